"""The engine-neutral runtime: the scheduler-side Offloader and the worker-side TransferWorker."""

from kvoffload.offload.jobs import JobResult, TransferJob
from kvoffload.offload.local import LocalOffload, build_local
from kvoffload.offload.offloader import Offloader
from kvoffload.offload.worker import TransferWorker

__all__ = ["JobResult", "LocalOffload", "Offloader", "TransferJob", "TransferWorker", "build_local"]
