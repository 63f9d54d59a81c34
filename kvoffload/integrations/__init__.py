"""Thin facades for inference engines. Each subpackage is the only place its engine is imported."""
