import subprocess
import sys

import numpy as np
import pytest

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
    with pytest.raises(ValueError, match="128 bits"):
        as_block_key(2**130)
    with pytest.raises(ValueError, match="bytes or int"):
        as_block_key("abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        as_block_key(b"")


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
