"""A process that opens ``SharedRegion``s on command (for test_region_identity.py).

    python -m tests.region_opener [--no-tmpfile]

One command a line on stdin, one answer a line on stdout:

- ``open DIRECTORY ENGINE_ID NBYTES MAPPERS ROLE`` -> ``ok <created 0/1> <token hex>`` or
  ``refused <message>`` (a ValueError);
- ``write OFFSET VALUE`` / ``read OFFSET`` -> ``ok`` / ``ok <value>`` (one byte of the region);
- ``close`` -> ``ok``.

``--no-tmpfile`` builds regions under a temporary name (``shm.USE_TMPFILE = False``). With
``KVOFFLOAD_SHM_KILL_AT`` set, the process SIGKILLs itself at that step of an open.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvoffload.integrations.vllm import shm
from kvoffload.integrations.vllm.region import SharedRegion


def main(args: list[str]) -> None:
    if "--no-tmpfile" in args:
        shm.USE_TMPFILE = False
    region: SharedRegion | None = None
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "open":
            directory, engine_id, nbytes, mappers, role = rest
            try:
                region = SharedRegion(
                    engine_id, int(nbytes), Path(directory), mappers=int(mappers), role=int(role)
                )
            except ValueError as e:
                answer = "refused " + str(e).replace("\n", " ")
            else:
                answer = f"ok {int(region.created)} {region.token.hex()}"
        elif cmd == "write" and region is not None:
            region.array[int(rest[0])] = int(rest[1])
            answer = "ok"
        elif cmd == "read" and region is not None:
            answer = f"ok {region.array[int(rest[0])]}"
        elif cmd == "close" and region is not None:
            region.close()
            region = None
            answer = "ok"
        else:
            answer = f"error: {line.strip()!r} with region {region}"
        print(answer, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
