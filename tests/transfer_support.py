"""Helpers shared by the CUDA backend tests on CPU (tests/fake_cuda.py) and on the GPU."""

from __future__ import annotations

import threading
from typing import Any

from kvoffload.transfer.spec import TransferSpec


class HeldAfterFirstSlice:
    """Make ``backend``'s submitter stop before the second layer slice of ``load`` until
    ``go`` is set; ``held`` is set once it stopped there. ``slices``: the load's slice count."""

    def __init__(self, backend: Any, load: list[TransferSpec], timeout: float = 30.0) -> None:
        self.go, self.held = threading.Event(), threading.Event()
        backend.inline_bytes = 0  # the load runs on the lane's thread, to be held there
        first, self.slices = backend._load_plan(load)[0][load[0].group]
        enqueue = backend._enqueue

        def held(spec: TransferSpec, lane: Any, part: Any, prepared: Any) -> None:
            if part is not None and part > first:
                self.held.set()
                if not self.go.wait(timeout):
                    raise TimeoutError("the test never released the held slice")
            enqueue(spec, lane, part, prepared)

        backend._enqueue = held
