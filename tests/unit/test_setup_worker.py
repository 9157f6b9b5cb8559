"""`rayhpc.up.setup_worker`, the worker set-up step of the Ray the platform starts, does what Ray's own
`setup_worker.py` does: the same command exec'd, in the same environment, for every runtime environment a
job may give; a context it does not know goes to Ray's script itself."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path
from unittest import mock

import pytest
import ray

from rayhpc.up import setup_worker

RAY_SCRIPT = Path(ray.__file__).parent / "_private" / "workers" / "setup_worker.py"
WORKER = ["/venv/ray/_private/workers/default_worker.py", "--node-ip-address=192.0.2.2",
          "--object-store-name=/tmp/a folder/plasma", "--raylet-name=/tmp/it's/raylet", "--startup-token=7"]
CONTEXTS = {
    "no runtime environment": {},
    "env_vars and a py_executable": {
        "env_vars": {"A_X": "x${HOME}y", "B_X": "${RAYHPC_NOT_SET_X}z", "C_X": "${A_X}-$HOME-c"},
        "py_executable": "env RAYHPC_HOME=/tmp/x /venv/bin/python -m rayhpc.up.worker"},
    "a command prefix and another entry point": {
        "command_prefix": ["source", "/venv/bin/activate", "&&"], "env_vars": {},
        "override_worker_entrypoint": "/image/default_worker.py", "py_executable": None, "java_jars": []},
}


def execed(run, argv: list[str], env: dict) -> tuple:
    """(what `run` exec'd, the environment then) with `argv` as the script's arguments, in `env`."""
    calls = []
    with mock.patch.dict(os.environ, env, clear=True), mock.patch.object(sys, "argv", ["setup_worker.py", *argv]), \
            mock.patch.object(os, "execvp", lambda file, args: calls.append(("execvp", file, args))), \
            mock.patch.object(os, "execv", lambda path, args: calls.append(("execv", path, args))):
        run()
        return calls, dict(os.environ)


def ray_own() -> None:
    runpy.run_path(str(RAY_SCRIPT), run_name="__main__")


@pytest.mark.parametrize("macos_path", [None, "/opt/lib"])
@pytest.mark.parametrize("context", CONTEXTS)
def test_the_worker_is_execed_as_rays_own_set_up_step_execs_it(context, macos_path):
    argv = [*WORKER, f"--serialized-runtime-env-context={json.dumps(CONTEXTS[context])}", "--language=PYTHON"]
    env = {"HOME": "/home/u", "PATH": "/usr/bin:/bin", **({"DYLD_LIBRARY_PATH": macos_path} if macos_path else {})}
    ours = execed(setup_worker.main, argv, env)
    assert ours == execed(ray_own, argv, env)
    assert [call[:2] for call in ours[0]] == [("execvp", "bash")], ours  # the worker's command, not Ray's script


@pytest.mark.parametrize("context, language", [({"a_key_of_a_newer_ray": 1}, "PYTHON"),
                                               ({"java_jars": ["/x.jar"]}, "JAVA"), ({}, "CPP")])
def test_a_context_it_does_not_know_goes_to_rays_own_script(context, language):
    argv = [*WORKER, f"--serialized-runtime-env-context={json.dumps(context)}", f"--language={language}"]
    calls, _ = execed(setup_worker.main, argv, {"PATH": "/usr/bin"})
    assert calls == [("execv", sys.executable, [sys.executable, str(RAY_SCRIPT), *argv])]
    assert RAY_SCRIPT.is_file()
