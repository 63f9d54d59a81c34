"""The shared tier's own RESP reader and writer (``resp.py``), over a real socket pair, with the
server's bytes arriving in pieces of every size: values land byte-exact in the caller's buffers,
the stream stays in step after a value of the wrong size, and a cut connection is an error."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

hiredis = pytest.importorskip("hiredis")

from kvoffload.store.tiers import resp  # noqa: E402


def errors(text: str) -> ValueError:
    return ValueError(text)


def feed(data: bytes, chunk: int, close: bool = False) -> tuple[socket.socket, threading.Thread]:
    """A socket whose peer sends ``data`` ``chunk`` bytes at a time (then closes, if asked)."""
    ours, theirs = socket.socketpair()
    ours.settimeout(10)

    def send() -> None:
        for i in range(0, len(data), chunk):
            theirs.sendall(data[i : i + chunk])
        if close:
            theirs.close()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return ours, thread


@pytest.mark.parametrize("chunk", [1, 3, 7, 4096, 1 << 20])
def test_values_land_in_their_buffers_whatever_the_pieces(chunk):
    rng = np.random.default_rng(chunk)
    head_n, body_n = 60, 20_000
    values = [rng.integers(0, 256, head_n + body_n, dtype=np.uint8).tobytes() for _ in range(3)]
    wire = b"".join(b"$%d\r\n%s\r\n" % (len(v), v) for v in values)
    wire += b"$-1\r\n-NOPERM no\r\n$5\r\nshort\r\n" + b"$%d\r\n%s\r\n" % (len(values[0]), values[0])
    sock, thread = feed(wire, chunk)
    reader = resp.Reader(sock)
    heads = [bytearray(head_n) for _ in range(4)]
    bodies = [bytearray(body_n) for _ in range(4)]
    for i in range(3):
        assert reader.bulk_into(memoryview(heads[i]), memoryview(bodies[i]), errors) is True
        assert bytes(heads[i]) + bytes(bodies[i]) == values[i]
    out_h, out_b = memoryview(bytearray(head_n)), memoryview(bytearray(body_n))
    assert reader.bulk_into(out_h, out_b, errors) is None  # nil: a miss
    refused = reader.bulk_into(out_h, out_b, errors)
    assert isinstance(refused, ValueError) and str(refused) == "NOPERM no"
    assert reader.bulk_into(out_h, out_b, errors) == 5  # read past: the stream stays in step
    assert reader.bulk_into(memoryview(heads[3]), memoryview(bodies[3]), errors) is True
    assert bytes(heads[3]) + bytes(bodies[3]) == values[0] and reader.buffered == 0
    thread.join(10)
    sock.close()


@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_small_replies(chunk):
    wire = b"+OK\r\n+QUEUED\r\n:42\r\n$3\r\nabc\r\n$-1\r\n*2\r\n:1\r\n$1\r\nx\r\n-ERR bad\r\n_\r\n"
    sock, thread = feed(wire, chunk)
    reader = resp.Reader(sock)
    got = [reader.reply(errors) for _ in range(8)]
    assert got[:7] == [True, "QUEUED", 42, b"abc", None, [1, b"x"], got[6]]
    assert isinstance(got[6], ValueError) and str(got[6]) == "ERR bad" and got[7] is None
    thread.join(10)
    sock.close()


def test_a_connection_cut_mid_value_is_an_error():
    sock, thread = feed(b"$100\r\n" + b"x" * 40, 16, close=True)
    reader = resp.Reader(sock)
    with pytest.raises(resp.ProtocolError, match="closed by the server mid-value"):
        reader.bulk_into(memoryview(bytearray(10)), memoryview(bytearray(90)), errors)
    thread.join(10)
    sock.close()


def test_garbage_is_an_error_not_a_value():
    sock, thread = feed(b"%3\r\n", 4)
    with pytest.raises(resp.ProtocolError, match="expected a bulk string"):
        resp.Reader(sock).bulk_into(memoryview(bytearray(1)), memoryview(bytearray(2)), errors)
    thread.join(10)
    sock.close()
    sock, thread = feed(b"+" + b"y" * (resp.READ_CHUNK + 10), 512)
    with pytest.raises(resp.ProtocolError, match="expected a reply line under"):
        resp.Reader(sock).reply(errors)
    thread.join(10)
    sock.close()


def test_commands_are_what_a_server_parses():
    """``pack``, ``set_pieces`` and ``coalesce`` give the RESP a server reads (hiredis parses
    requests and replies alike)."""
    payload = bytearray(np.arange(100_000, dtype=np.uint32).tobytes())
    pieces = resp.set_pieces(b"k{1}", b"HEAD", memoryview(payload), 60)
    pieces += resp.set_pieces(b"k2", b"H", memoryview(payload)[:10], 0)
    sent = resp.coalesce([resp.pack(b"GETEX", b"k", b"EX", 3600), *pieces])
    assert any(isinstance(p, memoryview) for p in sent)  # the large payload is not copied
    parser = hiredis.Reader()
    parser.feed(b"".join(bytes(p) for p in sent))
    assert parser.gets() == [b"GETEX", b"k", b"EX", b"3600"]
    assert parser.gets() == [b"SET", b"k{1}", b"HEAD" + bytes(payload), b"EX", b"60"]
    assert parser.gets() == [b"SET", b"k2", b"H" + bytes(payload[:10])]
    assert parser.gets() is False
