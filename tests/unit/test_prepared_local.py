"""A job command's local Ray gets its starter of workers at the command's start (`cluster.prepare_local`,
called by `run_main`), which imports while the command does. A command that starts no Ray after all stops it
and removes its folder as it exits; one that joins a cluster, starts its workers cold or shows its help
prepares none; a start takes it only where it has loaded what the command's task loaded, with its settings."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, job_env
from rayhpc import cluster

# a job command (run_main prepares only for those: its name) that reports what it found prepared, then
# either rejects its input or starts its local Ray and reports whose starter forks that Ray's workers
COMMAND = """
import json, os, sys
from rayhpc import cluster, entry
from rayhpc.config import ConfigError

def train_main(argv):
    local = cluster._prepared[-1] if cluster._prepared else None
    print(json.dumps(local and {"folder": str(local.folder), "starter": local.starter.pid}), flush=True)
    if not os.environ.get("T_START"):
        raise ConfigError("epochs (--epochs) 0: bad")
    import ray
    cluster.start_local(num_cpus=1, num_gpus=0, include_dashboard=False, logging_level="WARNING")

    @ray.remote(num_cpus=0)
    def grandparent():
        import psutil
        return psutil.Process(os.getppid()).ppid()

    print(json.dumps({"used": cluster._local[-1].starter.pid, "forks": ray.get(grandparent.remote())}), flush=True)
    cluster.disconnect()

entry.run_main(train_main, sys.argv[1:])
"""


def run(*args: str, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    proc = subprocess.run([sys.executable, "-c", COMMAND, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=job_env(env))
    return proc, [json.loads(line) for line in proc.stdout.splitlines() if line == "null" or line.startswith("{")]


def test_a_command_that_rejects_its_input_leaves_no_starter_and_no_folder():
    proc, (prepared,) = run("--epochs", "0")
    assert proc.returncode == 2 and proc.stderr.startswith("error: epochs (--epochs) 0"), proc.stderr
    assert prepared is not None, "a job command of a local Ray had no starter prepared"
    assert not Path(prepared["folder"]).exists(), "the prepared folder outlived the command"
    assert not Path(f"/proc/{prepared['starter']}").exists(), "the prepared starter outlived the command"


@pytest.mark.parametrize("args, env", [(["--address", "127.0.0.1:1"], {}), (["--address=127.0.0.1:1"], {}),
                                       ([], {"RAY_ADDRESS": "127.0.0.1:1"}), (["--help"], {}),
                                       ([], {"RAYHPC_WARM_WORKERS": "0"})],
                         ids=["--address", "--address=", "RAY_ADDRESS", "--help", "workers cold"])
def test_none_where_the_command_joins_a_cluster_starts_workers_cold_or_shows_help(args, env):
    _proc, (prepared,) = run(*args, **env)
    assert prepared is None


def test_a_start_takes_the_prepared_starter_whose_forks_are_its_workers():
    proc, (prepared, started) = run(T_START="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert started["used"] == prepared["starter"], "the start made a starter of its own"
    # Ray's worker: a fork of the starter of its job's workers, itself the prepared starter's child
    assert started["forks"] == prepared["starter"]


@pytest.fixture
def prepared(monkeypatch):
    """A prepared local Ray in this process (as for a command of a local Ray), discarded after the test."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the shared cluster's, where it runs
    monkeypatch.delenv("RAYHPC_WARM_WORKERS", raising=False)
    cluster.prepare_local([])
    assert len(cluster._prepared) == 1
    yield cluster._prepared[0]
    cluster._discard_prepared()


@pytest.mark.parametrize("change", ["none", "a torch setting", "a library loaded", "starter ended"])
def test_a_start_takes_it_only_where_it_loaded_what_the_task_did_with_the_same_settings(prepared, monkeypatch,
                                                                                         change):
    if change == "a torch setting":  # importing torch's compiler sets one
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(prepared.folder / "elsewhere"))
    elif change == "a library loaded":  # the task check built a Hugging Face model
        monkeypatch.setattr(cluster, "_worker_extras", lambda: ("transformers.modeling_utils",))
    elif change == "starter ended":
        prepared.starter.kill()
        prepared.starter.wait()
    taken = cluster._prepared_for_use()
    if change == "none":
        assert taken is prepared and prepared.starter.poll() is None
        cluster._prepared.append(taken)  # for the fixture to discard
    else:
        assert taken is None and not prepared.folder.exists() and prepared.starter.poll() is not None


def test_a_starter_whose_starting_process_ended_before_it_could_watch_it_ends():
    # the parent-death signal covers only a parent alive when the starter asks for it: a command that ends
    # within the starter's first moments (bad input) would leave it running for good
    proc = subprocess.run([sys.executable, "-m", "rayhpc.up.starter", "--workers", "--parent", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60, env=job_env({}))
    assert proc.returncode == 1 and "the process that started it (1) has ended" in proc.stderr, proc.stderr
