"""Job scripts run as a user runs them (`python jobs/X.py ARGS`), each in a new process, but forked from one
that has imported the platform, torch and Ray already: a job that ends at its input checks then takes
tens of milliseconds instead of the 3-4 s of a fresh interpreter's imports (about 60 such cases in the
suite). The forked child is a process of its own, with its own argv, environment, working directory,
stdout and stderr, and exit status; nothing of one case reaches the next. Only for jobs that end before
they start Ray: the server runs one child at a time.

    python tests/warm_jobs.py      # the server: one JSON request per line on stdin, answers on stdout
"""

from __future__ import annotations

import json
import os
import runpy
import select
import subprocess
import sys
import traceback
from pathlib import Path

# what every job script imports, loaded once in the server (none of these starts a thread: fork is safe)
WARM = ("rayhpc.cli", "rayhpc.tune.sweep", "rayhpc.train.trainer", "rayhpc.parallel.trainer", "rayhpc.ps.driver",
        "rayhpc.collectives.bench", "rayhpc.scaling.study")


def serve() -> None:
    import importlib
    import threading

    for name in WARM:
        importlib.import_module(name)
    assert threading.active_count() == 1, f"threads after the imports: {threading.enumerate()}"
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the server's own stray prints must not reach the answers
    for line in sys.stdin:
        request = json.loads(line)
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here may end up in a child's files
            stream.flush()
        pid = os.fork()
        if pid == 0:
            run_child(request)
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=answers, flush=True)


def run_child(request: dict) -> None:
    """In the forked child: become `python SCRIPT ARGS` with the request's environment, folder and files."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's requests are not the job's input
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        sys.argv = [request["script"], *request["args"]]
        try:
            runpy.run_path(request["script"], run_name="__main__")
            code = 0
        except SystemExit as exc:  # as the interpreter turns it into a status
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (the child's own uncaught error, printed as Python would)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


class WarmJobs:
    """The client: starts the server (in the pytest process's environment) and runs requests on it."""

    def __init__(self, root: Path):
        self.server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, cwd=root)
        self.pending = b""  # answer bytes read but not yet taken

    def run(self, script: Path, args: list[str], env: dict, cwd: Path, out: Path,
            timeout: float) -> subprocess.CompletedProcess:
        out.mkdir(parents=True, exist_ok=True)
        stdout, stderr = out / "stdout", out / "stderr"
        request = {"script": str(script), "args": list(args), "env": env, "cwd": str(cwd), "stdout": str(stdout),
                   "stderr": str(stderr)}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        child = self._answer(60)["pid"]
        try:
            returncode = self._answer(timeout)["returncode"]
        except TimeoutError:
            os.kill(child, 9)
            self._answer(60)
            raise subprocess.TimeoutExpired([str(script), *args], timeout) from None
        return subprocess.CompletedProcess([str(script), *args], returncode, stdout.read_text(), stderr.read_text())

    def _answer(self, timeout: float) -> dict:
        """The server's next answer line (read from the pipe itself: a buffered reader could hold the
        next line where `select` does not see it)."""
        fd = self.server.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the warm job server ended ({self.server.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=30)


if __name__ == "__main__":
    serve()
