"""Benchmarks, sweeps, peer runners (Hugging Face + torch) and the HTTP load generator.

`python -m mmjax.tools.bench_*` are their command lines; results go to docs/perf/results/<area>/."""
