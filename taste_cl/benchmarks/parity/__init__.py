"""Benchmarks that check two engines or runtimes train alike (``engines``)."""
