"""``kvoffload doctor``'s hardware-queue line: what CUDA_DEVICE_MAX_CONNECTIONS means for
kvoffload (docs/transfer.md, "twentieth round")."""

from __future__ import annotations

from kvoffload.doctor import hardware_queues


def test_unset_is_cudas_default_of_eight() -> None:
    assert hardware_queues({}) == "8 (CUDA's default; CUDA_DEVICE_MAX_CONNECTIONS is unset)"


def test_one_queue_says_the_waits_pass_and_the_stall_timer_reads_nothing() -> None:
    line = hardware_queues({"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert line.startswith("1 (CUDA_DEVICE_MAX_CONNECTIONS=1): every stream shares one queue")
    assert "layer waits still pass" in line
    assert "StallTimer reads ~0" in line


def test_another_count_is_reported_as_set() -> None:
    assert (
        hardware_queues({"CUDA_DEVICE_MAX_CONNECTIONS": " 32 "})
        == "32 (CUDA_DEVICE_MAX_CONNECTIONS)"
    )
