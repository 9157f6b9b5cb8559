"""Every GPU path of the platform on the GPUs this machine has, in one table (`jobs/gpu_check.py`).

Each line runs one path the way a user does (the job scripts, as subprocesses) or calls the
platform directly, and says PASS, FAIL or SKIP (why) with its figures. A line whose subject cannot
run on the GPUs present is SKIP with the reason, never PASS: NCCL runs one rank per GPU, so TP, PP,
the collectives and distributed trials need 2+ GPUs. Without a GPU every GPU line is SKIP and it
exits 0, so CI runs it too; on a machine whose GPUs torch cannot use it says so and exits 1.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from rayhpc.devices import cuda_unusable, node_gpus, torch_build

ROOT = Path(__file__).resolve().parents[2]  # the checkout: jobs/bench/gpu_check.py
# the H100 anchor (one worker, bf16): MLP 4096 -> 8192 x 3 -> 4096, batch 8192
ANCHOR = ["--in-features", "4096", "--hidden", "8192", "--depth", "4", "--batch", "8192"]
GOALS = {"rayhpc DDP": 0.99, "rayhpc FSDP2": 0.95}  # samples/s per GPU over raw PyTorch's in the same run
FIRST_STEP_GOAL_S = 10.0  # fit() to the first step, phase by phase
FIT_LINE = "fit() to first step"


@dataclass
class Line:
    name: str
    status: str  # PASS, FAIL, SKIP
    figures: str
    seconds: float = 0.0
    data: dict = field(default_factory=dict)


def run_job(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(ROOT / "jobs" / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def _failed(proc: subprocess.CompletedProcess) -> str:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return f"exit {proc.returncode}: " + " | ".join(tail)


def check_no_host_traffic(device: torch.device) -> Line:
    """The packed optimizer and the training loop's running sums step without a host-device sync
    (CUDA's sync debug mode turns any sync into an error)."""
    from rayhpc.task.batches import Batches
    from rayhpc.train.loop import Window
    from rayhpc.tune.optim import PackedAdam, PackedSGD

    params = [torch.nn.Parameter(torch.randn(4, 64, 64, device=device)) for _ in range(3)]
    opts = [PackedSGD(params, lr=[0.1] * 4, momentum=[0.9] * 4, weight_decay=[1e-4] * 4, max_norm=[1.0] * 4),
            PackedAdam(params, lr=[1e-3] * 4, weight_decay=[0.0] * 4, decoupled=True, max_norm=[None, 1.0] * 2)]
    batches = Batches(torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1)), device)
    win = Window(torch.zeros((), device=device))
    for p in params:
        p.grad = torch.randn_like(p)
    epochs = [batches(list(range(i, 256)), 64) for i in range(3)]
    firsts = [next(epoch) for epoch in epochs]  # an epoch's order goes to the device once, before its steps
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for epoch, first in zip(epochs, firsts):
            for x, _y in [first, *epoch]:
                for opt in opts:  # a schedule that changes every step (a pinned, non-blocking copy), clipping
                    opt.scale_lr([1.0 / (win.steps + 1)] * 4)
                    opt.clip_()
                    opt.step()
                win.add(x.sum(), len(x))
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    how = "CUDA sync debug mode: error" if device.type == "cuda" else f"{device.type} device: the path runs"
    return Line("no host sync in a step", "PASS", f"{win.steps} steps of 2 packed optimizers (schedule, clipping) + "
                f"running loss ({how})")


def check_packed_sweep(work: Path, gpus: int) -> Line:
    """The packed sweep with half a GPU per pack: two packs share each GPU."""
    import pandas as pd

    proc = run_job("tune_mlp.py", "--num-samples", "32", "--epochs", "3", "--gpus-per-trial", "0.5",
                   "--storage-path", str(work / "sweep"), "--name", "gpu-sweep")
    if proc.returncode:
        return Line("packed sweep, 0.5 GPU per pack", "FAIL", _failed(proc))
    table = pd.read_parquet(work / "sweep" / "gpu-sweep" / "results.parquet")
    first = next(line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "sweep gpu-sweep:" in line)
    stated = "tf32" in first and "2 per GPU" in first
    ok = stated and set(table["status"]) == {"finished"} and len(table) == 32
    return Line("packed sweep, 0.5 GPU per pack", "PASS" if ok else "FAIL",
                f"{len(table)} trials {dict(table['status'].value_counts())}, {2 * gpus} packs at once; "
                f"first line: {first.split(': ', 1)[-1][:90]}")


