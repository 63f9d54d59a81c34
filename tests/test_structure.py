"""The package's dependency rules, read statically from the source (``ast``, nothing imported).

1. No import cycle between kvoffload modules. Every import counts: module level, under
   ``TYPE_CHECKING``, inside a function, and ``importlib.import_module("literal")``; a reader has
   to hold both files of a circle at once whichever way it is imported.
2. Nothing outside ``kvoffload/bench/`` imports ``kvoffload.bench``: the library never depends on
   its benchmarks. ``kvoffload/cli.py`` routes ``kvoffload bench <what>`` to the bench modules.
3. The staged pipeline lives in C only (``kvoffload/transfer/cuda/native/``): no Python module or
   definition of a staging ring, submitter threads or a per-transfer chunk plan (issue 26).
4. No Python module over ``MAX_LINES`` lines.

``docs/structure.md`` describes the layout these rules keep.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Container
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Exceptions to the two rules below (none now: issue 20 §1, §2 fixed every one of them).
# An entry that no longer occurs fails the test, so the lists cannot outlive their reason.
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_BENCH_IMPORTS: set[tuple[str, str]] = set()
BENCH_ROUTER = "kvoffload.cli"
# The Python copy of the staged pipeline that issue 26 removed: its modules and its definitions.
PIPELINE_MODULES = {"staged.py", "buffers.py", "submitter.py"}
PIPELINE_NAMES = {"chunk_sizes", "chunk_blocks", "StagedBackend", "BufferRing", "Submitter"}
MAX_LINES = 500


def modules(root: Path, package: str = "kvoffload") -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package ``__init__``) for every module under ``root/package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def imported(tree: ast.AST, package: str, known: Container[str]) -> set[str]:
    """The modules of ``known`` a module in ``package`` imports: ``import a.b`` names ``a.b``;
    ``from a import b`` names the module ``a.b`` if there is one, else ``a`` (b is in a)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                names.add(sub if sub in known else base)
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
    return {n for n in names if n in known}


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def import_graph(root: Path, package: str = "kvoffload") -> dict[str, set[str]]:
    """Module -> the package's modules it imports by name (not the parents Python also runs)."""
    mods = modules(root, package)
    graph = {}
    for name, (path, is_package) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        here = name if is_package else name.rpartition(".")[0]
        graph[name] = imported(tree, here, mods) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_no_import_cycles_between_modules():
    found = set(cycles(import_graph(ROOT)))
    new = [sorted(c) for c in found - KNOWN_CYCLES]
    assert not new, f"import cycles (put what both need below both): {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES - found]
    assert not gone, f"fixed: remove from KNOWN_CYCLES: {gone}"


def test_only_the_benchmarks_import_the_benchmarks():
    graph = import_graph(ROOT)
    found = {
        (importer, dep)
        for importer, deps in graph.items()
        for dep in deps
        if _in_bench(dep) and not _in_bench(importer) and importer != BENCH_ROUTER
    }
    new = sorted(found - KNOWN_BENCH_IMPORTS)
    assert not new, f"library modules importing kvoffload.bench: {new}"
    gone = sorted(KNOWN_BENCH_IMPORTS - found)
    assert not gone, f"fixed: remove from KNOWN_BENCH_IMPORTS: {gone}"


def _in_bench(module: str) -> bool:
    return module == "kvoffload.bench" or module.startswith("kvoffload.bench.")


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """A two-file circle through each kind of import is found; a one-way chain is not."""
    pkg = tmp_path / "kvoffload"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from kvoffload.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n"
    )
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('kvoffload.d')\n")
    (pkg / "d.py").write_text("import kvoffload.e\n")
    (pkg / "e.py").write_text("from kvoffload import c\n")
    (pkg / "f.py").write_text("from kvoffload.sub.a import f\nimport kvoffload.e\n")
    graph = import_graph(tmp_path)
    assert graph["kvoffload.sub"] == {"kvoffload.sub.a"}  # the parent package is not an edge
    assert graph["kvoffload.e"] == {"kvoffload.c"}  # ``from pkg import module``: the module
    assert set(cycles(graph)) == {
        frozenset({"kvoffload.sub.a", "kvoffload.sub.b"}),
        frozenset({"kvoffload.c", "kvoffload.d", "kvoffload.e"}),
    }


