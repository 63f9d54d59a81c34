import numpy as np
import pytest
import torch

from kvoffload.transfer.layout import KVLayout, LayerGroup, Region
from kvoffload.transfer.shapes import MODELS, engine_tensors


def alloc(shape):
    return torch.empty(shape, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("layout", "regions_per_layer"),
    [("kv_split", 2), ("kv_pair", 2), ("page", 1)],
)
def test_per_layer_layouts(layout, regions_per_layer):
    m = MODELS["llama3-8b"]
    tensors, block_dim = engine_tensors(m, layout, 10, 16, alloc)
    kv = KVLayout.from_tensors(tensors, block_size=16, block_dim=block_dim)
    regions = kv.groups[0].regions
    assert len(regions) == regions_per_layer * m.layers
    assert kv.slot_bytes == m.block_bytes(16) == 2 << 20
    assert {r.page_bytes for r in regions} == {m.block_bytes(16) // len(regions)}
    assert kv.dtype == "bfloat16" and kv.device == "cpu"


def test_kv_split_regions_point_at_k_and_v():
    t = torch.empty(2, 10, 16, 8, 128, dtype=torch.bfloat16)
    r_k, r_v = KVLayout.from_tensors([t], block_size=16, block_dim=1).groups[0].regions
    assert r_k.base == t[0].data_ptr() and r_v.base == t[1].data_ptr()
    assert r_k.block_stride == r_k.page_bytes == 16 * 8 * 128 * 2
    assert r_v.base + 3 * r_v.block_stride == t[1, 3].data_ptr()


def test_cross_layer_is_one_region_per_block():
    m = MODELS["qwen2.5-7b"]
    tensors, _ = engine_tensors(m, "cross_layer", 4, 16, alloc)
    (region,) = KVLayout.from_tensors(tensors, block_size=16).groups[0].regions
    assert region.page_bytes == m.block_bytes(16)


def test_padded_pages_keep_their_stride():
    raw = torch.empty(6, 4096 + 512, dtype=torch.int8)
    (region,) = KVLayout.from_tensors([raw[:, :4096]], block_size=16).groups[0].regions
    assert region.page_bytes == 4096 and region.block_stride == 4096 + 512


def test_groups_and_fingerprint():
    full = [torch.empty(8, 16, 2, 64, dtype=torch.bfloat16) for _ in range(4)]
    swa = [torch.empty(8, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    kv = KVLayout.from_tensors(
        full + swa, block_size=16, groups=[[0, 1, 2, 3], [4, 5]], group_names=["full", "swa"]
    )
    assert [len(g.regions) for g in kv.groups] == [4, 2]
    assert kv.slot_bytes == kv.groups[0].slot_bytes
    again = KVLayout.from_tensors(
        [t.clone() for t in full + swa],
        block_size=16,
        groups=[[0, 1, 2, 3], [4, 5]],
        group_names=["full", "swa"],
    )
    assert kv.fingerprint("m") == again.fingerprint("m")  # addresses differ, shapes do not
    assert kv.fingerprint("m") != kv.fingerprint("other-model")
    one = KVLayout.from_tensors(full + swa, block_size=16)
    assert one.fingerprint("m") != kv.fingerprint("m")


def test_mismatched_tensors_are_clear_errors():
    a = torch.empty(8, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one dtype"):
        KVLayout.from_tensors([a, torch.empty(8, 16, 2, 64, dtype=torch.float16)], block_size=16)
    with pytest.raises(ValueError, match="share one shape"):
        KVLayout.from_tensors([a, torch.empty(8, 16, 4, 64, dtype=torch.bfloat16)], block_size=16)
    with pytest.raises(ValueError, match="same number of blocks"):
        LayerGroup((Region(4096, 64, 64, 8), Region(8192, 64, 64, 9)))
    with pytest.raises(ValueError, match="contiguous"):
        KVLayout.from_tensors([a.transpose(2, 3)], block_size=16)
    with pytest.raises(ValueError, match="block_dim"):
        KVLayout.from_tensors([a], block_size=16, block_dim=4)
    with pytest.raises(ValueError, match=r"torch\.Tensor or numpy\.ndarray"):
        KVLayout.from_tensors([[1, 2]], block_size=16)
    with pytest.raises(ValueError, match="tensor indices"):
        KVLayout.from_tensors([a], block_size=16, groups=[[0, 1]])
    with pytest.raises(ValueError, match="block_size > 0"):
        KVLayout.from_tensors([a], block_size=0)
    with pytest.raises(ValueError, match="at least one KV tensor"):
        KVLayout.from_tensors([], block_size=16)
    with pytest.raises(ValueError, match="block_stride >= page_bytes"):
        Region(base=4096, block_stride=10, page_bytes=20, num_blocks=2)


def test_numpy_layout():
    arrays = [np.zeros((5, 2, 16, 4, 8), dtype=np.uint16) for _ in range(3)]
    kv = KVLayout.from_tensors(arrays, block_size=16)
    assert kv.dtype == "uint16" and kv.slot_bytes == 3 * 2 * 16 * 4 * 8 * 2


def test_tensors_without_memory_are_refused_at_layout_time():
    """Each of these used to be accepted; the first copy then read or wrote address 0 (or past
    the storage) and crashed the process."""
    meta = torch.empty(8, 16, 2, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="tensor 1 on the meta device"):
        KVLayout.from_tensors([alloc((8, 16, 2, 64)), meta], block_size=16)
    emptied = alloc((8, 16, 2, 64))
    emptied.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"tensor 0 .* with none"):
        KVLayout.from_tensors([emptied], block_size=16)
    shrunk = alloc((8, 16, 2, 64))
    shrunk.untyped_storage().resize_(shrunk.untyped_storage().nbytes() // 2)
    with pytest.raises(ValueError, match="inside its storage"):
        KVLayout.from_tensors([shrunk], block_size=16)
    with pytest.raises(ValueError, match="with none"):
        KVLayout.from_tensors([np.zeros((0, 16, 4), np.float32)], block_size=16)
    with pytest.raises(ValueError, match="base > 0"):
        Region(base=0, block_stride=64, page_bytes=64, num_blocks=8)


def test_read_only_numpy_arrays_are_refused():
    frozen = np.zeros((8, 16, 4), np.float32)
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match="tensor 0 read-only"):
        KVLayout.from_tensors([frozen], block_size=16)
    from_bytes = np.frombuffer(bytes(8 * 64 * 4), np.float32).reshape(8, 16, 4)
    with pytest.raises(ValueError, match="writable"):
        KVLayout.from_tensors([from_bytes], block_size=16)


def test_kv_first_tensors_need_block_dim():
    kv_first = alloc((2, 10, 16, 8, 128))  # vLLM <= 0.26 / FlashAttention, K and V first
    with pytest.raises(ValueError, match=r"pass block_dim=1"):
        KVLayout.from_tensors([kv_first], block_size=16)
    right = KVLayout.from_tensors([kv_first], block_size=16, block_dim=1)
    assert right.slot_bytes == 2 * 16 * 8 * 128 * 2 and right.groups[0].num_blocks == 10
    two_blocks = KVLayout.from_tensors([kv_first], block_size=16, block_dim=0)  # said explicitly
    assert two_blocks.groups[0].num_blocks == 2
    assert KVLayout.from_tensors([alloc((3, 16, 8, 128))], block_size=16).slot_bytes == 32768
