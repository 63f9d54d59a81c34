"""Block keys: what names one full block of KV in every tier.

A key is ``bytes``. Engines that hash their own blocks (vLLM: ``request.block_hashes``) hand those
in, as bytes or int; engines that do not can have us compute a prefix chain: key_i =
xxh3_128(key_{i-1} || token ids of block i as little-endian int64 || salt). A key therefore names a
whole prefix, not just one block's tokens. Python's ``hash()`` is never used: it is salted per
process, so two engine instances (or a restart) would disagree on every key.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import xxhash

BlockKey = bytes

# Ints are keyed by value, so that every 128-bit digest (xxh3-128, sha256 cut to 128 bits) and every
# 64-bit hash fits: 0 <= h < 2**128 as 16 bytes, unsigned big-endian; a negative h (Python's hash()
# of older vLLM) as 17 bytes, b"-" and |h| in 16 bytes. The lengths differ, so no negative int ever
# shares a key with a non-negative one (-1 and 2**128 - 1 stay apart).
_INT_KEY_BYTES = 16
_INT_LIMIT = 1 << (8 * _INT_KEY_BYTES)
_NEGATIVE = b"-"
_ROOT = b"kvoffload/root/v1"


def as_block_key(h: bytes | int) -> BlockKey:
    """An engine-provided block hash as a key.

    ``bytes`` are the key as given. An ``int`` ``h`` with ``-2**128 < h < 2**128`` is keyed by
    value: ``0 <= h < 2**128`` as 16 bytes, unsigned big-endian (every xxh3-128 digest fits);
    a negative ``h`` as 17 bytes, ``b"-"`` then ``abs(h)`` in 16, so it never equals the key of a
    non-negative int. Raises ValueError for other types, empty bytes, and ints of 129 bits or more.

    >>> as_block_key(2**128 - 1).hex(), as_block_key(-1).hex()
    ('ffffffffffffffffffffffffffffffff', '2d00000000000000000000000000000001')
    """
    if isinstance(h, bytes):
        if not h:
            raise ValueError("expected a non-empty block hash, got b''")
        return h
    if isinstance(h, int) and not isinstance(h, bool):
        magnitude = -h if h < 0 else h
        if magnitude >= _INT_LIMIT:
            raise ValueError(
                "expected an int block hash in (-2**128, 2**128), i.e. of at most 128 bits, got "
                f"{'a negative' if h < 0 else 'an'} int of {magnitude.bit_length()} bits"
            )
        raw = magnitude.to_bytes(_INT_KEY_BYTES, "big")
        return _NEGATIVE + raw if h < 0 else raw
    raise ValueError(f"expected a block hash as bytes or int, got {type(h).__name__}")


def as_block_keys(hashes: Iterable[bytes | int]) -> list[BlockKey]:
    return [as_block_key(h) for h in hashes]


KeyArray = np.ndarray  # uint8 (n, KEY_ROW_BYTES): one 16-byte key per row
KEY_ROW_BYTES = _INT_KEY_BYTES


def key_rows(keys: np.ndarray, where: str, copy: bool = True) -> KeyArray:
    """An array of keys checked and copied read-only: uint8 of shape (n, 16), one key per row
    (row i is the key ``bytes(keys[i])``). O(1) Python work whatever n. ValueError otherwise.
    ``copy=False`` only checks, for a call that reads the keys and keeps nothing of them."""
    if keys.dtype != np.uint8 or keys.ndim != 2 or keys.shape[1] != KEY_ROW_BYTES:
        raise ValueError(
            f"{where}: expected keys as a uint8 array of shape (n, {KEY_ROW_BYTES}), got "
            f"{keys.dtype} of shape {keys.shape}"
        )
    if not copy:
        return keys
    rows: KeyArray = keys.copy(order="C")  # uint8 (checked above): a copy of its own
    rows.setflags(write=False)
    return rows


def key_list(keys: Sequence[BlockKey] | KeyArray) -> list[BlockKey]:
    """Keys as a list of ``bytes`` (an array's rows become bytes: per-key work, for the slower
    paths such as the lower tiers)."""
    if isinstance(keys, np.ndarray):
        return [bytes(row) for row in keys]
    return keys if isinstance(keys, list) else list(keys)


def checked_keys(
    keys: Iterable[bytes | int] | KeyArray, where: str, ordered: bool = True
) -> list[BlockKey] | KeyArray:
    """``keys`` as a list of keys: bytes kept, ints converted as by ``as_block_key``; or an
    array of 16-byte keys as ``key_rows`` checks it.

    Raises ValueError, naming ``where`` and saying what was given, for a container that is not a
    list of keys: one key-like object (``bytes``, ``bytearray``, ``memoryview``, ``str``: iterating
    it would give ints or characters), a non-iterable (an int), and, where ``ordered`` (keys in
    prefix order), a one-shot iterator such as a generator (a second use would see it empty).
    Then, naming the first bad position, for a bad key (a str, a bytearray, a float, empty bytes).
    Keys that are all non-empty ``bytes`` (the usual case) are checked at C speed and returned as
    given when already a list.
    """
    if isinstance(keys, np.ndarray):
        return key_rows(keys, where)
    if not isinstance(keys, list):
        check_key_list(keys, where, ordered)
    out: list[Any] = keys if isinstance(keys, list) else list(keys)
    if set(map(type, out)) <= {bytes} and b"" not in out:
        return out
    fixed = list(out)
    for i, key in enumerate(fixed):
        if type(key) is bytes and key:
            continue
        if isinstance(key, (bytes, int)) and not isinstance(key, bool) and key != b"":
            fixed[i] = as_block_key(bytes(key) if isinstance(key, bytes) else key)
            continue
        raise ValueError(
            f"{where}: expected keys as non-empty bytes (or int block hashes), got "
            f"{type(key).__name__} {key!r:.60} at position {i}"
        )
    return fixed


def check_key_list(keys: object, where: str, ordered: bool = True) -> None:
    """ValueError unless ``keys`` is a list-like of keys (``checked_keys``)."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        raise ValueError(
            f"{where}: expected a list of keys, got one {type(keys).__name__} object "
            f"({keys!r:.40}); pass [key] for a single key"
        )
    if not isinstance(keys, Iterable):
        raise ValueError(
            f"{where}: expected a list of keys, got {type(keys).__name__} {keys!r:.40}"
        )
    if ordered and isinstance(keys, Iterator):
        raise ValueError(
            f"{where}: expected a list of keys (in prefix order), got a one-shot "
            f"{type(keys).__name__}; pass list(...) of it"
        )


def prefix_block_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    salt: bytes = b"",
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Chain keys for the full blocks of ``token_ids``; a partial last block gets no key.

    ``parent`` continues a chain (the key of the block before ``token_ids[0]``); ``salt`` separates
    caches that must never share blocks (a LoRA adapter, a model revision, a tenant).

    >>> keys = prefix_block_keys(list(range(40)), block_size=16)
    >>> len(keys), len(keys[0])
    (2, 16)
    """
    if block_size <= 0:
        raise ValueError(f"expected block_size > 0, got {block_size}")
    tokens = np.ascontiguousarray(token_ids, dtype="<i8")
    if tokens.ndim != 1:
        raise ValueError(f"expected a 1-D sequence of token ids, got shape {tokens.shape}")
    n_full = len(tokens) // block_size
    raw = tokens[: n_full * block_size].tobytes()
    step = block_size * 8
    key = _ROOT if parent is None else parent
    keys: list[BlockKey] = []
    for i in range(n_full):
        key = xxhash.xxh3_128_digest(key + raw[i * step : (i + 1) * step] + salt)
        keys.append(key)
    return keys
