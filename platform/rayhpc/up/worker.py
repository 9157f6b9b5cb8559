"""A Ray worker process of a job on the user's cluster (`rayhpc up`), as Ray starts it:

    python -P -m rayhpc.up.worker .../ray/_private/workers/default_worker.py --flags...

Jobs that join the cluster name this as their workers' Python (Ray's `py_executable`, `runtime_env`). It
hands the worker over to the cluster's warm starter of workers (`rayhpc.up.starter --workers`), which has
imported torch once (and, once per job, Ray: the starter of the job's workers it forks): a child runs Ray's
worker script with this process's files, folder, environment and
arguments, seconds sooner, and this process waits for it, passing on every stop signal (`rayhpc.up.warm`).
Where there is no such starter (or one of other code), it becomes the worker itself. Standard library only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rayhpc.up import connection, warm

# where installed: what a task's Hugging Face model imports before its own model's module, 1.1 s of each worker
# (1.9 s of CPU), which a starter of workers loads too; the starter of a command's own Ray loads them only where
# the command has (`rayhpc.up.starter --extras`)
WORKER_EXTRAS = ("transformers", "transformers.modeling_utils")


def command() -> str:
    """Ray's `py_executable` for a job's workers: this module, run by this Python (`-P`: nothing imported from
    the worker's working folder, which `-m` would put first on the path)."""
    import shlex

    return f"{shlex.quote(sys.executable)} -P -m rayhpc.up.worker"


def main() -> None:
    script = sys.argv[1:]
    starter = connection.workers_socket_path()
    warm.waiting_for(starter)
    # as `python script` would have it: the script's folder (Ray's own) first on the path, unless the environment
    # sets PYTHONSAFEPATH (as the platform's Rays do), which leaves it off
    first = [] if os.environ.get("PYTHONSAFEPATH") else [str(Path(script[0]).resolve().parent)]
    status = warm.hand_over(starter, {"sys_argv": script}, [*first, *sys.path])
    if status is None:
        os.execv(sys.executable, [sys.executable, *script])
    sys.exit(status)


if __name__ == "__main__":
    main()
