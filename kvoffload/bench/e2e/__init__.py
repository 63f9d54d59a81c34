"""``kvoffload bench e2e``: multi-turn chat TTFT on a paged-attention model runner (``runner``)."""
