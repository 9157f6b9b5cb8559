"""Search spaces: what a sweep varies, validated, and turned into trial configs.

In YAML each parameter is either a fixed value or a one-key mapping:

    space:
      hidden: {choice: [4, 8, 16, 32]}
      lr: {loguniform: [1.0e-3, 0.3]}
      batch_size: {grid: [32, 64]}
      momentum: {uniform: [0.0, 0.9]}
      optimizer: sgd          # fixed

More kinds: `quniform: [low, high, q]` and `qloguniform: [low, high, q]` (floats rounded to a
multiple of q), `lograndint: [low, high)` (integers, log scale). A parameter may exist only for some
values of another (a conditional space; conditions may chain, a nested choice):

      optimizer: {choice: [sgd, adamw]}
      momentum: {uniform: [0.0, 0.9], when: {optimizer: sgd}}
      weight_decay: {loguniform: [1.0e-4, 0.1], when: {optimizer: adamw}}
      beta1: {choice: [0.8, 0.9], when: {optimizer: adamw, weight_decay_kind: [decoupled]}}

A trial whose condition does not hold has no value for it: the task sees the default, and the
results table's `config.<name>` is empty.

`random` and `grid` searches are sampled here, up front and reproducibly from
the sweep seed, so the same sweep always means the same trials whether or not
they are packed; `optuna` hands the space to Ray Tune's OptunaSearch. Parameters
are the platform's hyperparameters and the task's own (`rayhpc.task.hparams`).
"""

from __future__ import annotations

import math
import random
import typing
from typing import Any, Union

from pydantic import BaseModel, Field, ValidationError, model_validator

from rayhpc.config import ConfigError, StrictModel
from rayhpc.task.hparams import check_value

Scalar = Union[bool, int, float, str]


KINDS = ("grid", "choice", "uniform", "loguniform", "randint", "quniform", "qloguniform", "lograndint")
RANGES = ("uniform", "loguniform", "randint", "quniform", "qloguniform", "lograndint")  # [low, high, ...]
FLOATS = ("uniform", "loguniform", "quniform", "qloguniform")


class ParamSpec(StrictModel):
    """Exactly one way of drawing a parameter's values."""

    grid: list[Scalar] | None = Field(None, description="every value, each in its own trial (cross product)")
    choice: list[Scalar] | None = Field(None, description="one value drawn uniformly per trial")
    uniform: tuple[float, float] | None = Field(None, description="[low, high] float")
    loguniform: tuple[float, float] | None = Field(None, description="[low, high] float, log scale, low > 0")
    randint: tuple[int, int] | None = Field(None, description="[low, high) integer")
    quniform: tuple[float, float, float] | None = Field(None, description="[low, high, q] float, a multiple of q")
    qloguniform: tuple[float, float, float] | None = Field(None, description="[low, high, q] float, log scale, "
                                                           "a multiple of q")
    lograndint: tuple[int, int] | None = Field(None, description="[low, high) integer, log scale, low > 0")
    when: dict[str, Union[Scalar, list[Scalar]]] | None = Field(None, description="drawn only where every named "
                                                                 "parameter has this value (or one of these)")

    @model_validator(mode="after")
    def _one_kind(self) -> "ParamSpec":
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(KINDS)} (got {', '.join(given) or 'none'})")
        kind = given[0]
        value = getattr(self, kind)
        if kind in ("grid", "choice") and not value:
            raise ValueError(f"{kind}: empty list; give at least one value")
        if kind in RANGES and not value[0] < value[1]:
            raise ValueError(f"{kind}: low {value[0]} must be < high {value[1]}")
        if kind in ("loguniform", "qloguniform", "lograndint") and value[0] <= 0:
            raise ValueError(f"{kind}: low {value[0]} must be > 0")
        if kind in ("quniform", "qloguniform") and value[2] <= 0:
            raise ValueError(f"{kind}: q {value[2]} must be > 0")
        if self.when is not None and not self.when:
            raise ValueError("when: empty; name at least one parameter and its value")
        return self

    def holds(self, values: dict) -> bool:
        """Whether the condition (`when`) holds for a trial's values so far (no condition: always)."""
        return all(name in values and values[name] in (want if isinstance(want, list) else [want])
                   for name, want in (self.when or {}).items())

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
    """Reject draws the search cannot make, conditions that cannot hold, and spaces that search nothing."""
    for name, spec in space.items():
        if search == "grid" and isinstance(spec, ParamSpec) and spec.kind not in ("grid", "choice"):
            raise ConfigError(f"space.{name}: search=grid needs grid or choice values, got {spec.kind}")
        if search == "optuna" and isinstance(spec, ParamSpec) and spec.kind == "grid":
            raise ConfigError(f"space.{name}: search=optuna samples values; use choice instead of grid")
        if isinstance(spec, ParamSpec) and spec.when:
            _check_condition(space, name, spec, search)
    ordered(space)  # no cycle of conditions
    if not searched(space):
        raise ConfigError(f"space: empty search space; give at least one parameter as {', '.join(KINDS)}")


