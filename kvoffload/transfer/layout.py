"""KVLayout: an engine's KV cache described as byte regions, whatever tensors hold it.

A *region* is memory where block ``b``'s bytes for one piece of the model (a layer's K, a layer's
K+V page, or every layer at once) sit contiguously at ``base + b * block_stride`` and span
``page_bytes``. A *layer group* is a list of regions that share block ids (vLLM's KV cache group:
full-attention layers apart from sliding-window ones). One host slot holds one block of one group:
its regions' pages back to back, in region order.

The layouts engines use all reduce to this:

=====================================================  ==========================================
engine tensors                                         regions per block
=====================================================  ==========================================
per-layer K and V, ``[num_blocks, bs, heads, hd]``     2 per layer (``from_tensors(block_dim=0)``)
per-layer ``[2, num_blocks, bs, heads, hd]`` (vLLM     2 per layer (``from_tensors(block_dim=1)``)
<= 0.26, FlashAttention)
per-layer page holding K and V (vLLM 0.33 ``LBHNC``,   1 per layer (``from_tensors(block_dim=0)``)
``[num_blocks, ...]`` or int8 ``[num_blocks, page]``)
block-outermost / cross-layer ``[num_blocks, L, ...]`` 1 for the whole model
=====================================================  ==========================================

Tensors may be torch tensors (CPU or CUDA) or numpy arrays; only their addresses, shapes, strides
and dtype are read, so this module never imports torch. The caller keeps the tensors alive.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any


@dataclass(frozen=True)
class Region:
    base: int  # address of block 0's page
    block_stride: int  # bytes from block b to block b + 1
    page_bytes: int  # bytes of one block, contiguous
    num_blocks: int

    def __post_init__(self) -> None:
        if self.base <= 0:
            raise ValueError(f"expected a region at a real address (base > 0), got {self.base}")
        if self.page_bytes <= 0 or self.num_blocks <= 0:
            raise ValueError(
                f"expected page_bytes > 0 and num_blocks > 0, got {self.page_bytes}, "
                f"{self.num_blocks}"
            )
        if self.num_blocks > 1 and self.block_stride < self.page_bytes:
            raise ValueError(
                f"expected block_stride >= page_bytes ({self.page_bytes}), got {self.block_stride}"
            )


@dataclass(frozen=True)
class LayerGroup:
    regions: tuple[Region, ...]
    name: str = ""
    # Index of the first region of each model layer, ascending from 0 (a layer's K and V, or its
    # page); empty: every region is a layer of its own. Per-layer load completion
    # (``Pending.wait_on(layer=...)``) counts layers this way.
    layer_starts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.regions:
            raise ValueError("expected a layer group with at least one region, got none")
        starts = self.layer_starts
        if starts and (
            starts[0] != 0
            or any(b <= a for a, b in itertools.pairwise(starts))
            or starts[-1] >= len(self.regions)
        ):
            raise ValueError(
                f"expected layer_starts ascending from 0 below {len(self.regions)} (the region "
                f"count), got {starts}"
            )
        counts = {r.num_blocks for r in self.regions}
        if len(counts) != 1:
            raise ValueError(
                f"expected every region of group {self.name!r} to have the same number of "
                f"blocks, got {sorted(counts)}"
            )

    @property
    def num_blocks(self) -> int:
        return self.regions[0].num_blocks

    @property
    def slot_bytes(self) -> int:
        return sum(r.page_bytes for r in self.regions)

    @property
    def num_layers(self) -> int:
        return len(self.layer_starts) if self.layer_starts else len(self.regions)

    def layer_regions(self, layer: int) -> range:
        """Indices of the regions holding ``layer`` (ValueError outside ``[0, num_layers)``)."""
        n = self.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise ValueError(f"expected a layer in [0, {n}) of group {self.name!r}, got {layer!r}")
        if not self.layer_starts:
            return range(layer, layer + 1)
        end = self.layer_starts[layer + 1] if layer + 1 < n else len(self.regions)
        return range(self.layer_starts[layer], end)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each region's page inside a host slot."""
        out, acc = [], 0
        for r in self.regions:
            out.append(acc)
            acc += r.page_bytes
        return tuple(out)


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[LayerGroup, ...]
    dtype: str  # e.g. "bfloat16"
    block_size: int  # tokens per block
    device: str  # "cpu", "cuda:0", ...

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("expected a layout with at least one layer group, got none")
        if self.block_size <= 0:
            raise ValueError(f"expected block_size > 0, got {self.block_size}")

    @property
    def slot_bytes(self) -> int:
        """Bytes of one host slot: the largest group's block (vLLM sizes groups equally)."""
        return max(g.slot_bytes for g in self.groups)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def fingerprint(self, model: str = "") -> str:
        """Stable across processes and restarts: shapes and dtype, never addresses."""
        parts = [model, self.dtype, str(self.block_size)]
        for g in self.groups:
            parts.append(g.name + ":" + ",".join(str(r.page_bytes) for r in g.regions))
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]

    @classmethod
    def from_tensors(
        cls,
        tensors: Sequence[Any],
        block_size: int,
        block_dim: int | None = None,
        groups: Sequence[Sequence[int]] | None = None,
        group_names: Sequence[str] | None = None,
    ) -> KVLayout:
        """Describe ``tensors`` (one entry per engine KV tensor, in layer order).

        ``block_dim`` is the dimension that indexes blocks: 0 for ``[num_blocks, ...]``, 1 for
        ``[2, num_blocks, ...]`` (each index before it becomes its own region); each tensor is one
        layer for per-layer load completion (``LayerGroup.layer_starts``). Omitted, it is 0,
        except that a tensor whose dim 0 has size 2 is refused: that is almost always
        ``[2, num_blocks, ...]`` (K and V first) missing ``block_dim=1``, which would make every
        host slot hold all blocks' K (or V); a real 2-block cache passes ``block_dim=0``.
        ``groups`` lists, per layer group, the indices into ``tensors`` it holds (default: one
        group of all).
        Raises ValueError for one tensor instead of a list, mixed dtypes or devices, differing
        shapes inside a group, a block whose bytes are not contiguous, a layout the shapes
        contradict (``_check_block_size``: a block of two or more dims must have one of
        ``block_size``), and tensors that cannot hold KV: on the meta device, without storage
        (address 0, or less storage than the shape spans), or read-only numpy arrays (loads
        write into them). A block given as one flat dim (``[num_blocks, page]``) cannot be
        checked against ``block_size`` (docs/api.md).
        """
        if hasattr(tensors, "data_ptr") or hasattr(tensors, "__array_interface__"):
            raise ValueError(
                f"expected a list of KV tensors (one per layer), got one {type(tensors).__name__} "
                f"of shape {tuple(getattr(tensors, 'shape', ()))}; pass [tensor] for a single layer"
            )
        if not isinstance(tensors, Sequence):
            raise ValueError(f"expected a list of KV tensors, got {type(tensors).__name__}")
        if not tensors:
            raise ValueError("expected at least one KV tensor, got none")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"expected block_size > 0 (tokens per block), got {block_size!r}")
        infos = [_describe(t, i) for i, t in enumerate(tensors)]
        if block_dim is None:
            _refuse_likely_kv_first(infos)
            block_dim = 0
        for name in ("dtype", "device"):
            values = {getattr(i, name) for i in infos}
            if len(values) != 1:
                raise ValueError(f"expected KV tensors of one {name}, got {sorted(values)}")
        groups = [list(range(len(tensors)))] if groups is None else [list(g) for g in groups]
        names = [str(i) for i in range(len(groups))] if group_names is None else list(group_names)
        if len(names) != len(groups):
            raise ValueError(f"expected {len(groups)} group names, got {len(names)}")
        built = []
        for name, members in zip(names, groups, strict=True):
            if not members or any(not 0 <= m < len(tensors) for m in members):
                raise ValueError(
                    f"expected group {name!r} to list tensor indices in [0, {len(tensors)}), "
                    f"got {members}"
                )
            shapes = {infos[m].shape for m in members}
            if len(shapes) != 1:
                raise ValueError(
                    f"expected the tensors of group {name!r} to share one shape, got "
                    f"{sorted(shapes)}"
                )
            per_tensor = [_regions(infos[m], block_dim, m) for m in members]
            _check_block_size(infos[members[0]], block_dim, block_size, members[0])
            starts = [0]
            for tensor_regions in per_tensor[:-1]:
                starts.append(starts[-1] + len(tensor_regions))
            regions = tuple(r for rs in per_tensor for r in rs)
            built.append(LayerGroup(regions, name, tuple(starts)))
        return cls(tuple(built), infos[0].dtype, block_size, infos[0].device)


