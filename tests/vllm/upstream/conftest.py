"""vLLM 0.33.0's own tier tests, vendored (each file's header names its source): collected only
where vLLM is installed (the vLLM venv of ``.ci/vllm.sh``), since they import it at module level."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
