"""The bytes a lower tier keeps per block: a fixed header, the block key, then the payload.

One format for every lower tier (a disk file, a Valkey value), so a block can move between them
without re-encoding::

    offset  size  field
    0       8     magic b"KVOFFBLK"
    8       2     format version (little-endian u16; FORMAT_VERSION)
    10      2     key length in bytes
    12      4     reserved, zero
    16      8     payload length in bytes (u64)
    24      8     xxh3-64 of the payload
    32      16    layout fingerprint (``KVLayout.fingerprint(model)``, 32 hex digits as bytes)
    48      8     xxh3-64 of bytes 0..48 and the key (so a damaged header is caught too)
    56      k     the block key
    56 + k  n     the payload: one host slot, byte for byte

A block is only ever handed out after the fingerprint, the key, the length and both checksums
match; anything else is ``CorruptBlock`` (the tier turns it into a miss). xxh3-64 runs at memory
speed (tens of GB/s), far above any disk or network here, so checking every read costs nothing
measurable next to the read itself.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"KVOFFBLK"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sHHIQQ16s")  # magic, version, key_len, reserved, length, sum, fp
_SUM = struct.Struct("<Q")
HEADER_BYTES = _FIXED.size + _SUM.size  # 56, then the key


class CorruptBlock(Exception):
    """Stored bytes that must not be used: wrong magic, version, fingerprint, key, size or sum."""


@dataclass(frozen=True)
class Header:
    key: bytes
    payload_bytes: int
    payload_sum: int

    @property
    def nbytes(self) -> int:
        """Bytes before the payload."""
        return HEADER_BYTES + len(self.key)


def fingerprint_bytes(fingerprint: str) -> bytes:
    """The 16 bytes a 32-hex-digit layout fingerprint packs into; ValueError otherwise."""
    try:
        raw = bytes.fromhex(fingerprint)
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raise ValueError(
            f"expected a layout fingerprint of 32 hex digits (KVLayout.fingerprint), "
            f"got {fingerprint!r}"
        )
    return raw


def checksum(payload: memoryview | bytes) -> int:
    return int(xxhash.xxh3_64_intdigest(payload))


def pack_header(fingerprint: bytes, key: bytes, payload: memoryview | bytes) -> bytes:
    """The header (key included) for ``payload``; ``fingerprint`` from ``fingerprint_bytes``."""
    if not 0 < len(key) < 1 << 16:
        raise ValueError(f"expected a block key of 1..65535 bytes, got {len(key)}")
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, len(key), 0, len(payload), checksum(payload), fingerprint
    )
    return fixed + _SUM.pack(xxhash.xxh3_64_intdigest(fixed + key)) + key


def parse_header(buf: bytes | bytearray | memoryview, fingerprint: bytes, key: bytes) -> Header:
    """Check the header at the start of ``buf`` against the expected fingerprint and key.

    ``buf`` must hold at least ``HEADER_BYTES + len(key)`` bytes. Raises ``CorruptBlock``.
    """
    if len(buf) < HEADER_BYTES + len(key):
        raise CorruptBlock(f"header truncated: {len(buf)} bytes")
    magic, version, key_len, _, length, payload_sum, fp = _FIXED.unpack_from(buf)
    if magic != MAGIC:
        raise CorruptBlock("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"format version {version}, expected {FORMAT_VERSION}")
    (header_sum,) = _SUM.unpack_from(buf, _FIXED.size)
    stored_key = bytes(buf[HEADER_BYTES : HEADER_BYTES + key_len])
    if xxhash.xxh3_64_intdigest(bytes(buf[: _FIXED.size]) + stored_key) != header_sum:
        raise CorruptBlock("header checksum mismatch")
    if fp != fingerprint:
        raise CorruptBlock("layout fingerprint differs")
    if stored_key != key:
        raise CorruptBlock("block key differs")
    return Header(stored_key, length, payload_sum)


def check_payload(header: Header, payload: memoryview | bytes) -> None:
    """Raise ``CorruptBlock`` unless ``payload`` is the one ``header`` describes."""
    if len(payload) != header.payload_bytes:
        raise CorruptBlock(f"payload of {len(payload)} bytes, header says {header.payload_bytes}")
    if checksum(payload) != header.payload_sum:
        raise CorruptBlock("payload checksum mismatch")
