"""Page-lock host memory for the GPU (cudaHostRegister through torch's cudart binding)."""

from __future__ import annotations

from collections.abc import Callable

# Portable (every context sees it as pinned) | Mapped (device-visible through UVA, which the SM
# copy kernels read and write directly).
_REGISTER_FLAGS = 0x01 | 0x02


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def cuda_pin(address: int, nbytes: int) -> Callable[[], None]:
    """Pin ``[address, address + nbytes)``; returns the function that unpins it."""
    import torch

    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = cudart.cudaHostRegister(address, nbytes, _REGISTER_FLAGS)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {address:#x} failed: {err}")

    def unpin() -> None:
        cudart.cudaHostUnregister(address)

    return unpin
