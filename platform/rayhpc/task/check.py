"""Check a task in the driver, on one small batch, before any cluster starts.

Every way a task can be wrong that shows without training (a method that raises,
`data()` not returning two map-style datasets, `model()` not returning a Module, a loss
that is not a scalar or does not depend on the parameters, a metric that is not a
scalar, an objective that names nothing reported) becomes one `ConfigError` line
naming the task. The check also records which hyperparameters `model()` and `data()`
read: trials that differ only in others (lr, momentum, ...) can share a data order and
be trained as one pack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset

from rayhpc.config import ConfigError
from rayhpc.data import DataConfig
from rayhpc.task.batches import collate, holdout
from rayhpc.task.load import LoadedTask, one_line

CHECK_BATCH = 8  # samples in the checked batch (more than one: BatchNorm needs two)


class RecordingDict(dict):
    """A dict that remembers which keys were read (iterating it reads them all)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def __iter__(self):
        self.read.update(super().keys())
        return super().__iter__()

    def keys(self):
        self.read.update(super().keys())
        return super().keys()

    def items(self):
        self.read.update(super().keys())
        return super().items()

    def values(self):
        self.read.update(super().keys())
        return super().values()


@dataclass(frozen=True)
class TaskInfo:
    """What the check learnt about a task."""

    model_reads: frozenset[str]  # hyperparameters model() read
    data_reads: frozenset[str]  # hyperparameters data() read
    metric_names: tuple[str, ...]  # what metrics() returns (reported as val_<name>)
    has_val: bool  # a validation set exists (given, or held out)
    objective: tuple[str, str]  # (reported name, "min" or "max") a sweep optimises

    @property
    def reads(self) -> frozenset[str]:
        return self.model_reads | self.data_reads


def check_task(task: LoadedTask, hp: dict, data: DataConfig) -> tuple[TaskInfo, Any]:
    """(what was learnt, one small training batch) for `task` with hyperparameters `hp` (`data`: the
    job's `data:` section, for the validation hold-out)."""
    data_hp = RecordingDict(hp)
    train, val = check_data(task, _call(task, "data(hp)", task.data, data_hp))
    train, val = holdout(train, val, task.val_share(data), data.split_seed)
    model_hp = RecordingDict(hp)
    torch.manual_seed(hp["seed"])
    model = _call(task, "model(hp)", task.model, model_hp)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{task.where()}: model(hp) must return a torch.nn.Module, got {_kind(model)}")
    indices = list(range(min(CHECK_BATCH, hp["batch_size"], len(train))))
    try:
        batch = collate(train, indices)
    except Exception as exc:  # noqa: BLE001 - the user's dataset items
        raise ConfigError(f"{task.where()}: the default collate cannot batch train's items: {one_line(exc)}") from None
    check_loss(task, _call(task, "loss(model, batch)", task.loss, model, batch))
    names = check_metrics(task, model, batch)
    info = TaskInfo(frozenset(model_hp.read), frozenset(data_hp.read), names, val is not None,
                    objective(task, names, val is not None))
    return info, batch


def check_data(task: LoadedTask, out: Any) -> tuple[Any, Any]:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ConfigError(f"{task.where()}: data(hp) must return two datasets (train, val), got {_kind(out)}")
    for name, ds in zip(("train", "val"), out):
        if ds is None and name == "val":
            continue
        if isinstance(ds, IterableDataset) or not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise ConfigError(f"{task.where()}: data(hp)'s {name} must be a map-style Dataset (len() and [i], "
                              f"which DistributedSampler shards), got {_kind(ds)}")
        if len(ds) == 0:
            raise ConfigError(f"{task.where()}: data(hp)'s {name} dataset is empty")
    return out[0], out[1]


def check_loss(task: LoadedTask, loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"{task.where()}: loss(model, batch) must return a scalar tensor, got {_kind(loss)}")
    if loss.dim() != 0:
        raise ConfigError(f"{task.where()}: loss(model, batch) must return a scalar tensor (a mean over the batch), "
                          f"got shape {list(loss.shape)}")
    if not loss.is_floating_point():
        raise ConfigError(f"{task.where()}: loss(model, batch) must be a floating-point tensor, got {loss.dtype}")
    if not loss.requires_grad:
        raise ConfigError(f"{task.where()}: loss(model, batch) does not depend on the model's parameters "
                          "(no gradient flows to them)")


def check_metrics(task: LoadedTask, model: nn.Module, batch: Any) -> tuple[str, ...]:
    if not task.has_metrics:
        return ()
    model.eval()
    with torch.no_grad():
        out = _call(task, "metrics(model, batch)", task.metrics, model, batch)
    model.train()
    if not isinstance(out, dict) or not out:
        raise ConfigError(f"{task.where()}: metrics(model, batch) must return a dict of names to scalar tensors, "
                          f"got {_kind(out)}")
    for name, value in out.items():
        if not (isinstance(name, str) and name.isidentifier()):
            raise ConfigError(f"{task.where()}: metrics(model, batch): name {name!r} is not an identifier")
        if not (isinstance(value, (int, float)) or isinstance(value, torch.Tensor) and value.numel() == 1):
            raise ConfigError(f"{task.where()}: metrics(model, batch)[{name!r}] must be a scalar, got {_kind(value)}")
    return tuple(out)


def objective(task: LoadedTask, metric_names: tuple[str, ...], has_val: bool) -> tuple[str, str]:
    """The reported value a sweep optimises: the task's, checked against what is reported.
    Without validation data the default (val_loss) becomes train_loss."""
    name, mode = task.objective
    reported = ["train_loss"] + (["val_loss", *(f"val_{m}" for m in metric_names)] if has_val else [])
    if name == "val_loss" and not has_val:
        return "train_loss", mode
    if name not in reported:
        hint = "" if has_val else " (there is no validation set: data() gave none; set data.val_fraction)"
        raise ConfigError(f"{task.where()}: objective {name!r} is not reported; reported: {', '.join(reported)}{hint}")
    return name, mode


def _call(task: LoadedTask, what: str, fn, *args):
    try:
        return fn(*args)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code: any failure is their input's
        raise ConfigError(f"{task.where()}: {what} raised {one_line(exc)}") from None


def _kind(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {list(obj.shape)}"
    return "None" if obj is None else f"a {type(obj).__name__}"
