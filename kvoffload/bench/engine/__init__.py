"""A small paged-attention model runner that uses kvoffload the way a user's own engine would.

``model`` (a Llama-architecture decoder with seeded random weights), ``kv_cache`` (vLLM's
FlashAttention layout), ``block_pool`` (GPU blocks with prefix caching), ``host_tier`` (the
kvoffload integration, through the public API only), ``engine`` (chunked prefill, greedy decode,
the three modes) and ``bench`` (the multi-turn TTFT benchmark behind ``kvoffload bench e2e``).
"""
