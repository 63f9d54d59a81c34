"""Prometheus metrics of the engine-neutral API (``pip install -e '.[metrics]'``).

``LocalOffload.serve_metrics(port)`` (or ``serve(local, port)``) exposes them over HTTP;
``OffloadCollector(offloader, worker)`` registers them in a registry of your own. Every scrape
reads ``Offloader.snapshot()`` and ``TransferWorker.snapshot()`` (one lock each, no work on the
engine's path) and ``Offloader.tier_stats()`` for the disk and Valkey tiers. ``METRICS`` names them
all; ``docs/api.md`` lists them. prometheus-client is imported only when metrics are asked for.

Imports point one way: ``offload.local`` imports this module, which knows only the Offloader and
the worker (``Observed`` is any object holding both, a ``LocalOffload`` among them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvoffload.offload.offloader import Offloader
    from kvoffload.offload.worker import TransferWorker

PREFIX = "kvoffload_"

# name (without PREFIX) -> (type, labels, meaning). Counters are exposed with a _total suffix,
# histograms as _bucket, _sum and _count (buckets: kvoffload/offload/latency.py, with the
# measurements that chose them).
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "hit_blocks": (
        "counter",
        ("tier",),
        "Blocks found: host = leading blocks lookup found ready; disk/valkey = blocks read up "
        "and verified",
    ),
    "miss_blocks": (
        "counter",
        ("tier",),
        "Blocks not found: host = blocks lookup asked for past the ready prefix; disk/valkey = "
        "reads that missed, were corrupt or failed",
    ),
    "evicted_blocks": ("counter", ("tier",), "Blocks a tier dropped to make room"),
    "transfer_bytes": (
        "counter",
        ("direction",),
        "Bytes moved by successful jobs (store: engine to host, load: host to engine)",
    ),
    "transfer_seconds": (
        "counter",
        ("direction",),
        "Submit-to-completion seconds of successful jobs, summed",
    ),
    "transfer_jobs": (
        "counter",
        ("direction", "outcome"),
        "Jobs by outcome: ok, failed (the copy failed, or a timed-out load ended), cancelled, "
        "timed_out (a load reported failed at its deadline)",
    ),
    "transfer_duration_seconds": (
        "histogram",
        ("direction",),
        "Submit-to-completion seconds of each successful job",
    ),
    "layer_wait_seconds": (
        "histogram",
        (),
        "Host seconds TransferWorker.wait_on(job, layer=i) took for a load still running: on CPU "
        "backends the wait for that layer's blocks; GPU backends make the stream wait instead, so "
        "there it is the enqueue time",
    ),
    "tier_read_seconds": (
        "histogram",
        ("tier",),
        "Submit-to-completion seconds of each lower-tier read op (up to 16 blocks)",
    ),
    "prefill_tokens_saved": (
        "counter",
        (),
        "Tokens whose KV was loaded from host instead of recomputed (blocks x block size)",
    ),
    "queue_depth": ("gauge", (), "Jobs running in the worker (submitted, not yet reported)"),
    "jobs_in_flight": (
        "gauge",
        (),
        "Jobs the Offloader has handed out and not completed (requests not settled)",
    ),
    "late_loads": (
        "gauge",
        (),
        "Loads reported timed out whose copy has not ended yet (their engine blocks are held)",
    ),
    "host_slots": ("gauge", ("state",), "Host slots by state: free, writing, readable"),
    "pinned_slots": ("gauge", (), "Readable host slots being read (loads, tier writes)"),
    "tier": (
        "counter",
        ("tier", "counter"),
        "Every counter of a lower tier (docs/tiers.md): puts, put_bytes, put_failures, "
        "put_skipped, gets, get_bytes, misses, corrupt, errors, evictions, reconnects",
    ),
    "tier_up": (
        "gauge",
        ("tier",),
        "1 while a lower tier is usable (valkey: its server answers; disk: its directory can be "
        "written), else 0",
    ),
    "tier_flow": (
        "counter",
        ("counter",),
        "The lower tiers' flow: writes, written, write_failures, lost, promotions, promoted, "
        "promote_failures, probes, and the load rule's loads_taken, loads_unmeasured (blocks), "
        "declined_without_lookup (keys a too-slow tier was not asked about), remeasured",
    ),
}


class Observed(Protocol):
    """What ``serve`` exports: an Offloader and its worker (``LocalOffload`` is one)."""

    @property
    def offloader(self) -> Offloader: ...

    @property
    def worker(self) -> TransferWorker: ...


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError as err:
        raise ImportError(
            "kvoffload metrics need prometheus-client: pip install prometheus-client "
            "(or pip install -e '.[metrics]' in a kvoffload checkout)"
        ) from err
    return prometheus_client


class OffloadCollector:
    """A prometheus-client collector over one Offloader (and its worker, if given)."""

    def __init__(self, offloader: Offloader, worker: TransferWorker | None = None) -> None:
        self._families = _prometheus().core
        self.offloader = offloader
        self.worker = worker

    def describe(self) -> list[Any]:
        return []  # names are fixed (METRICS); skip a describe-time scrape

    def collect(self) -> Iterator[Any]:
        off = self.offloader.snapshot()
        work = self.worker.snapshot() if self.worker is not None else None
        families = {name: self._family(name) for name in METRICS}
        host, slots = off["host"], off["slots"]
        families["hit_blocks"].add_metric(["host"], host["hits"])
        families["miss_blocks"].add_metric(["host"], host["misses"])
        families["evicted_blocks"].add_metric(["host"], host["evictions"])
        for tier, counters in off["tiers"].get("tiers", {}).items():
            families["hit_blocks"].add_metric([tier], counters.get("gets", 0))
            missed = sum(counters.get(k, 0) for k in ("misses", "corrupt", "errors"))
            families["miss_blocks"].add_metric([tier], missed)
            families["evicted_blocks"].add_metric([tier], counters.get("evictions", 0))
            for counter, value in counters.items():
                families["tier"].add_metric([tier, counter], value)
        for counter, value in off["tiers"].get("flow", {}).items():
            families["tier_flow"].add_metric([counter], value)
        for tier, up in off["tiers"].get("up", {}).items():
            families["tier_up"].add_metric([tier], float(up))
        for tier, hist in off["tiers"].get("read_seconds", {}).items():
            _add_histogram(families["tier_read_seconds"], [tier], hist)
        if off["prefill_tokens_saved"] is not None:
            families["prefill_tokens_saved"].add_metric([], off["prefill_tokens_saved"])
        families["jobs_in_flight"].add_metric([], off["jobs_in_flight"])
        families["late_loads"].add_metric([], off["loads_late"])
        for state in ("free", "writing", "readable"):
            families["host_slots"].add_metric([state], slots[state])
        families["pinned_slots"].add_metric([], slots["pinned"])
        if work is not None:
            families["queue_depth"].add_metric([], work["queue_depth"])
            for direction in ("store", "load"):
                stats = work[direction]
                families["transfer_bytes"].add_metric([direction], stats["bytes"])
                families["transfer_seconds"].add_metric([direction], stats["seconds"])
                for outcome in ("ok", "failed", "cancelled", "timed_out"):
                    families["transfer_jobs"].add_metric([direction, outcome], stats[outcome])
                _add_histogram(
                    families["transfer_duration_seconds"], [direction], work["latency"][direction]
                )
            _add_histogram(families["layer_wait_seconds"], [], work["latency"]["layer_wait"])
        yield from families.values()

    def _family(self, name: str) -> Any:
        kind, labels, meaning = METRICS[name]
        make = {
            "counter": self._families.CounterMetricFamily,
            "gauge": self._families.GaugeMetricFamily,
            "histogram": self._families.HistogramMetricFamily,
        }[kind]
        return make(PREFIX + name, meaning, labels=list(labels))


def _add_histogram(family: Any, labels: list[str], hist: dict[str, Any]) -> None:
    """One series of ``family`` from a ``Histogram.snapshot``: cumulative counts per ``le``."""
    total, buckets = 0, []
    for bound, count in zip([*hist["bounds"], float("inf")], hist["counts"], strict=True):
        total += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    family.add_metric(labels, buckets, hist["sum"])


@dataclass
class MetricsServer:
    """A running metrics endpoint: ``http://<addr>:<port>/metrics``."""

    port: int
    _httpd: Any
    _thread: threading.Thread

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)


def serve(local: Observed, port: int, addr: str = "0.0.0.0") -> MetricsServer:
    """Serve ``local``'s metrics on ``addr:port`` (0: a free port) in a daemon thread."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"expected a TCP port in [0, 65535], got {port!r}")
    prometheus = _prometheus()
    registry = prometheus.CollectorRegistry(auto_describe=False)
    registry.register(OffloadCollector(local.offloader, local.worker))
    httpd, thread = prometheus.start_http_server(port, addr, registry)
    return MetricsServer(httpd.server_address[1], httpd, thread)
