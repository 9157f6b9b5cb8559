"""Runs in MLflow and W&B, written by one writer per job (`Tracker`): a thread, or for a sweep's driver a
process of its own.

The caller (a sweep's driver, a training job's rank 0) only queues what happened: a run opened, a step's
values, a run ended. The writer takes everything queued at once and writes each run's steps as one batch
(MLflow's `log_batch`), so tracking costs the training path a queue put, and a slow or unreachable server
costs it nothing. A write that fails is logged and dropped: tracking never stops a job.

A run is known by a key unique within its job (the trial id, or the job's name): a resumed job finds the
run it started before (MLflow: by the `rayhpc.key` tag; W&B: by the run id made from the key) and goes on.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import pickle
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

# a run's end, in the results table's words
FINISHED, EARLY_STOPPED, ERROR, INTERRUPTED = "finished", "early-stopped", "error", "interrupted"
DIVERGED = "diverged"  # a sweep's trial whose loss or val_loss was not finite (`rayhpc.tune.trainable`)
MLFLOW_STATUS = {FINISHED: "FINISHED", EARLY_STOPPED: "KILLED", ERROR: "FAILED", INTERRUPTED: "KILLED",
                 DIVERGED: "FAILED"}
KEY_TAG = "rayhpc.key"


@dataclass(frozen=True)
class RunInfo:
    key: str  # unique within the job: the trial id, or the job's name
    name: str
    params: dict  # the trial's full hyperparameters
    tags: dict = field(default_factory=dict)  # node, Slurm job, git commit, job kind


class MlflowRuns:
    """One MLflow experiment (the sweep or job's name); a run per key."""

    def __init__(self, uri: str, experiment: str):
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance mode and refuses it unless told: it needs no
            # server and no database, which is what a compute node without a network has
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient  # optional: rayhpc[mlflow]

        self.client = MlflowClient(uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            try:
                self.experiment = self.client.create_experiment(experiment)
            except Exception:  # noqa: BLE001 - another array task or slice made it first: use theirs
                found = self.client.get_experiment_by_name(experiment)
                if found is None:
                    raise
        if found is not None:
            self.experiment = found.experiment_id
        self.ids: dict[str, str] = {}
        self.params: dict[str, list] = {}  # key -> its parameters, not written yet
        # the runs a resumed job started before, by key: one search now, not one per run (a file store's
        # search reads every run of the experiment)
        self.before = {} if found is None else self._existing()

    def _existing(self) -> dict[str, str]:
        runs, token = {}, None
        while True:
            page = self.client.search_runs([self.experiment], max_results=1000, page_token=token)
            runs.update({r.data.tags[KEY_TAG]: r.info.run_id for r in page if KEY_TAG in r.data.tags})
            token = page.token
            if not token:
                return runs

    def open(self, run: RunInfo) -> None:
        from mlflow.entities import Param

        run_id = self.before.get(run.key)
        if run_id is not None:  # a resumed job: its run goes on
            self.client.update_run(run_id, "RUNNING")
        else:
            run_id = self.client.create_run(self.experiment, run_name=run.name,
                                            tags={**run.tags, KEY_TAG: run.key}).info.run_id
            # written with the first steps, in one batch (each write to a file store costs milliseconds)
            self.params[run.key] = [Param(k, str(v)[:6000]) for k, v in run.params.items()]
        self.ids[run.key] = run_id

    def log(self, key: str, steps: list[tuple[int, dict]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for step, values in steps for k, v in values.items()]
        params = self.params.pop(key, [])
        while metrics or params:  # MLflow's limits per batch: 1000 values, 100 of them params
            self.client.log_batch(self.ids[key], metrics=metrics[:1000 - len(params[:100])], params=params[:100])
            metrics, params = metrics[1000 - len(params[:100]):], params[100:]

    def close(self, key: str, status: str, artifact: Path | None) -> None:
        if self.params.get(key):  # a run that logged no step
            self.log(key, [])
        run_id = self.ids.pop(key)
        if artifact is not None:
            self.client.log_artifacts(run_id, str(artifact), "checkpoint")
        self.client.set_tag(run_id, "rayhpc.status", status)
        self.client.set_terminated(run_id, MLFLOW_STATUS[status])


class WandbRuns:
    """W&B runs of one project, grouped by the sweep or job's name; offline by default, under `folder`."""

    def __init__(self, project: str, group: str, folder: Path, mode: str):
        import wandb  # optional: rayhpc[wandb]

        self.wandb, self.project, self.group, self.folder, self.mode = wandb, project, group, folder, mode
        self.runs: dict[str, object] = {}

    def run_id(self, key: str) -> str:
        """W&B's id of a key's run: stable, so that a resumed job continues it (at most 64 of [A-Za-z0-9_-])."""
        text = re.sub(r"[^A-Za-z0-9_-]", "_", f"{self.group}-{key}")
        return text if len(text) <= 64 else f"{text[:47]}-{hashlib.sha1(text.encode()).hexdigest()[:16]}"

    def open(self, run: RunInfo) -> None:
        # nothing W&B would gather per run by itself: the node's packages (a pip listing per run made a run cost
        # 170 ms, 17 ms without), git state, code, machine stats; the platform records node and commit itself
        settings = self.wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_meta=True,
                                       x_save_requirements=False, disable_git=True, disable_code=True,
                                       save_code=False, x_disable_machine_info=True, disable_job_creation=True)
        self.runs[run.key] = self.wandb.init(
            project=self.project, group=self.group, name=run.name, id=self.run_id(run.key), resume="allow",
            config={**run.params, "rayhpc": {**run.tags, "key": run.key}}, dir=str(self.folder), mode=self.mode,
            reinit="create_new", settings=settings)

    def log(self, key: str, steps: list[tuple[int, dict]]) -> None:
        run = self.runs[key]
        for step, values in steps:
            run.log(values, step=step)

    def close(self, key: str, status: str, artifact: Path | None) -> None:
        run = self.runs.pop(key)
        if artifact is not None:
            run.log_artifact(str(artifact), name=f"checkpoint-{self.run_id(key)}", type="model")
        run.summary["status"] = status
        run.finish(exit_code=1 if status == ERROR else 0)


class Writer:
    """Writes run events to every backend, batched: everything queued while it wrote comes as one batch, each
    run's steps as one write. `items`: a queue of events; `ack(token)`: answers a flush."""

    def __init__(self, makers: list, items, ack):
        self.makers, self.items, self.ack, self.failures = makers, items, ack, 0

    def run(self) -> None:
        backends = [b for b in (self._call("start", make) for make in self.makers) if b is not None]
        while True:
            batch = _drain(self.items)
            pending: dict[str, list] = {}  # key -> its steps, in order
            for item in batch:
                if item is None:
                    self._write(backends, pending)
                    return
                if item[0] == "log":
                    pending.setdefault(item[1], []).append((item[2], _numbers(item[3])))
                    continue
                self._write(backends, pending)  # a run's steps before its end; everything before a flush
                self._event(backends, item)
            self._write(backends, pending)

    def _event(self, backends, item) -> None:
        kind = item[0]
        if kind == "open":
            for b in backends:
                self._call(f"open {item[1].key}", b.open, item[1])
        elif kind == "close":
            artifact = self._call("checkpoint", item[3]) if item[3] is not None else None
            for b in backends:
                self._call(f"close {item[1]}", b.close, item[1], item[2], artifact)
            if artifact is not None:  # a temporary folder, uploaded
                shutil.rmtree(artifact, ignore_errors=True)
        elif kind == "flush":
            self.ack(item[1])

    def _write(self, backends, pending: dict) -> None:
        for key, steps in pending.items():
            for b in backends:
                self._call(f"log {key}", b.log, key, steps)
        pending.clear()

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - tracking never stops a job: the failure is logged
            self.failures += 1
            if self.failures <= 5:
                log.warning(f"tracking: {what} failed: {type(exc).__name__}: {exc}")
            return None


class Tracker:
    """Queues run events for a `Writer`: on a thread of this process, or (`process=True`) in a process of its own
    (`python -m rayhpc.tracking.writer`), so that the writes take none of this process's time or its GIL: a
    sweep's driver, whose event loop schedules every trial, only pickles what it queues, on a feeder thread."""

    def __init__(self, makers: list, process: bool = False):
        """`makers`: functions that make the backends, called by the writer (importing MLflow takes a second);
        with `process`, picklable (a class and its arguments, `functools.partial`)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: dict[int, threading.Event] = {}
        self._writer = Writer(makers, self._queue, lambda event: event.set()) if not process else None
        target = self._writer.run if self._writer is not None else self._feed
        self._proc = _start_writer(makers) if process else None
        self._thread = threading.Thread(target=target, name="rayhpc-tracking", daemon=True)
        self._thread.start()
        if self._proc is not None:
            threading.Thread(target=self._acks, name="rayhpc-tracking-acks", daemon=True).start()

    @property
    def failures(self) -> int:
        """Writes that failed (a writer thread's; a writer process logs its own)."""
        return self._writer.failures if self._writer is not None else 0

    def open(self, run: RunInfo) -> None:
        self._queue.put(("open", run))

    def log(self, key: str, step: int, values: dict) -> None:
        self._queue.put(("log", key, step, values))

    def close(self, key: str, status: str, artifact=None) -> None:
        """`artifact`: None, or a function (picklable) returning a folder to upload, called by the writer."""
        self._queue.put(("close", key, status, artifact))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written; False if `timeout` seconds passed first."""
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout)

    def shutdown(self, timeout: float = 120.0) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()

    def _feed(self) -> None:
        """The feeder thread: batches of events, pickled down the writer process's stdin (a flush's event
        stays here, the writer gets its number)."""
        alive = True
        while True:
            batch = _drain(self._queue)
            for i, item in enumerate(batch):
                if item is not None and item[0] == "flush":
                    self._waiting[id(item[1])] = item[1]
                    batch[i] = ("flush", id(item[1]))
            try:
                if alive:
                    pickle.dump(batch, self._proc.stdin)
                    self._proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                alive = False
                log.warning(f"tracking: the writer process ended ({exc}); nothing more is tracked")
            if not alive:  # nobody will answer: nothing waits
                for event in self._waiting.values():
                    event.set()
            if batch[-1] is None:
                if alive:
                    self._proc.stdin.close()
                return

    def _acks(self) -> None:
        """Flushes the writer process has answered (its stdout), until it ends."""
        while True:
            try:
                token = pickle.load(self._proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                for event in self._waiting.values():
                    event.set()
                return
            event = self._waiting.pop(token, None)
            if event is not None:
                event.set()


def _drain(items) -> list:
    """The next event (waiting for it) and everything queued meanwhile: one batch."""
    batch = [items.get()]
    while True:
        try:
            batch.append(items.get_nowait())
        except queue.Empty:
            return batch


def _start_writer(makers: list) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-P", "-m", "rayhpc.tracking.writer"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    pickle.dump(makers, proc.stdin)
    proc.stdin.flush()
    return proc


def _numbers(values: dict) -> dict[str, float]:
    """The finite numbers among reported values (MLflow and W&B plot those)."""
    out = {}
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[k] = float(v)
    return out


def system_tags(task_spec: str, kind: str) -> dict:
    """What a run records about where it ran: the node, the Slurm job, the task file's git commit."""
    tags = {"rayhpc.kind": kind, "rayhpc.node": os.uname().nodename, "rayhpc.task": task_spec}
    if job := os.environ.get("SLURM_JOB_ID"):
        tags["rayhpc.slurm_job_id"] = job
    if (commit := git_commit(task_spec)) is not None:
        tags["rayhpc.git_commit"] = commit
    return tags


def git_commit(task_spec: str) -> str | None:
    """The commit of the git repository holding a file task (`/path/file.py:NAME`), if it is in one."""
    path = task_spec.rpartition(":")[0]
    if not path.endswith(".py"):
        return None
    try:
        out = subprocess.run(["git", "-C", str(Path(path).parent), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def start_tracker(tracking, name: str, storage_path: Path, job_dir: Path, process: bool = False) -> Tracker | None:
    """The job's tracker (None without a `tracking:` backend): MLflow's experiment and W&B's group are `name`;
    W&B's offline runs go under `job_dir`, MLflow's default file store (`--mlflow file`) under `storage_path`;
    `process`: its writer in a process of its own (`Tracker`)."""
    if not tracking.enabled:
        return None
    makers = []
    if tracking.mlflow is not None:
        makers.append(functools.partial(MlflowRuns, mlflow_uri(tracking.mlflow, storage_path), name))
    if tracking.wandb is not None:
        makers.append(functools.partial(WandbRuns, tracking.wandb, name, job_dir, tracking.wandb_mode))
    return Tracker(makers, process)


def tracking_home(cfg) -> tuple[str, Path, Path]:
    """(MLflow experiment and W&B group, where `--mlflow file` keeps its store, where W&B's offline runs go) of a
    job: its name, storage path and folder; a study's slices (`rayhpc.study`) share the study's."""
    study = getattr(cfg, "study", None)
    if study is not None:
        return Path(study).name, Path(study), Path(study)
    return cfg.name, cfg.storage_path, cfg.experiment_dir


class JobRun:
    """One tracked run around a block of plain training (a training job's rank 0, an array trial, a model-parallel
    or parameter-server job's driver): `log(step, values)` queues a step; leaving the block ends the run,
    finished, or error where the block raised (`status` may be set to another end before)."""

    def __init__(self, tracker: Tracker | None, key: str, params: dict, tags: dict, name: str | None = None,
                 owns: bool = False):
        """`owns`: the tracker is this run's alone; it is shut down (its writes waited for) when the run ends."""
        self.tracker, self.key, self.status, self.owns = tracker, key, FINISHED, owns
        self.artifact = None  # a function returning a folder to upload as the run ends (the writer removes it)
        if tracker is not None:
            tracker.open(RunInfo(key, name or key, params, tags))

    def log(self, step: int, values: dict) -> None:
        if self.tracker is not None:
            self.tracker.log(self.key, step, values)

    def __enter__(self) -> "JobRun":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if self.tracker is not None:
            self.tracker.close(self.key, ERROR if kind is not None else self.status, self.artifact)
            if self.owns:
                self.tracker.shutdown()


def job_run(cfg, params: dict, kind: str, key: str | None = None) -> JobRun:
    """The tracked run of a whole job, or of one trial `key` of it (`cfg.tracking`; nothing is tracked without a
    backend); it waits for its writes when it ends."""
    name, storage, folder = tracking_home(cfg)
    tracker = start_tracker(cfg.tracking, name, storage, folder)
    tags = {**system_tags(cfg.task, kind), **({"rayhpc.trial": key} if key else {})} if tracker else {}
    return JobRun(tracker, key or cfg.name, params, tags, f"{name}/{key}" if key else name, owns=True)


def mlflow_uri(given: str, storage_path: Path) -> str:
    """`file`: a file store in `storage_path`/mlruns, made only this user's (0700); anything else as given."""
    if given != "file":
        return given
    from rayhpc.private import private_dir

    return (private_dir(storage_path.resolve() / "mlruns")).as_uri()
