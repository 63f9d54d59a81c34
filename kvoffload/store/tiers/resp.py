"""RESP2 on a connected socket, for the shared tier's data path (torch-free).

The Valkey tier sends its GET/GETEX/SET pipelines itself on a socket it borrowed from the redis
client's pool (connected, authenticated, TLS set up and the database selected by the client), so
that a value lands where it belongs without being copied through the client's reply objects:

- ``Reader.bulk_into`` reads a bulk string's head into a small buffer and the rest straight into
  the caller's buffer (a host slot) with ``recv_into``: the kernel copies the bytes once, from the
  socket into the slot, with the GIL released for the copy.
- ``coalesce`` keeps large memoryviews (block payloads) as they are for the client's ``sendall``
  and joins the small pieces around them.

Any socket error, timeout or protocol surprise raises ``OSError`` (``ProtocolError``): the caller
drops the connection (its state is unknown) and treats the batch as failed.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

READ_CHUNK = 4 << 10  # the most a reply line read takes from the socket: a value's first bytes
# read with its line are copied once more, the rest goes straight to its slot
SMALL_PIECE = 64 << 10  # pieces under this are coalesced into one send


class ProtocolError(OSError):
    """The server's bytes were not the RESP reply expected (or the connection closed)."""


def pack(*args: bytes | str | int) -> bytes:
    """One command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


def set_pieces(name: bytes, head: bytes, payload: memoryview, ex: int) -> list[bytes | memoryview]:
    """``SET name <head + payload> [EX ex]`` as pieces: the payload is sent from where it lies."""
    n = len(head) + len(payload)
    args = 5 if ex else 3
    first = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (args, len(name), name, n)
    tail = b"\r\n" + (pack(b"EX", ex)[len(b"*2\r\n") :] if ex else b"")
    return [first + head, payload, tail]


def coalesce(pieces: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """``pieces`` for one ``sendall`` each: small ones joined, large ones as they are (no copy)."""
    out: list[bytes | memoryview] = []
    pending = bytearray()
    for piece in pieces:
        if len(piece) < SMALL_PIECE:
            pending += piece
            continue
        if pending:
            out.append(bytes(pending))
            pending.clear()
        out.append(piece)
    if pending:
        out.append(bytes(pending))
    return out


class Reader:
    """Replies from ``sock``, in order. Bulk strings may be read into the caller's buffers."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray(READ_CHUNK)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        """Bytes read from the socket and not yet consumed."""
        return self._end - self._start

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # a line longer than what is left: move it down
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        got = self.sock.recv_into(self._view[self._end :])
        if got == 0:
            raise ProtocolError("connection closed by the server mid-reply")
        self._end += got

    def line(self) -> bytes:
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                out = bytes(self._buf[self._start : at])
                self._start = at + 2
                return out
            if self._end - self._start >= len(self._buf) - 2:
                raise ProtocolError(f"expected a reply line under {len(self._buf)} bytes")
            self._fill()

    def into(self, out: memoryview) -> None:
        """Exactly ``len(out)`` bytes: what is buffered, then the socket's straight into ``out``."""
        n = len(out)
        have = min(n, self._end - self._start)
        out[:have] = self._view[self._start : self._start + have]
        self._start += have
        while have < n:
            got = self.sock.recv_into(out[have:])
            if got == 0:
                raise ProtocolError("connection closed by the server mid-value")
            have += got

    def skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            step = min(n, len(scratch))
            self.into(scratch[:step])
            n -= step

    def crlf(self) -> None:
        end = bytearray(2)
        self.into(memoryview(end))
        if end != b"\r\n":
            raise ProtocolError(f"expected CRLF after a bulk string, got {bytes(end)!r}")

    def reply(self, parse_error: Any) -> Any:
        """One small reply: ``+OK`` is True, other status lines their text, ``:n`` an int, a bulk
        string bytes (None for nil), an array a list, an error ``parse_error(text)``."""
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return True if rest == b"OK" else rest.decode(errors="replace")
        if kind == b"_":  # RESP3 null, should the connection have negotiated it
            return None
        if kind == b"-":
            return parse_error(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            value = bytearray(n)
            self.into(memoryview(value))
            self.crlf()
            return bytes(value)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply(parse_error) for _ in range(n)]
        raise ProtocolError(f"expected a RESP2 reply, got {line[:32]!r}")

    def bulk_into(self, head: memoryview, out: memoryview, parse_error: Any) -> Any:
        """A bulk string of ``len(head) + len(out)`` bytes into ``head`` then ``out``: returns
        True. Nil: None. An error reply: ``parse_error(text)``. A bulk string of another length
        is read past and its length returned (an int: no block of ours)."""
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return parse_error(rest.decode(errors="replace"))
        if kind == b"_":  # RESP3 null, should the connection have negotiated it
            return None
        if kind != b"$":
            raise ProtocolError(f"expected a bulk string, got {line[:32]!r}")
        n = int(rest)
        if n < 0:
            return None
        if n != len(head) + len(out):
            self.skip(n)
            self.crlf()
            return n
        self.into(head)
        self.into(out)
        self.crlf()
        return True
