"""What the benchmark scripts beside this folder (`jobs/bench_*.py`, `jobs/gpu_check.py`) run: plain-PyTorch
baselines, the pipeline bubble clock, the sweep and parameter-server comparisons. They run from a checkout
and are not part of the installed package."""

import sys

import ray.cloudpickle

# Ray's workers import the installed rayhpc, not this folder: functions defined here travel by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
