"""The host arena: one allocation cut into fixed-size slots, one slot per block.

A slot holds one block for every layer of a layer group (K and V), contiguous, so a whole block
moves as one DMA descriptor, one file write or one remote object. The memory is an anonymous
``mmap`` (page-aligned, committed by the OS on first touch). Pinning it for the GPU is done by the
caller through ``pin``, a function ``(address, nbytes) -> unpin`` (see
``kvoffload.transfer.pinning``), so this module never imports torch or CUDA. A ``placement``
(``kvoffload.store.numa``) binds the memory to a NUMA node before it is pinned or touched.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np

from kvoffload.store import numa
from kvoffload.store.numa import Placement

PinFn = Callable[[int, int], Callable[[], None]]


def slots_for_capacity(capacity_bytes: int, slot_bytes: int) -> int:
    """How many whole slots fit in ``capacity_bytes``; ValueError if not even one."""
    if slot_bytes <= 0:
        raise ValueError(f"expected slot_bytes > 0, got {slot_bytes}")
    if capacity_bytes < slot_bytes:
        raise ValueError(
            f"expected a host capacity of at least one block ({slot_bytes} bytes), "
            f"got {capacity_bytes} bytes"
        )
    return capacity_bytes // slot_bytes


class HostArena:
    """Fixed-size slots; ``slots`` is their (num_slots, slot_bytes) uint8 view. ``placement``:
    where it was asked to go and why (``numa.place``: "auto" degrades to none where the kernel
    refuses, saying so; a node asked for by id raises ``numa.NumaUnavailable``)."""

    placement = Placement.none("not placed (this arena's memory is not its own)")

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        pin: PinFn | None = None,
        placement: Placement | None = None,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"expected num_slots > 0, got {num_slots}")
        if slot_bytes <= 0:
            raise ValueError(f"expected slot_bytes > 0, got {slot_bytes}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.nbytes = num_slots * slot_bytes
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(-1, self.nbytes)
        except (OSError, OverflowError) as err:
            raise MemoryError(
                f"could not reserve the host arena: {self.nbytes} bytes "
                f"({self.nbytes / 2**30:.1f} GiB) for {num_slots} slots of {slot_bytes} bytes "
                f"({err}); set OffloadConfig host_capacity_bytes or host_capacity_blocks to what "
                "this machine can spare"
            ) from err
        self.slots: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8).reshape(
            num_slots, slot_bytes
        )
        self.base_address: int = self.slots.ctypes.data
        if placement is not None:  # before pinning: pinning allocates every page
            self.placement = numa.place(self.base_address, self.nbytes, placement)
        else:
            self.placement = Placement.none("no placement asked for")
        self._unpin = pin(self.base_address, self.nbytes) if pin is not None else None

    @property
    def pinned(self) -> bool:
        return self._unpin is not None

    def numa_where(self, samples: int = 64) -> dict[str, object]:
        """Where this arena's pages are (``numa.where``): its policy and sampled pages' nodes."""
        return numa.where(self.base_address, self.nbytes, samples)

    def slot_address(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"expected a slot in [0, {self.num_slots}), got {slot}")
        return self.base_address + slot * self.slot_bytes

    def close(self) -> None:
        """Unpin, and drop this arena's reference to the memory.

        The memory is unmapped once the last numpy view of it is gone (so a view kept elsewhere
        stays valid instead of pointing at unmapped memory). No copy may be in flight.
        """
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        if self._mmap is not None:
            del self.slots
            self._mmap = None

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