def _check_condition(space: Space, name: str, spec: ParamSpec, search: str) -> None:
    """Each parameter `when` names is in the space, takes the values named, and is known when `name` is
    drawn: a listed value (choice, grid) or a fixed one; a grid parameter's condition names grid values."""
    as_grid = {"grid"} | ({"choice"} if search == "grid" else set())
    for parent, want in spec.when.items():
        if parent == name or parent not in space:
            raise ConfigError(f"space.{name}.when: {parent} is not another parameter of the space "
                              f"({', '.join(n for n in space if n != name) or 'none'})")
        other = space[parent]
        values = list(other.args) if isinstance(other, ParamSpec) and other.kind in ("grid", "choice") else None
        if isinstance(other, ParamSpec) and values is None:
            raise ConfigError(f"space.{name}.when: {parent} is drawn from a range ({other.kind}); a condition "
                              "names a choice, grid or fixed parameter")
        values = values if values is not None else [other]
        for value in want if isinstance(want, list) else [want]:
            if value not in values:
                raise ConfigError(f"space.{name}.when: {parent}={value!r} is not a value {parent} takes "
                                  f"({', '.join(map(str, values))})")
        if spec.kind in as_grid and isinstance(other, ParamSpec) and other.kind not in as_grid:
            raise ConfigError(f"space.{name}.when: {name} is a grid parameter (every value its own trial) and "
                              f"{parent} is drawn per trial; make {parent} grid too, or {name} a choice")


def ordered(space: Space) -> list[str]:
    """The parameters in the space's order, each after those its condition names (a cycle is refused)."""
    placed: list[str] = []
    remaining = list(space)
    while remaining:
        ready = next((n for n in remaining if all(p in placed for p in _parents(space[n]))), None)
        if ready is None:
            raise ConfigError(f"space.{remaining[0]}.when: the conditions of {', '.join(remaining)} name each "
                              "other in a cycle")
        placed.append(ready)
        remaining.remove(ready)
    return placed


def _parents(spec) -> list[str]:
    return list(spec.when) if isinstance(spec, ParamSpec) and spec.when else []


def log_quanta(space: Space) -> dict[str, float]:
    """q of each qloguniform parameter: Optuna samples log-scale floats without a step (Tune's conversion
    drops it), so its proposals are rounded to q after (`quantize`)."""
    return {n: s.args[2] for n, s in space.items() if isinstance(s, ParamSpec) and s.kind == "qloguniform"}


def quantize(value: float, q: float) -> float:
    """`value` as a multiple of `q`, as Tune's quantized draws (float noise rounded off)."""
    return round(round(value / q) * q, 12)


def conditional(space: Space) -> dict[str, ParamSpec]:
    """The parameters that exist only where their condition holds."""
    return {n: s for n, s in space.items() if isinstance(s, ParamSpec) and s.when}


def check_space_values(space: Space, hp_model: type[BaseModel]) -> None:
    """Reject parameters the task does not take and values of the wrong type (the platform's and the
    task's own hyperparameters, `hp_model`)."""
    for name, spec in space.items():
        for value in _values_to_check(spec):
            check_value(hp_model, f"space.{name}", name, value)
        annotation = hp_model.model_fields[name].annotation
        if isinstance(spec, ParamSpec) and spec.kind in FLOATS and int in _types(annotation):
            raise ConfigError(f"space.{name}: {spec.kind} draws floats but {name} is an integer; use randint, "
                              "lograndint, choice or grid")


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
    low, high = spec.args[:2]
    return [low, high - 1 if spec.kind in ("randint", "lograndint") else high]


