"""``StagedConfig.host_ids`` and ``completion_poll_us`` on the fake driver: jobs of up to
``host_ids`` blocks give the kernels their ids in pinned host memory (no upload on the kernels'
stream), larger ones upload them first; every setting moves the host backend's bytes."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.transfer.cuda.staged_config import StagedConfig
from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import Calls, fake_cuda  # noqa: F401 (the fixture)
from tests.test_cuda_backends_on_cpu import POOL
from tests.test_native_engine import engine_on, needs_core


@needs_core
@pytest.mark.parametrize("coupled", [False, True])
@pytest.mark.parametrize("host_ids", [0, 4, POOL])
def test_ids_of_small_jobs_stay_on_the_host(
    fake_cuda: Calls,  # noqa: F811
    coupled: bool,
    host_ids: int,
) -> None:
    config = {"host_ids": host_ids, "completion_poll_us": 7}
    config |= {"load_coupled": coupled, "store_coupled": coupled}
    with engine_on("llama3-8b", "page", **config) as (pair, backend):
        rng = np.random.default_rng(host_ids)
        for count in (1, 4, 5, POOL):
            slots = rng.choice(POOL, count, replace=False)
            for direction in ("store", "load"):
                spec = TransferSpec.of(direction, rng.choice(POOL, count, replace=False), slots)
                kernels = backend.spec.gather[0 if direction == "store" else 1]
                start = len(fake_cuda.log)
                pending = backend.submit([spec])
                assert pending.wait(10) and pending.error() is None
                pair.oracle.copy([spec])
                pair.check()
                first = next(i for i, e in enumerate(fake_cuda.log[start:]) if e[0] == "launch")
                uploads = [
                    e
                    for e in fake_cuda.log[start : start + first]
                    if e[0] == "copy" and e[1] == kernels
                ]
                assert len(uploads) == (0 if count <= host_ids else 1)


def test_the_settings_are_checked() -> None:
    for name, bad in (
        ("host_ids", -1),
        ("host_ids", (1 << 20) + 1),
        ("host_ids", True),
        ("completion_poll_us", 0),
        ("completion_poll_us", 100_001),
        ("completion_poll_us", 1.5),
        ("wait_spin_us", -1),
        ("wait_spin_us", 100_001),
        ("wait_spin_us", True),
    ):
        with pytest.raises(ValueError, match=name):
            StagedConfig(**{name: bad})  # type: ignore[arg-type]
