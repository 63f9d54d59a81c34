"""``kvoffload bench tiers``: disk and Valkey tier throughput, latency and the fleet run."""
