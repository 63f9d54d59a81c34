"""The lower tiers' block format: every damaged header or payload byte is caught."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.store.tiers.payload import (
    HEADER_BYTES,
    CorruptBlock,
    check_payload,
    fingerprint_bytes,
    pack_header,
    parse_header,
)

FP = fingerprint_bytes("00112233445566778899aabbccddeeff")
KEY = bytes(range(16))


def _block(n: int = 4096) -> bytes:
    return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_round_trip():
    payload = _block()
    head = pack_header(FP, KEY, payload)
    assert len(head) == HEADER_BYTES + len(KEY)
    header = parse_header(head + payload, FP, KEY)
    assert (header.key, header.payload_bytes, header.nbytes) == (KEY, len(payload), len(head))
    check_payload(header, payload)


def test_every_header_byte_is_checked():
    payload = _block()
    head = pack_header(FP, KEY, payload)
    for i in range(len(head)):  # the reserved field too: the header checksum covers it
        bad = bytearray(head)
        bad[i] ^= 0x01
        with pytest.raises(CorruptBlock):
            parse_header(bytes(bad), FP, KEY)


def test_payload_damage_and_truncation_are_caught():
    payload = _block()
    header = parse_header(pack_header(FP, KEY, payload), FP, KEY)
    for i in (0, 1, 2047, len(payload) - 1):
        bad = bytearray(payload)
        bad[i] ^= 0x80
        with pytest.raises(CorruptBlock, match="checksum"):
            check_payload(header, bytes(bad))
    with pytest.raises(CorruptBlock, match="payload of"):
        check_payload(header, payload[:-1])
    with pytest.raises(CorruptBlock, match="truncated"):
        parse_header(pack_header(FP, KEY, payload)[:-1], FP, KEY)


def test_other_fingerprint_or_key_never_matches():
    payload = _block()
    head = pack_header(FP, KEY, payload)
    with pytest.raises(CorruptBlock, match="fingerprint"):
        parse_header(head, fingerprint_bytes("f" * 32), KEY)
    with pytest.raises(CorruptBlock, match="key"):
        parse_header(head, FP, bytes(16))


def test_bad_arguments():
    with pytest.raises(ValueError, match="32 hex digits"):
        fingerprint_bytes("not-hex")
    with pytest.raises(ValueError, match=r"1\.\.65535 bytes"):
        pack_header(FP, b"", b"x")
