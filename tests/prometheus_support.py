"""A real Prometheus scraping kvoffload's exporter while a small CPU workload runs.

``running_prometheus`` starts the OS package's ``prometheus`` (``bash .ci/prometheus.sh`` installs
it) on a free loopback port with a throwaway data directory, scraping the given targets every
second; ``Workload`` keeps an offload with a disk tier busy (stores, evictions written down,
promotions read back up, loads waited for layer by layer); ``panel_queries`` turns the dashboard's
Grafana variables into plain PromQL. ``python -m tests.prometheus_support docs/dashboard.png``
renders the dashboard's panels from the scraped series with matplotlib (the PNG in docs/).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload import KVLayout, OffloadConfig, build_local, prefix_block_keys
from tests.conftest import PROMETHEUS_SKIP

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "dashboards"
SCRAPE_S = 1
RATE_WINDOW = "10s"  # what $__rate_interval stands for here (>= 4 scrapes, as Grafana's)
BS = 16
LAYERS = 2


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read().decode())


@contextmanager
def running_prometheus(targets: list[str], workdir: Path) -> Iterator[str]:
    """A Prometheus scraping ``targets`` (host:port) every second; yields its base URL."""
    binary = prometheus_binary()
    if binary is None:
        raise FileNotFoundError(f"{PROMETHEUS_SKIP} (bash .ci/prometheus.sh installs it)")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {SCRAPE_S}s\n  evaluation_interval: {SCRAPE_S}s\n"
        "scrape_configs:\n  - job_name: kvoffload\n    static_configs:\n"
        f"      - targets: {json.dumps(targets)}\n"
    )
    port = free_port()
    log = (workdir / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {proc.returncode}: "
                    f"{(workdir / 'prometheus.log').read_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def query(url: str, expr: str, at: float | None = None) -> dict[str, Any]:
    """``/api/v1/query``: the ``data`` of a successful instant query."""
    params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
    reply = get_json(f"{url}/api/v1/query?{urllib.parse.urlencode(params)}")
    if reply.get("status") != "success":
        raise ValueError(f"expected a successful query, got {reply} for {expr}")
    data: dict[str, Any] = reply["data"]
    return data


def query_range(url: str, expr: str, start: float, end: float, step: float) -> dict[str, Any]:
    params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    reply = get_json(f"{url}/api/v1/query_range?{urllib.parse.urlencode(params)}")
    if reply.get("status") != "success":
        raise ValueError(f"expected a successful range query, got {reply} for {expr}")
    data: dict[str, Any] = reply["data"]
    return data


def load_builder() -> Any:
    """``dashboards/build.py`` as a module (the folder is no package)."""
    spec = importlib.util.spec_from_file_location("kvoffload_dashboards", DASHBOARDS / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def panel_queries(board: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, PromQL, legend) per target, with the dashboard's variables filled in as
    Grafana fills them when "All" is chosen."""
    out = []
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", RATE_WINDOW)
            expr = re.sub(r"\$[a-z_]+", ".*", expr)
            out.append((panel["title"], expr, target["legendFormat"]))
    return out


def legend_labels(legend: str) -> set[str]:
    return set(re.findall(r"\{\{(\w+)\}\}", legend))


def legend_text(legend: str, labels: dict[str, str]) -> str:
    """A legend as Grafana shows it: each ``{{label}}`` replaced by the series' value."""
    return re.sub(r"\{\{(\w+)\}\}", lambda m: labels.get(m.group(1), ""), legend)


