"""Hyperparameters: the platform's (optimiser, batch size, seed) and a task's own, as one typed model.

A task declares its hyperparameters as a dict of defaults (`{"channels": 8}`: types from
the defaults, ints and bools strict, floats accepting ints) or as a pydantic model class
(types and bounds from its fields). Every job validates the values it is given (a sweep's
`space:`, a training run's `hparams:` / `--hp`) against the union, so an unknown or
mistyped key is an error naming it, before anything starts.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, Strict, ValidationError, create_model

from rayhpc.config import ConfigError, Optim, Schedule

# the options of `rayhpc.optim`: the `optim:` and `schedule:` sections' keys, and accumulation
TRAINING_KEYS = (*Optim.model_fields, *Schedule.model_fields, "accumulate")
PLATFORM_KEYS = ("batch_size", "seed", *TRAINING_KEYS)


class PlatformHParams(Schedule, Optim):
    """The platform's hyperparameters: what every trial has, whatever the task: the keys of the `optim:`
    and `schedule:` sections (a training job's values of them), the batch, accumulation and seed."""

    batch_size: int = Field(32, ge=1, description="samples per optimizer step (over all workers)")
    accumulate: int = Field(1, ge=1, description="micro-batches per optimizer step (the batch is unchanged)")
    seed: int = Field(0, description="seeds initialisation, dropout and the data order")


# YAML reads `1e-3` (no dot) as a string: floats stay lax; the other kinds must be what they say
_TYPES = {bool: Annotated[bool, Strict()], int: Annotated[int, Strict()], float: float, str: Annotated[str, Strict()]}


def hparams_model(declared: Any, where: str) -> type[BaseModel]:
    """The union of the platform's hyperparameters and a task's `hparams` (dict or pydantic model)."""
    if isinstance(declared, type) and issubclass(declared, BaseModel):
        fields = {name: (f.annotation, f) for name, f in declared.model_fields.items()}
    elif isinstance(declared, dict):
        fields = {}
        for name, default in declared.items():
            kind = next((t for t in _TYPES if type(default) is t), None)
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(f"{where}: hparams key {name!r} is not a Python identifier")
            if kind is None:
                raise ConfigError(f"{where}: hparams[{name!r}] = {default!r}: a default must be a bool, int, float "
                                  f"or str (its type is the hyperparameter's type)")
            fields[name] = (_TYPES[kind], default)
    else:
        raise ConfigError(f"{where}: hparams must be a dict of defaults or a pydantic model class, "
                          f"got {type(declared).__name__}")
    clash = sorted(set(fields) & set(PLATFORM_KEYS))
    if clash:
        raise ConfigError(f"{where}: hparams {', '.join(clash)}: already platform hyperparameters "
                          f"({', '.join(PLATFORM_KEYS)}); use another name")
    return create_model("HParams", __base__=PlatformHParams, **fields)


def task_keys(model: type[BaseModel]) -> list[str]:
    """The task's own hyperparameter names (the model's fields beyond the platform's)."""
    return [name for name in model.model_fields if name not in PLATFORM_KEYS]


def check_value(model: type[BaseModel], key: str, name: str, value: Any) -> Any:
    """`value` for hyperparameter `name`, validated; `key` is how the error names it (`space.lr`)."""
    if name not in model.model_fields:
        raise ConfigError(f"{key}: unknown parameter; allowed: {', '.join(model.model_fields)}")
    try:
        return getattr(model.model_validate({name: value}), name)
    except ValidationError as exc:
        raise ConfigError(f"{key}: {exc.errors()[0]['msg'].removeprefix('Value error, ')} (got {value!r})") from None


def full_hparams(model: type[BaseModel], values: dict, key: str = "hparams.{name}") -> dict:
    """Every hyperparameter: the defaults, overridden by `values` (each checked; errors name it by `key`)."""
    checked = {name: check_value(model, key.format(name=name), name, value) for name, value in values.items()}
    return model.model_validate(checked).model_dump()

