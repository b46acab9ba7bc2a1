"""Benchmarks, sweeps, peer runners and load generators, and the record of their latest numbers."""
