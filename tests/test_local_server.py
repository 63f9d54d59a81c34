"""Throwaway servers start whatever else holds ports on the machine (local_server.py).

The races are made certain rather than waited for: ``free_port`` is made to hand out a port that
a socket of the test already listens on (as another process might take it between ``free_port``
and the server's bind), then real free ports.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from kvoffload.store.tiers import local_server
from kvoffload.store.tiers.local_server import LocalServer
from tests.tiers_support import require_server


@pytest.fixture
def server_binary() -> None:
    require_server()  # a skip counted as a lower-tier test that did not run (CI: a failure)


@pytest.fixture
def taken(server_binary: None) -> Iterator[socket.socket]:
    """A loopback port held by a listening socket that answers +PONG to anything."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    stop = threading.Event()

    def answer() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"+PONG\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    yield sock
    stop.set()
    thread.join()
    sock.close()


def hand_out_first(monkeypatch: pytest.MonkeyPatch, *ports: int) -> None:
    real = local_server.free_port
    queue = list(ports)
    monkeypatch.setattr(local_server, "free_port", lambda: queue.pop(0) if queue else real())


def server_pid(server: LocalServer) -> int:
    """The process id the server on ``server.port`` reports about itself."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"INFO server\r\n")
        reply = b""
        while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
            reply += s.recv(65536)
    line = next(x for x in reply.split(b"\r\n") if x.startswith(b"process_id:"))
    return int(line.split(b":")[1])


def test_a_taken_port_is_replaced_and_a_foreign_pong_is_not_taken_for_ours(
    monkeypatch: pytest.MonkeyPatch, taken: socket.socket
) -> None:
    port = taken.getsockname()[1]
    hand_out_first(monkeypatch, port)
    with LocalServer() as server:
        assert server.port != port
        assert server_pid(server) == server.pid  # ours answers, not the socket that said PONG
        assert b"Address already in use" not in server._log()  # this start's log only


def test_a_taken_cluster_bus_port_is_replaced(
    monkeypatch: pytest.MonkeyPatch, taken: socket.socket
) -> None:
    bus = taken.getsockname()[1]
    port = local_server.free_port()
    hand_out_first(monkeypatch, port, bus)  # the client port is free, the bus port is not
    with LocalServer(cluster_node_timeout_ms=1000) as server:
        assert server.bus_port != bus
        assert server_pid(server) == server.pid


def test_a_restarted_server_keeps_its_port(server_binary: None) -> None:
    with LocalServer() as server:
        port = server.port
        server.kill()
        server.start()
        assert server.port == port and server_pid(server) == server.pid


def test_a_given_port_that_is_taken_fails_with_the_servers_log(taken: socket.socket) -> None:
    port = taken.getsockname()[1]
    server = LocalServer(port=port)
    try:
        with pytest.raises(RuntimeError, match=f"(?s)exited with 1 .*{port}.*Address already"):
            server.start()
        assert server.port == port and server.proc is None
    finally:
        server.close()


def test_a_bad_option_fails_with_the_servers_log(server_binary: None) -> None:
    server = LocalServer(extra_args=("--no-such-directive", "1"))
    try:
        with pytest.raises(RuntimeError, match=r"(?s)exited with 1 .*no-such-directive"):
            server.start()
    finally:
        server.close()


def test_free_port_never_hands_out_a_port_twice() -> None:
    ports = [local_server.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
