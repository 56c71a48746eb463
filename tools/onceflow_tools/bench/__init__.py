"""Benchmarks: onceflow beside its peers, measured in the same run."""
