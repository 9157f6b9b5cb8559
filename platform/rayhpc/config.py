"""Typed, validated configuration shared by every job.

Each job has one config tree: strict pydantic models (unknown keys are
rejected by name), filled from an optional YAML file and then overridden by
command-line flags, validated once and passed down. Any problem with user
input becomes a `ConfigError` whose message is a single line naming the
offending key and what is allowed; `rayhpc.entry.run_main` prints it as
`error: ...` and exits with status 2.
"""

from __future__ import annotations

import os
import types
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Mapping, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from rayhpc.private import UnsafePath, check_ancestors, check_trusted, owned_dir, private_dir, replace_whole

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """Bad user input. The message is one line that names the key and what is allowed."""


class JobFailed(RuntimeError):
    """A job that started and failed in the user's code: one line naming where and why, the full tracebacks in
    the log file it names (exit status 1)."""


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def of(cls, values: dict):
        """This section from a flat dict of a trial's or a run's hyperparameters (`hp`), which hold its fields
        under their own names (what a sweep searches); a field `values` lacks takes the section's default."""
        return cls(**{k: values[k] for k in cls.model_fields if k in values})


class JobConfig(StrictModel):
    """What every job has: a name and folder, resumability, and the Ray cluster to use."""

    kind: ClassVar[str] = "job"
    name: str = Field("job", pattern=r"^[A-Za-z0-9_.=-]+$", description="the job's folder under storage_path")
    storage_path: Path = Field(Path("rayhpc_results"), description="where jobs are kept (relative: to the working dir)")
    resume: bool = Field(False, description="continue the job of this name")
    address: str | None = Field(None, description="Ray cluster to join; unset: RAY_ADDRESS, else a local Ray")

    @property
    def experiment_dir(self) -> Path:
        return self.storage_path.resolve() / self.name

    @property
    def saved_file(self) -> Path:
        return self.experiment_dir / f"{self.kind}.yaml"

    # how this run goes, not what the job computes: not saved, and a resume may give them anew
    run_keys: ClassVar[frozenset[str]] = frozenset()

    def saved(self) -> dict:
        """The fields that define the job, as written next to its results for `--resume`."""
        return self.model_dump(mode="json", exclude={"resume", "address", "storage_path", *self.run_keys},
                               exclude_none=True)

    def make_dir(self) -> Path:
        """The job's folder, only this user's (0700): other users can neither read its results and
        checkpoints nor plant anything that a resume would load."""
        try:
            owned_dir(self.storage_path.resolve())
            return private_dir(self.experiment_dir)
        except UnsafePath as exc:
            raise ConfigError(f"storage_path (--storage-path): {exc}") from None

    def save(self) -> None:
        self.make_dir()
        text = yaml.safe_dump(self.saved(), sort_keys=False)
        replace_whole(self.saved_file, lambda tmp: tmp.write_text(text))


# one vocabulary for every job's `precision:` (`rayhpc.precision` applies it)
Precision = Literal["fp32", "tf32", "bf16"]
PRECISION_HELP = ("fp32; tf32: fp32 with TF32 matmuls on GPUs (as fp32 on CPUs); bf16: mixed precision, weights and "
                  "optimizer in fp32 (FSDP's policy under FSDP, autocast elsewhere)")


class ModelOptions(StrictModel):
    """How every job that runs the task's model as a module runs it: compiled and activation-checkpointed per
    block (`rayhpc.engine.parallelize`), in torchtitan's order, before FSDP or DDP wraps it."""

    compile: Literal["none", "blocks", "model"] = Field("none", description="torch.compile each block (the task's "
                                                        "blocks(model), else its ModuleLists' entries) or the model")
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none", description="per block: full keeps only its input; selective also its matmul outputs")


class PerWorker(StrictModel):
    """What each worker reserves (the `compute:` section, shared by every job with workers)."""

    gpu: bool = Field(False, description="one GPU per worker and NCCL (else CPU and gloo)")
    cpus_per_worker: float | None = Field(None, gt=0, description="CPUs reserved per worker (its torch threads); "
                                          "unset: 1, or the largest power-of-two share that places every worker")


class Compute(PerWorker):
    """How many workers a run has, and what each reserves."""

    num_workers: int = Field(2, ge=1, description="training processes (ranks)")


