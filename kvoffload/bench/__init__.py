"""Benchmarks behind ``kvoffload bench``; results go to ``benchmarks/results/`` as JSON."""
