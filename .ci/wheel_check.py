"""Check a built wheel and sdist against setup.py: every extension setup.py declares is compiled
into the wheel, and every source file it names is in the sdist.

Usage: python .ci/wheel_check.py setup.py dist/kvoffload-*.whl dist/kvoffload-*.tar.gz
The extensions are read from setup.py's source (``Extension(name, sources=...)`` calls; the
sources expression is evaluated over setup.py's module-level string constants), so a second
extension needs no change here. Exit status 1, with what is missing, on a failure.
"""

from __future__ import annotations

import ast
import re
import sys
import tarfile
import zipfile
from pathlib import Path


def extensions(setup_py: Path) -> dict[str, list[str]]:
    """Extension module name -> its source files, as setup.py declares them."""
    tree = ast.parse(setup_py.read_text(), str(setup_py))
    consts = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for t in node.targets
        if isinstance(t, ast.Name) and isinstance(node.value.value, str)
    }
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension"):
            continue
        args = {kw.arg: kw.value for kw in node.keywords}
        name_node = node.args[0] if node.args else args["name"]
        sources_node = node.args[1] if len(node.args) > 1 else args["sources"]
        name = ast.literal_eval(name_node)
        code = compile(ast.Expression(sources_node), str(setup_py), "eval")
        names = {"__builtins__": {}, "sorted": sorted, "glob": _glob_under(setup_py.parent)}
        out[name] = list(eval(code, {**names, **consts}))  # setup.py's own text
    if not out:
        raise ValueError(f"expected Extension(...) calls in {setup_py}, got none")
    return out


def _glob_under(root: Path):  # type: ignore[no-untyped-def]
    """setup.py's ``glob``, relative to the project root as setup.py runs it."""

    def glob(pattern: str) -> list[str]:
        return [str(p.relative_to(root)) for p in root.glob(pattern)]

    return glob


def missing_in_wheel(names: list[str], wheel_files: list[str]) -> list[str]:
    """The extension names with no compiled module (``a/b/_c.<abi tag>.so``) in the wheel."""
    missing = []
    for name in names:
        pattern = re.compile(re.escape(name.replace(".", "/")) + r"\.[^/]*(so|pyd)$")
        if not any(pattern.fullmatch(f) for f in wheel_files):
            missing.append(name)
    return missing


def missing_in_sdist(sources: list[str], sdist_files: list[str]) -> list[str]:
    """Source files (relative to the project root) absent from the sdist (``name-ver/...``)."""
    inside = {f.split("/", 1)[1] for f in sdist_files if "/" in f}
    return [s for s in sources if s not in inside]


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.splitlines()[3].strip(), file=sys.stderr)
        return 2
    setup_py, wheel, sdist = (Path(a) for a in argv)
    exts = extensions(setup_py)
    with zipfile.ZipFile(wheel) as z:
        wheel_files = z.namelist()
    with tarfile.open(sdist) as t:
        sdist_files = t.getnames()
    no_module = missing_in_wheel(list(exts), wheel_files)
    no_source = missing_in_sdist([s for srcs in exts.values() for s in srcs], sdist_files)
    for name in no_module:
        print(f"wheel_check: expected {name} compiled in {wheel.name}, got no such module")
    for source in no_source:
        print(f"wheel_check: expected {source} in {sdist.name}, got no such file")
    if no_module or no_source:
        return 1
    print(f"wheel_check: {', '.join(exts)} in {wheel.name}; their sources in {sdist.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
