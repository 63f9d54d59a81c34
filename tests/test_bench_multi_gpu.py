"""``kvoffload bench multi-gpu`` on the CPU: N real processes moving real bytes through the host
backend with their own NUMA-placed arenas, the aggregation math, and a worker's failure reaching
the parent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvoffload.bench.host_memory import copy_rate
from kvoffload.bench.multi_gpu import aggregate, bound
from kvoffload.cli import main
from kvoffload.store.numa import Topology
from kvoffload.transfer.shapes import MODELS


def window(device: str, nbytes: int, start: float, end: float) -> dict[str, object]:
    return {
        "device": device,
        "bytes": nbytes,
        "start": start,
        "end": end,
        "GBps": nbytes / (end - start) / 1e9,
    }


def test_the_aggregate_spans_first_start_to_last_end():
    results = [window("cuda:0", 10**10, 0.0, 1.0), window("cuda:1", 3 * 10**9, 0.5, 2.0)]
    agg = aggregate(results)
    assert agg["GBps"] == pytest.approx(13 / 2.0)  # 13 GB over 2 s, not 10 + 2 GB/s
    assert agg["sum_of_rates_GBps"] == pytest.approx(10 + 2)
    assert agg["overlap"] == pytest.approx(0.5 / 2.0)
    apart = aggregate([window("a", 1, 0.0, 1.0), window("b", 1, 2.0, 3.0)])
    assert apart["overlap"] == 0.0


def test_the_bound_sums_links_per_gpu_and_caps_at_host_memory():
    alone = [
        window("cuda:0", 50 * 10**9, 0, 1),
        window("cuda:0", 40 * 10**9, 0, 1),  # a second process on GPU 0 shares its link
        window("cuda:1", 45 * 10**9, 0, 1),
    ]
    links = bound(alone, 400.0)
    assert links == {
        "links_GBps": pytest.approx(95.0),
        "host_memory_GBps": 400.0,
        "GBps": pytest.approx(95.0),
        "limited_by": "links",
    }
    host = bound(alone, 80.0)
    assert host["GBps"] == 80.0 and host["limited_by"] == "host memory"


def test_the_host_memory_probe_copies_and_counts_read_plus_write():
    row = copy_rate(8 << 20, 2, 2)
    assert row["threads"] == 2 and row["bytes"] == 8 << 20
    assert row["traffic_GBps"] == pytest.approx(2 * row["copied_GBps"]) and row["copied_GBps"] > 0
    with pytest.raises(ValueError, match=r"expected threads > 0, .* got 0, 1024, 1"):
        copy_rate(1024, 0, 1)


def one_node_sysfs(root: Path, cpus: str) -> Path:
    """This host's node 0 (the only node the kernel will bind to here), with ``cpus``."""
    node = root / "devices/system/node/node0"
    node.mkdir(parents=True)
    (root / "devices/system/node/online").write_text("0\n")
    (node / "cpulist").write_text(cpus + "\n")
    (node / "meminfo").write_text(f"Node 0 MemTotal:       {64 << 20} kB\n")
    return root


def test_n_processes_move_real_bytes_placed_and_not(tmp_path):
    if not Topology().nodes():
        pytest.skip("this kernel shows no NUMA nodes")
    sysfs = one_node_sysfs(tmp_path / "sys", "0")  # node 0 offers CPU 0 only: binding shows
    out = tmp_path / "r.json"
    argv = ["bench", "multi-gpu", "--device", "cpu", "--gpus", "2", "--numa", "0,off"]
    argv += ["--seconds", "0.2", "--blocks", "4", "--link-mib", "2", "--model", "llama3-8b"]
    argv += ["--host-mib", "8", "--host-reps", "2", "--sysfs", str(sysfs), "--out", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert r["benchmark"] == "multi_gpu" and r["date"] and r["host"]["cores"]
    assert r["topology"]["numa_nodes"] == {"0": {"cpus": [0], "mem_total_bytes": 64 << 30}}
    assert [w["device"] for w in r["topology"]["workers"]] == ["cpu", "cpu"]
    assert r["host_memory"]["traffic_GBps"] > 0
    placed, off = r["runs"]
    assert (placed["numa_node"], off["numa_node"]) == (0, "off")
    slot = 2 * 32 * 16 * MODELS["llama3-8b"].kv_heads * 128 * 2
    for run in r["runs"]:
        assert len({w["pid"] for w in run["workers"]}) == 2 and os.getpid() not in {
            w["pid"] for w in run["workers"]
        }
        assert [w["slot_bytes"] for w in run["workers"]] == [slot, slot]
        for w in run["workloads"]:
            per_step = 2 * 4 * slot if w["workload"] == "kv" else 2 * (2 << 20)
            assert [a["rank"] for a in w["alone"]] == [0, 1]
            assert [t["rank"] for t in w["together"]] == [0, 1]
            for win in (*w["alone"], *w["together"]):
                assert win["exact"] is True and win["steps"] >= 1
                assert win["bytes"] == win["steps"] * per_step
                assert win["end"] - win["start"] >= 0.2
            assert w["aggregate"] == pytest.approx(aggregate(w["together"]))
            assert w["bound"] == pytest.approx(bound(w["alone"], r["host_memory"]["traffic_GBps"]))
            assert w["of_bound"] == pytest.approx(w["aggregate"]["GBps"] / w["bound"]["GBps"])
            assert w["aggregate"]["overlap"] > 0  # started together
    for w in placed["workers"]:
        assert w["placement"] == {"node": 0, "strict": True, "reason": "numa_node=0"}
        assert w["arena_pages"]["policy"] == "bind" and w["arena_pages"]["policy_nodes"] == [0]
        assert w["arena_pages"]["pages_on_node"] == {"0": 64}
        assert w["cpus"] == [0] and w["affinity"] == [0]
    for w in off["workers"]:
        assert w["placement"]["node"] is None and w["arena_pages"]["policy"] == "default"
        assert w["cpus"] is None and w["affinity"] == sorted(os.sched_getaffinity(0))


def test_a_worker_that_fails_stops_the_run_with_its_error(tmp_path):
    argv = ["bench", "multi-gpu", "--device", "cpu", "--gpus", "1", "--numa", "1023"]
    argv += ["--seconds", "0.1", "--blocks", "2", "--link-mib", "1", "--host-mib", "1"]
    argv += ["--host-reps", "1", "--no-plot", "--out", str(tmp_path / "r.json")]
    with pytest.raises(RuntimeError, match=r"worker rank 0 on cpu:\n(.|\n)*expected numa_node in"):
        main(argv)
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--workloads", "link,copy", "--workloads: expected names from ['link', 'kv'], got 'copy'"),
        (
            "--numa",
            "near",
            "--numa: expected numa_node 'auto', 'off' or a node id >= 0, got 'near'",
        ),
        ("--gpus", "-1", "--gpus: expected a number of processes > 0, got -1"),
        (
            "--layout",
            "rows",
            "--layout: expected a name from ['cross_layer', 'kv_pair', "
            "'kv_split', 'page'], got 'rows'",
        ),
    ],
)
def test_bad_arguments_say_what_was_expected(flag, value, said):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "multi-gpu", "--device", "cpu", "--host-mib", "1", flag, value])
    assert str(exc.value) == said
