"""The CPU path: its kernels, decode modes and memory-bandwidth limit (see benchmarks/README.md)."""
