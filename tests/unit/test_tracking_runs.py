"""The tracker's thread (`rayhpc.tracking.runs.Tracker`): what the caller queues while a write is slow becomes
one batch per run, in order, each run's steps before its end; a backend that fails costs the others nothing.
And the `tracking:` section's bad input: one `error:` line, exit 2, before anything starts."""

import subprocess
import sys
import threading

from helpers import ROOT, job_env, run_job_warm
from rayhpc.tracking.runs import RunInfo, Tracker


class Recorder:
    """A backend that keeps every call; `gate` holds its first open() until set."""

    def __init__(self, gate: threading.Event | None = None, fail_logs: bool = False):
        self.calls, self.gate, self.fail_logs = [], gate, fail_logs

    def open(self, run):
        if self.gate is not None:
            self.gate.wait(30)
        self.calls.append(("open", run.key))

    def log(self, key, steps):
        if self.fail_logs:
            raise ConnectionError("server unreachable")
        self.calls.append(("log", key, [s for s, _ in steps], [v["loss"] for _, v in steps]))

    def close(self, key, status, artifact):
        self.calls.append(("close", key, status))


def test_what_is_queued_during_a_slow_write_is_one_batch_per_run_in_order():
    gate = threading.Event()
    backend = Recorder(gate)
    tracker = Tracker([lambda: backend])
    tracker.open(RunInfo("a", "a", {}))
    tracker.open(RunInfo("b", "b", {}))
    for step in range(1, 51):  # queued while the thread is held in the first open()
        tracker.log("a", step, {"loss": float(step), "note": "text is not a metric"})
        tracker.log("b", step, {"loss": -float(step), "nan": float("nan")})
    tracker.close("a", "early-stopped")
    gate.set()
    tracker.shutdown()
    steps = list(range(1, 51))
    assert backend.calls == [("open", "a"), ("open", "b"), ("log", "a", steps, [float(s) for s in steps]),
                             ("log", "b", steps, [-float(s) for s in steps]), ("close", "a", "early-stopped")]


def test_a_failing_backend_costs_the_others_nothing():
    broken, working = Recorder(fail_logs=True), Recorder()
    tracker = Tracker([lambda: broken, lambda: 1 / 0, lambda: working])  # the second cannot even start
    tracker.open(RunInfo("a", "a", {}))
    tracker.log("a", 1, {"loss": 0.5})
    tracker.close("a", "finished")
    assert tracker.flush(30)
    tracker.shutdown()
    assert working.calls == [("open", "a"), ("log", "a", [1], [0.5]), ("close", "a", "finished")]
    assert broken.calls == [("open", "a"), ("close", "a", "finished")] and tracker.failures == 2


def test_bad_tracking_input_is_one_error_line():
    proc = run_job_warm("tune_mlp.py", "--log-checkpoint", "sometimes")
    assert proc.returncode == 2 and proc.stderr.startswith("error: tracking.log_checkpoint (--log-checkpoint)")
    assert "'none', 'last' or 'best'" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = run_job_warm("train_mlp.py", "--keep-best", "1", "--checkpoint-every", "5")
    assert proc.returncode == 2 and "checkpoint.keep_best (--keep-best) 1 and checkpoint.every" in proc.stderr
    proc = run_job_warm("tune_mlp.py", "--wandb", "a/b")
    assert proc.returncode == 2 and proc.stderr.startswith("error: tracking.wandb (--wandb)")


def test_a_tracking_flag_without_its_package_says_how_to_install_it():
    code = ("import sys; sys.modules['mlflow'] = None; sys.argv = ['tune_mlp.py', '--mlflow', 'file']; "
            f"import runpy; runpy.run_path({str(ROOT / 'jobs' / 'tune_mlp.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=job_env(None), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("error: tracking.mlflow (--mlflow): needs mlflow, which is not installed: "
                                   "pip install 'rayhpc[mlflow]'")


def test_export_loads_nothing_from_a_sweep_folder_others_can_write(tmp_path):
    """`rayhpc export` reads the sweep's definition, which names a task file to import: from a folder another user
    could have written, it refuses with one line and imports nothing."""
    sweep, marker = tmp_path / "sweep", tmp_path / "imported"
    sweep.mkdir()
    planted = tmp_path / "planted.py"
    planted.write_text(f"open({str(marker)!r}, 'w').close()\nclass Task: pass\n")
    (sweep / "sweep.yaml").write_text(f"name: sweep\ntask: {planted}:Task\n")
    sweep.chmod(0o777)
    proc = subprocess.run([sys.executable, "-m", "rayhpc", "export", str(sweep), str(tmp_path / "out")],
                          capture_output=True, text=True, env=job_env(None), timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: SWEEP_DIR:"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not marker.exists()



def test_every_status_of_a_trials_row_has_an_mlflow_status():
    """The statuses a sweep's rows have (`rayhpc.tune.results.trial_rows`), each closed in MLflow with its own."""
    from rayhpc.tracking.runs import MLFLOW_STATUS

    assert set(MLFLOW_STATUS) == {"finished", "error", "early-stopped", "interrupted", "diverged"}
    assert MLFLOW_STATUS["diverged"] == MLFLOW_STATUS["error"] == "FAILED"
