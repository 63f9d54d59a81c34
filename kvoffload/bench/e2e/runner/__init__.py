"""A small paged-attention model runner that uses kvoffload the way a user's own engine would.

``model`` (a Llama-architecture decoder with random weights), ``dtype`` (its CPU dtype choice),
``kv_cache`` (vLLM's FlashAttention layout), ``block_pool`` (GPU blocks with prefix caching),
``host_tier`` (the kvoffload integration, through the public API only; ``calls`` times each of
its kvoffload calls), ``engine`` (chunked prefill, layer-by-layer restores, store policies, the
four modes), ``graphs`` (the piecewise and full CUDA-graph modes), ``workload`` (chat, fits,
docs, mixed), ``bench_config`` / ``bench`` / ``results`` / ``targets`` / ``plot`` / ``verify``
(the benchmark behind ``kvoffload bench e2e``) and ``variants`` (engine variants side by side).
It ships in the package so that ``kvoffload bench e2e`` runs from any install; only ``kvoffload
bench`` imports it.
"""
