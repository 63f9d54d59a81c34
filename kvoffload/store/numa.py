"""NUMA placement of host memory: the node nearest a GPU, binding a range to it, and where its
pages landed.

A GPU's copies read and write host memory through the PCI root complex of one socket; pinned memory
on the other socket's node crosses the socket interconnect on every copy. The kernel names each PCI
device's node in ``<sysfs>/bus/pci/devices/<bus id>/numa_node`` (-1: not known). ``resolve`` turns
the ``numa_node`` option ("auto", "off" or a node id) and the GPU's bus id into a ``Placement``;
``bind`` applies it with ``mbind(2)`` to a range not yet touched (its pages are then allocated on
that node when first touched or pinned); ``where`` reads back where pages are (``move_pages(2)``)
and the range's policy (``get_mempolicy(2)``). Torch-free: the GPU's bus id comes from the caller
(``kvoffload.transfer.topology``).

A node asked for by id is bound strictly (``MPOL_BIND``): the pages land there or allocation fails.
"auto" prefers the node (``MPOL_PREFERRED``): when the node is full, pages go elsewhere instead of
failing the engine, and ``where`` shows it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NumaSetting = int | str  # "auto", "off" or a node id

MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND = 0, 1, 2
MPOL_MF_STRICT = 1  # mbind: fail if pages already present are elsewhere
MPOL_F_ADDR = 2  # get_mempolicy: the policy of the range holding an address
POLICY_NAMES = {0: "default", 1: "preferred", 2: "bind", 3: "interleave", 4: "local"}
MASK_WORDS = 16  # node masks of 1024 bits, the kernel's largest MAX_NUMNODES
# Syscall numbers (glibc exports none of these wrappers; libnuma does, and is not a dependency).
SYSCALLS = {
    "x86_64": {"mbind": 237, "get_mempolicy": 239, "move_pages": 279},
    "aarch64": {"mbind": 235, "get_mempolicy": 236, "move_pages": 239},
}
PAGE = os.sysconf("SC_PAGE_SIZE")
_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


class NumaUnavailable(RuntimeError):
    """Placement was asked for and cannot be done here (the call refused, an unknown machine)."""


@dataclass(frozen=True)
class Placement:
    node: int | None  # where the memory goes; None: wherever the kernel puts it
    strict: bool  # MPOL_BIND (a node asked for by id) rather than MPOL_PREFERRED ("auto")
    reason: str  # why this node, or why none

    @classmethod
    def none(cls, reason: str) -> Placement:
        return cls(None, False, reason)


def check_setting(value: object) -> None:
    """ValueError unless ``value`` is "auto", "off" or a node id >= 0."""
    ok = value in ("auto", "off") if isinstance(value, str) else False
    ok = ok or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
    if not ok:
        raise ValueError(f"expected numa_node 'auto', 'off' or a node id >= 0, got {value!r}")


def normalize_bus_id(bus_id: str) -> str:
    """A PCI address as sysfs names it (``0000:18:00.0``), from torch's or nvidia-smi's form
    (``00000000:18:00.0``) or one without a domain (``18:00.0``)."""
    m = _BUS_ID.match(bus_id.strip())
    if m is None:
        raise ValueError(f"expected a PCI bus id like 0000:18:00.0, got {bus_id!r}")
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def parse_list(text: str) -> list[int]:
    """A kernel list (``0-3,8,10-11``) as its numbers."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


