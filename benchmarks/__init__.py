"""Benchmarks: ferry side by side with its floor or peer, in one run, ratios printed. Never tests.

Each ``benchmarks/bench_<area>.py`` exposes ``run(quick: bool = False) -> list[dict]`` returning rows
``{"metric", "ferry", "peer", "ratio", "target"}``; ``python -m benchmarks [--quick] [NAME ...]`` runs them all
and prints one table.
"""
