"""``kvoffload bench transfer``: copy GB/s per method, model shape and layout."""
