"""``kvoffload bench store``: the control plane's lookup, store and eviction cost."""