@dataclass(frozen=True)
class _TensorInfo:
    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes
    itemsize: int
    dtype: str
    device: str


def _describe(t: Any, index: int) -> _TensorInfo:
    if hasattr(t, "data_ptr"):  # torch.Tensor
        if t.device.type == "meta":
            raise ValueError(
                f"expected KV tensors with memory, got tensor {index} on the meta device"
            )
        item = t.element_size()
        info = _TensorInfo(
            t.data_ptr(),
            tuple(t.shape),
            tuple(s * item for s in t.stride()),
            item,
            str(t.dtype).removeprefix("torch."),
            str(t.device),
        )
        storage = t.untyped_storage()
        _check_memory(info, index, storage.data_ptr(), storage.nbytes())
        return info
    if hasattr(t, "__array_interface__"):  # numpy.ndarray
        if not t.flags.writeable:
            raise ValueError(
                f"expected writable KV arrays (loads write into them), got tensor {index} "
                "read-only: pass a writable array (e.g. a copy)"
            )
        info = _TensorInfo(
            t.ctypes.data, tuple(t.shape), tuple(t.strides), t.itemsize, str(t.dtype), "cpu"
        )
        _check_memory(info, index, info.address, _span(info))
        return info
    raise ValueError(f"expected a torch.Tensor or numpy.ndarray, got {type(t).__name__}")


