"""Load a task named on the command line, and ship it to every Ray worker.

`--task FILE.py:NAME` imports the file under a private module name (its folder on
`sys.path` while it runs, as for a script, so it may import modules beside it);
`--task package.module:NAME` imports an installed module; `mlp` is the built-in task.

Shipping: a file task lives only where the driver runs, so its module (and the modules
beside it that it imported) are registered with Ray's cloudpickle to travel *by value*,
inside every object that reaches a worker, the way Ray ships functions defined in a
driver's `__main__`. Workers on other nodes never read the file, so nothing assumes a
shared path. A module task travels by reference: like rayhpc itself, it must be
installed on every node.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import re
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayhpc.config import ConfigError
from rayhpc.private import UnsafePath, check_code_folder, check_trusted
from rayhpc.task.hparams import hparams_model

BUILTIN = {"mlp": "rayhpc.task.mlp:MLPTask"}
REQUIRED = ("model", "data", "loss")
MODES = ("min", "max")


@dataclass
class LoadedTask:
    """The user's task object with what the platform derives from it; pickles to workers."""

    spec: str  # as the job names it: "mlp", "/abs/path/file.py:NAME", "package.module:NAME"
    obj: Any  # the user's task instance
    by_value: tuple[str, ...] = field(default=(), repr=False)  # modules shipped inside pickles

    def where(self) -> str:
        return f"task (--task) {self.spec}"

    # --- the user's methods
    def model(self, hp: dict):
        return self.obj.model(hp)

    def initial_model(self, hp: dict):
        """A trial's initial model: torch seeded with the trial's seed, then `model(hp)`; the same on
        every rank, in every pack member and in a plain single-process run."""
        import torch  # torch: about 1.5 s to import, only where something trains

        torch.manual_seed(hp["seed"])
        return self.obj.model(hp)

    def data(self, hp: dict):
        return self.obj.data(hp)

    def loss(self, model, batch):
        return self.obj.loss(model, batch)

    def metrics(self, model, batch) -> dict:
        return self.obj.metrics(model, batch) if self.has_metrics else {}

    def optimizer(self, params, hp: dict):
        """The task's own `optimizer(params, hp)`, else the one `hp`'s `optim:` values name
        (`rayhpc.optim.make_optimizer`)."""
        from rayhpc.config import Optim
        from rayhpc.optim import make_optimizer  # torch: only where a task trains

        own = getattr(self.obj, "optimizer", None)
        return own(params, hp) if callable(own) else make_optimizer(Optim.of(hp), params)

    def scheduler(self, optimizer, hp: dict, step: int = 0):
        """The task's own `scheduler(optimizer, hp)` (a torch LR scheduler, stepped after every optimizer
        step) as it stands after `step` optimizer steps, or None: the `schedule:` section sets the lr.
        A resumed run's optimizer is set back to the lr its schedule began with (`initial_lr`, which
        torch's schedulers keep in the optimizer's state) and the new scheduler replays the steps, so it
        continues where the interrupted one was."""
        own = getattr(self.obj, "scheduler", None)
        if not callable(own):
            return None
        for group in optimizer.param_groups:
            group["lr"] = group.get("initial_lr", group["lr"])
        scheduler = own(optimizer, hp)
        with warnings.catch_warnings():  # torch warns of scheduler steps before optimizer steps: a replay here
            warnings.simplefilter("ignore")
            for _ in range(step):
                scheduler.step()
        return scheduler

    @property
    def own_optimizer(self) -> str | None:
        """"optimizer()", "scheduler()" or both, where the task brings its own (packs cannot step them)."""
        return " and ".join(f"{n}()" for n in ("optimizer", "scheduler") if callable(getattr(self.obj, n, None))) or None

    # --- the optional parts, with their defaults
    @property
    def has_metrics(self) -> bool:
        return callable(getattr(self.obj, "metrics", None))

    @property
    def objective(self) -> tuple[str, str]:
        return tuple(getattr(self.obj, "objective", ("val_loss", "min")))

    @property
    def val_fraction(self) -> float | None:
        return getattr(self.obj, "val_fraction", None)

    def val_share(self, data) -> float | None:
        """The share of `train` held out when `data()` gives no validation set: the job's
        `data.val_fraction` (`--val-fraction`), else the task's own `val_fraction`."""
        return data.val_fraction if data.val_fraction is not None else self.val_fraction

    def split_data(self, hp: dict, data) -> tuple:
        """(train, val): `data(hp)`, with the job's validation hold-out (`data`: its `data:` section)."""
        from rayhpc.task.batches import holdout  # torch: only where a task's data is split

        return holdout(*self.data(hp), self.val_share(data), data.split_seed)

    def tokens_per_sample(self, hp: dict) -> int | None:
        """Tokens one sample holds (`tokens_per_sample(hp)`, for tokens/s), or None where the task says nothing."""
        per_sample = getattr(self.obj, "tokens_per_sample", None)
        return per_sample(hp) if callable(per_sample) else None

    @property
    def default_space(self) -> dict | None:
        return getattr(self.obj, "space", None)

    @functools.cached_property
    def hp_model(self):
        """The pydantic model of every hyperparameter this task takes (platform's and its own)."""
        return hparams_model(getattr(self.obj, "hparams", {}) or {}, self.where())

    def ship(self) -> None:
        """Make the task's own modules travel by value to Ray workers (call before pickling it)."""
        import ray.cloudpickle  # Ray: only where a cluster is used (config checks and --help stay fast)

        for name in self.by_value:
            ray.cloudpickle.register_pickle_by_value(sys.modules[name])

    def copied_spec(self, dest: Path) -> str | None:
        """The spec of this file task once `copy_files(dest)` has copied it; None for other tasks
        (installed on every node)."""
        if not self.by_value:
            return None
        module, _, name = self.spec.rpartition(":")
        return f"{dest / Path(module).name}:{name}"

    def copy_files(self, dest: Path) -> None:
        """Copy a file task, and the modules beside it that it imported, into `dest` (same layout)."""
        root = Path(self.spec.rpartition(":")[0]).parent
        for name in self.by_value:
            source = Path(sys.modules[name].__file__).resolve()
            target = dest / source.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)

    def __getstate__(self):  # the derived hp model is rebuilt where needed, never pickled
        return {k: v for k, v in self.__dict__.items() if k != "hp_model"}


