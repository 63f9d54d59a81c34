"""Can a load's enqueue be one CUDA graph launch instead of one driver call per copy? (issue 25)

A restore's enqueue costs the engine ~0.3-0.6 ms of driver time per request in ``bench e2e``
whichever thread makes the calls (the nineteenth round: handed to kvoffload's thread, the same
time came back in the engine's launch), because the driver's cost is per copy operation, batched
or not (docs/transfer.md, seventh and sixteenth rounds). ``DESIGN.md`` names the way left: the
pipeline as a CUDA graph, launched with one ``cuGraphLaunch`` per job. This probe measures what
that would save before anything is built: ``graph_enqueue_probe.c`` (compiled here against the
toolkit's ``cuda.h``) enqueues a load of S slices x R copies + a kernel + a flag write per slice
directly, as a captured graph launched as is (the floor), and as that graph with every node's
parameters changed per load (what a real load needs: other host slots, other sequence numbers),
and times a launch-bound loop on another thread beside each (``graph_enqueue_probe.c`` says how).

    python -m benchmarks.graph_enqueue_probe OUT.json [--configs 8x1,8x4,16x4,8x16]
        [--iters 200] [--copy-kib 1024]        # CUDA only; needs cc and the toolkit's cuda.h
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "graph_enqueue_probe.c"
RUN_TIMEOUT_S = 300


def parse_configs(text: str) -> list[tuple[int, int]]:
    """``SxR,...`` (slices x copies per slice) as pairs; ValueError saying what was expected."""
    out = []
    for part in text.split(","):
        s, sep, r = part.partition("x")
        if not (sep and s.isdigit() and r.isdigit() and int(s) >= 1 and int(r) >= 1):
            raise ValueError(f"expected --configs as SxR pairs of ints >= 1 (8x4), got {text!r}")
        if int(s) * int(r) * 3 + 8 > 4096:
            raise ValueError(f"expected slices x runs <= 1,360 per config, got {part!r}")
        out.append((int(s), int(r)))
    return out


def args_of(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="graph_enqueue_probe.py")
    p.add_argument("out")
    p.add_argument("--configs", default="8x1,8x4,16x4,8x16")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--copy-kib", type=int, default=1024)
    args = p.parse_args(argv)
    try:
        args.pairs = parse_configs(args.configs)
        if args.iters < 10:
            raise ValueError(f"expected --iters >= 10, got {args.iters}")
        if args.copy_kib < 1:
            raise ValueError(f"expected --copy-kib >= 1, got {args.copy_kib}")
    except ValueError as err:
        raise SystemExit(f"graph_enqueue_probe.py: {err}") from None
    return args


def cuda_home() -> Path:
    """The toolkit holding ``include/cuda.h`` (CUDA_HOME, else nvcc's), or SystemExit."""
    nvcc = shutil.which("nvcc")
    for root in (os.environ.get("CUDA_HOME"), Path(nvcc).parents[1] if nvcc else None):
        if root and (Path(root) / "include" / "cuda.h").exists():
            return Path(root)
    raise SystemExit("graph_enqueue_probe.py: expected a CUDA toolkit (cuda.h), got none")


def build(workdir: Path) -> Path:
    home = cuda_home()
    exe = workdir / "graph_enqueue_probe"
    libs = [home / "lib64" / "stubs", home / "lib64", Path("/usr/lib/x86_64-linux-gnu")]
    argv = ["cc", "-O2", "-std=gnu11", f"-I{home / 'include'}", str(SOURCE), "-o", str(exe)]
    argv += [f"-L{d}" for d in libs if d.exists()] + ["-lcuda", "-lpthread"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"graph_enqueue_probe.py: the build failed:\n{done.stderr}")
    return exe


def run(exe: Path, slices: int, runs: int, iters: int, nbytes: int) -> dict[str, Any]:
    """One config's arms; with the flag writes, or without them where a graph cannot capture
    them (the error kept)."""
    out: dict[str, Any] = {"slices": slices, "runs": runs}
    for flags in (1, 0):
        argv = [str(exe), str(slices), str(runs), str(iters), str(nbytes), str(flags)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if done.returncode == 0:
            out["arms"] = [json.loads(line) for line in done.stdout.splitlines() if line]
            return out
        out[f"error_flags_{flags}"] = done.stderr.strip()[-2000:]
    return out


def main(argv: list[str]) -> int:
    args = args_of(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("graph_enqueue_probe.py: expected a CUDA device, got none")
    from benchmarks import probe_util
    from kvoffload.bench.e2e.command import device_info

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        for slices, runs in args.pairs:
            row = run(exe, slices, runs, args.iters, args.copy_kib << 10)
            rows.append(row)
            for arm in row.get("arms", []):
                print(
                    f"{slices:3}x{runs:<3} {arm['arm']:9} nodes {arm['graph_nodes']:4} enqueue "
                    f"p50 {arm['enqueue_us_p50']:8.1f} us (p10 {arm['enqueue_us_p10']:.1f}, "
                    f"p90 {arm['enqueue_us_p90']:.1f}); launch loop beside "
                    f"{arm['loop_beside_us'] / arm['loop_alone_us']:.2f}x alone; bytes "
                    f"{arm['bytes_verified']}; flags {arm['flag_writes']}"
                )
            for key in ("error_flags_1", "error_flags_0"):
                if key in row:
                    print(f"{slices}x{runs} {key}: {row[key]}")
    probe_util.dump(
        args.out,
        "graph_enqueue_probe",
        driver=device_info("cuda")["driver"],
        iters=args.iters,
        copy_bytes=args.copy_kib << 10,
        results=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