def optimizer_class(name: str):
    """`sgd`, `adam`, `adamw`, or any other `torch.optim` optimizer by its class name, in any case (`rmsprop`)."""
    import torch  # torch: imported only when a config names an optimizer

    known = {n: c for n, c in vars(torch.optim).items()
             if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    by_lower = {n.lower(): c for n, c in known.items()}
    if name.lower() not in by_lower:
        raise ValueError(f"unknown optimizer {name!r}: expected sgd, adam, adamw or a torch.optim class "
                         f"({', '.join(sorted(known))})")
    return by_lower[name.lower()]


def _optimizer_name(name: str) -> str:
    optimizer_class(name)
    return name


# an optimizer's name, checked against torch.optim (the `optim:` section and the hyperparameter alike)
OptimizerName = Annotated[str, AfterValidator(_optimizer_name)]


class Optim(StrictModel):
    """The optimiser and its step (the `optim:` section; `rayhpc.optim`)."""

    optimizer: OptimizerName = Field("adam", description="sgd, adam, adamw, or a torch.optim class by name")
    lr: float = Field(0.01, gt=0, description="learning rate (the peak, after the warm-up)")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum (ignored by Adam)")
    weight_decay: float = Field(0.0, ge=0, description="weight decay (L2 in SGD and Adam, decoupled in AdamW)")
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam's first beta")
    beta2: float = Field(0.999, ge=0, lt=1, description="Adam's second beta")
    eps: float = Field(1e-8, gt=0, description="Adam's epsilon")
    clip_grad_norm: float | None = Field(None, gt=0, description="clip the gradient's total norm to this")


class Schedule(StrictModel):
    """The learning rate over the optimizer steps (the `schedule:` section): a linear warm-up, then a decay."""

    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up")
    warmup_fraction: float | None = Field(None, ge=0, lt=1, description="the warm-up as a share of all optimizer "
                                          "steps, instead of warmup_steps")
    decay: Literal["constant", "cosine", "linear", "step"] = Field("constant", description="after the warm-up: "
                                                                   "cosine or linear down to min_lr_ratio x lr at the "
                                                                   "last step; step: x0.1 at 1/2 and 3/4 of the way")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="the lowest share of lr the decay reaches")

    @model_validator(mode="after")
    def _one_warmup(self):
        if self.warmup_steps and self.warmup_fraction is not None:
            raise ConfigError(f"warmup_fraction (--warmup-fraction) {self.warmup_fraction:g} and warmup_steps "
                              f"(--warmup-steps) {self.warmup_steps}: give one, not both")
        return self


class Checkpoints(StrictModel):
    """How many checkpoints are kept, in every job (a sweep's `checkpoint:` section: its trials checkpoint every epoch)."""

    keep: int = Field(1, ge=1, description="checkpoints kept, the latest ones, per run or trial (the latest is what "
                      "resume needs; at 10,000 trials each more is 10,000 more folders)",
                      json_schema_extra={"flag": "--keep-checkpoints"})


class RankedCheckpoints(Checkpoints):
    """A sweep's checkpoints, which may also be kept by score."""

    keep_best: int | None = Field(None, ge=1, description="keep the K checkpoints with the best objective (a "
                                  "pack's: its best member's at that epoch) and the latest (resume needs it), "
                                  "instead of the latest `keep`", json_schema_extra={"flag": "--keep-best"})


class StepCheckpoints(Checkpoints):
    """When a training run checkpoints and how many it keeps (the `checkpoint:` section)."""

    every: int | None = Field(None, ge=1, description="checkpoint every K optimizer steps (training runs also at "
                              "each epoch's end)", json_schema_extra={"flag": "--checkpoint-every"})


J = TypeVar("J", bound=JobConfig)
RESUME_ENV = "RAYHPC_RESUME"  # set by the sbatch startup in a requeued job: resume if there is something to resume


def reconcile_resume(cfg: J, explicit: set[str]) -> J:
    """Refuse to clobber an existing job; on `--resume` use its saved definition.

    Values the user gave explicitly (YAML or flags) must agree with the saved
    ones: a resumed job cannot change what it computes. `--resume` of a job
    that never ran is an error listing the jobs that exist; a requeued Slurm job
    (RAYHPC_RESUME=1) resumes if there is something to resume and starts otherwise.
    """
    check_storage(cfg.storage_path)
    exists = cfg.saved_file.exists()
    if not cfg.resume and exists and os.environ.get(RESUME_ENV) == "1":
        cfg = cfg.model_copy(update={"resume": True})
    if not cfg.resume:
        if exists:
            raise ConfigError(f"name (--name) {cfg.name}: a {cfg.kind} already exists at {cfg.experiment_dir}; "
                              "pass --resume to continue it or choose another --name")
        return cfg
    if not exists:
        if os.environ.get(RESUME_ENV) == "1":
            return cfg.model_copy(update={"resume": False})
        there = sorted(p.parent.name for p in cfg.storage_path.resolve().glob(f"*/{cfg.kind}.yaml"))
        raise ConfigError(f"resume (--resume): no {cfg.kind} named {cfg.name} under {cfg.storage_path.resolve()}; "
                          f"{cfg.kind}s there: {', '.join(there) or 'none'}")
    check_trusted_job(cfg.experiment_dir)
    saved = validate(type(cfg), load_yaml(cfg.saved_file))
    check_agrees(cfg.saved(), saved.saved(), explicit, f"the resumed {cfg.kind}'s", "drop it to resume, or start "
                 "a new --name")
    run = {k: getattr(cfg, k) for k in cfg.run_keys}  # this run's own (a resumed sweep's new time budget)
    return saved.model_copy(update={"resume": True, "address": cfg.address, "storage_path": cfg.storage_path, **run})