def searched(space: Space) -> list[str]:
    """Names of the parameters the space varies (its `config.<name>` result columns)."""
    return [name for name, spec in space.items() if isinstance(spec, ParamSpec)]


def sample_configs(space: Space, num_samples: int, search: str, seed: int, hp_model: type[BaseModel],
                   defaults: dict) -> list[dict]:
    """Every trial's full hyperparameters (`defaults` where the space sets nothing), in trial order; a
    conditional parameter whose condition does not hold is left out (the task gets its default).

    As in Ray Tune, grid values form a cross product and `num_samples` draws of
    the other parameters are made for each grid point. With `search=grid`,
    choice parameters count as grid parameters. `seed` seeds the draws.
    """
    rng = random.Random(seed)
    as_grid = {"grid"} | ({"choice"} if search == "grid" else set())
    order = ordered(space)
    grid = [n for n in order if isinstance(space[n], ParamSpec) and space[n].kind in as_grid]
    points = [{}]
    for name in grid:  # the cross product, each grid parameter only where its condition holds
        spec = space[name]
        points = [q for p in points for q in ([{**p, name: v} for v in spec.args] if spec.holds(p) else [p])]
    configs = []
    for _ in range(num_samples):
        for point in points:
            values = dict(point)
            for name in order:
                spec = space[name]
                if name not in values and name not in grid and (not isinstance(spec, ParamSpec) or spec.holds(values)):
                    values[name] = draw(spec, rng)
            configs.append(_trial_hparams(space, values, hp_model, defaults))
    return configs


def complete_point(space: Space, point: dict, seed: int, hp_model: type[BaseModel], defaults: dict) -> dict:
    """A point to evaluate as a trial's full hyperparameters: the parameters it leaves out drawn (seeded by
    `seed`), each conditional one only where its condition holds (else left out, as in `sample_configs`)."""
    rng = random.Random(seed)
    values = dict(point)
    for name in ordered(space):
        spec = space[name]
        if name in values or (isinstance(spec, ParamSpec) and not spec.holds(values)):
            continue
        values[name] = rng.choice(spec.args) if isinstance(spec, ParamSpec) and spec.kind == "grid" else draw(spec, rng)
    return _trial_hparams(space, values, hp_model, defaults)


def _trial_hparams(space: Space, values: dict, hp_model: type[BaseModel], defaults: dict) -> dict:
    """A trial's full hyperparameters from the values drawn for it: `defaults` for the rest, less the
    conditional parameters not drawn (their condition did not hold: the task gets its default)."""
    left_out = set(conditional(space)) - set(values)
    full = hp_model.model_validate({**defaults, **values}).model_dump()
    return {k: v for k, v in full.items() if k not in left_out}


def draw(spec: ParamSpec | Scalar, rng: random.Random) -> Any:
    if not isinstance(spec, ParamSpec):
        return spec
    kind, args = spec.kind, spec.args
    if kind == "choice":
        return rng.choice(args)
    if kind in ("uniform", "quniform"):
        value = rng.uniform(args[0], args[1])
    elif kind in ("loguniform", "qloguniform", "lograndint"):
        value = math.exp(rng.uniform(math.log(args[0]), math.log(args[1])))
    elif kind == "randint":
        return rng.randrange(args[0], args[1])
    else:
        raise AssertionError(f"unhandled kind {kind}")  # grid values are placed by sample_configs
    if kind == "lograndint":  # [low, high), as Tune's
        return min(args[1] - 1, max(args[0], int(value)))
    if kind in ("quniform", "qloguniform"):
        return quantize(value, args[2])
    return value


def tune_domains(space: Space) -> dict[str, Any]:
    """The space as Ray Tune sampling domains (for searchers such as OptunaSearch), parents before the
    parameters whose conditions name them."""
    from ray import tune  # Ray: only where a cluster is used (config checks and --help stay fast)

    make = {"choice": tune.choice, "uniform": lambda a: tune.uniform(*a),
            "loguniform": lambda a: tune.loguniform(*a), "randint": lambda a: tune.randint(*a),
            "quniform": lambda a: tune.quniform(*a), "qloguniform": lambda a: tune.qloguniform(*a),
            "lograndint": lambda a: tune.lograndint(*a)}
    return {n: make[space[n].kind](space[n].args) if isinstance(space[n], ParamSpec) else space[n]
            for n in ordered(space)}
