"""The copy-backend interface imports no backend; the registry builds them by name."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import kvoffload.transfer.backend as interface
from kvoffload.store.arena import HostArena
from kvoffload.transfer import registry
from kvoffload.transfer.host import HostBackend
from kvoffload.transfer.layout import KVLayout


def _imported_modules(path: Path) -> set[str]:
    """Every module an import statement in ``path`` names, at any depth (lazy ones too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_interface_module_imports_no_backend():
    imported = _imported_modules(Path(interface.__file__))
    backends = {
        m for m in imported if m.startswith(("kvoffload.transfer.host", "kvoffload.transfer.cuda"))
    }
    assert backends == set()
    assert "kvoffload.transfer.planner" not in imported


def test_registry_builds_by_name_and_the_interface_module_holds_no_registry():
    kv = [np.zeros((4, 16, 8), np.float32)]
    layout = KVLayout.from_tensors(kv, block_size=16)
    with HostArena(2, layout.slot_bytes) as arena:
        backend = registry.make_backend("auto", layout, arena)
        assert isinstance(backend, HostBackend)
        backend.close()
        with pytest.raises(ValueError, match="expected a copy backend in"):
            registry.make_backend("nope", layout, arena)
    for name in ("BACKENDS", "make_backend", "register_backend"):  # one place: the registry
        assert not hasattr(interface, name)
