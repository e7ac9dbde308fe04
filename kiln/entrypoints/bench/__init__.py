"""Benchmark clients behind `kiln bench`: workloads, the HTTP load generator, the offline throughput run."""
