"""The staged backend's compiled enqueue loop (``kvoffload/transfer/cuda/native.c``) on CPU.

The C loop is built with this machine's compiler and calls the fake driver's entry points
(``tests/fake_cuda.py``: ctypes callbacks that move real bytes), so these tests check what the C
code computes (chunk areas, descriptor ranges, kernel arguments and their i32/i64 packing, the
order of waits and records) against the Python loop and the host backend's bytes.
"""

from __future__ import annotations

import shutil
from typing import Any

import numpy as np
import pytest

from kvoffload.transfer.cuda import native
from kvoffload.transfer.cuda.driver import CudaCopyError
from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import Calls, fake_cuda
from tests.test_cuda_backends_on_cpu import POOL, Pair

__all__ = ["fake_cuda"]  # the fixture, used by name

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) here")


def staged(pair: Pair, inline_bytes: int | None = None, **config: Any) -> Any:
    from kvoffload.transfer.cuda.staged import StagedBackend, StagedConfig

    fields: dict[str, Any] = {
        "staging_bytes": 4 * pair.kv.slot_bytes,
        "depth": 2,
        "first_chunk_bytes": 1,
        "layer_slice_bytes": 8,
        "max_layer_slices": 4,
        "layer_slice_transfer_bytes": 1,
    }
    fields.update(config)
    backend = StagedBackend(
        pair.kv, pair.arena, config=StagedConfig(**fields), inline_bytes=inline_bytes
    )
    backend.min_slice_transfer_bytes = 1
    return backend


def round_trips(pair: Pair, backend: Any, seed: int, rounds: int = 3) -> None:
    """Stores then loads of several sizes, each checked against the host backend's bytes."""
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        for count in (9, 1, 5):
            blocks = rng.choice(POOL, count, replace=False)
            slots = rng.choice(POOL, count, replace=False)
            for specs in (
                [TransferSpec.of("store", blocks, slots)],
                [TransferSpec.of("load", rng.choice(POOL, count, replace=False), slots)],
            ):
                pending = backend.submit(specs)
                assert pending.wait(10) and pending.error() is None
                pair.oracle.copy(specs)
                pair.check()


