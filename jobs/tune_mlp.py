"""Hyperparameter sweep of the seed documents' two-layer MLP on Ray Tune.

    python jobs/tune_mlp.py                       # local Ray, all CPUs
    python jobs/tune_mlp.py --address HOST:PORT   # any Ray cluster (or RAY_ADDRESS)
    python jobs/tune_mlp.py --config sweep.yaml --num-samples 64 --scheduler asha
    python jobs/tune_mlp.py --name my-sweep --resume

Results: <storage-path>/<name>/results.parquet, one row per trial.
"""

from rayhpc.cli import tune_main
from rayhpc.entry import run_main

if __name__ == "__main__":
    run_main(tune_main)
