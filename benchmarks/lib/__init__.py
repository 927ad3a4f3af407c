"""What several benchmark scripts share, one concept per module: paths, percentiles,
argument helpers, the streaming client, server processes, engine timing, and the
random checkpoints the GPU checks measure."""
