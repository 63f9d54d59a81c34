"""The release: one version (``kvoffload.__version__``), which ``pyproject.toml`` reads, the
command prints and the changelog has a section for; ``.ci/wheel_check.py`` finds every extension
``setup.py`` declares. These read the source tree (``.ci/wheel.sh`` leaves them out)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import kvoffload

ROOT = Path(__file__).resolve().parents[1]


def wheel_check() -> Any:
    spec = importlib.util.spec_from_file_location("wheel_check", ROOT / ".ci" / "wheel_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_version_is_written_once_and_the_command_prints_it():
    assert re.fullmatch(r"\d+\.\d+\.\d+", kvoffload.__version__)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "kvoffload.__version__" }' in pyproject
    assert not re.search(r"^version\s*=\s*\"", pyproject, re.M)  # no second copy
    out = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert out.stdout.strip() == f"kvoffload {kvoffload.__version__}"


def test_the_changelog_has_a_section_for_this_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(
        rf"^## {re.escape(kvoffload.__version__)} \(\d{{4}}-\d\d-\d\d\)$", changelog, re.M
    )


def test_wheel_check_reads_every_extension_setup_py_declares(tmp_path):
    check = wheel_check()
    exts = check.extensions(ROOT / "setup.py")
    assert "kvoffload.transfer.cuda._engine" in exts
    for sources in exts.values():
        assert sources and all((ROOT / s).is_file() for s in sources), sources
    # a second extension is found without a change to the checker
    setup = tmp_path / "setup.py"
    setup.write_text(
        'D = "pkg/src/"\nsetup(ext_modules=[Extension("pkg.a._x", sources=[D + "x.c"]),\n'
        '    Extension(name="pkg.b._y", sources=[D + f for f in ("y.c", "z.c")])])\n'
    )
    assert check.extensions(setup) == {
        "pkg.a._x": ["pkg/src/x.c"],
        "pkg.b._y": ["pkg/src/y.c", "pkg/src/z.c"],
    }


def test_wheel_check_names_a_missing_module_and_a_missing_source(tmp_path):
    check = wheel_check()
    files = ["pkg/a/_x.cpython-311-x86_64-linux-gnu.so", "pkg/a/__init__.py", "pkg/b/_y.py"]
    assert check.missing_in_wheel(["pkg.a._x", "pkg.b._y"], files) == ["pkg.b._y"]
    sdist = ["pkg-1.0/pkg/src/x.c", "pkg-1.0/setup.py"]
    assert check.missing_in_sdist(["pkg/src/x.c", "pkg/src/y.c"], sdist) == ["pkg/src/y.c"]
    wheel = tmp_path / "pkg-1.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/__init__.py", "")
    tar = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(tar, "w:gz") as t:
        t.add(ROOT / "setup.py", "pkg-1.0/setup.py")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / ".ci" / "wheel_check.py"),
            str(ROOT / "setup.py"),
            str(wheel),
            str(tar),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert "expected kvoffload.transfer.cuda._engine compiled in" in out.stdout
    assert "expected kvoffload/transfer/cuda/native/engine.c in pkg-1.0.tar.gz" in out.stdout
