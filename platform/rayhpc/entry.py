"""Running a command (`run_main`): what every job command, `jobs/*.py` and each `python -m` entry point of
the platform goes through, whatever it runs. Bad input never produces a traceback: `ConfigError`s and
argparse errors are one `error: ...` line on stderr and exit status 2; a rank that fails in the task's
code one line and 1 (`JobFailed`); a stop signal is one line and 128 + its number. Nothing here imports a
command's modules: the commands (`rayhpc.cli`) and the modules run with `python -m` sit above it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import Callable, NoReturn, Sequence

from rayhpc import cluster, interrupt
from rayhpc import log as rayhpc_log
from rayhpc.config import ConfigError, JobFailed
from rayhpc.private import UnsafePath, private_tmpdir

USAGE_ERROR = 2


def run_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None, *,
             quick_exit: bool = True) -> NoReturn:
    """Run `main`, turning user-input errors into `error: ...` and exit status 2, and a stop signal
    (Ctrl-C, SIGTERM, Slurm's SIGUSR1 warning: `rayhpc.interrupt`) into one line and 128 + its number;
    checkpoints already written are kept, and a resumed run continues from them. `quick_exit`: the
    process ends once its exit handlers ran (`_quick_exit`); False where the caller goes on after it."""
    if quick_exit:
        atexit.register(_quick_exit)
    rayhpc_log.show()  # the platform's progress lines, as plain lines on stdout
    # what the job writes (results, checkpoints, logs, a local Ray's files: its processes inherit this) is
    # the user's alone, 0600 files in 0700 folders, on nodes and filesystems other users share
    os.umask(0o077)
    try:
        private_tmpdir()  # before torch is imported: its compile caches live in TMPDIR
    except UnsafePath as exc:
        print(f"error: {exc}", file=sys.stderr)
        _exit_status[:] = [USAGE_ERROR]
        sys.exit(USAGE_ERROR)
    try:
        try:
            interrupt.install()
            cluster.use_token_if_present()
            code = main(argv)
        except (ConfigError, UnsafePath) as exc:  # UnsafePath: a folder or file another user may control
            print(f"error: {exc}", file=sys.stderr)
            code = USAGE_ERROR
        except JobFailed as exc:  # a rank failed in the task's code: its tracebacks are in the file it names
            print(f"error: {exc}", file=sys.stderr)
            code = 1
        except KeyboardInterrupt:
            code = interrupt.report()
    except SystemExit as exc:  # argparse's errors and --help; a status as the interpreter makes it
        _exit_status[:] = [exc.code if isinstance(exc.code, int) else int(exc.code is not None)]
        raise
    except BaseException:  # an uncaught error: its traceback, status 1
        _exit_status[:] = [1]
        raise
    _exit_status[:] = [code or 0]
    sys.exit(code or 0)


def _quick_exit() -> None:
    """The last exit handler (registered before Ray and torch are imported, so it runs after theirs, which
    stop Ray and remove its folders): end the process with the status it is exiting with, without the
    interpreter's own teardown. Freeing torch's and Ray's modules one by one takes 0.7-1 s of every
    command's wall and does nothing a job needs: its files are closed and its Ray stopped by then."""
    interrupt.await_forced_exit()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(_exit_status[0] if _exit_status else 0)


_exit_status: list[int] = []  # the status this process exits with, once known