def check_agrees(now: dict, before: dict, explicit: set[str], whose: str, fix: str) -> None:
    """Every key the user gave explicitly equals what was saved (`whose`: whose values they are)."""
    for key in sorted(explicit):
        if key.split(".")[0] in before and _get(now, key) != _get(before, key):
            raise ConfigError(f"{key}: {_get(now, key)!r} differs from {whose} {_get(before, key)!r}; {fix}")


def check_trusted_job(folder: Path) -> None:
    """Before a resume loads anything from a job's folder (Tune's pickles, checkpoints, a copied task
    file): it and everything in it are this user's and nobody else can write them."""
    try:
        check_trusted(folder, below=True)
    except UnsafePath as exc:
        raise ConfigError(f"resume (--resume): {exc}") from None


def check_storage(path: Path) -> None:
    """`storage_path` must be a folder, or a path whose first existing ancestor is a writable folder, and
    no other user may be able to swap it (or a folder above it) out."""
    path = path.expanduser().resolve()
    try:
        check_ancestors(path)
    except UnsafePath as exc:
        raise ConfigError(f"storage_path (--storage-path): {exc}") from None
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                what = "is a file" if parent == path else f"lies under {parent}, which is a file"
                raise ConfigError(f"storage_path (--storage-path) {path}: {what}, not a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(f"storage_path (--storage-path) {path}: {parent} is not writable")
            return


def explicit_keys(model: type[BaseModel], data: Mapping[str, Any], prefix: str = "") -> set[str]:
    """Dotted keys set in `data`, descending into sub-models only (a dict-valued field is one key)."""
    out = set()
    for key, value in data.items():
        field = model.model_fields.get(key)
        sub = unwrap_annotation(field.annotation) if field is not None else None
        if isinstance(value, dict) and is_model(sub):
            out |= explicit_keys(sub, value, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out


def field_at(model: type[BaseModel], dotted: str):
    """The pydantic field that a dotted key (`data.path`) names."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        model = unwrap_annotation(model.model_fields[part].annotation)
    return model.model_fields[leaf]


def _get(d: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; any problem becomes a one-line `ConfigError`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {path}: not a text (UTF-8) file: byte {exc.start} is {exc.object[exc.start]:#04x}") \
            from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"--config {path}: invalid YAML{line}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of keys, got {type(data).__name__}")
    return data


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` into a copy of `base`; dotted keys (`data.path`) address nested sections."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if rest:
            section = out.get(head)
            out[head] = merge(section if isinstance(section, dict) else {}, {rest: value})
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def validate(model: type[M], data: Mapping[str, Any], flags: Mapping[str, str] | None = None) -> M:
    """Build `model` from `data`, turning pydantic's errors into one-line `ConfigError`s.

    `flags` maps config keys to the command-line flags that set them, so an
    error in a value that came from the command line names the flag too.
    """
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(describe(model, exc, flags or {})) from None


def describe(model: type[BaseModel], exc: ValidationError, flags: Mapping[str, str]) -> str:
    """One line for the first validation error (and how many more there are)."""
    errors = exc.errors()
    first = errors[0]
    loc = [str(part) for part in first["loc"]]
    key = ".".join(loc)
    if key in flags:
        key = f"{key} ({flags[key]})"
    if first["type"] == "extra_forbidden":
        allowed = sorted(_fields_at(model, loc[:-1]))
        msg = f"unknown key; allowed keys: {', '.join(allowed)}" if allowed else "unknown key"
    else:
        msg = first["msg"]
        if first["type"] not in ("missing", "value_error", "assertion_error"):
            msg += f" (got {first.get('input')!r})"
        msg = msg.removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    # errors from whole-model validators carry no location; their message names the keys
    return f"{key}: {msg}{more}" if key else f"{msg}{more}"


def _fields_at(model: Any, loc: list[str]) -> set[str]:
    """The field names of the (sub)model that `loc` points into."""
    current: Any = model
    for part in loc:
        current = _submodel(current, part)
        if current is None:
            return set()
    return set(current.model_fields) if is_model(current) else set()


def _submodel(annotation: Any, part: str) -> Any:
    """Follow one location step through models, Optional, dict values and list items."""
    if is_model(annotation):
        field = annotation.model_fields.get(part)
        return unwrap_annotation(field.annotation) if field is not None else None
    return unwrap_annotation(annotation)


def unwrap_annotation(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if is_model(a)]
        return models[0] if models else None
    if origin in (dict, list, tuple):
        args = typing.get_args(annotation)
        return unwrap_annotation(args[-1]) if args else None
    return annotation


def is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)
