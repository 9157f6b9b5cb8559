"""The task interface on real Ray: the user's own model, data and loss through every job.

The seed handbook's DDP listing equals `torchrun` of the listing itself; a sweep of the digits CNN
reaches what a plain PyTorch loop reaches; DDP = one process and FSDP2 = DDP for a task; a task
file travels to the workers by value (deleted after loading, the sweep still runs); a task that
cannot be vmapped runs unpacked; every bad task is one `error:` line before Ray starts.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from ray.tune import Callback
from torch.utils.data import DataLoader, DistributedSampler

from helpers import ROOT, run_job, run_job_warm
from rayhpc.config import validate
from rayhpc.data import DataConfig
from rayhpc.engine.checkpoint import complete_checkpoints, latest_checkpoint, load_full_state_dict, load_progress
from rayhpc.task import task_for
from rayhpc.train.config import TrainConfig
from rayhpc.train.trainer import run_training
from rayhpc.tune.config import SweepConfig
from rayhpc.tune.sweep import run_sweep

TASKS = ROOT / "jobs" / "tasks"
DIGITS = f"{TASKS / 'digits.py'}:DigitsCNN"
LISTING = f"{TASKS / 'seed_listing.py'}:SeedListing"


@pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers)
def test_the_seed_listing_task_equals_the_listing_under_torchrun(ray_address, tmp_path):
    """2 workers x batch 32, SGD lr 0.01, 1 epoch, seed 0: the same weights as `torchrun --nproc_per_node 2`
    of the handbook's mlp_ddp.py (DistributedSampler, model built under torch.manual_seed(0))."""
    listing = tmp_path / "listing.pt"
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    for _ in range(2):  # the plain listing's gloo teardown aborted (SIGABRT) in 2 of 8 CI runs: run it again
        ran = subprocess.run([torchrun, "--nproc_per_node", "2", str(ROOT / "tests" / "seed_listing" / "mlp_ddp.py"),
                              str(listing)], capture_output=True, text=True, cwd=ROOT / "tests" / "seed_listing",
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
        if ran.returncode == 0:
            break
    assert ran.returncode == 0 and "Steps: 16" in ran.stdout, ran.stdout + ran.stderr
    proc = run_job("train_mlp.py", "--task", LISTING, "--num-workers", "2", "--batch-size-per-worker", "32",
                   "--optimizer", "sgd", "--lr", "0.01", "--epochs", "1", "--seed", "0", "--name", "listing",
                   "--storage-path", str(tmp_path), "--address", ray_address)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "for 1 epochs (16 steps)" in proc.stdout
    metrics = pd.read_parquet(tmp_path / "listing" / "metrics.parquet")
    ours, want = load_full_state_dict(latest_checkpoint(tmp_path / "listing")), torch.load(listing)
    assert ours.keys() == want.keys() == {"hidden_layer.weight", "hidden_layer.bias", "output_layer.weight",
                                          "output_layer.bias"}
    for key in want:
        torch.testing.assert_close(ours[key], want[key], msg=lambda m: f"{key}: {m}")
    assert "val_loss" not in metrics.columns  # the listing has no validation set


def test_the_seed_listing_task_learns():
    """Its targets are random (variance 1): the loss falls from the initial model's towards that floor."""
    from rayhpc.task.hparams import full_hparams
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.single import train_alone

    task = task_for(LISTING, DataConfig())
    losses = []
    train_alone(task, full_hparams(task.hp_model, {"optimizer": "sgd", "lr": 0.01}), SweepConfig(epochs=5),
                then=lambda values, epoch: losses.append(values["train_loss"]))
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.85 * losses[0], losses


def plain_digits(hp: dict, epochs: int) -> float:
    """The digits task trained the plain PyTorch way; its best validation accuracy over the epochs."""
    task = task_for(DIGITS, DataConfig())
    train, val = task.obj.data(hp)
    torch.manual_seed(hp["seed"])
    model = task.obj.model(hp)
    opt = torch.optim.Adam(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=hp["seed"])
    best = 0.0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in DataLoader(train, batch_size=hp["batch_size"], sampler=sampler):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            hits = sum(int((model(x).argmax(1) == y).sum()) for x, y in DataLoader(val, batch_size=1000))
        best = max(best, hits / len(val))
    return best


def test_a_digits_sweep_writes_its_columns_and_reaches_a_plain_loops_accuracy(ray_address, tmp_path):
    proc = run_job("tune_mlp.py", "--task", DIGITS, "--num-samples", "6", "--epochs", "4", "--storage-path",
                   str(tmp_path), "--address", ray_address, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "by best_val_accuracy" in proc.stdout and "pack(s)" in proc.stdout
    table = pd.read_parquet(tmp_path / "digits-sweep" / "results.parquet")
    for column in ("config.channels", "config.lr", "config.dropout", "val_loss", "best_val_loss", "val_accuracy",
                   "best_val_accuracy"):
        assert column in table.columns, table.columns
    assert len(table) == 6 and set(table["status"]) == {"finished"} and table["pack_size"].max() > 1
    best = table.loc[table["best_val_accuracy"].idxmax()]
    assert best["best_val_accuracy"] > 0.8  # 10 classes: chance is 0.1
    hp = {"lr": best["config.lr"], "channels": int(best["config.channels"]), "dropout": best["config.dropout"],
          "batch_size": 32, "optimizer": "adam", "momentum": 0.0, "weight_decay": 0.0, "seed": 0}
    torch.testing.assert_close(best["best_val_accuracy"], plain_digits(hp, 4), rtol=0, atol=1e-6)


def digits_run(tmp_path, **kw) -> TrainConfig:
    return validate(TrainConfig, {"task": DIGITS, "storage_path": str(tmp_path), "epochs": 2,
                                  "compute": {"num_workers": 2}, "batch_size_per_worker": 32,
                                  "optim": {"optimizer": "sgd", "lr": 0.1}, "hparams": {"channels": 4}, **kw})


@pytest.fixture(scope="module")
def digits_ddp(ray_address, tmp_path_factory):
    """Keeping the best checkpoint by the task's objective, validation accuracy (maximised), and the latest."""
    return run_training(digits_run(tmp_path_factory.mktemp("digits"), name="ddp", checkpoint={"keep_best": 1}))


def test_ddp_on_a_task_equals_one_process(digits_ddp):
    task = task_for(DIGITS, DataConfig())
    hp = {"channels": 4, "dropout": 0.0, "seed": 0}
    train, _ = task.obj.data(hp)
    torch.manual_seed(0)
    model = task.obj.model(hp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=0)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train, batch_size=64, sampler=sampler):  # 2 workers x 32
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    got = load_full_state_dict(digits_ddp.checkpoint_dir)
    assert got.keys() == model.state_dict().keys()
    for key, want in model.state_dict().items():
        torch.testing.assert_close(got[key], want, msg=lambda m: f"{key}: {m}")
    epochs = digits_ddp.metrics[digits_ddp.metrics["kind"] == "epoch"]
    assert "val_accuracy" in epochs and epochs["val_accuracy"].iloc[-1] > 0.3  # reported beside val_loss


def test_a_maximised_objectives_best_is_its_highest_and_keep_best_keeps_that_epoch(digits_ddp):
    epochs = digits_ddp.metrics[digits_ddp.metrics["kind"] == "epoch"].drop_duplicates("epoch", keep="last")
    accuracy = dict(zip(epochs["epoch"], epochs["val_accuracy"]))
    assert len(accuracy) == 2 and len(set(accuracy.values())) == 2, accuracy  # a best and a worst epoch
    highest = [max(list(accuracy.values())[:i + 1]) for i in range(len(accuracy))]
    assert epochs["best_val_accuracy"].tolist() == highest, (epochs["best_val_accuracy"].tolist(), accuracy)
    kept = {load_progress(c).epoch for c in complete_checkpoints(digits_ddp.checkpoint_dir.parent)}
    assert kept == {max(accuracy, key=accuracy.get), max(accuracy)}, (kept, accuracy)  # the best, and the latest


def test_fsdp_on_a_task_equals_ddp(digits_ddp, tmp_path):
    fsdp = run_training(digits_run(tmp_path, name="fsdp", strategy="fsdp"))
    got, want = load_full_state_dict(fsdp.checkpoint_dir), load_full_state_dict(digits_ddp.checkpoint_dir)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=lambda m: f"{key}: {m}")
    assert sum(p.name.endswith(".distcp") for p in fsdp.checkpoint_dir.iterdir()) == 2  # one shard file per rank


