"""Benchmarks, shipped as ``taste_cl.benchmarks`` and run with ``taste-cl bench NAME``.

Each measures ratios side by side in one run, prints a table and writes JSON.
"""
