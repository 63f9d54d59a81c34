import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvoffload.store.keys import as_block_key, prefix_block_keys


def test_partial_last_block_has_no_key():
    assert len(prefix_block_keys(list(range(47)), 16)) == 2
    assert len(prefix_block_keys(list(range(48)), 16)) == 3
    assert prefix_block_keys(list(range(15)), 16) == []


def test_keys_chain_over_the_whole_prefix():
    a = prefix_block_keys([1] * 16 + [2] * 16, 16)
    b = prefix_block_keys([9] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # same second block, different first block
    assert len(set(a)) == 2 and all(len(k) == 16 for k in a)


def test_parent_continues_the_chain():
    tokens = list(range(64))
    whole = prefix_block_keys(tokens, 16)
    tail = prefix_block_keys(tokens[32:], 16, parent=whole[1])
    assert tail == whole[2:]


def test_salt_separates_caches():
    tokens = list(range(32))
    assert prefix_block_keys(tokens, 16, salt=b"lora-a") != prefix_block_keys(tokens, 16)


def test_token_dtype_does_not_change_keys():
    tokens = list(range(1000, 1032))
    assert prefix_block_keys(np.array(tokens, dtype=np.int32), 16) == prefix_block_keys(tokens, 16)


def test_keys_are_stable_across_processes():
    code = (
        "from kvoffload.store.keys import prefix_block_keys as p; print(p(range(32), 16)[1].hex())"
    )
    out = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
        ).stdout
        for env in ({"PYTHONHASHSEED": "1"}, {"PYTHONHASHSEED": "2"})
    }
    assert len(out) == 1 and out.pop().strip() == prefix_block_keys(range(32), 16)[1].hex()


def test_engine_hashes_as_keys():
    assert as_block_key(b"\x01\x02") == b"\x01\x02"
    assert as_block_key(5) != as_block_key(-5)
    assert len(as_block_key(2**127 - 1)) == 16
    for too_big, shown in [(2**130, "an int of 131 bits"), (-(2**128), "a negative int of 129")]:
        with pytest.raises(ValueError, match=rf"at most 128 bits, got {shown}"):
            as_block_key(too_big)
    with pytest.raises(ValueError, match="bytes or int"):
        as_block_key("abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        as_block_key(b"")


def test_every_128_bit_digest_is_a_key_and_distinct():
    """534 of 1,000 unsigned xxh3-128 digests (the top bit set) used to be refused with "expected
    at most 128 bits, got 128 bits"."""
    digests = [xxhash.xxh3_128_intdigest(i.to_bytes(8, "little")) for i in range(1000)]
    assert sum(d >> 127 for d in digests) > 400  # the top bit is set in about half
    keys = [as_block_key(d) for d in digests]
    assert [int.from_bytes(k, "big") for k in keys] == digests and {len(k) for k in keys} == {16}
    assert len(set(keys)) == 1000
    assert as_block_key(2**128 - 1) == b"\xff" * 16 and as_block_key(0) == bytes(16)
    # ints below 2**127 keep the key they had before (16 bytes, big-endian): stored keys stay valid
    assert as_block_key(123) == (123).to_bytes(16, "big", signed=True)


def test_negative_ints_never_share_a_key_with_non_negative_ones():
    pairs = [(-1, 2**128 - 1), (-5, 5), (-(2**127), 2**127), (-(2**128 - 1), 1)]
    for neg, pos in pairs:
        assert as_block_key(neg) != as_block_key(pos)
    assert as_block_key(-1) == b"-" + (1).to_bytes(16, "big")
    assert len({as_block_key(h) for h in range(-300, 300)}) == 600


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size > 0"):
        prefix_block_keys([1, 2], 0)


def test_checked_keys():
    from kvoffload.store.keys import checked_keys

    ks = [b"a", b"b"]
    assert checked_keys(ks, "x") is ks  # the common case: no copy
    assert checked_keys((b"a", 5), "x") == [b"a", as_block_key(5)]

    class Hash(bytes):
        pass

    (plain,) = checked_keys([Hash(b"h")], "x")
    assert type(plain) is bytes and plain == b"h"
    for bad, shown in [
        ("abc", "str 'abc'"),
        (b"", "bytes b''"),
        (True, "bool True"),
        (1.0, "float"),
    ]:
        with pytest.raises(ValueError, match=f"x: expected keys as non-empty bytes.*{shown}"):
            checked_keys([b"ok", bad], "x")  # type: ignore[list-item]
