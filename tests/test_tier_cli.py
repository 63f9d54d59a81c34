"""What a newcomer sees without the lower-tier dependencies: ``kvoffload bench tiers`` ends in one
clear line and exit status 1 (no traceback), and the test run's summary line says how many tier
tests did not run and how to install a server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvoffload.store.tiers.local_server import free_port
from tests.tiers_support import require_server

REPO = Path(__file__).resolve().parents[1]


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "CI"}
    return subprocess.run(
        args, cwd=REPO, env={**base, **(env or {})}, capture_output=True, text=True, timeout=300
    )


def bench(*extra: str, prelude: str = "", env: dict[str, str] | None = None):
    code = f"import sys; {prelude}from kvoffload.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["bench", "tiers", "--mib", "1", "--rounds", "1", "--sections", "valkey", *extra]
    return run([sys.executable, "-c", code, *args], env)


def one_line_failure(done: subprocess.CompletedProcess[str], *words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    assert lines[0].startswith("kvoffload bench tiers: ")
    assert all(w in lines[0] for w in words), lines[0]


def test_bench_tiers_without_the_redis_client():
    # The client absent, as on a machine without the 'tiers' extra.
    done = bench(prelude="sys.modules['redis'] = None; ")
    one_line_failure(done, "needs the redis client", "pip install -e '.[tiers]'")


def test_bench_tiers_without_a_server_binary(tmp_path):
    done = bench(env={"PATH": str(tmp_path)})  # an empty PATH: no valkey-server/redis-server
    one_line_failure(done, "valkey-server", "bash .ci/tiers.sh", "--valkey-url")


def test_bench_tiers_against_an_unreachable_url():
    require_server()
    done = bench("--valkey-url", f"redis://127.0.0.1:{free_port()}/0")
    one_line_failure(done, "unreachable")


def test_summary_line_counts_tier_tests_that_did_not_run(tmp_path):
    pytest_args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    done = run([*pytest_args, "tests/test_tier_valkey.py"], {"PATH": str(tmp_path)})
    last = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout[-3000:]
    assert "12 skipped" in last and "12 lower-tier tests did not run" in last, last
    assert "bash .ci/tiers.sh" in last
