#!/usr/bin/env bash
# The package as users install it: `python -m build` makes the sdist and the wheel (the wheel is
# built from the sdist, so the native engine compiles from the shipped sources), the wheel is
# installed (not editable) in a fresh venv, and the CPU tests run against that installed package
# from a directory that holds only the tests and the docs they read. KVOFFLOAD_REQUIRE_NATIVE=1:
# the native engine and native block index extensions must be in the wheel. test_structure.py reads the source tree, so it
# runs in the main job only.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
rm -rf dist .venv-wheel
python -m pip install -q build
python -m build -q --sdist --wheel --outdir dist .
ls -l dist
python3 -m venv .venv-wheel
.venv-wheel/bin/python -m pip install -q --upgrade pip
.venv-wheel/bin/python -m pip install -q 'torch==2.13.0'
wheel=$(ls dist/kvoffload-*.whl)
.venv-wheel/bin/python -m pip install -q "$wheel[dev,bench,tiers]"
work=$(mktemp -d)
cp -r tests docs pyproject.toml "$work"/
cd "$work"
"$repo/.venv-wheel/bin/python" -c "import kvoffload, kvoffload.transfer.cuda.native as n; \
print('installed:', kvoffload.__file__); print('native engine:', n.module() or n.unavailable()); \
from kvoffload.doctor import block_index; print('native index:', block_index())"
KVOFFLOAD_REQUIRE_NATIVE=1 CI="${CI:-1}" "$repo/.venv-wheel/bin/python" -m pytest -q \
  -p no:cacheprovider --ignore=tests/test_structure.py
