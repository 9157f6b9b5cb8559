"""Every bad input to `jobs/tune_mlp.py` exits 2 with one `error:` line, before Ray starts."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import CPUS, GPUS, run_job_warm

WORKERS = min(CPUS, GPUS) if GPUS else CPUS  # distributed-trial workers this machine places


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def parquet(path: Path, **columns) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


CASES = {
    "unknown yaml key": (lambda d: ["--config", write(d / "s.yaml", "num_sample: 3\n")],
                         "error: num_sample: unknown key; allowed keys: accumulate, activation_checkpointing, address, "
                         "asha, checkpoint"),
    "yaml wrong type": (lambda d: ["--config", write(d / "s.yaml", "epochs: [1, 2]\n")],
                        "error: epochs: Input should be a valid integer (got [1, 2])"),
    "flag wrong type": (lambda d: ["--num-samples", "lots"],
                        "error: num_samples (--num-samples): Input should be a valid integer"),
    "empty search space": (lambda d: ["--config", write(d / "s.yaml", "space: {}\n")],
                           "error: space: empty search space; give at least one parameter as grid, choice"),
    "activation checkpointing of packs": (lambda d: ["--activation-checkpointing", "full", "--pack", "4"],
                                          "error: activation_checkpointing (--activation-checkpointing) full: packed "
                                          "trials run as one batched model"),
    "num_samples < 1": (lambda d: ["--num-samples", "0"],
                        "error: num_samples (--num-samples): Input should be greater than or equal to 1"),
    "unknown search": (lambda d: ["--search", "bayes"],
                       "error: search (--search): Input should be 'random', 'grid' or 'optuna' (got 'bayes')"),
    "gpus without gpus" if GPUS == 0 else "gpu share below 1/8":
        (lambda d: ["--gpus-per-trial", "0.05"],
         "error: gpus_per_trial (--gpus-per-trial) 0.05: " + ("the cluster has no GPUs" if GPUS == 0 else
                                                              "at most 8 trial processes share a GPU")),
    "gpu fraction for distributed trials": (lambda d: ["--gpus-per-trial", "0.5", "--workers-per-trial", "2"],
                                            "error: gpus_per_trial (--gpus-per-trial) 0.5: with workers_per_trial 2 "
                                            "every worker is one NCCL rank on a whole GPU"),
    "steps and epochs": (lambda d: ["--steps", "100", "--epochs", "3"],
                         "error: steps (--steps) 100 and epochs (--epochs) 3: give one, not both"),
    "steps under asha": (lambda d: ["--steps", "100", "--scheduler", "asha"],
                         "error: steps (--steps) 100: scheduler asha compares trials epoch by epoch; give epochs"),
    "bf16 on CPUs": (lambda d: ["--precision", "bf16", "--gpus-per-trial", "0"],
                     "error: precision (--precision) bf16: autocast is for GPUs"),
    "cpus beyond cluster": (lambda d: ["--cpus-per-trial", str(CPUS + 1)],
                            f"error: cpus_per_trial (--cpus-per-trial) {CPUS + 1}: larger than the"),
    "missing data file": (lambda d: ["--data", str(d / "nope.parquet")],
                          "error: data.path (--data) "),
    "data not parquet": (lambda d: ["--data", write(d / "x.parquet", "a,b\n1,2\n")],
                         "error: data.path (--data) "),
    "data without target": (lambda d: ["--data", parquet(d / "x.parquet", a=[1.0, 2.0, 3.0], b=[1, 2, 3])],
                            "error: data.target (--target) "),
    "data with text column": (lambda d: ["--data", parquet(d / "x.parquet", a=["u", "v"], target=[1.0, 2.0])],
                              "error: data "),
    "unknown flag": (lambda d: ["--num-trials", "3"], "error: unrecognized arguments: --num-trials 3"),
    "pbt with optuna": (lambda d: ["--scheduler", "pbt", "--search", "optuna"],
                        "error: scheduler (--scheduler) pbt: PBT evolves the members of packs the sweep draws"),
    "pbt unpacked": (lambda d: ["--scheduler", "pbt", "--pack", "1"],
                     "error: pack (--pack) 1: scheduler pbt evolves the members of a pack"),
    "pbt with nothing to perturb": (lambda d: ["--scheduler", "pbt", "--config", write(
                                        d / "s.yaml", "space: {hidden: {choice: [8, 16]}}\n")],
                                    "error: space: scheduler pbt perturbs lr, momentum, weight_decay inside a pack, "
                                    "and the space varies none of them (hidden)"),
    # a sweep on a GPU machine gives each worker of a distributed trial a GPU
    "workers beyond cluster": (lambda d: ["--workers-per-trial", str(WORKERS + 1), "--config", write(
                                   d / "s.yaml", f"space: {{batch_size: {{choice: [{16 * (WORKERS + 1)}]}}}}\n")],
                               f"error: workers_per_trial (--workers-per-trial) {WORKERS + 1}: the cluster can place "
                               f"{WORKERS} worker(s)"),
    "batch not divisible by workers": (lambda d: ["--workers-per-trial", "2", "--config",
                                                  write(d / "s.yaml", "space: {batch_size: {choice: [32, 33]}}\n")],
                                       "error: space.batch_size: 33 is not divisible by workers_per_trial"),
    "micro-batches that do not divide": (lambda d: ["--config", write(d / "s.yaml", "space: {batch_size: 32, "
                                                                   "accumulate: {grid: [2, 3]}}\n")],
                                         "error: space.accumulate: 3 does not divide the batch per worker 32"),
    "a constant batch not divisible by workers": (lambda d: ["--workers-per-trial", "3"],
                                                  "error: global_batch_size (--global-batch-size): 32 is not "
                                                  "divisible by workers_per_trial (--workers-per-trial) 3"),
    "a constant the space searches too": (lambda d: ["--accumulate", "2", "--config", write(
                                              d / "s.yaml", "space: {accumulate: {grid: [1, 2]}}\n")],
                                          "error: accumulate (--accumulate) 2: space.accumulate sets it too; give "
                                          "it in one place"),
    "a section key the space searches too": (lambda d: ["--lr", "0.1", "--config", write(
                                                 d / "s.yaml", "space: {lr: {loguniform: [0.001, 0.1]}}\n")],
                                             "error: optim.lr (--lr) 0.1: space.lr sets it too; give it in one place"),
    "a schedule section key the space searches too": (lambda d: ["--config", write(
                                                          d / "s.yaml", "schedule: {decay: cosine}\n"
                                                          "space: {decay: {choice: [linear, step]}}\n")],
                                                      "error: schedule.decay (--decay) cosine: space.decay sets it "
                                                      "too"),
    "an unknown optimizer in the section": (lambda d: ["--optimizer", "lion"],
                                            "error: optim.optimizer (--optimizer): unknown optimizer 'lion'"),
    "an unknown optimizer": (lambda d: ["--config", write(d / "s.yaml", "space: {optimizer: {choice: [adamw, lion]}}\n")],
                             "error: space.optimizer: unknown optimizer 'lion'"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_with_one_error_line_before_ray_starts(case, tmp_path):
    make_args, expected = CASES[case]
    ray_tmp = tmp_path / "ray"
    proc = run_job_warm("tune_mlp.py", *make_args(tmp_path), "--storage-path", str(tmp_path / "results"),
                        env={"RAY_TMPDIR": str(ray_tmp)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr
    assert not ray_tmp.exists(), "Ray was started before the input was rejected"
    if case.startswith("data"):
        assert "x.parquet" in lines[0] or "nope.parquet" in lines[0]


def test_existing_sweep_is_not_overwritten_without_resume(tmp_path):
    storage = tmp_path / "results"
    (storage / "mlp-sweep").mkdir(parents=True)
    (storage / "mlp-sweep" / "sweep.yaml").write_text("name: mlp-sweep\n")
    proc = run_job_warm("tune_mlp.py", "--storage-path", str(storage), env={"RAY_TMPDIR": str(tmp_path / "ray")})
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: name (--name) mlp-sweep: a sweep already exists at "), proc.stderr
    assert "pass --resume" in proc.stderr


def test_the_rayhpc_command_runs_sweeps_and_rejects_unknown_commands(tmp_path):
    import subprocess
    import sys

    rayhpc = Path(sys.executable).with_name("rayhpc")
    env = {"RAY_TMPDIR": str(tmp_path / "ray"), "PATH": str(rayhpc.parent)}
    bad = subprocess.run([str(rayhpc), "tune", "--num-samples", "0"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("error: num_samples (--num-samples): "), bad.stderr
    unknown = subprocess.run([str(rayhpc), "sweep"], capture_output=True, text=True, env=env)
    assert unknown.returncode == 2 and unknown.stderr.strip() == "error: command 'sweep': expected one of tune, train, parallel, ps, collectives, scaling, up, down, submit, status, stop, doctor, export, sync (see rayhpc --help)"
