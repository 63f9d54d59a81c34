"""The host tier as one shared-memory region per engine, seen by the scheduler and every worker.

vLLM's tiering design, kept: secondary tiers (disk, Valkey) run in the scheduler process and copy
host chunks through a memoryview, so host memory must be visible there, not private to each
worker. ``KVOffloadSpec`` therefore puts its host slots in one file under ``/dev/shm`` that the
scheduler and every worker map (``SharedRegion``). Its layout, for ``W`` workers of ``B`` bytes
per block each, ``bpc`` blocks per chunk::

    chunk c = [ slot c*bpc | slot c*bpc+1 | ... ]        (a row: what a lower tier stores per key)
    slot s  = [ rank 0's B bytes | rank 1's B bytes | ... | rank W-1's ]

so a worker's slots sit at a fixed stride (``W * B``) from its own base (``rank * B``): every copy
backend addresses them as ``base + slot * stride``, unchanged (``RankArena``), and a chunk's bytes
for every rank are one contiguous row (``RowArena``), which is what makes one key per chunk safe
under tensor and pipeline parallelism (a value always holds every rank's shard, in rank order).

Each process opens the region under its own role (0 for the scheduler, ``r + 1`` for worker rank
``r``). It is built under no name and only then named, sized with ``posix_fallocate`` (so a
``/dev/shm`` too small for ``cpu_bytes_to_use`` fails at start-up, not with a SIGBUS later), and
its name is unlinked as soon as all ``mappers`` processes have opened it (``shm.py``): from then on
the memory lives exactly as long as the processes that map it, however they end (SIGTERM, SIGKILL,
a crash). Two engines given one ``engine_id`` on a host never share a region and no engine is
split over two: a process that would make either happen is refused (``shm.py`` says why that is
the only safe answer). What an engine killed while starting leaves is reclaimed at the next start,
never while a live process maps it.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvoffload.integrations.vllm.shm import (
    SUFFIX,
    ShmFile,
    close_shared,
    open_shared,
    region_name,
    still_named,
)
from kvoffload.store.arena import HostArena, PinFn

SHM_DIR = Path("/dev/shm")


class SharedRegion:
    """``nbytes`` of shared memory named by ``engine_id`` and mapped by ``mappers`` processes,
    each constructing one ``SharedRegion`` with its own ``role`` in ``range(mappers)`` (vLLM: 0
    for the scheduler, ``r + 1`` for worker rank ``r``); ``array`` is its flat uint8 view and
    ``token`` the random 16 bytes naming this region (equal in every process that maps it).

    ValueError: bad arguments, no room in ``directory``, or ``engine_id`` in use by another
    engine on this host (``shm.open_shared``); nothing is created or counted then.
    """

    def __init__(
        self,
        engine_id: str,
        nbytes: int,
        directory: Path = SHM_DIR,
        mappers: int = 1,
        role: int = 0,
    ) -> None:
        if nbytes <= 0:
            raise ValueError(f"expected a shared region of > 0 bytes, got {nbytes}")
        if mappers < 1:
            raise ValueError(f"expected mappers >= 1 (processes mapping the region), got {mappers}")
        if not 0 <= role < mappers:
            raise ValueError(f"expected a role in [0, {mappers}) (one per mapper), got {role}")
        self.path = directory / f"{region_name(engine_id)}{SUFFIX}"
        self.nbytes = nbytes
        self._shm: ShmFile | None = open_shared(self.path, nbytes, mappers, role)
        self.created = self._shm.created
        self.token = self._shm.token
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(self._shm.fd, nbytes, mmap.MAP_SHARED)
        except BaseException:
            self.close()
            raise
        self.array: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address: int = self.array.ctypes.data

    @property
    def named(self) -> bool:
        """Whether the file's name is still in its directory (not every mapper has opened it)."""
        return self._shm is not None and still_named(self._shm)

    def rows(self, num_rows: int) -> np.ndarray:
        """The region as ``num_rows`` rows (chunks), for the scheduler's lower tiers."""
        return self.array.reshape(num_rows, self.nbytes // num_rows)

    def close(self) -> None:
        """Release this process's hold (and the name, if the creator still sees it) and drop
        this object's mapping reference; the memory goes once the last view of it is gone."""
        if self._shm is not None:
            close_shared(self._shm)
            self._shm = None
        if getattr(self, "_mmap", None) is not None:
            del self.array
            self._mmap = None


class RankArena(HostArena):
    """One worker's host slots inside a ``SharedRegion``: ``num_slots`` slots of ``slot_bytes``
    usable bytes, ``stride`` bytes apart, the first at byte ``offset``.

    ``slot_bytes`` (the attribute the copy backends use as the slot address stride) is ``stride``;
    ``slots`` is a ``(num_slots, usable)`` strided view. ``pin`` page-locks the whole region;
    ``close`` unpins it and closes the region (this process's handle on it).
    """

    def __init__(
        self,
        region: SharedRegion,
        num_slots: int,
        usable: int,
        stride: int,
        offset: int,
        pin: PinFn | None = None,
    ) -> None:
        if num_slots <= 0 or not 0 < usable <= stride or offset + usable > stride:
            raise ValueError(
                f"expected num_slots > 0 and 0 < usable <= stride with offset + usable <= stride, "
                f"got {num_slots}, {usable}, {stride}, {offset}"
            )
        if (num_slots - 1) * stride + offset + usable > region.nbytes:
            raise ValueError(
                f"expected {num_slots} slots of stride {stride} to fit the {region.nbytes}-byte "
                "shared region"
            )
        self.region = region
        self.num_slots = num_slots
        self.slot_bytes = stride
        self.nbytes = num_slots * stride
        self._mmap = None
        base = region.array[offset:]
        self.slots = as_strided(base, (num_slots, usable), (stride, 1))
        self.base_address = region.address + offset
        self._unpin = pin(region.address, region.nbytes) if pin is not None else None

    def close(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self.region.close()


class RowArena(HostArena):
    """Rows of an existing 2-D buffer (vLLM's primary-tier memoryview, or ``SharedRegion.rows``)
    as host slots, one row per slot, for a lower tier's ``TierMover``. Owns no memory."""

    def __init__(self, rows: np.ndarray | memoryview) -> None:
        array = np.asarray(rows).view(np.uint8)
        if array.ndim != 2 or array.strides[1] != 1 or array.strides[0] != array.shape[1]:
            raise ValueError(
                f"expected contiguous 2-D rows, got shape {array.shape} strides {array.strides}"
            )
        self.num_slots, self.slot_bytes = array.shape
        self.nbytes = array.nbytes
        self._mmap = None
        self._unpin = None
        self.slots = array
        self.base_address = array.ctypes.data

    def close(self) -> None:
        """Drop the view, so the buffer's owner can unmap it (vLLM closes its region's mmap)."""
        self.slots = np.empty((0, self.slot_bytes), dtype=np.uint8)
