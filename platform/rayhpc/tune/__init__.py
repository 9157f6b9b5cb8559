"""Hyperparameter sweeps of any task with Ray Tune (packed trials, ASHA, Optuna, PBT): `run_sweep(SweepConfig(...))`.

Imports are lazy: an array-job task (`python -m rayhpc.tune.single`) must not
pay for importing Ray Tune, which it does not use.
"""

from typing import Any

__all__ = ["SweepConfig", "run_sweep"]


def __getattr__(name: str) -> Any:
    if name == "SweepConfig":
        from rayhpc.tune.config import SweepConfig  # lazy: see the module docstring

        return SweepConfig
    if name == "run_sweep":
        from rayhpc.tune.sweep import run_sweep  # lazy: see the module docstring

        return run_sweep
    raise AttributeError(f"module 'rayhpc.tune' has no attribute {name!r}")