def strategy_names(gpus: int) -> dict[str, str]:
    """The DDP and FSDP2 lines' names, saying what ran: one worker per GPU; on one GPU the platform's DDP
    does not wrap a single rank, so that line measures its training loop alone."""
    ddp = f"DDP bf16, {gpus} GPUs" if gpus > 1 else "loop bf16, 1 GPU (one rank: no DDP wrapper)"
    return {"rayhpc DDP": f"{ddp} vs raw PyTorch", "rayhpc FSDP2": f"FSDP2 bf16, {gpus} GPU(s) vs raw PyTorch"}


def check_strategies(work: Path, gpus: int) -> list[Line]:
    """DDP and FSDP2 (bf16, a worker per GPU) against raw PyTorch on one GPU (data on the GPU) at the anchor size,
    in one run: samples/s per GPU, MFU, each side's share of time waiting for data, fit() time."""
    out = work / "strategies.json"
    proc = run_job("bench_train.py", "--strategies", "--gpu", "--workers", str(gpus), *ANCHOR, "--samples", "256000",
                   "--epochs", "3", "--repeats", "1", "--json", str(out), timeout=420)
    if proc.returncode:
        return [Line("DDP / FSDP2 vs raw PyTorch", "FAIL", _failed(proc))]
    rows = json.loads(out.read_text())
    raw = rows["raw PyTorch"]
    lines = []
    for name, goal in GOALS.items():
        r = rows[name]
        ratio = r["samples_per_s"] / gpus / raw["samples_per_s"]
        # On a GPU the host's time in next(batches) also holds its waits on a full CUDA launch queue, so even
        # raw PyTorch, whose batches are indexed on the GPU, shows some: the platform may wait as much as raw.
        waits = r["data_wait_share"] < max(0.05, raw["data_wait_share"])
        lines.append(Line(strategy_names(gpus)[name], "PASS" if ratio >= goal and waits else "FAIL",
                          f"{r['samples_per_s'] / gpus:,.0f} vs {raw['samples_per_s']:,.0f} samples/s per GPU = "
                          f"{ratio:.3f}x (goal >= {goal}); MFU {r['mfu']:.1%}; waiting for data "
                          f"{r['data_wait_share']:.1%} of the time (raw {raw['data_wait_share']:.1%})", data=r))
    detail = rows["rayhpc DDP"]["detail"]  # the job's start-up line: Ray, fit() to first step and its phases
    found = re.search(r"fit\(\) to first step ([0-9.]+) s", detail)
    first = float(found.group(1)) if found else float("nan")
    lines.append(Line(FIT_LINE, "PASS" if first < FIRST_STEP_GOAL_S else "FAIL",
                      f"{first:.1f} s (goal < {FIRST_STEP_GOAL_S:g} s); fit() to done "
                      f"{rows['rayhpc DDP']['fit_s']:.1f} s; start-up: {detail}"))
    return lines


def layouts(gpus: int) -> dict[str, dict]:
    """Model-parallel layouts for this many GPUs (one rank per GPU; 2+)."""
    mlp = {"hparams": {"hidden": 32 * gpus, "depth": 4}}
    found = {f"tp{gpus}": dict(parallelism={"tp": gpus}, **mlp),
             "pp2 1f1b": dict(parallelism={"pp": 2, "microbatches": 4, "schedule": "1f1b"}, **mlp)}
    if gpus >= 4:
        found["tp2 x pp2"] = dict(parallelism={"tp": 2, "pp": 2, "microbatches": 4, "schedule": "1f1b"}, **mlp)
    return found


