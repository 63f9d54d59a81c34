"""The package's dependency rules, read statically from the source (``ast``, nothing imported).

1. No import cycle between kvoffload modules. Every import counts: module level, under
   ``TYPE_CHECKING``, inside a function, and ``importlib.import_module("literal")``; a reader has
   to hold both files of a circle at once whichever way it is imported.
2. Nothing outside ``kvoffload/bench/`` imports ``kvoffload.bench``: the library never depends on
   its benchmarks. ``kvoffload/cli.py`` routes ``kvoffload bench <what>`` to the bench modules.
3. The staged pipeline lives in C only (``kvoffload/transfer/cuda/native/``): no Python module or
   definition of a staging ring, submitter threads or a per-transfer chunk plan (issue 26).
4. No Python module over ``MAX_LINES`` lines.
5. Each ``kvoffload bench <what>`` command is a package ``kvoffload/bench/<what>/`` whose
   ``command.py`` imports, directly or through other bench modules, only its own package and
   ``kvoffload.bench.common`` (and any library module): one command never pulls in another's.
6. One meaning for "engine": the serving engine (vLLM's or the user's). No module, package or C
   file is named ``engine*`` except the ones in ``ENGINE_NAMES``, which are about the serving
   engine; our C transfer core is the "core" (``native/core.c``, the extension ``_core``).

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
# (``transfer/cuda/staged.py`` is now the facade over the native core: the definitions below
# are what the check refuses there.)
PIPELINE_MODULES = {"buffers.py", "submitter.py"}
PIPELINE_NAMES = {"chunk_sizes", "chunk_blocks", "StagedBackend", "BufferRing", "Submitter"}
MAX_LINES = 500
# Rule 5's exceptions: (importer, imported) edges across bench packages, with their reason (none
# now: the multi-GPU worker builds its backend through the library's registry). An entry that no
# longer occurs fails the test.
KNOWN_CROSS_BENCH: set[tuple[str, str]] = set()
BENCH_COMMON = "kvoffload.bench.common"
# Rule 6: the files named for the serving engine. vLLM's engine adapter (the worker-side copies
# of a vLLM engine) and the e2e model runner's ``PagedEngine`` (a small serving engine).
ENGINE_NAMES = {
    "kvoffload/integrations/vllm/engine.py",
    "kvoffload/bench/e2e/runner/engine.py",
}


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


def test_the_native_core_has_one_owner_per_concept():
    """Every C file is under the line limit; the binding includes only core.h's API (never the
    core's state or lock); the pipeline knows nothing of threads or the core; the headers
    include each other without a circle; the ABI number is defined once."""
    files = sorted(NATIVE.glob("*.[ch]"))
    long = [f"{f.name}: {n}" for f in files if (n := len(f.read_text().splitlines())) > MAX_LINES]
    assert not long, f"native files over {MAX_LINES} lines: {long}"
    for binding in ("module.c", "module_job.c", "binding.h"):
        text = (NATIVE / binding).read_text()
        assert "core_state.h" not in c_includes(NATIVE / binding), binding
        for private in ("pthread_", "->mu", "->lane", "->flags", "->inflight", "->spec"):
            assert private not in text, f"{binding} names the core's {private}"
    for pure in ("pipeline.c", "pipeline.h", "part.h", "copies.c", "flags.c", "job.c"):
        text = (NATIVE / pure).read_text()
        core = {"core.h", "core_state.h"} & c_includes(NATIVE / pure)
        assert "pthread" not in text and not core, pure
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


def bench_commands(root: Path) -> list[str]:
    """The modules ``kvoffload/cli.py`` routes ``kvoffload bench <what>`` to (string literals)."""
    tree = ast.parse((root / "kvoffload" / "cli.py").read_text())
    return sorted(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _in_bench(node.value)
    )


def cross_bench_imports(
    graph: dict[str, set[str]], commands: list[str], known: Container[tuple[str, str]] = ()
) -> set[tuple[str, str, str]]:
    """(command, importer, imported) for every bench module a command reaches, directly or
    through other bench modules, outside its own package and ``kvoffload.bench.common``. A
    ``known`` edge is not followed."""
    found = set()
    for command in commands:
        package = command.rpartition(".")[0]
        seen, todo = {command}, [command]
        while todo:
            here = todo.pop()
            for dep in graph.get(here, ()):
                if not _in_bench(dep) or dep in seen or (here, dep) in known:
                    continue
                if dep != BENCH_COMMON and dep != package and not dep.startswith(package + "."):
                    found.add((command, here, dep))
                seen.add(dep)
                todo.append(dep)
    return found


def test_each_bench_command_imports_only_its_own_package():
    commands = bench_commands(ROOT)
    assert commands, "no bench command routed by kvoffload/cli.py"
    not_packaged = [c for c in commands if not re.fullmatch(r"kvoffload\.bench\.\w+\.command", c)]
    assert not not_packaged, f"a bench command is kvoffload.bench.<what>.command: {not_packaged}"
    graph = import_graph(ROOT)
    found = cross_bench_imports(graph, commands, KNOWN_CROSS_BENCH)
    assert not found, f"bench commands importing another command's package: {sorted(found)}"
    edges = {(a, b) for a, deps in graph.items() for b in deps}
    gone = sorted(KNOWN_CROSS_BENCH - edges)
    assert not gone, f"fixed: remove from KNOWN_CROSS_BENCH: {gone}"


def engine_named(root: Path, package: str = "kvoffload") -> list[str]:
    """Modules, packages and C files under ``root/package`` named ``engine*`` or ``_engine*``
    (a file's stem or any folder on its path), except ``ENGINE_NAMES``."""
    found = set()
    for path in sorted((root / package).rglob("*")):
        if path.suffix not in (".py", ".c", ".h") or "__pycache__" in path.parts:
            continue
        where = path.relative_to(root)
        names = [*where.parts[:-1], path.stem]
        if str(where) not in ENGINE_NAMES and any(
            n.lstrip("_").startswith("engine") for n in names
        ):
            found.add(str(where))
    return sorted(found)


def test_engine_names_only_the_serving_engine():
    found = engine_named(ROOT)
    assert not found, (
        '"engine" is the serving engine; name our parts for their role (the C transfer core is '
        f'"core"): {found}'
    )
    setup = (ROOT / "setup.py").read_text()
    assert '"kvoffload.transfer.cuda._core"' in setup and "_engine" not in setup


def test_the_bench_and_name_checks_see_what_they_refuse(tmp_path):
    pkg = tmp_path / "kvoffload"
    for folder in ("bench/a", "bench/b", "bench/engine", "transfer/cuda/native"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "bench" / "__init__.py").write_text("")
    (pkg / "bench" / "common.py").write_text("")
    (pkg / "bench" / "a" / "command.py").write_text(
        "from kvoffload.bench.a import helper\nfrom kvoffload.bench import common\n"
    )
    (pkg / "bench" / "a" / "helper.py").write_text(
        "def f():\n    from kvoffload.bench.b import x\n"
    )
    (pkg / "bench" / "b" / "command.py").write_text("import kvoffload.bench.b.x\n")
    (pkg / "bench" / "b" / "x.py").write_text("")
    (pkg / "transfer" / "cuda" / "native" / "engine.c").write_text("")
    (pkg / "transfer" / "cuda" / "_engine.py").write_text("")
    graph = import_graph(tmp_path)
    commands = ["kvoffload.bench.a.command", "kvoffload.bench.b.command"]
    assert cross_bench_imports(graph, commands) == {
        ("kvoffload.bench.a.command", "kvoffload.bench.a.helper", "kvoffload.bench.b.x")
    }
    known = {("kvoffload.bench.a.helper", "kvoffload.bench.b.x")}
    assert cross_bench_imports(graph, commands, known) == set()
    assert engine_named(tmp_path) == [
        "kvoffload/bench/engine/__init__.py",
        "kvoffload/transfer/cuda/_engine.py",
        "kvoffload/transfer/cuda/native/engine.c",
    ]