SHIPPED_TASK = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from regression_data import make_data   # a module beside the task file: it travels with it


class Regression:
    hparams = {"width": 8}

    def model(self, hp):
        return nn.Sequential(nn.Linear(3, hp["width"]), nn.Tanh(), nn.Linear(hp["width"], 1))

    def data(self, hp):
        x, y = make_data()
        return TensorDataset(x[:200], y[:200]), TensorDataset(x[200:], y[200:])

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)
'''
DATA_MODULE = '''
import torch

def make_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 3, generator=g)
    return x, (x * torch.tensor([1.0, -2.0, 0.5])).sum(1, keepdim=True)
'''


class DeleteFolder(Callback):
    """Removes a folder when the sweep starts: after the driver loaded the task, before any trial runs."""

    def __init__(self, folder: Path):
        self.folder = folder

    def setup(self, **info):
        shutil.rmtree(self.folder)


def test_a_task_file_travels_to_the_workers_by_value(ray_address, tmp_path):
    """Trials run in other processes (on other nodes, on a cluster) than the driver that read the file:
    the file and the module beside it are deleted once the driver has loaded them, and the sweep runs."""
    folder = tmp_path / "private"
    folder.mkdir()
    (folder / "regression.py").write_text(SHIPPED_TASK)
    (folder / "regression_data.py").write_text(DATA_MODULE)
    cfg = validate(SweepConfig, {"task": f"{folder / 'regression.py'}:Regression", "storage_path": str(tmp_path),
                                 "num_samples": 4, "epochs": 3,
                                 "space": {"width": {"choice": [4, 16]}, "lr": {"loguniform": [0.003, 0.03]}}})
    table = run_sweep(cfg, callbacks=(DeleteFolder(folder),))
    assert not folder.exists()
    assert len(table) == 4 and set(table["status"]) == {"finished"}, table
    assert set(table["config.width"]) <= {4, 16} and table["best_val_loss"].min() < 1.0


def readme_block(section: str) -> str:
    """The first Python block of the README's `section`."""
    text = (ROOT / "README.md").read_text()
    part = text[text.index(f"## {section}\n"):]
    start = part.index("```python\n") + len("```python\n")
    return part[start:part.index("```\n", start)]


def test_the_readme_task_and_python_api_examples_run_and_learn(ray_address, tmp_path, monkeypatch):
    """The README's task, saved as my_task.py, and its Python API example run as written (on the suite's
    Ray, which they join): the sweep's best trial and the training run both learn the task."""
    (tmp_path / "my_task.py").write_text(readme_block("A task in a dozen lines"))
    monkeypatch.chdir(tmp_path)
    example: dict = {}
    exec(readme_block("Python API"), example)  # noqa: S102 - the README's own example, as a user runs it
    table, run = example["table"], example["run"]
    assert len(table) == 4 and set(table["status"]) == {"finished"}, table
    # the target is a sum of 8 standard normals (variance 8): the best trial explains most of it
    assert table["best_val_loss"].min() < 0.1 * 8, table
    losses = run.metrics["val_loss"].tolist()
    assert len(losses) == 3 and losses[-1] < losses[0] and losses[-1] < 0.05 * 8, losses
    assert run.checkpoint_dir is not None and run.checkpoint_dir.is_relative_to(tmp_path), run.checkpoint_dir


@pytest.mark.parametrize("trials", [("--num-samples", "3"), ("--num-samples", "1", "--repeats", "3")])
def test_a_task_that_cannot_be_vmapped_runs_unpacked_and_says_so(trials, ray_address, tmp_path):
    """Three configurations, or one configuration's three seeds (which a packing sweep packs together)."""
    proc = run_job("tune_mlp.py", "--task", f"{ROOT / 'tests' / 'tasks' / 'odd.py'}:Branchy", *trials,
                   "--epochs", "2", "--name", "branchy-sweep", "--storage-path", str(tmp_path), "--address", ray_address)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line for line in proc.stdout.splitlines() if "cannot be packed" in line]
    assert len(said) == 1 and "data-dependent control flow" in said[0] and "run unpacked" in said[0], proc.stdout
    table = pd.read_parquet(tmp_path / "branchy-sweep" / "results.parquet")
    assert len(table) == 3 and set(table["pack_size"]) == {1} and set(table["status"]) == {"finished"}


BAD_TASKS = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset

DATA = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))


class Good:
    hparams = {"width": 8}

    def model(self, hp):
        return nn.Linear(3, 1)

    def data(self, hp):
        return DATA, None

    def loss(self, model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()


class NoLoss:
    def model(self, hp):
        return nn.Linear(3, 1)

    def data(self, hp):
        return DATA, None


class NotAModule(Good):
    def model(self, hp):
        return "a model"


class OneDataset(Good):
    def data(self, hp):
        return DATA


class VectorLoss(Good):
    def loss(self, model, batch):
        x, y = batch
        return (model(x) - y) ** 2


class Raises(Good):
    def model(self, hp):
        raise ValueError("no such layer")
'''


