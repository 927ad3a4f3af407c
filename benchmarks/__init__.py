"""Benchmark scripts, grouped by what they measure, and ``lib``, the code they share.

A package so that a script imports ``benchmarks.lib`` however it is started; never part
of the installed wheel (pyproject.toml's package discovery takes ``llmserve*`` only)."""
