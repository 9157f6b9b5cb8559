"""Stopping a job by signal, the same for every job kind (sweep, training, model-parallel, parameter server).

Ctrl-C (SIGINT), SIGTERM (scancel, a requeue, the end of a Slurm job) and SIGUSR1 (Slurm's warning
before a time limit or preemption) end a job within seconds: its actors and placement groups are
released, its checkpoints are kept, stderr gets one line saying what stopped it and how to resume,
and the exit status is 128 + the signal's number (130, 143, 138), as a shell reports it.

How:
- SIGINT raises `KeyboardInterrupt` in the main thread: installed explicitly, since a job started in
  the background of a script (the sbatch startup runs its command so) inherits SIGINT *ignored*, and
  Python then never installs its own handler;
- SIGTERM and SIGUSR1 send the process a SIGINT, so that Ray Tune's and Ray Train's own SIGINT handlers,
  while they are installed, stop a sweep (saving its state one last time) or a training run (aborting
  its worker group) exactly as on Ctrl-C. Only the first stop signal is forwarded: a second SIGINT
  tells Tune to skip its last save;
- the first stop signal is remembered (`received`): the exit status and the line name it;
- a job that has not ended GRACE_S after it (RAYHPC_STOP_GRACE_S) is ended at once, with the same
  line: whatever blocks its clean-up (a loaded node, a cluster that stopped answering), the user gets
  the prompt back. The processes it started (a local Ray's) are killed with it, and Ray frees the
  actors and placement groups of a driver that is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Callable

from rayhpc import processes
from rayhpc.config import ConfigError

FORWARDED = (signal.SIGTERM, signal.SIGUSR1)
# seconds from the first stop signal to a forced end: below the 10 s users wait, above the 2-4 s a clean
# stop takes on a loaded 2-CPU node (a sweep's last save, a worker group's kill, the local Ray's shutdown)
GRACE_S = 7.0
GRACE_VARIABLE = "RAYHPC_STOP_GRACE_S"
_received: list[int] = []  # the first stop signal this process got
_job: list = []  # the config of the job this process runs, once known (its line names it)
_causes: list[Callable[[], str | None]] = []  # what may have sent the signal, asked when the line is made
_grace: list[threading.Timer] = []  # the clock to a forced end, once a stop signal came
_planned: list[str] = []  # why this process stopped itself (a time budget), once it did
_ray_level: list[int] = []  # the "ray" logger's level before a stop signal quieted it


def install() -> None:
    """Our handlers for SIGINT, SIGTERM and SIGUSR1 (main thread only; idempotent). Called at a job's start
    and again wherever Ray replaced them: `ray.init` makes SIGTERM `sys.exit` at once (a sweep would then
    skip its last save), and Tune's and Train's SIGINT handlers stay installed after they return."""
    if threading.current_thread() is not threading.main_thread():
        return
    grace_s()  # a bad value is an input error at the start, not at the stop
    signal.signal(signal.SIGINT, _raise_interrupt)
    for signum in FORWARDED:
        signal.signal(signum, _forward)


def received() -> int | None:
    """The first stop signal this process received, if any."""
    return _received[0] if _received else None


def grace_s() -> float:
    """Seconds a stopped job has to end before it is ended at once: GRACE_S, or RAYHPC_STOP_GRACE_S."""
    value = os.environ.get(GRACE_VARIABLE, "")
    try:
        seconds = float(value) if value.strip() else GRACE_S
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):

        raise ConfigError(f"{GRACE_VARIABLE} {value!r}: expected seconds >= 0, e.g. {GRACE_VARIABLE}=30")
    return seconds


def explain(cause: Callable[[], str | None]) -> None:
    """`cause()`, where it returns a text, says what stopped the job in its line, instead of the signal
    (the user's cluster going down sends its jobs SIGTERM)."""
    _causes.append(cause)


def running(cfg) -> None:
    """The job (a JobConfig) this process runs: the line of a stop names it and says how to resume it."""
    _job[:] = [cfg]


def _note(signum: int) -> bool:
    """Remember the first stop signal and start the clock to a forced end; True if this is it. From then
    on Ray's own messages about the stop (Tune's "Stop signal received", Train's "Gracefully aborting")
    are not shown: the job prints one line of its own."""
    if _received:
        return False
    _received.append(signum)
    _ray_level[:] = [logging.getLogger("ray").level]
    logging.getLogger("ray").setLevel(logging.CRITICAL)
    quiet_workers()
    timer = threading.Timer(grace_s(), _force_exit)
    timer.daemon = True  # a job that ends in time does not wait for it
    timer.start()
    _grace.append(timer)
    return True


def stop_after(seconds: float, why: str) -> threading.Timer:
    """Stop the job as SIGUSR1 would (a sweep saves its state; its running trials can be resumed) once
    `seconds` have passed, unless the returned timer is cancelled first: a time budget, `why` its words."""
    def stop():
        if not _received:
            _planned.append(why)
            os.kill(os.getpid(), signal.SIGUSR1)

    timer = threading.Timer(max(0.0, seconds), stop)
    timer.daemon = True
    timer.start()
    return timer


def planned() -> str | None:
    """Why the job stopped itself (`stop_after`), if the stop was its own; None for a signal from outside."""
    return _planned[0] if _planned and received() == signal.SIGUSR1 else None


def settle() -> None:
    """The job's own stop (`stop_after`) was its planned end: no forced exit, no stop line; the signals are
    ours again, for a real stop while the job finishes."""
    for timer in _grace:
        timer.cancel()
    _grace.clear()
    _received.clear()
    _planned.clear()
    if _ray_level:
        logging.getLogger("ray").setLevel(_ray_level.pop())
    install()


def quiet_workers() -> None:
    """Stop printing what the job's Ray workers write: they are being stopped with the job, and Ray's
    SIGTERM handler in a dying worker can print "Exception ignored ... Traceback" (its SystemExit raised
    inside a weakref callback), which Ray would forward to this terminal after our one line. Ray has no
    public switch for `log_to_driver` once it is connected, so the driver's private log dispatcher loses
    its printing handler; the workers' logs stay in Ray's session folder."""
    with contextlib.suppress(Exception):
        # Ray: only where a cluster is used (config checks and --help stay fast)
        from ray._private.ray_logging import global_worker_stdstream_dispatcher

        global_worker_stdstream_dispatcher.remove_handler("ray_print_logs")


def _force_exit() -> None:
    """The job did not end within the grace period of the stop signal: its line (unless `report` printed
    it and the exit itself hangs), every process it started killed (a local Ray: raylet, GCS, agents,
    workers), and exit. Ray removes the actors and placement groups of a driver that is gone."""
    _forcing.set()
    line = stop_line(forced=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if _reported.acquire(blocking=False):
        os.write(2, f"{line}\n".encode())
    processes.kill_gcs_last(processes.descendants(os.getpid()), timeout_s=2.0)
    for clean_up in _at_forced_exit:
        clean_up()
    os._exit(exit_code())


_at_forced_exit: list[Callable[[], None]] = []
_forcing = threading.Event()  # set once the forced exit began: it ends the process itself


def await_forced_exit() -> None:
    """Where the forced exit (another thread) has begun, wait for it to end the process rather than exit
    first: an exit meanwhile would cut its clean-up short (the local Ray's folder left behind)."""
    if _forcing.is_set():
        threading.Event().wait()


def at_forced_exit(clean_up: Callable[[], None]) -> None:
    """Call `clean_up` on a forced exit, after the job's processes are killed (the modules that start
    things register here: this module imports none of them)."""
    _at_forced_exit.append(clean_up)


_reported = threading.Lock()  # held once the line is printed: one line, whoever prints it


def report() -> int:
    """Print the stop's line once (the job ended in time); the exit status to end with."""
    if _reported.acquire(blocking=False):
        print(stop_line(), file=sys.stderr, flush=True)
    return exit_code()


def exit_code() -> int:
    """128 + the stop signal's number, as a shell reports a process that signal ended."""
    return 128 + (received() or signal.SIGINT)


def _raise_interrupt(signum, _frame) -> None:
    _note(signum)
    raise KeyboardInterrupt


def _forward(signum, _frame) -> None:
    if _note(signum):
        os.kill(os.getpid(), signal.SIGINT)


def noting(handler: Callable) -> Callable:
    """`handler` (a SIGINT handler Ray installed), called after the signal is remembered."""
    def note_then_handle(signum, frame):
        _note(signum)
        return handler(signum, frame)
    return note_then_handle


def watch_tune() -> None:
    """While Tune runs (called from a Tune callback's `setup`, after Tune installed its handlers): its
    SIGINT handler also remembers the signal, and SIGUSR1 goes through ours (to Tune's SIGINT handler)."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGINT)
    if callable(current) and current is not _raise_interrupt:
        signal.signal(signal.SIGINT, noting(current))
    for signum in FORWARDED:
        signal.signal(signum, _forward)


KINDS = {"sweep": "sweep", "train": "training run", "parallel": "model-parallel run", "ps": "parameter-server run"}


def stop_line(forced: bool = False) -> str:
    """The one line a stopped job prints: which signal, whether it had to be ended at once, and for a job
    with a folder (`running`) where its checkpoints are and the command that resumes it."""
    line = f"interrupted by {signal.Signals(received() or signal.SIGINT).name}"
    for cause in _causes:
        with contextlib.suppress(Exception):  # the line is printed whatever a cause's check meets
            line = cause() or line
    if forced:
        line += f" (not stopped within {grace_s():g} s: ended at once)"
    if _job:
        cfg = _job[0]
        line += (f": {KINDS.get(cfg.kind, cfg.kind)} {cfg.name} stopped; its checkpoints and results are kept in "
                 f"{cfg.experiment_dir}; resume with: {resume_command(cfg)}")
    return line


def resume_command(cfg) -> str:
    """The command that resumes the job `cfg`: this process's program, naming the job, with `--resume`
    (a resumed job reads the rest of its definition from the config saved beside its results)."""
    argv = sys.argv if sys.argv and sys.argv[0] else ["rayhpc"]
    if Path(argv[0]).name == "__main__.py":  # python -m rayhpc COMMAND
        command = ["python", "-m", "rayhpc", *argv[1:2]]
    elif argv[0].endswith(".py"):  # python jobs/train_ps.py
        command = ["python", argv[0]]
    else:  # rayhpc COMMAND
        command = [Path(argv[0]).name, *argv[1:2]]
    where = ["--address", cfg.address] if cfg.address else []
    if getattr(cfg, "study", None) is not None:  # a slice of a study: any slice started on it continues it
        return shlex.join([*command, "--study", str(cfg.study), *where])
    return shlex.join([*command, "--name", cfg.name, "--storage-path", str(cfg.experiment_dir.parent), *where,
                       "--resume"])