@pytest.fixture(scope="module")
def bad_tasks(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tasks") / "bad.py"
    path.write_text(BAD_TASKS)
    return path


BAD = {
    "missing file": (lambda p: ["--task", f"{p.parent / 'nope.py'}:Good"], "error: task (--task) {d}/nope.py:Good: "
                     "no such file {d}/nope.py"),
    "missing module": (lambda p: ["--task", "no_such_pkg.tasks:Good"],
                       "error: task (--task) no_such_pkg.tasks:Good: no module named 'no_such_pkg'"),
    "no NAME": (lambda p: ["--task", f"{p}:Missing"], "error: task (--task) {p}:Missing: {p} has no 'Missing'; "
                "tasks it defines: Good, NotAModule, OneDataset, Raises, VectorLoss"),
    "no colon": (lambda p: ["--task", str(p)], "error: task (--task) {p}: expected FILE.py:NAME or package.module:NAME"),
    "lacks loss": (lambda p: ["--task", f"{p}:NoLoss"], "error: task (--task) {p}:NoLoss: NoLoss has no "
                   "loss(model, batch) method"),
    "model not a Module": (lambda p: ["--task", f"{p}:NotAModule"], "error: task (--task) {p}:NotAModule: model(hp) "
                           "must return a torch.nn.Module, got a str"),
    "data not two": (lambda p: ["--task", f"{p}:OneDataset"], "error: task (--task) {p}:OneDataset: data(hp) must "
                     "return two datasets (train, val), got a TensorDataset"),
    "loss not scalar": (lambda p: ["--task", f"{p}:VectorLoss"], "error: task (--task) {p}:VectorLoss: loss(model, "
                        "batch) must return a scalar tensor (a mean over the batch), got shape [8, 1]"),
    "method raises": (lambda p: ["--task", f"{p}:Raises"], "error: task (--task) {p}:Raises: model(hp) raised "
                      "ValueError: no such layer"),
    "unknown hparam": (lambda p: ["--task", f"{p}:Good", "--config", _yaml(p, "space: {depth: {choice: [1, 2]}}")],
                       "error: space.depth: unknown parameter; allowed: optimizer, lr, momentum, weight_decay, "
                       "beta1, beta2, eps, clip_grad_norm, warmup_steps, warmup_fraction, decay, min_lr_ratio, "
                       "batch_size, accumulate, seed, width"),
    "mistyped hparam": (lambda p: ["--task", f"{p}:Good", "--config", _yaml(p, "space: {width: {choice: [4, wide]}}")],
                        "error: space.width: Input should be a valid integer (got 'wide')"),
    "mlp data for a task": (lambda p: ["--task", f"{p}:Good", "--data", str(p)], "error: data.path (--data): only "
                            "the built-in mlp task reads it; task (--task) {p}:Good loads its own data in data(hp)"),
    "storage is a file": (lambda p: ["--storage-path", str(p)], "error: storage_path (--storage-path) {p}: is a file, "
                          "not a folder"),
}


def _yaml(p: Path, text: str) -> str:
    path = p.parent / f"sweep-{abs(hash(text))}.yaml"
    path.write_text(text + "\n")
    return str(path)


@pytest.mark.parametrize("case", BAD)
def test_a_bad_task_is_one_error_line_before_ray_starts(case, bad_tasks, tmp_path):
    args, expected = BAD[case]
    ray_tmp = tmp_path / "ray"
    proc = run_job_warm("tune_mlp.py", *args(bad_tasks), "--storage-path", str(tmp_path / "results"),
                        env={"RAY_TMPDIR": str(ray_tmp)}) if case != "storage is a file" else \
        run_job_warm("tune_mlp.py", *args(bad_tasks), env={"RAY_TMPDIR": str(ray_tmp)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected.format(p=bad_tasks, d=bad_tasks.parent)), proc.stderr
    assert not ray_tmp.exists(), "Ray was started before the input was rejected"


def test_the_train_job_checks_the_task_too(bad_tasks, tmp_path):
    proc = run_job_warm("train_mlp.py", "--task", f"{bad_tasks}:VectorLoss", "--storage-path", str(tmp_path),
                        env={"RAY_TMPDIR": str(tmp_path / "ray")})
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: task (--task) {bad_tasks}:VectorLoss: loss"), \
        proc.stderr
    proc = run_job_warm("train_mlp.py", "--task", f"{bad_tasks}:Good", "--hp", "width=wide", "--storage-path",
                        str(tmp_path), env={"RAY_TMPDIR": str(tmp_path / "ray")})
    assert proc.returncode == 2 and proc.stderr.strip() == "error: hparams.width (--hp): Input should be a valid " \
                                                            "integer (got 'wide')", proc.stderr
    assert not (tmp_path / "ray").exists()


def test_resume_of_a_sweep_that_never_ran_lists_the_ones_that_exist(ray_address, tmp_path):
    for name in ("alpha", "beta"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "sweep.yaml").write_text(f"name: {name}\n")
    proc = run_job_warm("tune_mlp.py", "--name", "gamma", "--resume", "--storage-path", str(tmp_path),
                        env={"RAY_TMPDIR": str(tmp_path / "ray")})
    assert proc.returncode == 2 and proc.stderr.strip() == (f"error: resume (--resume): no sweep named gamma under "
                                                            f"{tmp_path}; sweeps there: alpha, beta"), proc.stderr
    # a requeued Slurm job (RAYHPC_RESUME=1) resumes what is there, and starts what is not
    proc = run_job("tune_mlp.py", "--name", "gamma", "--num-samples", "2", "--epochs", "1", "--storage-path",
                   str(tmp_path), "--address", ray_address, env={"RAYHPC_RESUME": "1"})
    assert proc.returncode == 0 and (tmp_path / "gamma" / "results.parquet").is_file(), proc.stdout + proc.stderr


def test_python_m_rayhpc_is_the_rayhpc_command(tmp_path):
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path / "ray")}
    for module in ("rayhpc", "rayhpc.cli"):
        helped = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, env=env)
        assert helped.returncode == 0 and "commands:" in helped.stdout, helped.stdout + helped.stderr
        for command in ("tune", "train", "parallel", "ps", "collectives", "scaling", "submit", "status"):
            assert f"\n  {command} " in helped.stdout, helped.stdout
        bad = subprocess.run([sys.executable, "-m", module, "tune", "--num-samples", "0"], capture_output=True,
                             text=True, env=env)
        assert bad.returncode == 2 and bad.stderr.startswith("error: num_samples (--num-samples): "), bad.stderr
        nothing = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, env=env)
        assert nothing.returncode == 2 and nothing.stderr.startswith("error: command nothing: expected one of tune")
    rayhpc = Path(sys.executable).with_name("rayhpc")
    helped = subprocess.run([str(rayhpc), "--help"], capture_output=True, text=True, env=env)
    assert helped.returncode == 0 and "  tune " in helped.stdout
    tune_help = subprocess.run([str(rayhpc), "tune", "--help"], capture_output=True, text=True, env=env)
    for flag in ("--task", "--workers-per-trial", "--val-fraction", "--grace-period"):
        assert flag in tune_help.stdout, tune_help.stdout


@pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers)
def test_the_byte_gpt_learns_standard_library_source(ray_address, tmp_path):
    """The GPT example on 2 DDP workers: the loss falls well below a uniform guess over 256 bytes
    (ln 256 = 5.55 nats, 8 bits per byte), and bits per byte is the loss in bits."""
    proc = run_job("train_mlp.py", "--task", f"{TASKS / 'gpt.py'}:GPT", "--hp", "corpus_bytes=200000",
                   "--optimizer", "adam", "--lr", "0.003", "--epochs", "2", "--num-workers", "2",
                   "--storage-path", str(tmp_path), "--address", ray_address, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    epochs = pd.read_parquet(tmp_path / "gpt-train" / "metrics.parquet").query("kind == 'epoch'")
    assert epochs["val_loss"].tolist() == sorted(epochs["val_loss"], reverse=True)  # falls every epoch
    assert epochs["val_loss"].iloc[-1] < 0.6 * torch.log(torch.tensor(256.0)).item(), epochs["val_loss"].tolist()
    torch.testing.assert_close(torch.tensor(epochs["val_bits_per_byte"].tolist()),
                               torch.tensor(epochs["val_loss"].tolist()) / 0.6931471805599453)
    assert (epochs["tokens_per_s"] == epochs["samples_per_s"] * 64).all()  # 64 bytes predicted per sample


FAILS_ON_THE_RANKS = '''
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class FailsOnTheRanks:
    def model(self, hp):
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def data(self, hp):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x.sum(1, keepdim=True)), None

    def loss(self, model, batch):  # passes the driver's check, fails on every rank
        x, y = batch
        if dist.is_initialized():
            raise RuntimeError(f"no loss on rank {dist.get_rank()}")
        return F.mse_loss(model(x), y)
'''


@pytest.mark.parametrize("script, args, ranks", [
    # our worker group waits for every rank: both are named
    ("train_parallel.py", ["--dp", "2", "--steps", "2", "--max-failures", "0"],
     [["rank 0 (pp=0, dp=0, fsdp=0, tp=0)", "rank 1 (pp=0, dp=1, fsdp=0, tp=0)"]]),
    # Ray Train's controller ends the run at the first poll that sees a failed rank: the other may not have
    # failed by then, so either rank alone, or both, is what it reports
    ("train_mlp.py", ["--num-workers", "2", "--epochs", "1", "--max-failures", "0"],
     [["rank 0", "rank 1"], ["rank 0"], ["rank 1"]]),
])
def test_a_rank_failing_in_the_task_is_one_line_and_a_run_that_never_stepped_can_start_again(script, args, ranks,
                                                                                             ray_address, tmp_path):
    """One `error:` line naming the lowest failed rank, the task's function and line, and the cause; every failed
    rank's traceback in the run's error.log, which the line names; the same command again fails the same way (no
    "already exists")."""
    task = tmp_path / "fails.py"
    task.write_text(FAILS_ON_THE_RANKS)
    raises = next(i for i, text in enumerate(FAILS_ON_THE_RANKS.splitlines(), 1) if "raise RuntimeError" in text)
    log = tmp_path / "fails" / "error.log"
    for attempt in range(2):
        proc = run_job(script, "--task", f"{task}:FailsOnTheRanks", *args, "--address", ray_address,
                       "--storage-path", str(tmp_path), "--name", "fails")
        traces = re.split(r"^--- (.+) ---$", log.read_text(), flags=re.M)[1:]
        logged = dict(zip(traces[::2], traces[1::2]))
        assert list(logged) in ranks and oct(log.stat().st_mode & 0o777) == "0o600", (attempt, list(logged))
        for name, trace in logged.items():
            assert trace.rstrip().endswith(f"RuntimeError: no loss on {name.split(' (')[0]}"), (name, trace)
            # the rank's whole traceback, down to the task's line (Ray Train's own text is a snippet of every rank's)
            assert f'File "{task}", line {raises}, in loss' in trace and "truncated" not in trace, (name, trace)
        first = next(iter(logged))
        assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1:] == [
            f"error: {first} failed in the task's loss() at {task}:{raises}: RuntimeError: no loss on "
            f"{first.split(' (')[0]} (every rank's traceback: {log})"], (attempt, proc.stderr)
        assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stdout + proc.stderr


