"""Benchmarks that need more than the installed package: the end-to-end model runner in engine/."""