class Workload:
    """An offload with a disk tier, kept busy on a thread until ``stop``: six prefixes of four
    blocks take turns through an eight-block host, so each comes back from disk (a promotion, a
    tier read), is loaded layer by layer (layer waits) and stored again with a block of its own; a
    lookup of a prefix never stored adds misses."""

    def __init__(self, disk_path: Path) -> None:
        rng = np.random.default_rng(0)
        self.kv = [rng.integers(0, 2**16, (2, 16, BS, 8), dtype=np.uint16) for _ in range(LAYERS)]
        layout = KVLayout.from_tensors(self.kv, BS, block_dim=1)
        config = OffloadConfig(
            host_capacity_blocks=8, disk_path=str(disk_path), model_id="prometheus-test"
        )
        self.local = build_local(layout, config)
        self.server = self.local.serve_metrics(0, "127.0.0.1")
        self.rounds = 0
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvoffload-workload", daemon=True)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.local.close()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._round(self.rounds)
                self.rounds += 1
                time.sleep(0.02)
        except BaseException as e:  # noqa: BLE001 (re-raised by stop(), in the test's thread)
            self._error = e

    def _round(self, i: int) -> None:
        off, worker = self.local.offloader, self.local.worker
        keys = prefix_block_keys(np.arange(4 * BS) + 1000 * (i % 6), BS)
        deadline = time.monotonic() + 10
        while True:
            found = off.lookup_tiers(keys)
            if not (found.pending or found.probing) or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        off.lookup(prefix_block_keys(np.arange(BS) + 10**6 + i, BS))  # never stored: a miss
        if found.ready:
            dst = list(range(8, 8 + found.ready))
            load = off.schedule_load(f"load{i}", keys[: found.ready], dst)
            worker.submit(load)
            for layer in range(LAYERS):
                worker.wait_on(load.job_id, layer=layer)
            self._settle(load.job_id)
        # the prefix and one block of this round's own (a turn's new tokens): never all held
        tokens = np.concatenate([np.arange(4 * BS) + 1000 * (i % 6), np.arange(BS) + 10**7 + i])
        store = off.schedule_store(f"store{i}", prefix_block_keys(tokens, BS), [0, 1, 2, 3, 4])
        if store is not None:
            worker.submit(store)
            self._settle(store.job_id)

    def _settle(self, job_id: int) -> None:
        worker = self.local.worker
        if worker.wait([job_id], 30):
            raise TimeoutError(f"job {job_id} did not finish in 30 s")
        self.local.offloader.complete(worker.get_finished())


def render_png(url: str, board: dict[str, Any], start: float, end: float, path: Path) -> None:
    """Every panel of ``board`` as a matplotlib subplot, from the series Prometheus holds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = board["panels"]
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    step = max(1.0, (end - start) / 200)
    for ax, panel in zip(axes.flat, panels, strict=False):
        unit = panel["fieldConfig"]["defaults"]["unit"]
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", RATE_WINDOW)
            expr = re.sub(r"\$[a-z_]+", ".*", expr)
            for series in query_range(url, expr, start, end, step)["result"]:
                t = [float(v[0]) - start for v in series["values"]]
                y = [float(v[1]) for v in series["values"]]
                scale, _ = UNITS.get(unit, (1.0, ""))
                label = legend_text(target["legendFormat"], series["metric"])
                ax.plot(t, [v * scale for v in y], label=label)
        ax.set_title(panel["title"], fontsize=9)
        ax.set_xlabel("s since the workload started", fontsize=8)
        ax.set_ylabel(UNITS.get(unit, (1.0, unit))[1], fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        f"{board['title']}: dashboards/{board['uid']}.json, every panel's query over the series a "
        "real Prometheus scraped from kvoffload's exporter during the CPU workload of "
        "tests/test_prometheus.py",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


UNITS = {"percentunit": (100.0, "%"), "s": (1e3, "ms"), "Bps": (1e-6, "MB/s"), "short": (1.0, "")}


def main(argv: list[str]) -> int:
    """``python -m tests.prometheus_support OUT.png [SECONDS]``: run the workload under a real
    Prometheus for SECONDS (default 40) and render the dashboard from what it scraped."""
    import tempfile

    if not argv:
        print("usage: python -m tests.prometheus_support OUT.png [SECONDS]", file=sys.stderr)
        return 2
    out, seconds = Path(argv[0]), float(argv[1]) if len(argv) > 1 else 40.0
    board = load_builder().dashboards()["kvoffload.json"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Workload(Path(tmp) / "disk")
        with running_prometheus([work.target], Path(tmp) / "prometheus") as url:
            start = time.time()
            work.start()
            try:
                time.sleep(seconds)
            finally:
                work.stop()
            time.sleep(2 * SCRAPE_S)
            render_png(url, board, start, time.time(), out)
    print(f"wrote {out}: {len(board['panels'])} panels, {work.rounds} workload rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
