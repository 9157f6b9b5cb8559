"""A resume is exact on every runner. Each job runs the configuration of test_one_engine (the dropout task,
AdamW, a 10-step warm-up then cosine decay, clipping, 2 micro-batches, seed 3; 8 steps an epoch, the last
one partial; 3 epochs, a sweep 4) from its command, as a user starts it. Its driver is SIGKILLed once a
checkpoint in the warm-up is saved, the job resumed with `--resume` and stopped with Ctrl-C (SIGINT to its
process group, as a terminal sends it) once a checkpoint in the decay is saved (it may save more while it
stops), then resumed to its end. What it trained must be what plain PyTorch ranks train uninterrupted
(`helpers.plain_ranks`): the final weights, each epoch's val_loss and, where the job records it, each step's
loss. `rayhpc train` and `parallel`, which checkpoint every K steps, are killed mid-epoch; a sweep's trials
checkpoint at each epoch's end, and go on from there. Each rank's RNG state must come back from the
checkpoint (the parameter server's workers draw from (seed, worker, step) instead)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from test_one_engine import BATCH, HPARAMS, LR, OPTIM, SCHEDULE, SEED, TASK, close, same_weights

from helpers import EPOCHS, FIXED, ROOT, job_env, plain_ranks
from rayhpc.config import validate
from rayhpc.engine.checkpoint import latest_checkpoint, load_extra, load_full_state_dict, load_progress
from rayhpc.train.trainer import STARTUP_PHASES
from rayhpc.tune.config import SweepConfig

WARMUP = FIXED["warmup_steps"]
PER_EPOCH = 8
TRAINING = ["--task", TASK, "--epochs", str(EPOCHS), "--seed", str(SEED), "--global-batch-size", str(BATCH),
            "--accumulate", str(FIXED["accumulate"]), "--hp", "step_ms=120",
            *(a for k, v in {**OPTIM, **SCHEDULE}.items() for a in (f"--{k.replace('_', '-')}", str(v))),
            "--checkpoint-every", "3"]
# one configuration of each runner (`rayhpc train` on 1 worker, and a trial alone, run the same runner as DDP
# and a pack member: test_one_engine proves them equal, test_sweep resumes a trial alone after its process died;
# Ray Train's runner once, under FSDP2, whose sharded state is the harder one to bring back: DDP's resume with
# every option is test_training_options')
JOBS = {  # name: (ranks, script, its own arguments)
    "fsdp2 2 workers": (2, "train_mlp.py",
                        ["--num-workers", "2", "--strategy", "fsdp", "--metrics-every-steps", "1"]),
    "parallel dp 2": (2, "train_parallel.py", ["--dp", "2"]),
    "ps sync 2 workers": (2, "train_ps.py", ["--mode", "sync", "--num-workers", "2", "--num-servers", "2"]),
}
# Ctrl-C lets a running trial finish its epoch (Tune waits for it): a sweep one epoch longer still has one to
# resume after it
SWEEP_EPOCHS = EPOCHS + 1
SWEEPS = {  # name: (ranks, the sweep's own keys)
    "pack member": (1, {"pack": 4}),
    "warm group trial": (2, {"workers_per_trial": 2, "max_concurrent": 1}),
}
# one task of `rayhpc submit --array` as its sbatch script runs it; a requeued task runs the same command again
ARRAY = "array task"


# CI: the jobs and the sweeps beside the Slurm tests (pyproject's markers), the array task in the other session,
# which balances the two
@pytest.mark.parametrize("runner", [*(pytest.param(job, marks=pytest.mark.newest) for job in (*JOBS, *SWEEPS)),
                                    ARRAY])
def test_a_job_killed_in_the_warm_up_and_stopped_in_the_decay_ends_as_if_never_stopped(runner, ray_address,
                                                                                      tmp_path):
    world, args, exp = command(runner, tmp_path, ray_address)
    epochs = SWEEP_EPOCHS if runner in SWEEPS else EPOCHS
    # the first stop: a checkpoint of the warm-up (mid-epoch where the job checkpoints every 3 steps)
    killed = stop_after(args, exp, lambda step: 0 < step <= WARMUP, signal.SIGKILL)
    if runner == "fsdp2 2 workers" and (table := exp / "metrics.parquet").exists():
        # made certain: the driver killed once Ray Train had registered the checkpoint (pruning the one before)
        # and before its report's rows reached the table; they are then in the checkpoint alone
        saved = {(r["global_step"], r["kind"]) for r in load_extra(latest_checkpoint(exp))["rows"]}
        rows = pd.read_parquet(table)
        rows[[(s, k) not in saved for s, k in zip(rows["global_step"], rows["kind"])]].to_parquet(table, index=False)
    resume = args if runner == ARRAY else [*args, "--resume"]
    interrupted = stop_after(resume, exp, lambda step: step > WARMUP, signal.SIGINT)
    assert killed <= WARMUP < interrupted < epochs * PER_EPOCH, (killed, interrupted, logs(tmp_path))
    if runner in JOBS and not runner.startswith("ps"):  # killed mid-epoch: its ranks stop with the driver (a
        assert killed % PER_EPOCH, killed  # sweep's trials checkpoint at epochs' ends; the parameter server's
        # servers may save another checkpoint before Ray ends them)
    proc = subprocess.run(resume, capture_output=True, text=True, env=job_env(None), cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "train_mlp.py" in args[1]:  # its start-up line times this session's first step, not the first session's
        line = re.search(r"fit\(\) to first step (\S+) s(.*)", proc.stdout)
        first_step = float(line.group(1))
        assert 0 < first_step < 300, proc.stdout[-3000:]
        # ... phase by phase, from Ray Train's processes to the first step, adding up to it (each rounded)
        phases = re.findall(r"; (.+?) (\d+\.\d) s", line.group(2))
        assert [name for name, _ in phases] == list(STARTUP_PHASES), line.group(0)
        assert sum(float(s) for _, s in phases) == pytest.approx(first_step, abs=0.3), line.group(0)
        # rank 0's marks, in the order it passed them: its process, joining the world (began, ended), the function,
        # its device, the first collective, its data and model
        marks = pd.read_parquet(exp / "metrics.parquet").iloc[-1][list(STARTUP_PHASES.values())[:-2]]
        assert list(marks) == sorted(marks) and marks.is_unique, marks
    if runner == ARRAY:  # a requeue of the finished task leaves its result (its time in it) as it is
        result = next(exp.glob("*/trial_00000.json"))
        before = result.read_text()
        assert subprocess.run(resume, env=job_env(None), cwd=ROOT, timeout=300).returncode == 0
        assert result.read_text() == before

    want = plain_ranks(world, LR, SEED, epochs=epochs)
    weights, val, train, steps = trained(runner, exp, epochs)
    if runner == ARRAY:  # a requeued task goes on from its checkpoint (started again, it would end the same)
        row = json.loads(next(exp.glob("*/trial_00000.json")).read_text())
        assert row["resumed_from_epoch"] == interrupted // PER_EPOCH > 0, (row, interrupted)
    want_val = [v for v, _ in want.epochs]
    close(runner, "val_loss", val, [min(want_val), want_val[-1]] if runner in (*SWEEPS, ARRAY) else want_val)
    # an epoch resumed mid-way reports the loss of all its steps (the parameter server's driver holds its
    # workers' step records until their epoch ends: a killed driver's come from server 0's checkpoint)
    if train is not None:
        close(runner, "epoch loss", train, [t for _, t in want.epochs])
    if steps is not None:
        close(runner, "step loss", list(steps.values()), [want.step_losses[s - 1] for s in steps])
    same_weights(runner, weights, want.weights)


def command(runner: str, tmp_path: Path, address: str) -> tuple[int, list[str], Path]:
    """(ranks, the job's command line, its folder)."""
    if runner == ARRAY:  # the sweep's folder as `rayhpc submit --array` leaves it: the sweep, the drawn trials
        from rayhpc.tune.array import ARRAY_DIR, prepare_array
        from rayhpc.tune.plan import save_plan

        cfg, _, configs, _ = prepare_array(validate(SweepConfig, sweep_keys(tmp_path, 1, EPOCHS)), set())
        cfg.save()
        save_plan([[c] for c in configs], cfg.experiment_dir)
        return 1, [sys.executable, "-m", "rayhpc.tune.single", "--config", str(cfg.saved_file), "--index", "0",
                   "--out", str(cfg.experiment_dir / ARRAY_DIR)], cfg.experiment_dir
    if runner in JOBS:
        world, script, own = JOBS[runner]
        return world, [sys.executable, str(ROOT / "jobs" / script), "--storage-path", str(tmp_path), "--name", "r",
                       "--address", address, *TRAINING, *own], tmp_path / "r"
    world, own = SWEEPS[runner]
    config = tmp_path / "sweep.yaml"
    config.write_text(json.dumps({**sweep_keys(tmp_path, own.get("pack", 1), SWEEP_EPOCHS), **own}))
    return world, [sys.executable, str(ROOT / "jobs" / "tune_mlp.py"), "--config", str(config), "--address",
                   address], tmp_path / "r"


def sweep_keys(tmp_path: Path, pack: int, epochs: int) -> dict:
    """The sweep's config: a grid of `pack` learning rates, LR's trial the one compared."""
    lrs = [0.005, 0.01, 0.02, LR][-pack:] if pack > 1 else [LR]
    return {"name": "r", "storage_path": str(tmp_path), "task": TASK, "search": "grid", "epochs": epochs,
            "seed": SEED, "optim": {k: v for k, v in OPTIM.items() if k != "lr"}, "schedule": SCHEDULE,
            "space": {"lr": {"grid": lrs}, **HPARAMS, "step_ms": 120.0, "batch_size": BATCH,
                      "accumulate": FIXED["accumulate"]}}


def stop_after(args: list[str], exp: Path, when, sig: int) -> int:
    """Start the job, and send `sig` to its process group once it has saved a checkpoint whose step `when`
    takes (and, where Ray Train keeps a snapshot of its checkpoints, that snapshot names it: a resume starts
    from it); the step of the newest checkpoint once the job has ended."""
    log = exp.parent / f"{signal.Signals(sig).name}.log"
    with open(log, "w") as out:
        job = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=job_env(None),
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not any(when(step) for step in saved_steps(exp)):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
    finally:
        os.killpg(job.pid, sig)
        job.wait(timeout=120)
    return max(saved_steps(exp))


def logs(folder: Path) -> str:
    return "\n".join(f"{log.name}:\n{log.read_text()[-2000:]}" for log in sorted(folder.glob("*.log")))


def saved_steps(exp: Path) -> list[int]:
    """The global steps of the job's complete checkpoints, in every folder of it (a sweep's trials)."""
    steps, found = [], None
    while found is None:
        try:
            found = list(exp.rglob("checkpoint_*/progress.json"))
        except FileNotFoundError:  # a checkpoint folder pruned while the glob read it: read them again
            continue
    for progress in found:
        snapshot = progress.parent.parent / "checkpoint_manager_snapshot.json"
        if not snapshot.exists() or progress.parent.name in whole_json(snapshot):
            try:
                steps.append(load_progress(progress.parent).global_step)
            except (ValueError, OSError):  # being copied into the trial's folder (Tune persists a checkpoint
                continue  # so), or pruned since the glob (a job keeps its newest few)
    return steps or [0]


def whole_json(path: Path) -> str:
    """The text of a JSON file that Ray Train rewrites in place: its controller, which outlives a killed
    driver for a moment, may have emptied it to write it again; read it until it parses."""
    for _ in range(200):
        text = path.read_text()
        try:
            json.loads(text)
            return text
        except ValueError:
            time.sleep(0.05)
    raise AssertionError(f"{path} is not JSON after 10 s: {text!r}")


def trained(runner: str, exp: Path, epochs: int) -> tuple[dict, list, list | None, dict | None]:
    """(the final weights, each epoch's val_loss (a sweep: its best and its last), each epoch's training loss
    (a sweep: None), {global step: its loss} of the steps whose loss the job records, or None)."""
    if runner == ARRAY:
        from rayhpc.tune.array import ARRAY_DIR

        row = json.loads((exp / ARRAY_DIR / "trial_00000.json").read_text())
        assert row["iterations"] == epochs, row
        final = latest_checkpoint(exp / ARRAY_DIR / "trial_00000")
        assert load_progress(final).global_step == epochs * PER_EPOCH, final
        return load_full_state_dict(final), [row["best_val_loss"], row["val_loss"]], None, None
    if runner in SWEEPS:
        table = pd.read_parquet(exp / "results.parquet")
        row = table[table["config.lr"] == LR].iloc[0]
        assert row["iterations"] == epochs, row
        if runner == "warm group trial":
            folder = next(p for p in exp.iterdir() if row["trial_id"] in p.name and (p / "params.json").exists())
            weights = load_full_state_dict(latest_checkpoint(folder))
        else:
            from rayhpc.tune.weights import trial_weights

            weights = trial_weights(f"{exp}:{row['trial_id']}", ("val_loss", "min")).state
        return weights, [row["best_val_loss"], row["val_loss"]], None, None
    final = latest_checkpoint(exp)
    assert load_progress(final).global_step == epochs * PER_EPOCH, final
    rows = pd.read_parquet(exp / "metrics.parquet")
    ends = rows[rows["kind"] == "epoch"].drop_duplicates("epoch", keep="last")
    assert ends["epoch"].tolist() == list(range(1, epochs + 1)), rows
    steps = None
    if runner.startswith("parallel"):
        steps = dict(enumerate(load_extra(final)["losses"], 1))
    elif "--metrics-every-steps" in JOBS[runner][2]:  # a row a step; an epoch's row stands for its last step
        every = rows.drop_duplicates("global_step", keep="last").sort_values("global_step")
        assert every["global_step"].tolist() == list(range(1, epochs * PER_EPOCH + 1)), every
        # the final checkpoint keeps its report's rows (steps after the checkpoint before it), for a resume that
        # a kill between Ray Train's registration of it and the table's rows would otherwise leave without them
        kept = load_extra(final)["rows"]
        since = (epochs * PER_EPOCH - 1) // 3 * 3  # checkpoints every 3 steps and at each epoch's end
        assert [(r["global_step"], r["kind"]) for r in kept] == [
            *((s, "step") for s in range(since + 1, epochs * PER_EPOCH)), (epochs * PER_EPOCH, "epoch")], kept
        assert [r["loss"] for r in kept[:-1]] == every["loss"].tolist()[since:-1]
        every = every[every["kind"] == "step"]
        steps = dict(zip(every["global_step"], every["loss"]))
    return load_full_state_dict(final), ends["val_loss"].tolist(), ends["loss"].tolist(), steps
