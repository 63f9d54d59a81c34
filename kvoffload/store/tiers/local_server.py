"""Start and stop throwaway ``valkey-server`` (or ``redis-server``) processes on loopback: one
server, or a Valkey/Redis Cluster of primaries with replicas.

For tests, benchmarks and trying the shared tier on one machine; production points ``valkey_url``
at servers it runs itself. The servers keep nothing on disk (no RDB, no AOF; a cluster node keeps
only its ``nodes.conf``, so a killed node rejoins when restarted), listen on 127.0.0.1 only, on
free ports, optionally over TLS only (``ServerTls``: certificates the caller made).

A free port is only free until someone binds it: between ``free_port()`` and the server's bind,
another process on the machine (another server, its cluster bus, a client's ephemeral port) may
take it. So a server is up only when its own log says it accepts connections and it answers
PING (never another process's PONG on that port); when its bind fails and we chose the ports, it
is started again on new ones (``BIND_ATTEMPTS``); any other failure raises with the server's own
last log lines.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SERVER_BINARIES = ("valkey-server", "redis-server")
BIND_ATTEMPTS = 8  # starts on new ports after a bind failure on ports we chose
READY = b"Ready to accept connections"  # Redis 6-7 and Valkey 7-8 log this once listening
BIND_FAILED = b"Address already in use"
LOG_LINES = 8  # of the server's log, in a start failure's message
CLI_BINARIES = ("valkey-cli", "redis-cli")


def server_binary() -> str | None:
    """Path of the first of ``valkey-server``, ``redis-server`` on PATH, or None."""
    return _first(SERVER_BINARIES)


def cli_binary() -> str | None:
    """Path of the first of ``valkey-cli``, ``redis-cli`` on PATH (cluster set-up), or None."""
    return _first(CLI_BINARIES)


def _first(names: tuple[str, ...]) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


_handed_out: set[int] = set()  # never hand the same port to two servers of this process


def free_port() -> int:
    """A loopback port nobody listens on now (a start that loses the race picks another)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


@dataclass(frozen=True)
class ServerTls:
    """PEM files for a TLS-only server: its certificate and key, the CA it trusts for client
    certificates, and whether it requires one; ``client_*`` are what a local client presents."""

    cert_file: str
    key_file: str
    ca_file: str
    require_client_cert: bool = True
    client_cert_file: str | None = None
    client_key_file: str | None = None

    def server_args(self, cluster: bool) -> list[str]:
        args = [
            "--tls-cert-file", self.cert_file,
            "--tls-key-file", self.key_file,
            "--tls-ca-cert-file", self.ca_file,
            "--tls-auth-clients", "yes" if self.require_client_cert else "no",
        ]  # fmt: skip
        if cluster:
            args += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        return args

    def cli_args(self) -> list[str]:
        args = ["--tls", "--cacert", self.ca_file]
        if self.client_cert_file and self.client_key_file:
            args += ["--cert", self.client_cert_file, "--key", self.client_key_file]
        return args

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.client_cert_file:
            ctx.load_cert_chain(self.client_cert_file, self.client_key_file)
        return ctx


