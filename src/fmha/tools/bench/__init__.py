"""Benchmarks: suites of cases, peer providers, metrics and the runner (``python -m fmha.tools.bench``)."""
