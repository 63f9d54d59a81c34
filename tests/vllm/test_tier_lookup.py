"""vLLM 0.33.0's async-lookup scenarios (``upstream/test_async_lookup.py``) on our tiers.

vLLM's ``fs`` tier answers a lookup through ``AsyncLookupManager``: RETRY, one batch of probes per
step, the answer cached per request, ``mark_miss`` after a failed load so the request cannot loop
(#49176). Ours keep no per-request state: the Valkey tier answers from what this process last
learnt (shared by every request), else RETRY and one pipelined probe per step; the disk tier
answers at once from its key map. The same rules are checked here with the ops each tier sends.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

pytest.importorskip("vllm")
if not os.environ.get("CI"):  # under CI a missing Valkey client is a failure, not a skip
    pytest.importorskip("redis")

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from tests.vllm.tier_support import CTX, END, Build, drain, key, make_job, store

RETRY, HIT, MISS = LookupResult.RETRY, LookupResult.HIT, LookupResult.MISS


def recorded(tier: Any) -> list[Any]:
    """The ops ``tier`` sends its mover from now on."""
    ops: list[Any] = []
    submit = tier.mover.submit

    def record(op: Any) -> None:
        ops.append(op)
        submit(op)

    tier.mover.submit = record
    return ops


def step(tier: Any) -> None:
    """The end of a scheduler step, then wait for what it sent."""
    tier.on_schedule_end(END)
    drain(tier)


def valkey_holding(build: Build, *held: int) -> Any:
    """A Valkey tier (as a second engine: nothing known) over a server holding ``held``."""
    writer = build("valkey")
    store(writer, [key(i) for i in held], list(range(len(held))))
    return build("valkey")


def test_an_unknown_key_is_retry_then_one_probe_answers_it(build: Build) -> None:
    tier = valkey_holding(build, 1, 3)
    ops = recorded(tier)
    assert [tier.lookup(key(i), CTX) for i in range(1, 5)] == [RETRY] * 4
    assert tier.lookup(key(1), CTX) is RETRY  # asked again: still one probe
    assert ops == []  # nothing is sent before the step ends
    step(tier)
    assert [(op.kind, op.keys) for op in ops] == [("probe", tuple(key(i) for i in range(1, 5)))]
    assert [tier.lookup(key(i), CTX) for i in range(1, 5)] == [HIT, MISS, HIT, MISS]


def test_a_step_with_no_unknown_key_sends_nothing(build: Build) -> None:
    tier = valkey_holding(build, 1)
    ops = recorded(tier)
    step(tier)
    assert ops == []
    tier.lookup(key(1), CTX)
    step(tier)
    tier.lookup(key(1), CTX)  # answered from memory now
    step(tier)
    assert len(ops) == 1


def test_answers_carry_across_steps_and_requests(build: Build) -> None:
    tier = valkey_holding(build, 1, 2, 3)
    ops = recorded(tier)
    tier.lookup(key(1), CTX)
    step(tier)
    tier.lookup(key(2), CTX)
    tier.lookup(key(3), CTX)
    step(tier)
    other = ReqContext(req_id="other")
    tier.on_request_finished(CTX)  # nothing per request to release
    assert [tier.lookup(key(i), other) for i in (1, 2, 3)] == [HIT] * 3
    assert len(ops) == 2


@pytest.mark.parametrize("kind", ["disk", "valkey"])
def test_a_failed_load_is_a_miss_without_a_new_probe(build: Build, kind: str) -> None:
    """The livelock rule (#49176): after a failed load, the key is a MISS at once; it is not
    offered again as a hit, and no probe is sent for it."""
    import redis

    tier = build(kind)
    store(tier, [key(1)], [0])
    assert tier.lookup(key(1), CTX) is HIT
    if kind == "valkey":  # gone from the server behind the tier's back
        redis.Redis.from_url(tier.options.config.valkey_url).delete(tier.tier.key_name(key(1)))
    else:  # damaged on disk
        disk = tier.tier
        fd, offset = disk._locate(disk._where[key(1)])
        os.pwrite(fd, b"\xff" * 64, offset + 4096)
    ops = recorded(tier)
    tier.submit_load(make_job(2, [key(1)], [1], promotion=True))
    assert [r.success for r in drain(tier)] == [False]
    for _ in range(3):
        assert tier.lookup(key(1), CTX) is MISS
        step(tier)
    assert [op.kind for op in ops] == ["read"]


def test_the_disk_tier_answers_at_once(build: Build) -> None:
    tier = build("disk")
    store(tier, [key(1)], [0])
    ops = recorded(tier)
    start = time.perf_counter()
    assert [tier.lookup(key(1), CTX), tier.lookup(key(2), CTX)] == [HIT, MISS]
    assert time.perf_counter() - start < 1.0  # (a bound on a hang, not a timing test)
    step(tier)
    assert ops == []
