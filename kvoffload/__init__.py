"""kvoffload: extend an LLM engine's GPU KV cache with host memory, disk and a shared store.

Importing the package is light (numpy and xxhash only); torch, Triton and CUDA are imported by the
parts that move bytes on a GPU, when they are first used.
"""

from kvoffload.config import OffloadConfig
from kvoffload.offload import (
    JobResult,
    LocalOffload,
    Offloader,
    TransferJob,
    TransferWorker,
    build_local,
)
from kvoffload.store.keys import as_block_key, prefix_block_keys
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.stall import StallTimer

# The release, written only here (pyproject.toml reads it; CHANGELOG.md has a section per release).
__version__ = "0.2.0"

__all__ = [
    "JobResult",
    "KVLayout",
    "LocalOffload",
    "OffloadConfig",
    "Offloader",
    "StallTimer",
    "TransferJob",
    "TransferWorker",
    "__version__",
    "as_block_key",
    "build_local",
    "prefix_block_keys",
]
