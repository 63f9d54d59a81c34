"""Lower tiers below host RAM: a local disk tier and a shared Valkey/Redis tier (torch-free).

The contract and the block flow are in ``base.py``; the on-disk / on-wire format in ``payload.py``;
how the shared tier is reached (URL forms, one server or a cluster, password, TLS, namespace) in
``endpoint.py``. ``ValkeyTier`` imports its client (``redis``, the ``tiers`` extra) only when one
is built.
"""

from kvoffload.store.tiers.base import Tier, TierStartupError, TierStats
from kvoffload.store.tiers.disk import DiskTier
from kvoffload.store.tiers.payload import FORMAT_VERSION, CorruptBlock
from kvoffload.store.tiers.valkey import ValkeyTier

__all__ = [
    "FORMAT_VERSION",
    "CorruptBlock",
    "DiskTier",
    "Tier",
    "TierStartupError",
    "TierStats",
    "ValkeyTier",
]
