"""Helpers of the benchmarks (`jobs/bench_*.py`) and of the tests, outside the library's core:
plain-PyTorch baselines, the single-process reference of a parallel run, the pipeline-bubble clock."""
