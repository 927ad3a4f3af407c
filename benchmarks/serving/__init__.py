"""Through real serve / gateway / up processes over HTTP (see benchmarks/README.md)."""
