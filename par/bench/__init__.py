"""Benchmarks: each module times a par strategy against the torch built-in doing the same job."""
