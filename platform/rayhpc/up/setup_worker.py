"""Ray's worker set-up step, without Ray's imports: what the raylet of a Ray the platform starts runs for each
worker process, as the path Ray names `setup_worker_path` (`rayhpc.cluster.start_local`):

    python .../setup_worker.py default_worker.py --flags... --serialized-runtime-env-context=... --language=PYTHON

Ray's own `setup_worker.py` imports Ray (0.5 s of CPU in each worker process, before the worker imports it
again) only to read that context and replace itself with the worker's command. This does the same with the
standard library: the context's environment variables set as Ray sets them (`${NAME}` expanded, unknown ones
empty), then `exec` of the command Ray's `RuntimeEnvContext.exec_worker` makes, through bash as Ray does. A
context it does not know (keys of a newer Ray, Java jars, another language) goes to Ray's own script.
"""

import sys

if __name__ == "__main__":  # run as a script: its folder, first on the path, would shadow modules of its names
    del sys.path[0]

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402

KNOWN = {"command_prefix", "env_vars", "py_executable", "override_worker_entrypoint", "java_jars"}


def worker_command(argv: list[str]) -> list[str] | None:
    """Bash's arguments for the worker of `argv` (this script's arguments), the job's environment variables set
    in this process's environment as Ray sets them; None where Ray's own script must set it up."""
    parser = argparse.ArgumentParser()  # Ray's script's two options, parsed as it parses them
    parser.add_argument("--serialized-runtime-env-context", type=str)
    parser.add_argument("--language", type=str)
    args, rest = parser.parse_known_args(argv)
    context = json.loads(args.serialized_runtime_env_context or "{}")
    if args.language != "PYTHON" or not set(context) <= KNOWN or context.get("java_jars"):
        return None
    for key, value in (context.get("env_vars") or {}).items():  # one by one: a value may name an earlier one
        os.environ[key] = re.sub(r"\$\{[A-Z0-9_]+\}", "", os.path.expandvars(value))  # as Ray's `update_envs`
    if context.get("override_worker_entrypoint"):
        rest[0] = context["override_worker_entrypoint"]
    command = [*(context.get("command_prefix") or []), "exec", context.get("py_executable") or sys.executable,
               *map(shlex.quote, rest)]
    if "DYLD_LIBRARY_PATH" in os.environ:  # as Ray does (for macOS)
        command.insert(0, f"DYLD_LIBRARY_PATH={os.environ['DYLD_LIBRARY_PATH']}")
    return ["bash", "-c", " ".join(command)]


def main() -> None:
    found = worker_command(sys.argv[1:])
    if found is not None:
        os.execvp("bash", found)
    else:
        ray = importlib.util.find_spec("ray").submodule_search_locations[0]  # found, not imported
        os.execv(sys.executable, [sys.executable, os.path.join(ray, "_private", "workers", "setup_worker.py"),
                                  *sys.argv[1:]])


if __name__ == "__main__":
    main()