def _span(info: _TensorInfo) -> int:
    """Bytes from the tensor's first element to one past its last (0 when it has none)."""
    if 0 in info.shape:
        return 0
    return info.itemsize + sum((n - 1) * s for n, s in zip(info.shape, info.strides, strict=True))


def _check_memory(info: _TensorInfo, index: int, storage_base: int, storage_bytes: int) -> None:
    """Refuse a tensor whose elements are not all inside live storage (copies would crash)."""
    if info.address == 0 or storage_bytes == 0:
        raise ValueError(
            f"expected KV tensors with storage, got tensor {index} of shape {info.shape} with "
            f"none (address {info.address:#x}, {storage_bytes} bytes of storage)"
        )
    if any(s < 0 for s in info.strides):
        raise ValueError(f"expected non-negative strides, got tensor {index}: {info.strides}")
    end = info.address + _span(info)
    if info.address < storage_base or end > storage_base + storage_bytes:
        raise ValueError(
            f"expected tensor {index} (shape {info.shape}) to lie inside its storage, got "
            f"{end - info.address} bytes from offset {info.address - storage_base} in a storage "
            f"of {storage_bytes} bytes"
        )


def _refuse_likely_kv_first(infos: Sequence[_TensorInfo]) -> None:
    for i, info in enumerate(infos):
        if len(info.shape) >= 2 and info.shape[0] == 2:
            raise ValueError(
                f"expected block_dim for tensor {i} of shape {info.shape}: dim 0 has size 2, "
                "which looks like [2, num_blocks, ...] (K and V first); pass block_dim=1 "
                "(or block_dim=0 if dim 0 really indexes 2 blocks)"
            )


def _check_block_size(info: _TensorInfo, block_dim: int, block_size: int, index: int) -> None:
    """A block shaped with two or more dims (``[bs, heads, hd]``, ``[2, bs, heads, hd]``,
    ``[heads, bs, hd]``...) holds its tokens in one of them: refuse one that has no dim of
    ``block_size``, which catches a wrong ``block_size`` and a ``block_dim`` pointing at the token
    dim. A flat block (``[num_blocks, page]``) says nothing and passes."""
    inner = info.shape[block_dim + 1 :]
    if len(inner) < 2 or block_size in inner:
        return
    hint = ""
    if info.shape[block_dim] == block_size and block_dim > 0:
        hint = (
            f"; dim {block_dim} (block_dim) has size {block_size}: is it the token dim, the "
            f"blocks being dim {block_dim - 1}?"
        )
    raise ValueError(
        f"expected each block of tensor {index} (shape {info.shape}, block_dim {block_dim}) to "
        f"hold block_size={block_size} tokens in one of its dims, got block dims {inner}{hint}"
    )


def _regions(info: _TensorInfo, block_dim: int, index: int) -> list[Region]:
    ndim = len(info.shape)
    if not 0 <= block_dim < ndim:
        raise ValueError(
            f"expected block_dim in [0, {ndim}) for tensor {index} of shape {info.shape}, "
            f"got {block_dim}"
        )
    inner_shape = info.shape[block_dim + 1 :]
    page = prod(inner_shape) * info.itemsize
    contiguous = info.itemsize
    for size, stride in zip(
        reversed(inner_shape), reversed(info.strides[block_dim + 1 :]), strict=True
    ):
        if size != 1 and stride != contiguous:
            raise ValueError(
                f"expected each block of tensor {index} (shape {info.shape}, byte strides "
                f"{info.strides}) to be contiguous below dim {block_dim}"
            )
        contiguous *= size
    outer: list[tuple[int, ...]] = [()]  # every index combination of the dims before block_dim
    for size in info.shape[:block_dim]:
        outer = [(*o, i) for o in outer for i in range(size)]
    return [
        Region(
            info.address + sum(i * s for i, s in zip(idx, info.strides[:block_dim], strict=True)),
            info.strides[block_dim],
            page,
            info.shape[block_dim],
        )
        for idx in outer
    ]
