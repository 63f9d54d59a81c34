"""Which dtype the model runner computes in: bf16 on a GPU and on CPUs that do bf16 math in
hardware, float32 on CPUs that would emulate it.

Why: on a CPU without bf16 instructions, torch converts every bf16 operand to float32 and back
around each op; on a 2-core AMD EPYC with AVX2 only, the README's main command took 7 min 5 s in
bf16 (one core busy with conversions) against about a minute expected.

How it is detected (``native_bf16``), first answer wins:
1. x86: the CPU flags of ``/proc/cpuinfo`` name ``avx512_bf16`` (bf16 dot products, AVX-512) or
   ``amx_bf16`` (AMX tiles);
2. ARM: the ``Features`` line of ``/proc/cpuinfo`` names ``bf16`` (FEAT_BF16); on macOS the
   ``hw.optional.arm.FEAT_BF16`` sysctl;
3. elsewhere (no ``/proc/cpuinfo``, e.g. Windows): torch's own query
   (``torch.cpu._is_avx512_bf16_supported`` / ``_is_amx_tile_supported``), else float32.
"""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Iterable

DTYPES = ("auto", "bfloat16", "float32")
X86_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Iterable[str]) -> set[str]:
    """The feature words of a ``/proc/cpuinfo`` text (x86 ``flags``, ARM ``Features``)."""
    flags: set[str] = set()
    for line in cpuinfo:
        name, sep, value = line.partition(":")
        if sep and name.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def native_bf16_from_flags(flags: set[str], machine: str) -> bool:
    """Whether CPU ``flags`` (of ``cpu_flags``) include bf16 arithmetic on ``machine``
    (``platform.machine()``: x86_64/AMD64, aarch64/arm64)."""
    arch = machine.lower()
    if arch in ("aarch64", "arm64") or arch.startswith("armv8"):
        return "bf16" in flags
    return bool(flags & X86_BF16_FLAGS)


def native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (see the module docstring for how)."""
    machine = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags = cpu_flags(f)
    except OSError:
        flags = set()
    if flags:
        return native_bf16_from_flags(flags, machine)
    if platform.system() == "Darwin" and machine.lower() == "arm64":
        return _sysctl("hw.optional.arm.FEAT_BF16") == "1"
    return _torch_says_bf16()


def resolve(name: str, device_type: str) -> str:
    """``bfloat16`` or ``float32`` for ``--dtype name`` on a ``cuda``/``cpu`` device."""
    if name not in DTYPES:
        raise ValueError(f"expected a dtype in {DTYPES}, got {name!r}")
    if name != "auto":
        return name
    if device_type != "cpu" or native_bf16():
        return "bfloat16"
    return "float32"


def _sysctl(name: str) -> str:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def _torch_says_bf16() -> bool:
    import torch

    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)
