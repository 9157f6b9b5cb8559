"""Five models users bring (`jobs/bench/brought.py`) through five jobs, each as a user runs it, and how each
ended: it works, it is refused before Ray starts (exit 2, one `error:` line: the fix it names), or it fails after
Ray started (a rank's error). A markdown table on stdout (docs/tasks.md, "Models users bring").

    python jobs/bench/model_jobs.py [--models Gpt2,Qwen2] [--jobs ddp,pp]

Each cell is a fresh local Ray and a few steps, so the table takes about a minute a cell on 2 CPUs. Run the
timm and litgpt models with a Python that has them (see the tasks' module).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

JOBS_DIR = Path(__file__).resolve().parents[1]
TASKS = Path(__file__).with_name("brought.py")
MODELS = ("Gpt2", "Qwen2", "VitTiny", "ResNet18", "LitGpt", "VitTinyPlanned", "ResNet18Planned", "LitGptPlanned")
STEPS = ("--steps", "4")
JOBS = {  # a sweep, data-parallel training (DDP, FSDP2) and the model-parallel job (TP, PP), as few steps as show it
    "sweep": ("tune_mlp.py", "--num-samples", "2", "--global-batch-size", "8", *STEPS),
    "ddp": ("train_mlp.py", "--num-workers", "2", "--batch-size-per-worker", "4", *STEPS),
    "fsdp": ("train_mlp.py", "--num-workers", "2", "--batch-size-per-worker", "4", "--strategy", "fsdp", *STEPS),
    "tp": ("train_parallel.py", "--tp", "2", "--global-batch-size", "8", *STEPS),
    "pp": ("train_parallel.py", "--pp", "2", "--global-batch-size", "8", *STEPS),
}


def run_cell(model: str, job: str, storage: Path, timeout_s: float) -> tuple[str, float]:
    """How `job` on `model` ended, in a few words and its error line; and its wall seconds."""
    script, *args = JOBS[job]
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(JOBS_DIR / script), "--task", f"{TASKS}:{model}", *args,
                               "--name", f"{model}-{job}", "--storage-path", str(storage)],
                              capture_output=True, text=True, timeout=timeout_s, cwd=JOBS_DIR.parent)
    except subprocess.TimeoutExpired:
        return f"did not end within {timeout_s:g} s", time.perf_counter() - started
    seconds = time.perf_counter() - started
    if proc.returncode == 0:
        return "works", seconds
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    said = errors[-1] if errors else (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    ray_started = "started local Ray" in proc.stdout + proc.stderr
    how = "refused before Ray" if proc.returncode == 2 and not ray_started else f"fails after Ray started (exit {proc.returncode})"
    return f"{how}: {said}", seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="of " + ", ".join(MODELS))
    parser.add_argument("--jobs", default=",".join(JOBS), help="of " + ", ".join(JOBS))
    parser.add_argument("--timeout-s", type=float, default=600, help="a cell that runs longer is ended")
    parser.add_argument("--storage-path", type=Path, default=Path("rayhpc_results") / "model_jobs")
    args = parser.parse_args(argv)
    jobs = args.jobs.split(",")
    print(f"| model | {' | '.join(jobs)} |\n| --- |{' --- |' * len(jobs)}")
    for model in args.models.split(","):
        cells = [run_cell(model, job, args.storage_path, args.timeout_s) for job in jobs]
        print(f"| {model} | " + " | ".join(f"{how} ({seconds:.0f} s)" for how, seconds in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
