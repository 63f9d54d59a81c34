"""Moving bytes: layouts, transfer specs, copy backends. CUDA parts are imported lazily."""

from kvoffload.transfer.backend import CopyBackend, Pending
from kvoffload.transfer.layout import KVLayout, LayerGroup, Region
from kvoffload.transfer.registry import BACKENDS, make_backend, register_backend
from kvoffload.transfer.spec import TransferSpec

__all__ = [
    "BACKENDS",
    "CopyBackend",
    "KVLayout",
    "LayerGroup",
    "Pending",
    "Region",
    "TransferSpec",
    "make_backend",
    "register_backend",
]