@dataclass(frozen=True)
class Topology:
    """The NUMA facts sysfs gives, under ``root`` (tests point it at a fake tree)."""

    root: Path = Path("/sys")

    def nodes(self) -> list[int]:
        """Online nodes; [] where the kernel shows no NUMA at all."""
        path = self.root / "devices/system/node/online"
        return parse_list(path.read_text()) if path.exists() else []

    def cpus(self, node: int) -> list[int]:
        return parse_list((self.root / f"devices/system/node/node{node}/cpulist").read_text())

    def mem_total(self, node: int) -> int | None:
        """The node's RAM in bytes (its meminfo's MemTotal), None where sysfs does not say."""
        path = self.root / f"devices/system/node/node{node}/meminfo"
        if not path.exists():
            return None
        m = re.search(r"MemTotal:\s+(\d+) kB", path.read_text())
        return int(m.group(1)) * 1024 if m else None

    def device_path(self, bus_id: str) -> Path:
        return self.root / "bus/pci/devices" / normalize_bus_id(bus_id) / "numa_node"

    def device_node(self, bus_id: str) -> int | None:
        """The node of PCI device ``bus_id``; None where the file is missing or says -1."""
        path = self.device_path(bus_id)
        if not path.exists():
            return None
        node = int(path.read_text())
        return node if node >= 0 else None

    def describe(self) -> dict[str, Any]:
        """Each node's CPUs and RAM, for benchmark results and ``doctor``."""
        return {
            str(n): {"cpus": self.cpus(n), "mem_total_bytes": self.mem_total(n)}
            for n in self.nodes()
        }


def resolve(
    setting: NumaSetting, bus_id: str | None, nbytes: int = 0, topology: Topology | None = None
) -> Placement:
    """The placement ``setting`` asks for, for ``nbytes`` of memory serving the GPU at ``bus_id``
    (None: the memory serves no GPU). ValueError for a setting that is not one, a node this host
    lacks, or a node asked for by id with less RAM than ``nbytes``."""
    check_setting(setting)
    topo = topology or Topology()
    if setting == "off":
        return Placement.none("numa_node='off'")
    nodes = topo.nodes()
    if isinstance(setting, int):
        if setting not in nodes:
            raise ValueError(
                f"expected numa_node in this host's online NUMA nodes {nodes}, got {setting}"
            )
        total = topo.mem_total(setting)
        if total is not None and nbytes > total:
            raise ValueError(
                f"expected at most node {setting}'s {total} bytes of RAM with numa_node="
                f"{setting}, got {nbytes} bytes of host memory to place there"
            )
        return Placement(setting, True, f"numa_node={setting}")
    if bus_id is None:
        return Placement.none("auto: the KV is not on a GPU")
    if len(nodes) <= 1:
        return Placement.none(f"auto: this host has one NUMA node ({nodes}), nothing to choose")
    node = topo.device_node(bus_id)
    if node is None:
        return Placement.none(
            f"auto: the kernel gives no NUMA node for GPU {bus_id} "
            f"({topo.device_path(bus_id)} is missing or -1)"
        )
    if node not in nodes:
        return Placement.none(f"auto: GPU {bus_id}'s node {node} is not online ({nodes})")
    return Placement(node, False, f"auto: nearest GPU {normalize_bus_id(bus_id)}")


def _syscall(name: str) -> tuple[Any, int]:
    numbers = SYSCALLS.get(platform.machine())
    if numbers is None:
        raise NumaUnavailable(
            f"expected a machine of {sorted(SYSCALLS)} for NUMA placement, "
            f"got {platform.machine()!r}"
        )
    return _libc_syscall(), numbers[name]


@functools.cache
def _libc_syscall() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall


