"""The engine in-process, feature by feature (see benchmarks/README.md)."""
