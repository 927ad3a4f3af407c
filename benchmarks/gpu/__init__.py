"""The prepared GPU check (gpu_check.sh) and the steps it runs (see benchmarks/README.md)."""
