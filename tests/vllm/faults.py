"""A host backend that fails chosen copies, for the failure-path contract tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import CopyBackend
from kvoffload.transfer.host import HostBackend
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec


class CopyFault(RuntimeError):
    pass


@dataclass
class FaultPlan:
    """Fail the next ``loads`` load copies and the next ``stores`` store copies."""

    loads: int = 0
    stores: int = 0
    failed: list[str] = field(default_factory=list)

    def factory(self, layout: KVLayout, arena: HostArena) -> CopyBackend:
        return FaultyHost(layout, arena, self)


class FaultyHost(HostBackend):
    """The real host backend; a planned failure raises before any byte moves."""

    def __init__(self, layout: KVLayout, arena: HostArena, plan: FaultPlan) -> None:
        super().__init__(layout, arena)
        self.plan = plan

    def copy(self, specs: Sequence[TransferSpec]) -> None:
        direction = specs[0].direction if specs else None
        if direction == "load" and self.plan.loads > 0:
            self.plan.loads -= 1
            self.plan.failed.append("load")
            raise CopyFault("injected load failure")
        if direction == "store" and self.plan.stores > 0:
            self.plan.stores -= 1
            self.plan.failed.append("store")
            raise CopyFault("injected store failure")
        super().copy(specs)