class LocalServer:
    """One server process: ``start`` / ``stop`` / ``kill`` / ``pause`` / ``resume``; ``url``."""

    def __init__(
        self,
        port: int | None = None,
        maxmemory: str = "0",
        binary: str | None = None,
        *,
        tls: ServerTls | None = None,
        cluster_node_timeout_ms: int | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        self.binary = binary or server_binary()
        if self.binary is None:
            raise FileNotFoundError(
                f"expected one of {list(SERVER_BINARIES)} on PATH (bash .ci/tiers.sh installs "
                "one; Debian: apt-get install valkey-server or redis-server), found none"
            )
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.tls = tls
        self.cluster_node_timeout_ms = cluster_node_timeout_ms
        # The cluster bus port is pinned too: the default (port + 10000) may not be free.
        self.bus_port = free_port() if cluster_node_timeout_ms is not None else None
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="kvoffload-valkey-")
        # Ports may move until the first start succeeds, and only if the caller gave none
        # (a restarted cluster node must keep its address).
        self._ports_movable = port is None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def args(self) -> list[str]:
        listen = (
            ["--port", "0", "--tls-port", str(self.port)]
            if self.tls
            else ["--port", str(self.port)]
        )
        args = [
            self.binary or "",
            *listen,
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir,
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru",
            "--protected-mode", "yes",
        ]  # fmt: skip
        if self.tls:
            args += self.tls.server_args(cluster=self.cluster_node_timeout_ms is not None)
        if self.cluster_node_timeout_ms is not None:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.cluster_node_timeout_ms),
                "--cluster-port", str(self.bus_port),
            ]  # fmt: skip
        return args + list(self.extra_args)

    @property
    def log_path(self) -> str:
        """The server's log (its stdout and stderr) since its last start."""
        return os.path.join(self._dir, "server.log")

    def start(self, timeout_s: float = 10.0) -> LocalServer:
        """Start and wait until it answers; RuntimeError (with its log lines) if it does not."""
        for _ in range(BIND_ATTEMPTS if self._ports_movable else 1):
            if self._start_once(timeout_s):
                self._ports_movable = False
                return self
            self._move_ports()
        raise RuntimeError(
            f"{self.binary} could not bind its ports in {BIND_ATTEMPTS} attempts; last log lines:"
            f"\n{self.log_tail()}"
        )

    def _start_once(self, timeout_s: float) -> bool:
        """True once up; False when its bind failed and the ports may move; else raises."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                if self._ports_movable and BIND_FAILED in self._log():
                    return False
                raise RuntimeError(
                    f"{self.binary} exited with {code} at start on port {self.port}; its last "
                    f"log lines:\n{self.log_tail()}"
                )
            if READY in self._log() and self._answers():
                return True
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"{self.binary} did not answer on port {self.port} in {timeout_s} s; its last log "
            f"lines:\n{self.log_tail()}"
        )

    def _move_ports(self) -> None:
        self.port = free_port()
        if self.bus_port is not None:
            self.bus_port = free_port()
        # a failed cluster node may have written its identity with the old ports
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self._dir, "nodes.conf"))

    def _log(self) -> bytes:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return b""

    def log_tail(self, lines: int = LOG_LINES) -> str:
        """The last ``lines`` lines of the server's log."""
        text = self._log().decode(errors="replace").rstrip("\n")
        return "\n".join(text.splitlines()[-lines:])

    def _answers(self) -> bool:
        """PING answered (PONG, or NOAUTH: up, with a password)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                s = (
                    self.tls.client_context().wrap_socket(raw, server_hostname="127.0.0.1")
                    if self.tls
                    else raw
                )
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:  # ssl.SSLError included: not up yet
            return False

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the server stops answering but keeps its sockets (a slow/hung server)."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalCluster:
    """A Valkey/Redis Cluster of ``primaries`` primaries with ``replicas`` replicas each, on
    loopback: started with ``--cluster-enabled yes`` and joined with ``<cli> --cluster create``.

    ``cluster-node-timeout`` is ``node_timeout_ms`` (1 s by default: a replica takes over a
    killed primary in about 2 s). ``url`` names every node as a seed.
    """

    def __init__(
        self,
        primaries: int = 3,
        replicas: int = 1,
        maxmemory: str = "0",
        *,
        tls: ServerTls | None = None,
        node_timeout_ms: int = 1000,
    ) -> None:
        self.cli = cli_binary()
        if self.cli is None:
            raise FileNotFoundError(
                f"expected one of {list(CLI_BINARIES)} on PATH to create a cluster "
                "(bash .ci/tiers.sh installs it with the server), found none"
            )
        self.primaries, self.replicas, self.tls = primaries, replicas, tls
        self.nodes = [
            LocalServer(maxmemory=maxmemory, tls=tls, cluster_node_timeout_ms=node_timeout_ms)
            for _ in range(primaries * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        scheme = "rediss+cluster" if self.tls else "redis+cluster"
        return f"{scheme}://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            create = ["--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas)]
            done = subprocess.run(
                [self.cli or "", *self._tls_args(), *create, "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"{self.cli} --cluster create failed: {done.stdout[-2000:]}")
            self.wait_ok(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def cli_call(self, node: LocalServer, *args: str, timeout_s: float = 5.0) -> str:
        """One command through the CLI on ``node`` (its output; '' if it did not answer)."""
        done = subprocess.run(
            [self.cli or "", *self._tls_args(), "-h", "127.0.0.1", "-p", str(node.port), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        return done.stdout if done.returncode == 0 else ""

    def _tls_args(self) -> list[str]:
        return self.tls.cli_args() if self.tls else []

    def alive(self) -> list[LocalServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and sees ``primaries`` primaries with
        slots, and every live replica has synced with its primary (a replica that never synced
        cannot take over)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._ok(n) for n in self.alive()):
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster not ok after {timeout_s} s")

    def _ok(self, node: LocalServer) -> bool:
        if "cluster_state:ok" not in self.cli_call(node, "CLUSTER", "INFO"):
            return False
        replication = self.cli_call(node, "INFO", "replication")
        if "role:slave" in replication and "master_link_status:up" not in replication:
            return False
        return len(self.primary_ports(node)) == self.primaries

    def primary_ports(self, node: LocalServer | None = None) -> list[int]:
        """Ports of the primaries that hold slots, as ``node`` (default: a live one) sees them."""
        node = node or self.alive()[0]
        ports = []
        for line in self.cli_call(node, "CLUSTER", "NODES").splitlines():
            fields = line.split()
            if len(fields) >= 9 and "master" in fields[2] and "fail" not in fields[2]:
                ports.append(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
        return sorted(ports)

    def node(self, port: int) -> LocalServer:
        return next(n for n in self.nodes if n.port == port)

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_version() -> str:
    """``redis-server 7.0.15``: the server started here, by name and version (not its path)."""
    binary = server_binary() or "?"
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    version = next((w[2:] for w in done.stdout.split() if w.startswith("v=")), "?")
    return f"{Path(binary).name} {version}"