def spec_label(spec: str) -> str:
    """A short name for a task spec (default job names): `mlp`, the file's stem, the module's last part."""
    if spec in BUILTIN:
        return spec
    module = spec.rpartition(":")[0]
    return Path(module).stem if module.endswith(".py") else module.rsplit(".", 1)[-1]


def absolute_spec(spec: str) -> str:
    """A file task's spec with an absolute path (a resumed job may start in another folder)."""
    module, sep, name = spec.rpartition(":")
    if sep and (module.endswith(".py") or "/" in module):
        return f"{Path(module).expanduser().resolve()}:{name}"
    return spec


def load_task(spec: str) -> LoadedTask:
    """The task `spec` names, instantiated and checked for the three required methods."""
    where = f"task (--task) {spec}"
    module_part, sep, name = BUILTIN.get(spec, spec).rpartition(":")
    if not sep or not module_part or not name.isidentifier():
        raise ConfigError(f"{where}: expected FILE.py:NAME or package.module:NAME (or the built-in {', '.join(BUILTIN)})")
    if module_part.endswith(".py") or "/" in module_part:
        module, by_value = _import_file(Path(module_part), where)
    else:
        module, by_value = _import_module(module_part, where), ()
    if not hasattr(module, name):
        found = _tasks_defined_in(module)
        raise ConfigError(f"{where}: {module_part} has no {name!r}; "
                          + (f"tasks it defines: {', '.join(found)}" if found else
                             "it defines no task (a class or object with model, data and loss methods)"))
    obj = getattr(module, name)
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:  # noqa: BLE001 - the user's constructor: any failure is their input's
            raise ConfigError(f"{where}: {name}() failed: {one_line(exc)}") from None
    missing = [m for m in REQUIRED if not callable(getattr(obj, m, None))]
    if missing:
        signatures = {"model": "model(hp)", "data": "data(hp)", "loss": "loss(model, batch)"}
        raise ConfigError(f"{where}: {name} has no {', '.join(signatures[m] for m in missing)} method; a task needs "
                          "model(hp), data(hp) and loss(model, batch)")
    task = LoadedTask(spec, obj, by_value)
    _check_objective(task)
    return task


def _check_objective(task: LoadedTask) -> None:
    objective = getattr(task.obj, "objective", ("val_loss", "min"))
    if not (isinstance(objective, (tuple, list)) and len(objective) == 2 and isinstance(objective[0], str)
            and objective[1] in MODES):
        raise ConfigError(f"{task.where()}: objective {objective!r}: expected (name, 'min' or 'max'), "
                          "e.g. ('val_accuracy', 'max')")


def _import_module(name: str, where: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise ConfigError(f"{where}: no module named {exc.name!r} (a module path must be importable here "
                              "and on every node; for a file give its path, FILE.py:NAME)") from None
        raise ConfigError(f"{where}: importing {name} failed: {one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module: any failure is their input's
        raise ConfigError(f"{where}: importing {name} failed: {one_line(exc)}") from None


def _import_file(path: Path, where: str):
    """(module, names to ship by value): the file imported under a name private to its path."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{where}: no such file {path}")
    try:  # its folder too: it goes on sys.path, so a module planted beside it would be imported
        check_code_folder(path.parent)
        check_trusted(path)
    except UnsafePath as exc:
        raise ConfigError(f"{where}: {exc}") from None
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    name = f"rayhpc_task_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"
    if name in sys.modules:  # loaded once per process
        return sys.modules[name], sys.modules[name].__rayhpc_by_value__
    before = set(sys.modules)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))  # `import helpers` beside the file works, as for a script
    try:
        module.__spec__.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file: any failure is their input's
        del sys.modules[name]
        raise ConfigError(f"{where}: importing {path.name} failed: {one_line(exc)}") from None
    finally:
        sys.path.remove(str(path.parent))
    siblings = [m for m in set(sys.modules) - before - {name} if _beside(sys.modules[m], path.parent)]
    module.__rayhpc_by_value__ = (name, *sorted(siblings))
    return module, module.__rayhpc_by_value__


def _beside(module, folder: Path) -> bool:
    """Whether `module` was loaded from a file under `folder` (not an installed package there)."""
    file = getattr(module, "__file__", None)
    if not file:
        return False
    path = Path(file).resolve()
    return folder in path.parents and not {"site-packages", "dist-packages"} & set(path.parts)


def _tasks_defined_in(module) -> list[str]:
    return sorted(n for n, v in vars(module).items() if not n.startswith("_")
                  and getattr(v, "__module__", None) == module.__name__
                  and all(callable(getattr(v, m, None)) for m in REQUIRED))


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
