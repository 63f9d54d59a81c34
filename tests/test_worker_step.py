"""``TransferWorker.step`` (one call per engine step) and ``layer_gate`` on the host backend.

Bytes are checked against the blocks stored; a refused step is checked to have changed nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload import OffloadConfig, build_local, prefix_block_keys
from kvoffload.offload import TransferJob
from kvoffload.offload.local import LocalOffload
from kvoffload.transfer.backend import LayerGate
from kvoffload.transfer.layout import KVLayout
from tests.test_offload_jobs import Snapshot, block, collect, layout_of, make_kv, same


def must(job: TransferJob | None) -> TransferJob:
    assert job is not None
    return job


def loading(local: LocalOffload, src: int, dst: int, group: int = 0) -> TransferJob:
    """Store engine block ``src`` of ``group`` (one key), complete it, then schedule and submit
    its load into block ``dst``: the load job, in flight."""
    off, worker = local.offloader, local.worker
    key = prefix_block_keys(list(range(64)), 16)[0]
    store = must(off.schedule_store("r", [key], [src], group=group))
    worker.submit(store)
    off.complete(collect(worker, {store.job_id}))
    load = must(off.schedule_load("q", [key], [dst], group=group))
    worker.submit(load)
    return load


@pytest.mark.parametrize("background", [False, True])
def test_step_submits_every_job_in_order_and_returns_the_finished_ones(background: bool) -> None:
    """``background`` too: the host backend has no caller-thread enqueue to hand over, so it
    changes nothing but is accepted (an engine sets it whatever the backend)."""
    kv = make_kv(1)
    local = build_local(layout_of(kv), OffloadConfig(host_capacity_blocks=8))
    try:
        off, worker = local.offloader, local.worker
        keys = prefix_block_keys(list(range(64)), 16)
        stores = [must(off.schedule_store(f"r{i}", [keys[i]], [i])) for i in range(3)]
        results = worker.step(stores, background=background)
        results += collect(worker, {j.job_id for j in stores} - {r.job_id for r in results})
        assert sorted(r.job_id for r in results) == sorted(j.job_id for j in stores)
        assert all(r.ok for r in results)
        off.complete(results)
        wanted = [block(kv, i) for i in range(3)]
        loads = [must(off.schedule_load(f"q{i}", [keys[i]], [10 + i])) for i in range(3)]
        results = worker.step(loads, background=background)
        results += collect(worker, {j.job_id for j in loads} - {r.job_id for r in results})
        off.complete(results)
        for i in range(3):
            assert same(block(kv, 10 + i), wanted[i])
        assert worker.step([]) == []
    finally:
        local.close()


def test_a_refused_step_submits_none_of_its_jobs() -> None:
    kv = make_kv(2)
    local = build_local(layout_of(kv), OffloadConfig(host_capacity_blocks=8))
    try:
        off, worker = local.offloader, local.worker
        keys = prefix_block_keys(list(range(64)), 16)
        good = must(off.schedule_store("r", [keys[0]], [0]))
        before = Snapshot(local, kv)
        for bad in ([good, "job"], [good, good], "jobs", b"jobs"):
            with pytest.raises(ValueError, match="expected"):
                worker.step(bad)  # type: ignore[arg-type]
            assert worker.pending_count() == 0 and before.unchanged()
        for flag in (1, "yes", None):
            with pytest.raises(ValueError, match=r"expected background True or False, got "):
                worker.step([good], background=flag)  # type: ignore[arg-type]
            assert worker.pending_count() == 0 and before.unchanged()
        results = worker.step([good])  # the refused steps left it runnable
        results += collect(worker, {good.job_id} - {r.job_id for r in results})
        assert [r.ok for r in results] == [True]
        with pytest.raises(ValueError, match=r"^step: expected a job not submitted before"):
            worker.step([good])  # run already: the message names the call that refused it
        off.complete(results)
    finally:
        local.close()


def test_a_layer_gate_on_a_cpu_backend_waits_for_the_listed_jobs_whole() -> None:
    kv = make_kv(3)
    local = build_local(layout_of(kv), OffloadConfig(host_capacity_blocks=8))
    try:
        off, worker = local.offloader, local.worker
        load = loading(local, 0, 9)
        gate = worker.layer_gate(2)
        assert isinstance(gate.gate, LayerGate) and gate.layers == 2
        gate.open(None, [load.job_id, 12345])  # an unknown or finished id counts as landed
        assert same(block(kv, 9), block(kv, 0))  # the whole load has landed
        gate.wait(None, 1)
        for bad in (2, -1, True, "0"):
            with pytest.raises(ValueError, match=r"layer in \[0, 2\)"):
                gate.wait(None, bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=">= 1 layers"):
            worker.layer_gate(0)
        off.complete(collect(worker, {load.job_id}))
        assert np.array_equal(kv[0][:, 9], kv[0][:, 0])
    finally:
        local.close()


def test_a_layer_waiter_checks_layers_and_waits_for_the_load() -> None:
    kv = make_kv(4)
    local = build_local(layout_of(kv), OffloadConfig(host_capacity_blocks=8))
    try:
        off, worker = local.offloader, local.worker
        load = loading(local, 2, 11)
        waiter = worker.layer_waiter(load.job_id)
        waiter(1)  # on a CPU backend: the host waits for the whole copy
        assert same(block(kv, 11), block(kv, 2))
        for bad in (2, -1, True):
            with pytest.raises(ValueError, match=r"layer in \[0, 2\)"):
                waiter(bad)
        with pytest.raises(ValueError, match="handed out"):
            worker.layer_waiter(10_000)
        off.complete(collect(worker, {load.job_id}))
        worker.layer_waiter(load.job_id)(0)  # finished: only the layer is checked
    finally:
        local.close()


def test_a_layer_waiter_checks_the_layers_of_the_jobs_own_group() -> None:
    """Group 0 has two layers, group 1 one: a load of group 1 refuses layer 1 while in flight and
    after it finished but before its Offloader completed it; once completed (the job is gone),
    any layer of the largest group is accepted, with nothing to wait for."""
    kv = [*make_kv(5), make_kv(6)[0]]
    layout = KVLayout.from_tensors(kv, block_size=16, block_dim=1, groups=[[0, 1], [2]])
    local = build_local(layout, OffloadConfig(host_capacity_blocks=8))
    try:
        off, worker = local.offloader, local.worker
        load = loading(local, 2, 11, group=1)
        for waiter in (worker.layer_waiter(load.job_id), None):
            if waiter is None:  # finished, reported, not yet completed by the Offloader
                results = collect(worker, {load.job_id})
                waiter = worker.layer_waiter(load.job_id)
            waiter(0)
            with pytest.raises(ValueError, match=r"layer in \[0, 1\), got 1"):
                waiter(1)
        off.complete(results)
        assert np.array_equal(kv[2][:, 11], kv[2][:, 2])
        worker.layer_waiter(load.job_id)(1)  # completed: checked against the largest group
    finally:
        local.close()