def _mask(node: int) -> ctypes.Array[ctypes.c_ulong]:
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    if not 0 <= node < MASK_WORDS * bits:
        raise ValueError(f"expected a NUMA node in [0, {MASK_WORDS * bits}), got {node}")
    mask = (ctypes.c_ulong * MASK_WORDS)()
    mask[node // bits] = 1 << (node % bits)
    return mask


def _failed(call: str, what: str) -> NumaUnavailable:
    code = ctypes.get_errno()
    hint = {
        errno.EPERM: "a container's seccomp profile refuses NUMA calls without CAP_SYS_NICE",
        errno.ENOSYS: "this kernel was built without NUMA",
        errno.EINVAL: "the node is not online, or the range is not page-aligned",
        errno.EIO: "pages already present are on another node",
    }.get(code, "")
    return NumaUnavailable(
        f"{call} {what} failed: {os.strerror(code)}" + (f" ({hint})" if hint else "")
    )


def bind(address: int, nbytes: int, placement: Placement) -> None:
    """Apply ``placement`` to ``[address, address + nbytes)`` (page-aligned, best not yet
    touched); nothing when its node is None. NumaUnavailable when the kernel refuses."""
    if placement.node is None:
        return
    if address % PAGE:
        raise ValueError(f"expected a page-aligned address, got {address:#x}")
    call, number = _syscall("mbind")
    mode = MPOL_BIND if placement.strict else MPOL_PREFERRED
    flags = MPOL_MF_STRICT if placement.strict else 0
    rc = call(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_ulong(nbytes),
        ctypes.c_int(mode),
        _mask(placement.node),
        ctypes.c_ulong(MASK_WORDS * 8 * ctypes.sizeof(ctypes.c_ulong) + 1),
        ctypes.c_uint(flags),
    )
    if rc != 0:
        what = f"of {nbytes} bytes at {address:#x} to node {placement.node}"
        raise _failed(f"mbind({POLICY_NAMES[mode]})", what)


def place(address: int, nbytes: int, placement: Placement) -> Placement:
    """``bind``, except that a placement "auto" chose degrades to none (logged, and said in the
    returned reason) where the kernel refuses; one asked for by id raises."""
    try:
        bind(address, nbytes, placement)
    except NumaUnavailable as err:
        if placement.strict:
            raise
        log.warning("host memory not placed on NUMA node %s: %s", placement.node, err)
        return Placement.none(f"{placement.reason}, but {err}")
    return placement


def where(address: int, nbytes: int, samples: int = 64) -> dict[str, Any]:
    """Where the range's pages are: the policy of the range at ``address`` and, for up to
    ``samples`` pages spread over it, the node of each (pages never touched count as
    ``untouched``). Reads only; touches nothing."""
    call, number = _syscall("get_mempolicy")
    mode = ctypes.c_int(-1)
    mask = (ctypes.c_ulong * MASK_WORDS)()
    maxnode = ctypes.c_ulong(MASK_WORDS * 8 * ctypes.sizeof(ctypes.c_ulong) + 1)
    addr = ctypes.c_void_p(address)
    if call(ctypes.c_long(number), ctypes.byref(mode), mask, maxnode, addr, MPOL_F_ADDR) != 0:
        raise _failed("get_mempolicy", f"at {address:#x}")
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    policy_nodes = [i for i in range(MASK_WORDS * bits) if mask[i // bits] >> (i % bits) & 1]
    pages = max(1, nbytes // PAGE)
    count = min(samples, pages)
    first = address - address % PAGE
    picks = [first + (i * pages // count) * PAGE for i in range(count)]
    call, number = _syscall("move_pages")
    addrs = (ctypes.c_void_p * count)(*picks)
    status = (ctypes.c_int * count)()
    rc = call(ctypes.c_long(number), 0, ctypes.c_ulong(count), addrs, None, status, 0)
    if rc != 0:
        raise _failed("move_pages", f"(query of {count} pages at {address:#x})")
    on: dict[int, int] = {}
    untouched = 0
    for s in status:
        if s >= 0:
            on[s] = on.get(s, 0) + 1
        elif s == -errno.ENOENT:
            untouched += 1
        else:
            raise NumaUnavailable(f"move_pages: a page at {address:#x}+ says {os.strerror(-s)}")
    return {
        "policy": POLICY_NAMES.get(mode.value, str(mode.value)),
        "policy_nodes": policy_nodes,
        "sampled_pages": count,
        "pages_on_node": {str(k): v for k, v in sorted(on.items())},
        "untouched": untouched,
    }


def summary(found: dict[str, Any]) -> str:
    """``where``'s answer in one line."""
    on = ", ".join(f"{v} on node {k}" for k, v in found["pages_on_node"].items()) or "none placed"
    nodes = ",".join(map(str, found["policy_nodes"]))
    policy = found["policy"] + (f" {nodes}" if nodes else "")
    return f"policy {policy}; of {found['sampled_pages']} sampled pages {on}" + (
        f", {found['untouched']} untouched" if found["untouched"] else ""
    )
