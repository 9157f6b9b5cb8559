"""Search spaces: what a sweep varies, validated, and turned into trial configs.

In YAML each parameter is either a fixed value or a one-key mapping:

    space:
      hidden: {choice: [4, 8, 16, 32]}
      lr: {loguniform: [1.0e-3, 0.3]}
      batch_size: {grid: [32, 64]}
      momentum: {uniform: [0.0, 0.9]}
      optimizer: sgd          # fixed

`random` and `grid` searches are sampled here, up front and reproducibly from
the sweep seed, so the same sweep always means the same trials whether or not
they are packed; `optuna` hands the space to Ray Tune's OptunaSearch. Parameters
are the platform's hyperparameters and the task's own (`rayhpc.task.hparams`).
"""

from __future__ import annotations

import itertools
import math
import random
import typing
from typing import Any, Union

from pydantic import BaseModel, Field, ValidationError, model_validator

from rayhpc.config import ConfigError, StrictModel
from rayhpc.task.hparams import check_value

Scalar = Union[bool, int, float, str]


KINDS = ("grid", "choice", "uniform", "loguniform", "randint")


class ParamSpec(StrictModel):
    """Exactly one way of drawing a parameter's values."""

    grid: list[Scalar] | None = Field(None, description="every value, each in its own trial (cross product)")
    choice: list[Scalar] | None = Field(None, description="one value drawn uniformly per trial")
    uniform: tuple[float, float] | None = Field(None, description="[low, high] float")
    loguniform: tuple[float, float] | None = Field(None, description="[low, high] float, log scale, low > 0")
    randint: tuple[int, int] | None = Field(None, description="[low, high) integer")

    @model_validator(mode="after")
    def _one_kind(self) -> "ParamSpec":
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(KINDS)} (got {', '.join(given) or 'none'})")
        kind = given[0]
        value = getattr(self, kind)
        if kind in ("grid", "choice") and not value:
            raise ValueError(f"{kind}: empty list; give at least one value")
        if kind in ("uniform", "loguniform", "randint") and not value[0] < value[1]:
            raise ValueError(f"{kind}: low {value[0]} must be < high {value[1]}")
        if kind == "loguniform" and value[0] <= 0:
            raise ValueError(f"loguniform: low {value[0]} must be > 0")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def args(self) -> Any:
        return getattr(self, self.kind)


Space = dict[str, Union[ParamSpec, Scalar]]


def parse_space(raw: Any) -> Space:
    """Turn the YAML mapping into `ParamSpec`s and fixed values (pydantic "before" validator)."""
    if not isinstance(raw, dict):
        raise ValueError(f"expected a mapping of parameter names, got {type(raw).__name__}")
    space: Space = {}
    for name, value in raw.items():
        if isinstance(value, ParamSpec) or isinstance(value, (bool, int, float, str)):
            space[name] = value
        elif isinstance(value, dict):
            try:
                space[name] = ParamSpec.model_validate(value)
            except ValidationError as exc:
                err = exc.errors()[0]
                if err["type"] == "extra_forbidden":
                    msg = f"unknown kind {err['loc'][0]!r}; allowed: {', '.join(KINDS)}"
                else:
                    where = ".".join(str(p) for p in err["loc"])
                    msg = (f"{where}: " if where else "") + err["msg"].removeprefix("Value error, ")
                raise ValueError(f"{name}: {msg}") from None
        else:
            raise ValueError(f"{name}: expected a fixed value or a mapping like {{choice: [...]}}, got {value!r}")
    return space


def check_space_form(space: Space, search: str) -> None:
    """Reject draws the search cannot make, and spaces that search nothing."""
    for name, spec in space.items():
        if search == "grid" and isinstance(spec, ParamSpec) and spec.kind not in ("grid", "choice"):
            raise ConfigError(f"space.{name}: search=grid needs grid or choice values, got {spec.kind}")
        if search == "optuna" and isinstance(spec, ParamSpec) and spec.kind == "grid":
            raise ConfigError(f"space.{name}: search=optuna samples values; use choice instead of grid")
    if not searched(space):
        raise ConfigError(f"space: empty search space; give at least one parameter as {', '.join(KINDS)}")


def check_space_values(space: Space, hp_model: type[BaseModel]) -> None:
    """Reject parameters the task does not take and values of the wrong type (the platform's and the
    task's own hyperparameters, `hp_model`)."""
    for name, spec in space.items():
        for value in _values_to_check(spec):
            check_value(hp_model, f"space.{name}", name, value)
        annotation = hp_model.model_fields[name].annotation
        if isinstance(spec, ParamSpec) and spec.kind in ("uniform", "loguniform") and int in _types(annotation):
            raise ConfigError(f"space.{name}: {spec.kind} draws floats but {name} is an integer; use randint, choice or grid")


def _types(annotation) -> set:
    """The plain types an annotation stands for (through Annotated)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _types(typing.get_args(annotation)[0])
    return {annotation}


def _values_to_check(spec: ParamSpec | Scalar) -> list[Any]:
    if not isinstance(spec, ParamSpec):
        return [spec]
    if spec.kind in ("grid", "choice"):
        return list(spec.args)
    return [spec.args[0], spec.args[1] - 1 if spec.kind == "randint" else spec.args[1]]


def searched(space: Space) -> list[str]:
    """Names of the parameters the space varies (its `config.<name>` result columns)."""
    return [name for name, spec in space.items() if isinstance(spec, ParamSpec)]


def sample_configs(space: Space, num_samples: int, search: str, seed: int, hp_model: type[BaseModel],
                   defaults: dict) -> list[dict]:
    """Every trial's full hyperparameters (`defaults` where the space sets nothing), in trial order.

    As in Ray Tune, grid values form a cross product and `num_samples` draws of
    the other parameters are made for each grid point. With `search=grid`,
    choice parameters count as grid parameters. `seed` seeds the draws.
    """
    rng = random.Random(seed)
    as_grid = {"grid"} | ({"choice"} if search == "grid" else set())
    grid_names = [n for n, s in space.items() if isinstance(s, ParamSpec) and s.kind in as_grid]
    grid_points = list(itertools.product(*(space[n].args for n in grid_names)))
    configs = []
    for _ in range(num_samples):
        for point in grid_points:
            values = dict(zip(grid_names, point))
            for name, spec in space.items():
                if name not in values:
                    values[name] = draw(spec, rng)
            configs.append(hp_model.model_validate({**defaults, **values}).model_dump())
    return configs


def draw(spec: ParamSpec | Scalar, rng: random.Random) -> Any:
    if not isinstance(spec, ParamSpec):
        return spec
    kind, args = spec.kind, spec.args
    if kind == "choice":
        return rng.choice(args)
    if kind == "uniform":
        return rng.uniform(*args)
    if kind == "loguniform":
        return math.exp(rng.uniform(math.log(args[0]), math.log(args[1])))
    if kind == "randint":
        return rng.randrange(args[0], args[1])
    raise AssertionError(f"unhandled kind {kind}")  # grid values are placed by sample_configs


def tune_domains(space: Space) -> dict[str, Any]:
    """The space as Ray Tune sampling domains (for searchers such as OptunaSearch)."""
    from ray import tune  # Ray: only where a cluster is used (config checks and --help stay fast)

    make = {"choice": tune.choice, "uniform": lambda a: tune.uniform(*a),
            "loguniform": lambda a: tune.loguniform(*a), "randint": lambda a: tune.randint(*a)}
    return {n: make[s.kind](s.args) if isinstance(s, ParamSpec) else s for n, s in space.items()}
