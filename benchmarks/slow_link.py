"""A TCP proxy that paces the bytes it forwards: a shared tier behind a slower link.

On this development VM a loopback Valkey reads faster than the CPU models prefill, so the load
rule always loads from it; on an H100 the engine prefills faster than one Valkey server serves
(``benchmarks/results/e2e_lower_llama3-8b_*``: 27,600 tokens/s against 1.2 GB/s). Pointing
``bench e2e --lower-tiers valkey --valkey-url`` at this proxy gives a CPU run the GPU's regime:
every byte is real and checked, it only arrives later. Both directions share one budget of
``--mbps`` MB/s (a link), paced per 64 KiB chunk; ``--delay-ms`` is added to every chunk.

    python benchmarks/slow_link.py --listen 7001 --to 127.0.0.1:6379 --mbps 8
"""

from __future__ import annotations

import argparse
import asyncio
import time

CHUNK = 64 << 10


class Link:
    def __init__(self, bytes_per_s: float, delay_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.delay_s = delay_s
        self._free_at = time.monotonic()  # when the link has sent everything accepted so far
        self._lock = asyncio.Lock()

    async def send(self, n: int) -> None:
        async with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + n / self.bytes_per_s
            wait = self._free_at - now + self.delay_s
        if wait > 0:
            await asyncio.sleep(wait)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
    try:
        while data := await reader.read(CHUNK):
            await link.send(len(data))
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def serve(port: int, host: str, target_port: int, link: Link) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer, link), _pipe(up_reader, writer, link))

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", type=int, required=True, help="port on 127.0.0.1")
    p.add_argument("--to", required=True, help="host:port of the server")
    p.add_argument("--mbps", type=float, required=True, help="MB/s (10^6 bytes), both ways")
    p.add_argument("--delay-ms", type=float, default=0.0, help="added to every chunk")
    a = p.parse_args()
    if a.mbps <= 0 or a.delay_ms < 0:
        raise SystemExit(f"expected --mbps > 0 and --delay-ms >= 0, got {a.mbps}, {a.delay_ms}")
    host, _, port = a.to.rpartition(":")
    asyncio.run(serve(a.listen, host, int(port), Link(a.mbps * 1e6, a.delay_ms / 1e3)))


if __name__ == "__main__":
    main()
