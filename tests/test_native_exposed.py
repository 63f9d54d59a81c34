"""``StagedConfig.exposed_programs``: the kernel of a job's exposed chunk (a store's first gather,
a load's last scatter) runs on more programs, the rest of the pipeline on its own count, and the
bytes are the host backend's (the fake driver logs each launch's program count)."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.transfer.cuda.staged_config import StagedConfig
from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import Calls, fake_cuda  # noqa: F401 (the fixture)
from tests.test_cuda_backends_on_cpu import POOL
from tests.test_native_engine import engine_on, needs_core

PROGRAMS = 2  # the kernels' own count here


def launches(calls: Calls, start: int) -> list[int]:
    """The program counts of the launches logged since ``start``."""
    return [e[3] for e in calls.log[start:] if e[0] == "launch"]


@needs_core
@pytest.mark.parametrize("coupled", [False, True])
@pytest.mark.parametrize("exposed", [0, 48])
def test_only_the_exposed_chunks_kernel_runs_wider(
    fake_cuda: Calls,  # noqa: F811
    coupled: bool,
    exposed: int,
) -> None:
    config = {"programs": PROGRAMS, "load_programs": PROGRAMS, "exposed_programs": exposed}
    config["load_program_bytes"] = 0  # the kernels' own count (by bytes: test_native_engine.py)
    config |= {"load_coupled": coupled, "store_coupled": coupled}
    with engine_on("llama3-8b", "page", **config) as (pair, backend):
        rng = np.random.default_rng(exposed + coupled)
        for count in (1, 9, POOL):
            slots = rng.choice(POOL, count, replace=False)
            for direction in ("store", "load"):
                spec = TransferSpec.of(direction, rng.choice(POOL, count, replace=False), slots)
                start = len(fake_cuda.log)
                pending = backend.submit([spec])
                assert pending.wait(10) and pending.error() is None
                pair.oracle.copy([spec])
                pair.check()
                grids = launches(fake_cuda, start)
                edge = grids[0] if direction == "store" else grids[-1]
                assert edge == max(exposed, PROGRAMS)
                # one exposed kernel per job: every other chunk (earlier slices' scatters
                # overlap the next slice's copies) on the kernels' own count
                assert sorted(grids) == [PROGRAMS] * (len(grids) - 1) + [edge]
                if count == POOL:
                    assert len(grids) > 2  # several chunks (or slices) took part


def test_exposed_programs_out_of_range_is_refused() -> None:
    for bad in (-1, 70000, True, 2.0):
        with pytest.raises(ValueError, match="exposed_programs"):
            StagedConfig(exposed_programs=bad)  # type: ignore[arg-type]
