"""Plain Ray Tune, a baseline of `jobs/bench_sweep.py`: the trials of a sweep config as Ray Tune's docs write
them, one trial per configuration, the same training loop (the sweep's trainable, a pack of one each), reported
and checkpointed every epoch.

    python jobs/bench/plain_tuner.py SWEEP.yaml --storage-path DIR --out result.json --launch-time T

`ray.init()` with its defaults (a local Ray of its own), a `Tuner` with its defaults. Writes the seconds from
the launch (`--launch-time`, unix time) to Ray's start, to the first result and to the end of `fit()`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml


def plain_trainable(task, cfg):
    """The trials' function: the platform's trainable for one configuration (`{"members": [hp]}`), one thread,
    each epoch reported to Tune with its checkpoint, its seconds in every report."""
    from ray import tune

    from rayhpc.tune.trainable import TrialSettings, train_pack

    settings = TrialSettings.of(cfg, task, task.objective, threads=1)
    return tune.with_parameters(train_pack, task=task, packs=None, settings=settings)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--storage-path", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--launch-time", type=float, required=True)
    args = parser.parse_args()

    import ray
    from ray import tune

    from rayhpc.task import task_for
    from rayhpc.tune.config import SweepConfig, bind_sweep
    cfg = SweepConfig(**yaml.safe_load(Path(args.config).read_text()))
    task = task_for(cfg.task, cfg.data)
    cfg, _ = bind_sweep(cfg, task)
    configs = cfg.configs(task.hp_model)
    marks = {"imports and config": time.time() - args.launch_time}
    ray.init()
    marks["ray"] = time.time() - args.launch_time

    class FirstResult(tune.Callback):
        def on_trial_result(self, iteration, trials, trial, result, **info):
            marks.setdefault("first result", time.time() - args.launch_time)

    tune.Tuner(plain_trainable(task, cfg), param_space={"members": tune.grid_search([[hp] for hp in configs])},
               run_config=tune.RunConfig(name="plain", storage_path=str(Path(args.storage_path).resolve()),
                                         verbose=0, callbacks=[FirstResult()])).fit()
    marks["work"] = time.time() - args.launch_time
    ray.shutdown()
    marks["shutdown"] = time.time() - args.launch_time
    Path(args.out).write_text(json.dumps({**marks, "trials": len(configs)}))


if __name__ == "__main__":
    main()
