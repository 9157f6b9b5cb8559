"""The workers of a Ray a command starts for itself (`cluster.start_local`): set up without Ray's own set-up
script (`rayhpc.up.setup_worker`), with what a job gives them in its runtime environment, and forked from a
starter that has loaded what the command's task loaded, and only that."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from helpers import ROOT, job_env, require

# a command's own Ray, started twice: before its task has loaded Hugging Face's library, then after
JOB = """
import json, logging, os, sys
from rayhpc import cluster
import ray

@ray.remote(num_cpus=0)
def seen():  # in a worker forked from the Ray's starter of workers: what that starter had loaded
    return {"torch": "torch" in sys.modules, "transformers": "transformers.modeling_utils" in sys.modules,
            "env": os.environ["RAYHPC_T_ENV"]}

for task_loaded_it in (False, True):
    if task_loaded_it:
        import transformers.modeling_utils  # as the check of a task whose model is a Hugging Face one does
    cluster.start_local(num_cpus=1, num_gpus=0, include_dashboard=False, logging_level=logging.WARNING,
                        runtime_env={"env_vars": {"RAYHPC_T_ENV": "a-${RAYHPC_T_HOME}-${RAYHPC_T_UNSET}-b"}})
    print(json.dumps(ray.get(seen.remote())), flush=True)
    cluster.disconnect()
"""


def test_a_commands_own_workers_get_the_jobs_environment_and_what_its_task_loaded_preloaded():
    require("transformers (pip install 'rayhpc[hf]')", importlib.util.find_spec("transformers") is not None)
    proc = subprocess.run([sys.executable, "-c", JOB], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**job_env(None), "RAYHPC_T_HOME": "/h"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    before, after = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    # Ray's own expansion of the job's variables: the set one in, the unset one empty
    assert before["env"] == after["env"] == "a-/h--b", (before, after)
    # both from a warm starter (torch loaded); Hugging Face's library only once the command had it
    assert (before["torch"], before["transformers"]) == (True, False), before
    assert (after["torch"], after["transformers"]) == (True, True), after


def test_a_jobs_first_worker_is_asked_for_at_once_where_its_workers_start_warm(ray_cluster, monkeypatch):
    import ray

    from rayhpc import cluster

    # the shared cluster's workers start warm (a starter of workers of its own): the task is asked for, and runs
    ref = cluster.first_worker_now()
    assert ref is not None and ray.get(ref, timeout=120) is None
    # a local Ray whose workers start cold: nothing asked for
    monkeypatch.setattr(cluster._local[-1], "starter", None)
    assert cluster.first_worker_now() is None
    # the user's cluster (`rayhpc up`), whose workers start warm: asked for
    monkeypatch.setattr(cluster, "_user_cluster", [ray.get_runtime_context().gcs_address])
    assert cluster.first_worker_now() is not None