FAILS_IN_TRIALS = '''
import ray

from rayhpc.task.mlp import MLPTask


class FailsInTrials(MLPTask):
    def model(self, hp):
        self.fails = hp["hidden"] in FAILING
        return super().model(hp)

    def loss(self, model, batch):  # the driver's checks (before Ray starts) pass; a trial of a failing width fails
        if self.fails and ray.is_initialized():
            raise RuntimeError("no loss in this trial")
        return super().loss(model, batch)
'''


# every trial failed (packed), and some (distributed, in warm worker groups): each branch once
@pytest.mark.parametrize("failing, workers", [((8, 16), 1), ((8,), 2)])
def test_trials_failing_in_the_task_are_one_line_and_the_others_are_kept(failing, workers, ray_address, tmp_path):
    """A sweep whose every trial failed in the task's code: one `error:` line (exit 1) naming the first trial,
    the task's function and line, and the cause, each trial's traceback in the sweep's error.log. Where some
    trials finished, the same as a warning line, the finished trials in the table (exit 0). Packed trials,
    and distributed trials in warm worker groups (a group started again says why)."""
    task = tmp_path / "fails.py"
    task.write_text(f"FAILING = {failing!r}\n" + FAILS_IN_TRIALS)
    (tmp_path / "space.yaml").write_text("space:\n  hidden: {grid: [8, 16]}\n")
    raises = next(i for i, text in enumerate(task.read_text().splitlines(), 1) if "raise RuntimeError" in text)
    args = ["--config", str(tmp_path / "space.yaml"), "--task", f"{task}:FailsInTrials", "--search", "grid",
            "--epochs", "2", "--max-failures", str(workers - 1), "--workers-per-trial", str(workers),
            "--address", ray_address, "--storage-path", str(tmp_path), "--name", "fails"]
    proc = run_job("tune_mlp.py", *args, timeout=600)
    log = tmp_path / "fails" / "error.log"
    line = (f"failed in the task's loss() at {task}:{raises}: RuntimeError: no loss in this trial "
            f"(every failed trial's traceback: {log})")
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stdout + proc.stderr
    assert log.read_text().count("--- trial ") == len(failing) and oct(log.stat().st_mode & 0o777) == "0o600"
    if workers > 1:
        # from the trial's process, as Ray forwards its log
        assert "(RuntimeError: no loss in this trial); starting the worker group again" in proc.stderr, proc.stderr
    table = pd.read_parquet(tmp_path / "fails" / "results.parquet")
    assert sorted(table.loc[table["status"] == "error", "config.hidden"]) == list(failing)
    if len(failing) == 2:
        # the only `error:` line (the trials' forwarded log lines may come after it)
        errors = [text for text in proc.stderr.splitlines() if text.startswith("error:")]
        assert proc.returncode == 1 and len(errors) == 1, proc.stderr
        assert re.fullmatch(r"error: trial \w{5}_\d{5} " + re.escape(line), errors[0]), errors
        if workers == 1:  # no trial reported: the same command runs the sweep again, no "already exists"
            again = run_job("tune_mlp.py", *args, timeout=600)
            assert again.returncode == 1 and again.stderr.splitlines()[-1].startswith("error: trial "), again.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert re.search(r"sweep fails: 1 of 2 trials failed; trial \w{5}_\d{5} " + re.escape(line), proc.stdout)
        assert list(table.loc[table["status"] == "finished", "config.hidden"]) == [16]


