"""The task interface: the user's model, data and loss, on every job (`--task FILE.py:NAME`).

    from rayhpc.task import Task          # optional base class documenting every hook

`bind_task` is what a job calls once, in the driver, before any cluster starts: load
the task, check it on one small batch, and validate the hyperparameters it is given.
"""

from __future__ import annotations

from rayhpc.config import ConfigError
from rayhpc.data import DataConfig
from rayhpc.task.api import Task
from rayhpc.task.load import LoadedTask, load_task

__all__ = ["LoadedTask", "Task", "load_task", "task_for"]


def task_for(spec: str, data: DataConfig) -> LoadedTask:
    """The task `spec` names; the built-in MLP task reads the job's `data:` section, which other
    tasks may use only for the validation hold-out."""
    from rayhpc.task.mlp import MLPTask  # the built-in task's module imports torch

    task = load_task(spec)
    if isinstance(task.obj, MLPTask):
        task.obj = type(task.obj)(data)  # subclasses of the built-in task (jobs/tasks/straggler.py) too
    elif data.mlp_only():
        key = data.mlp_only()[0]
        flag = {"path": " (--data)", "target": " (--target)"}.get(key, "")
        raise ConfigError(f"data.{key}{flag}: only the built-in mlp task reads it; {task.where()} loads its own "
                          "data in data(hp)")
    return task
