"""Run by test_gpu_refusals.py in a process of its own, whose environment describes one GPU to Ray that
torch cannot use, on any machine (a GPU node included): RAY_OVERRIDE_RESOURCES='{"GPU": 1}', and
CUDA_VISIBLE_DEVICES naming a GPU UUID that does not exist, with Ray told not to set it. One local Ray serves every check; prints one JSON
object: each job's exit status and stderr, each runner's refusal, and whether the parameter server's
actors placed on the one GPU."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import ray

from rayhpc import cli, cluster
from rayhpc.config import validate
from rayhpc.entry import run_main
from rayhpc.ps.config import PSConfig
from rayhpc.ps.driver import fleet_resources
from rayhpc.tune.trainable import _device
from rayhpc.workers.group import WorkerGroup


def job(main, argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            run_main(main, argv, quick_exit=False)
        except SystemExit as exc:
            return exc.code, err.getvalue()
    return 0, err.getvalue()


def refusal(call) -> str | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return str(exc)
    return None


@ray.remote
class Placed:
    def ready(self) -> bool:
        return True


def ps_places() -> bool:
    """The PS fleet's actors (server, evaluator, then the worker, in start_fleet's order) on the one GPU."""
    resources = fleet_resources(validate(PSConfig, {"compute": {"gpu": True, "num_workers": 1}}), cluster.probe(None))
    actors = [Placed.options(**resources[kind]).remote() for kind in ("server", "evaluator", "worker")]
    ready, _ = ray.wait([a.ready.remote() for a in actors], num_returns=len(actors), timeout=20)
    return len(ready) == len(actors)


def main(storage: str) -> dict:
    cluster.connect(None)
    where = ["--storage-path", storage]
    report = {"gpus": ray.cluster_resources().get("GPU", 0), "jobs": {
        "tune": job(cli.tune_main, [*where, "--gpus-per-trial", "0.5", "--num-samples", "2", "--epochs", "1"]),
        "train": job(cli.train_main, [*where, "--gpu", "--num-workers", "1", "--epochs", "1"]),
        "parallel": job(cli.parallel_main, [*where, "--gpu", "--steps", "2"]),
        "ps": job(cli.ps_main, [*where, "--gpu", "--num-workers", "1", "--epochs", "1"]),
    }}
    report["trial"] = refusal(lambda: ray.get(ray.remote(num_gpus=0.5)(_device).remote()))
    report["group"] = refusal(lambda: WorkerGroup(1, gpus_per_worker=1.0, timeout_s=60).shutdown())
    report["fractional group"] = refusal(lambda: WorkerGroup(2, gpus_per_worker=0.5, start=False))
    report["ps placed"] = ps_places()
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