def test_a_parameter_server_worker_failing_in_the_task_is_replaced_then_one_line(ray_address, tmp_path):
    """A worker that fails in the task's code is replaced, with one line naming the cause; once the failures
    pass `max_failures`, one `error:` line names the worker, the task's function and line and the cause, its
    traceback in the run's error.log; a run without a checkpoint can be started again."""
    task = tmp_path / "fails.py"
    task.write_text("FAILING = (4,)\n" + FAILS_IN_TRIALS)  # the default width
    raises = next(i for i, text in enumerate(task.read_text().splitlines(), 1) if "raise RuntimeError" in text)
    log = tmp_path / "fails" / "error.log"
    for _ in range(2):  # failed before its first checkpoint: the same command starts it again
        proc = run_job("train_ps.py", "--task", f"{task}:FailsInTrials", "--max-failures", "1", "--address",
                       ray_address, "--storage-path", str(tmp_path), "--name", "fails")
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stdout + proc.stderr
    assert re.search(r"worker \d failed \(RuntimeError: no loss in this trial\); replaced", proc.stdout), proc.stdout
    errors = [text for text in proc.stderr.splitlines() if text.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    assert re.fullmatch(r"error: worker \d, after 1 recoveries \(max_failures 1\), failed in the task's loss\(\) at "
                        + re.escape(f"{task}:{raises}: RuntimeError: no loss in this trial (its traceback: {log})"),
                        errors[0]), errors
    assert "no loss in this trial" in log.read_text() and oct(log.stat().st_mode & 0o777) == "0o600"