def shape(log: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """A log with streams and events renamed by first appearance and copy sizes dropped, so two
    backends' logs compare (their handles differ; a single-descriptor chunk is a plain copy in C,
    a batch of one in the Python fake)."""
    names: dict[tuple[str, Any], int] = {}

    def name(kind: str, value: Any) -> int:
        return names.setdefault((kind, value), len(names))

    out: list[tuple[Any, ...]] = []
    for op, stream, arg in log:
        if op in ("batch", "copy"):
            out.append(("copy", name("s", stream)))
        elif op == "launch":
            out.append(("launch", name("s", stream), arg))
        else:
            out.append((op, name("s", stream), name("e", arg)))
    return out


@needs_cc
@pytest.mark.parametrize("model", ["llama3-8b", "llama3-70b-tp8-fp8", "deepseek-v2-lite-mla"])
@pytest.mark.parametrize("layout", ["kv_split", "page"])
def test_the_c_loop_moves_the_oracles_bytes_with_the_python_loops_calls(
    fake_cuda: Calls, model: str, layout: str
) -> None:
    logs = {}
    for use_native in (True, False):
        pair = Pair(model, layout)
        backend = staged(pair, native=use_native, inline_bytes=0)  # both on the thread
        try:
            round_trips(pair, backend, seed=5, rounds=1)  # first use of each kernel variant
            start = len(fake_cuda.log)
            round_trips(pair, backend, seed=6)
            logs[use_native] = shape(fake_cuda.log[start:])
            if use_native:
                assert backend.native_reason is None
                assert backend.native_parts > 0
            else:
                assert backend.native_parts == 0
                assert backend.native_reason == "StagedConfig(native=False)"
        finally:
            backend.close()
            pair.close()
    assert logs[True] == logs[False]


@needs_cc
def test_a_kernel_variant_runs_through_python_first_then_through_c(fake_cuda: Calls) -> None:
    pair = Pair("llama3-8b", "kv_split")
    backend = staged(pair)
    try:
        spec = [TransferSpec.of("store", [1, 2, 3], [4, 5, 6])]
        assert backend.submit(spec).wait(10)
        assert (backend.python_parts, backend.native_parts) == (1, 0)
        assert backend.submit(spec).wait(10)
        assert (backend.python_parts, backend.native_parts) == (1, 1)
        pair.oracle.copy(spec)
        pair.check()
    finally:
        backend.close()
        pair.close()


@needs_cc
def test_a_copy_the_driver_refuses_in_the_c_loop_fails_the_transfer_naming_it(
    fake_cuda: Calls,
) -> None:
    pair = Pair("llama3-8b", "kv_split")
    backend = staged(pair, depth=1, first_chunk_bytes=1 << 30)  # one chunk: one batch
    try:
        spec = [TransferSpec.of("store", [1, 2, 3, 4], [4, 9, 6, 11])]
        assert backend.submit(spec).wait(10)  # compiles the variant
        fake_cuda.fail_batch_at = 2
        pending = backend.submit(spec)
        assert pending.wait(10)
        error = pending.error()
        assert isinstance(error, CudaCopyError)
        assert error.index == 2 and "descriptor 2 of 4" in str(error)
        assert backend.native_parts == 1
    finally:
        fake_cuda.fail_batch_at = None
        backend.close()
        pair.close()


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """``native.library()`` built again into an empty cache directory, and forgotten after."""
    monkeypatch.setenv("KVOFFLOAD_CACHE_DIR", str(tmp_path))
    native.library.cache_clear()
    yield tmp_path
    native.library.cache_clear()


def test_without_a_compiler_the_backend_says_why_and_moves_the_same_bytes(
    fake_cuda: Calls, fresh_build: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-kvoffload")
    pair = Pair("llama3-8b", "page")
    backend = staged(pair)
    try:
        reason = backend.native_reason
        assert reason is not None and "no-such-compiler-kvoffload" in reason
        assert "install gcc, or set CC" in reason
        round_trips(pair, backend, seed=7, rounds=2)
        assert backend.native_parts == 0 and backend.python_parts > 0
    finally:
        backend.close()
        pair.close()


def test_a_failing_build_reports_the_compilers_message(
    fresh_build: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'cc: fatal error: out of cheese' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with pytest.raises(RuntimeError, match="exit 3: cc: fatal error: out of cheese"):
        native.build()
    assert native.library() is None
    assert "out of cheese" in (native.unavailable() or "")
    assert not list((fresh_build / "native").glob("*.so"))  # no half-written library left


def test_kvoffload_native_0_turns_the_compiled_loop_off(
    fresh_build: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVOFFLOAD_NATIVE", "0")
    assert native.library() is None
    assert native.unavailable() == "disabled by KVOFFLOAD_NATIVE=0"


@needs_cc
def test_a_build_is_reused_and_named_by_its_source(fresh_build: Any) -> None:
    first = native.build()
    mtime = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == mtime
    assert first.parent == fresh_build / "native"
    lib = native.library()
    assert lib is not None and lib.kvo_abi() == native.ABI


@needs_cc
def test_small_transfers_go_inline_only_with_the_compiled_loop(fake_cuda: Calls) -> None:
    from kvoffload.transfer.cuda.staged import NATIVE_INLINE_BYTES

    pair = Pair("llama3-8b", "page")
    with_c, without = staged(pair), staged(pair, native=False)
    explicit = staged(pair, inline_bytes=0)
    try:
        assert with_c.inline_bytes == NATIVE_INLINE_BYTES
        assert without.inline_bytes == 0 and explicit.inline_bytes == 0
        spec = [TransferSpec.of("store", [1, 2], [3, 4])]
        for _ in range(2):
            assert with_c.submit(spec).wait(10)
        assert with_c._submitters["store"].inline_jobs == 2
        assert with_c._submitters["store"].thread_jobs == 0
    finally:
        for b in (with_c, without, explicit):
            b.close()
        pair.close()


def test_integer_widths_follow_tritons_rule() -> None:
    assert not native.wide(2**31 - 1) and native.wide(2**31) and not native.wide(-(2**31))
    assert native.wide(-(2**31) - 1)