def check_model_parallel(work: Path, gpus: int) -> list[Line]:
    """The worker group on NCCL against the one-process reference (fp32, no TF32), and a bf16 run."""
    sys.path.insert(0, str(ROOT / "tests"))  # the tests' one-process reference: this runs from a checkout
    from parallel_reference import reference_run
    from rayhpc.parallel import ParallelConfig, run_parallel

    lines = []
    for name, layout in layouts(gpus).items():
        world = ParallelConfig(**layout).parallelism.world_size
        cfg = ParallelConfig(storage_path=work / "parallel", name=re.sub(r"\W+", "-", name), steps=4,
                             precision="fp32", compute={"gpu": True, "num_workers": world}, **layout)
        result = run_parallel(cfg, log_level=logging.DEBUG)
        losses, _, _ = reference_run(cfg)
        try:
            torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(losses), rtol=1e-4, atol=1e-5)
            status, figures = "PASS", f"4 steps equal one process; loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        except AssertionError as exc:
            status, figures = "FAIL", str(exc).splitlines()[0]
        lines.append(Line(f"TP/PP on NCCL: {name}", status, figures))
    cfg = ParallelConfig(storage_path=work / "parallel", name="bf16", steps=10, precision="bf16",
                         parallelism={"tp": 2}, compute={"gpu": True, "num_workers": 2})
    result = run_parallel(cfg, log_level=logging.DEBUG)
    falls = result.losses[-1] < result.losses[0]
    lines.append(Line("TP/PP on NCCL: tp2 bf16 autocast", "PASS" if falls else "FAIL",
                      f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f} in 10 steps"))
    return lines


def check_collectives(work: Path, gpus: int) -> Line:
    import pandas as pd

    proc = run_job("bench_collectives.py", "--gpu", "--num-workers", str(gpus), "--max-size", "1GiB",
                   "--primitives", "all_reduce,all_gather,reduce_scatter", "--storage-path", str(work / "coll"),
                   timeout=300)
    if proc.returncode:
        return Line("NCCL collectives", "FAIL", _failed(proc))
    table = pd.concat(pd.read_parquet(p) for p in (work / "coll").rglob("collectives.parquet"))
    big = table[table["size_bytes"] == table["size_bytes"].max()].set_index("primitive")
    busbw = ", ".join(f"{k} {v:.0f}" for k, v in big["busbw_GBps"].items())
    moved = bool((big["busbw_GBps"] > 0).all())  # a collective over one rank moves nothing: never a pass
    return Line("NCCL collectives", "PASS" if table["correct"].all() and moved else "FAIL",
                f"{gpus} rank(s), busbw at {big['size_bytes'].iloc[0] / 2**30:.0f} GiB (GB/s): {busbw}")


def check_bubble() -> Line:
    proc = run_job("bench_parallel.py", "--only", "bubble", "--gpu", "--pp", "2", "--microbatches", "2,4,8",
                   "--steps", "3")
    if proc.returncode:
        return Line("pipeline bubble (CUDA events)", "FAIL", _failed(proc))
    # columns: schedule v m step-ms idle-by-rank... idle formula diff F/B/W
    rows = [r.split() for r in proc.stdout.splitlines() if r.split()[:1] in (["gpipe"], ["1f1b"])]
    off = max(abs(float(r[-4]) - float(r[-3])) for r in rows)
    return Line("pipeline bubble (CUDA events)", "PASS" if off < 0.15 else "FAIL",
                "; ".join(f"{r[0]} m={r[2]} idle {r[-4]} vs {r[-3]}" for r in rows))


def check_digits(work: Path) -> Line:
    import pandas as pd

    proc = run_job("tune_mlp.py", "--task", "jobs/tasks/digits.py:DigitsCNN", "--num-samples", "8", "--epochs", "5",
                   "--storage-path", str(work / "digits"), "--name", "digits")
    if proc.returncode:
        return Line("digits CNN sweep on GPU", "FAIL", _failed(proc))
    best = pd.read_parquet(work / "digits" / "digits" / "results.parquet")["best_val_accuracy"].max()
    return Line("digits CNN sweep on GPU", "PASS" if best > 0.9 else "FAIL", f"best val accuracy {best:.3f}")


def check_warm_sweep(work: Path, gpus: int) -> Line:
    """Distributed trials (2 NCCL ranks, a GPU each) on warm worker groups: the group starts once per slot."""
    import pandas as pd

    proc = run_job("tune_mlp.py", "--workers-per-trial", "2", "--num-samples", "6", "--max-concurrent", "2",
                   "--epochs", "3", "--storage-path", str(work / "warm"), "--name", "warm")
    if proc.returncode:
        return Line("warm distributed-trial sweep", "FAIL", _failed(proc))
    exp = work / "warm" / "warm"
    table = pd.read_parquet(exp / "results.parquet")
    rows = [pd.read_parquet(exp / f"train-trial_id={t}" / "metrics.parquet") for t in table["trial_id"]]
    starts = sum(bool((r["group_start_s"] > 0).any()) for r in rows)
    ok = set(table["status"]) == {"finished"} and starts <= 2 and all(set(r["world_size"]) == {2} for r in rows)
    return Line("warm distributed-trial sweep", "PASS" if ok else "FAIL",
                f"{len(table)} trials, {starts} group start(s), setup per trial "
                f"{sum(r['setup_s'].iloc[0] for r in rows) / len(rows):.2f} s, best val_loss "
                f"{table['best_val_loss'].min():.4g}")


def check_array_task(gpus: float = 1) -> Line:
    """An array task asking for a GPU trains on it (`gpus` 0: on the CPU, which a CPU test runs)."""
    from rayhpc.data import DataConfig
    from rayhpc.task import task_for
    from rayhpc.task.hparams import full_hparams
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.single import task_device, train_alone

    task = task_for("mlp", DataConfig())
    result = train_alone(task, full_hparams(task.hp_model, {}), SweepConfig(epochs=2), device=task_device(gpus))
    where = next(result["model"].parameters()).device
    return Line("array task on its GPU", "PASS" if where.type == ("cuda" if gpus else "cpu") else "FAIL",
                f"trained on {where}, val_loss {result['val_loss']:.4f}")


def _timed(check: Callable[[], Line | list[Line]], name: str) -> list[Line]:
    started = time.perf_counter()
    try:
        found = check()
    except Exception as exc:  # noqa: BLE001 - one broken path must not hide the others
        traceback.print_exc()
        found = Line(name, "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200])
    found = found if isinstance(found, list) else [found]
    for line in found:
        line.seconds = (time.perf_counter() - started) / len(found)
    return found


def checks(work: Path, gpus: int) -> list[tuple[str, list[str], int, Callable[[], Line | list[Line]]]]:
    """(key for --only, the names of its lines, GPUs it needs, the check) of every GPU line."""
    many = max(gpus, 2)
    return [
        ("packed sweep", ["packed sweep, 0.5 GPU per pack"], 1, lambda: check_packed_sweep(work, gpus)),
        ("DDP/FSDP2", [*strategy_names(max(gpus, 1)).values(), FIT_LINE], 1,
         lambda: check_strategies(work, gpus)),
        ("TP/PP", [*(f"TP/PP on NCCL: {name}" for name in layouts(many)), "TP/PP on NCCL: tp2 bf16 autocast"], 2,
         lambda: check_model_parallel(work, gpus)),
        ("NCCL", ["NCCL collectives"], 2, lambda: check_collectives(work, gpus)),
        ("bubble", ["pipeline bubble (CUDA events)"], 2, check_bubble),
        ("digits", ["digits CNN sweep on GPU"], 1, lambda: check_digits(work)),
        ("warm sweep", ["warm distributed-trial sweep"], 2, lambda: check_warm_sweep(work, gpus)),
        ("array task", ["array task on its GPU"], 1, check_array_task),
    ]


def run_checks(out: Path, only: str | None = None) -> tuple[list[Line], str]:
    """Every line (`only`: those whose check name contains it) on this machine's GPUs, and where they ran."""
    gpus, machine = torch.cuda.device_count(), node_gpus()
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    found = f"{gpus} x {', '.join(names)}" if gpus else \
        f"{machine} NVIDIA GPU(s) that torch cannot use" if machine else "no GPU"
    where = f"{found}; {torch_build()}; python {sys.version.split()[0]}"
    lines = _timed(lambda: check_no_host_traffic(torch.device("cuda" if gpus else "meta")), "no host sync")
    if machine and not gpus:  # GPUs on the machine, but not for this torch: every GPU line would be a lie
        return [*lines, Line("torch can use this machine's GPUs", "FAIL",
                             cuda_unusable(f"{machine} NVIDIA GPU(s) on this machine (driver)"))], where
    work = Path(tempfile.mkdtemp(prefix="gpu_check_")) if gpus else Path(".")  # (no GPU: every line SKIPs)
    for key, line_names, needs, check in checks(work, gpus):
        if only is not None and only not in key:
            continue
        if gpus < needs:
            why = "no GPU on this machine" if not gpus else \
                f"needs {needs} GPUs (NCCL runs one rank per GPU), found {gpus}"
            lines += [Line(name, "SKIP", why) for name in line_names]
            continue
        lines += _timed(check, key)
        write(out, lines, where)  # what is done is kept if a later line hangs
    return lines, where


def write(out: Path, lines: list[Line], where: str) -> None:
    out.write_text(json.dumps({"machine": where, "lines": [asdict(line) for line in lines]}, indent=1, default=str))


def format_table(lines: list[Line], where: str) -> str:
    width = max(len(line.name) for line in lines)
    rows = [f"{line.name:<{width}}  {line.status:<4}  {line.seconds:6.1f} s  {line.figures}" for line in lines]
    return "\n".join([f"gpu_check: {where}", *rows])
