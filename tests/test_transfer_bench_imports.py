"""Import direction of the transfer benchmark and the commands around it (issue 20 §1, §2, §7):
the library never imports ``kvoffload.bench``, no import circle passes through the transfer
benchmark, calibrate, doctor or the timing helpers (imports inside functions and under
``TYPE_CHECKING`` count: the reader holds both files either way), and its files stay short."""

from __future__ import annotations

import ast
from pathlib import Path

import kvoffload

ROOT = Path(kvoffload.__file__).parent
OURS = (
    "kvoffload.bench.transfer",
    "kvoffload.bench.common",
    "kvoffload.calibrate",
    "kvoffload.doctor",
    "kvoffload.transfer.timing",
    "kvoffload.console",
)


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every kvoffload module ``path`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("kvoffload."):
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def test_nothing_outside_bench_imports_the_benchmarks():
    offenders = {
        m: sorted(d for d in deps if d.startswith("kvoffload.bench"))
        for m, deps in graph().items()
        if not m.startswith("kvoffload.bench")
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def test_no_import_circle_passes_through_the_transfer_benchmark_calibrate_or_doctor():
    g = graph()

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in g.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    ours = [m for m in g if m.startswith(OURS)]
    assert "kvoffload.bench.transfer.gpu" in ours and "kvoffload.calibrate" in ours
    circles = {m: sorted(d for d in g[m] if m in reach(d)) for m in ours}
    assert {m: c for m, c in circles.items() if c} == {}


def test_the_transfer_benchmark_files_are_short_and_name_no_second_engine():
    for path in (ROOT / "bench" / "transfer").glob("*.py"):
        if path.name.startswith(("host_time", "vllm_triton")):
            continue  # the host-time and vllm-triton modules moved in (issue 26): not this rule's
        text = path.read_text()
        assert len(text.splitlines()) <= 400, path.name
        assert "class Engine" not in text, path.name
