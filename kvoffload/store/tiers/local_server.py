"""Start and stop a throwaway ``valkey-server`` (or ``redis-server``) on loopback.

For tests, benchmarks and trying the shared tier on one machine; production points ``valkey_url``
at a server it runs itself. The server keeps nothing on disk (no RDB, no AOF) and listens on
127.0.0.1 only, on a free port.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

SERVER_BINARIES = ("valkey-server", "redis-server")


def server_binary() -> str | None:
    """Path of the first of ``valkey-server``, ``redis-server`` on PATH, or None."""
    for name in SERVER_BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    """One server process: ``start`` / ``stop`` / ``kill`` / ``pause`` / ``resume``; ``url``."""

    def __init__(self, port: int | None = None, maxmemory: str = "0", binary: str | None = None):
        self.binary = binary or server_binary()
        if self.binary is None:
            raise FileNotFoundError(
                f"expected one of {list(SERVER_BINARIES)} on PATH (Debian: apt-get install "
                "valkey-server or redis-server), found none"
            )
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="kvoffload-valkey-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalServer:
        args = [
            self.binary or "",
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir,
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru",
            "--protected-mode", "yes",
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self.proc.returncode} at start")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer on port {self.port} in {timeout_s} s")

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
