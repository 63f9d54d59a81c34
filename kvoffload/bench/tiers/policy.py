"""``policy``: a full host tier streaming stores, write-behind (the implementation) against
demote-on-evict (the evicted blocks are written to disk before their slots take the new store),
as the engine sees it: store settle time per 16-block job and the blocks that reached disk; back
to back (stores as fast as the host copy goes) and, for write-behind, paced at ``PACE_MBPS`` (an
engine whose prefill produces KV at that rate)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.bench.tiers.common import BATCH, lat, mbps

PACE_MBPS = 200  # the paced run: stores at this rate, under the disk's sustained writes


def policy_round(
    root: Path, size: int, host_blocks: int, jobs: int, demote: bool, pace_mbps: float = 0.0
) -> dict[str, Any]:
    from kvoffload.config import OffloadConfig
    from kvoffload.offload.local import build_local
    from kvoffload.store.keys import prefix_block_keys
    from kvoffload.transfer.layout import KVLayout

    kv = [np.random.default_rng(1).integers(0, 256, (BATCH * 2, size), dtype=np.uint8)]
    layout = KVLayout.from_tensors(kv, block_size=16, block_dim=0)
    config = OffloadConfig(
        host_capacity_blocks=host_blocks,
        model_id="bench",
        disk_path=str(root),
        disk_capacity_bytes=(jobs * BATCH + 8) * (size + 8192),
    )
    local = build_local(layout, config)
    off, worker = local.offloader, local.worker
    assert off.lower is not None and local.mover is not None
    disk = local.mover.tiers["disk"]
    if demote:  # nothing is written behind: blocks go down only when evicted
        off.lower.names = []
    keys = prefix_block_keys(np.arange(jobs * BATCH * 16), 16)
    settle = []
    t_all = time.perf_counter()
    for j in range(jobs):
        batch = keys[j * BATCH : (j + 1) * BATCH]
        t0 = time.perf_counter()
        if demote:
            need = len(batch) - off.index.num_free
            if need > 0:  # write the victims out, holding their slots, then free them
                free = (k for k in off.index.candidates() if not off.index.readers(k))
                victims = list(itertools.islice(free, need))
                slots = off.index.prepare_load(victims)  # held until written
                disk.put(victims, [memoryview(local.arena.slots[s]) for s in slots.tolist()])
                off.index.complete_load(victims)
                off.index.remove(victims)
        job = off.schedule_store("r", batch, list(range((j % 2) * BATCH, (j % 2 + 1) * BATCH)))
        if job is not None:
            worker.submit(job)
            worker.wait([job.job_id], 60)
            off.complete(worker.get_finished())
        settle.append(time.perf_counter() - t0)
        if pace_mbps:  # an engine that produces KV at pace_mbps, not back to back
            due = t_all + (j + 1) * BATCH * size / (pace_mbps * 1e6)
            time.sleep(max(0.0, due - time.perf_counter()))
    elapsed = time.perf_counter() - t_all
    off.drain_tiers(120)
    on_disk = sum(bool(c) for c in disk.contains(keys))
    stored = off.index.stats.stores
    local.close()
    return {
        "store_settle": lat(settle),
        "stores_MBps": mbps(stored * size, elapsed),
        "blocks_stored": stored,
        "blocks_on_disk": on_disk,
        "blocks": len(keys),
    }
