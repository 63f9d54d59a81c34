"""Independent processes: one stores, another loads byte-identical (Valkey, and disk across a
restart); a different model never matches. Each role is a fresh ``python`` running ROLE below."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.tiers_support import running_server

REPO = Path(__file__).resolve().parents[1]
N = 12  # blocks stored

ROLE = """
import json, sys
import numpy as np
import xxhash
from kvoffload import prefix_block_keys
from tests.tiers_support import BS, build, engine_kv, run_job, wait_ready

role, seed, tiers = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
N = 12
keys = prefix_block_keys(np.arange(N * BS), BS, salt=b"procs")
if role == "store":
    kv = engine_kv(seed)
    local = build(kv, host_blocks=16, **tiers)
    job = local.offloader.schedule_store("r", keys, list(range(N)))
    run_job(local, job)
    local.close()  # writes everything still queued for the tiers
    digest = xxhash.xxh3_128_hexdigest(b"".join(t[:, :N].tobytes() for t in kv))
    print(json.dumps({"digest": digest}))
else:
    kv = engine_kv(seed + 1000)  # other contents: only a real load can make them match
    local = build(kv, host_blocks=16, **tiers)
    ready = wait_ready(local, keys, N)
    if ready:
        run_job(local, local.offloader.schedule_load("r", keys[:ready], list(range(ready))))
    digest = xxhash.xxh3_128_hexdigest(b"".join(t[:, :N].tobytes() for t in kv))
    print(json.dumps({"ready": ready, "digest": digest, "stats": local.offloader.tier_stats()}))
    local.close()
"""


def role(name: str, seed: int, **tiers: object) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", ROLE, name, str(seed), json.dumps(tiers)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_block_stored_by_one_process_is_loaded_by_another_through_valkey():
    with running_server() as server:
        stored = role("store", 11, valkey_url=server.url)
        loaded = role("load", 11, valkey_url=server.url)
    assert loaded["ready"] == N
    assert loaded["digest"] == stored["digest"]  # byte-identical
    assert loaded["stats"]["tiers"]["valkey"]["gets"] == N


def test_disk_blocks_survive_a_restart_and_other_models_never_match(tmp_path):
    stored = role("store", 22, disk_path=str(tmp_path))
    loaded = role("load", 22, disk_path=str(tmp_path))
    assert loaded["ready"] == N and loaded["digest"] == stored["digest"]
    other = role("load", 22, disk_path=str(tmp_path), model_id="another/model")
    assert other["ready"] == 0 and other["digest"] != stored["digest"]
    assert other["stats"]["tiers"]["disk"]["gets"] == 0