def python_pipeline(root: Path, package: str = "kvoffload") -> list[str]:
    """Where a Python staged pipeline shows under ``root/package``: modules named as its parts,
    functions or classes with its names."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        where = str(path.relative_to(root))
        if path.name in PIPELINE_MODULES:
            found.append(where)
        for node in ast.walk(ast.parse(path.read_text(), where)):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and node.name in PIPELINE_NAMES
            ):
                found.append(f"{where}: {node.name}")
    return found


def long_modules(root: Path, package: str = "kvoffload") -> list[str]:
    return [
        f"{path.relative_to(root)}: {n} lines"
        for path in sorted((root / package).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]


def test_the_staged_pipeline_is_not_in_python():
    found = python_pipeline(ROOT)
    assert not found, (
        "the staged pipeline lives in C only (kvoffload/transfer/cuda/native/); where the "
        f"extension is absent staged falls back to dma: {found}"
    )


def test_no_module_is_over_the_line_limit():
    found = long_modules(ROOT)
    assert not found, f"modules over {MAX_LINES} lines (split them by concept): {found}"


def test_the_pipeline_and_length_checks_see_what_they_refuse(tmp_path):
    pkg = tmp_path / "kvoffload"
    (pkg / "transfer").mkdir(parents=True)
    (pkg / "transfer" / "buffers.py").write_text("x = 1\n")
    (pkg / "transfer" / "plan.py").write_text(
        "def chunk_sizes():\n    pass\n\n\nclass Submitter:\n    pass\n"
    )
    (pkg / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (pkg / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert python_pipeline(tmp_path) == [
        "kvoffload/transfer/buffers.py",
        "kvoffload/transfer/plan.py: chunk_sizes",
        "kvoffload/transfer/plan.py: Submitter",
    ]
    assert long_modules(tmp_path) == [f"kvoffload/long.py: {MAX_LINES + 1} lines"]


NATIVE = ROOT / "kvoffload" / "transfer" / "cuda" / "native"


def c_includes(path: Path) -> set[str]:
    return set(re.findall(r'^#include "([^"]+)"', path.read_text(), re.M))


def test_the_native_engine_has_one_owner_per_concept():
    """Every C file is under the line limit; the binding includes only engine.h's API (never the
    engine's state or lock); the pipeline knows nothing of threads or the engine; the headers
    include each other without a circle; the ABI number is defined once."""
    files = sorted(NATIVE.glob("*.[ch]"))
    long = [f"{f.name}: {n}" for f in files if (n := len(f.read_text().splitlines())) > MAX_LINES]
    assert not long, f"native files over {MAX_LINES} lines: {long}"
    for binding in ("module.c", "module_job.c", "binding.h"):
        text = (NATIVE / binding).read_text()
        assert "engine_state.h" not in c_includes(NATIVE / binding), binding
        for private in ("pthread_", "->mu", "->lane", "->flags", "->inflight", "->spec"):
            assert private not in text, f"{binding} names the engine's {private}"
    for pure in ("pipeline.c", "pipeline.h", "flags.c", "job.c"):
        text = (NATIVE / pure).read_text()
        assert "pthread" not in text and "engine" not in c_includes(NATIVE / pure), pure
    graph = {f.name: c_includes(f) for f in files if f.suffix == ".h"}
    state: dict[str, int] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert state.get(name) != 1, f"include circle: {' -> '.join((*path, name))}"
        if state.get(name) == 2:
            return
        state[name] = 1
        for dep in graph.get(name, ()):
            visit(dep, (*path, name))
        state[name] = 2

    for name in graph:
        visit(name, ())
    defined = [f.name for f in files if re.search(r"#define KVO_ABI\b", f.read_text())]
    assert defined == ["kvo.h"], defined
