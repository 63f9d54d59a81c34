"""A process that maps a ``SharedRegion`` and waits to be killed (for test_region_lifetime.py).

    python -m tests.region_child DIRECTORY ENGINE_ID NBYTES MAPPERS FILL ROLE

Fills the region with byte FILL if it created it, prints ``ready <created> <first byte>``, then
sleeps until killed; on SIGTERM it exits without closing anything, as a killed engine does.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from kvoffload.integrations.vllm.region import SharedRegion


def main(directory: str, engine_id: str, nbytes: str, mappers: str, fill: str, role: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    region = SharedRegion(
        engine_id, int(nbytes), Path(directory), mappers=int(mappers), role=int(role)
    )
    if region.created:
        region.array[:] = int(fill)
    print(f"ready {int(region.created)} {region.array[0]}", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main(*sys.argv[1:])
