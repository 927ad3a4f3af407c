"""Across devices and processes: the pure head/shard arithmetic (``shapes``), shared
with the operator, which must not import the engine."""
