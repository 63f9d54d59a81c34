"""Closing with jobs in flight settles every request and leaves nothing pinned.

Found through the public API: after ``close()`` with jobs in flight no request could ever settle
(``complete`` and ``abort`` raised, ``cancel`` returned []), so an engine could never free those
requests' blocks, and their host slots stayed pinned or reserved.
"""

from __future__ import annotations

import threading

import numpy as np

from kvoffload import KVLayout, OffloadConfig, build_local, prefix_block_keys
from kvoffload.offload import TransferWorker
from kvoffload.transfer.host import HostBackend

BLOCKS, PAGE, SLOTS = 32, 128, 8


class Gate(HostBackend):
    """The host backend, each copy held at a gate until the test opens it; then real bytes."""

    def __init__(self, layout: KVLayout, arena) -> None:
        super().__init__(layout, arena)
        self.gate = threading.Event()
        self.started = threading.Event()

    def copy(self, specs):
        self.started.set()
        assert self.gate.wait(60)
        super().copy(specs)


def test_close_with_jobs_in_flight_settles_every_request_and_pins_nothing():
    kv = np.random.default_rng(3).integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8)
    layout = KVLayout.from_tensors([kv], block_size=16, block_dim=0)
    local = build_local(layout, OffloadConfig(host_capacity_blocks=SLOTS))
    off = local.offloader
    local.worker.close()
    backend = Gate(layout, local.arena)
    worker = local.worker = TransferWorker(backend, off)
    keys = prefix_block_keys(np.arange(16 * 6), 16)
    held, k1, k2, k3 = keys[:2], keys[2], keys[3], keys[4]

    backend.gate.set()
    base = off.schedule_store("base", held, [0, 1])
    assert base is not None
    worker.submit(base)
    assert worker.wait([base.job_id], 30) == set()
    off.complete(worker.get_finished())
    assert off.lookup(held) == 2
    backend.gate.clear()
    backend.started.clear()

    running = off.schedule_store("running", [k1], [2])  # copying when close starts
    assert running is not None
    worker.submit(running)
    assert backend.started.wait(10)
    queued = off.schedule_store("queued", [k2], [3])  # submitted, not started: cancelled
    assert queued is not None
    worker.submit(queued)
    load = off.schedule_load("load", held, [10, 11])  # a load queued behind them: cancelled
    worker.submit(load)
    off.schedule_load("unsent_load", held[:1], [12])  # never submitted
    unsent = off.schedule_store("unsent_store", [k3], [4])  # never submitted
    assert unsent is not None
    assert off.index.num_pinned == 2 and off.index.num_writing == 3
    engine_before = kv.copy()
    host = local.arena.slots  # a view stays valid after the arena is released
    requests = ["base", "running", "queued", "load", "unsent_load", "unsent_store"]
    assert sum(off.is_settled(r) for r in requests) == 1

    threading.Timer(0.5, backend.gate.set).start()  # the running copy ends after the wait below
    local.close(transfer_wait_s=0.1)

    assert all(off.is_settled(r) for r in requests)
    ix = off.index
    ix.check_invariants()
    assert off.in_flight() == set() and ix.num_pinned == 0 and ix.num_writing == 0
    assert ix.num_free + ix.num_readable == SLOTS  # no slot leaked
    # The copy that was running finished and counts; nothing else became readable.
    assert {k for k in keys if ix.state(k) == 2} == {*held, k1}
    for key, block in [(held[0], 0), (held[1], 1), (k1, 2)]:
        slot = ix.slot_of(key)
        assert slot is not None and np.array_equal(host[slot][:PAGE], kv[block])
    assert np.array_equal(kv, engine_before)  # the cancelled and unsent loads wrote nothing
    stats = worker.snapshot()
    assert (stats["store"]["cancelled"], stats["load"]["cancelled"]) == (1, 1)
    # After close cancel still answers (there is nothing left to cancel), and nothing raises.
    assert worker.cancel(off.in_flight() | {running.job_id, unsent.job_id}) == []
    assert worker.get_finished() == []
