"""Several objectives and constraints of a sweep: what they may name, what the platform measures for
them, and the Pareto front of the results table.

An objective is `NAME:MODE` (`val_accuracy:max`); a constraint is `NAME<=BOUND` or `NAME>=BOUND`
(`params<=5e6`). NAME is a value the task reports (train_loss, val_loss, val_<metric>) or one the
platform measures per trial:

- `params`: the parameters of the trial's model (`model(hp)`, built once on the CPU before it trains);
- `flops`: model FLOPs per training sample (`rayhpc.monitor.flops`, torch's counter: the forward's matmuls,
  convolutions and attention, times 3 for the backward);
- `step_ms`: milliseconds per optimizer step of the trial's pack (members of one pack share it);
- `peak_mem_mb`: the trial process's peak memory in MiB (its GPU's allocated peak on a GPU, else its
  resident set): also shared by a pack's members.

The first objective is the sweep's "best" (ASHA, PBT, kept checkpoints, `--init-from`); all of them
go to Optuna's multi-objective samplers, and the results table marks the non-dominated trials
(`pareto`) and, with constraints, the trials that meet them all (`feasible`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rayhpc.config import ConfigError

MEASURED = ("params", "flops", "step_ms", "peak_mem_mb")
PER_MEMBER = ("params", "flops")  # measured once per member, before it trains; the others per epoch, per pack
MODES = ("min", "max")
_CONSTRAINT = re.compile(r"^\s*([A-Za-z_]\w*)\s*(<=|>=)\s*([-+0-9.eE]+)\s*$")


def parse_objective(text: str) -> tuple[str, str]:
    """`NAME:MODE` as (name, mode) (the config's validation names the key)."""
    name, sep, mode = str(text).partition(":")
    if not sep or not name.strip() or mode.strip() not in MODES:
        raise ConfigError(f"{text!r}: expected NAME:MODE with MODE min or max, e.g. val_accuracy:max")
    return name.strip(), mode.strip()


@dataclass(frozen=True)
class Constraint:
    name: str
    op: str  # "<=" or ">="
    bound: float

    def __str__(self) -> str:
        return f"{self.name}{self.op}{self.bound:g}"

    def violation(self, value: float) -> float:
        """Optuna's convention: <= 0 where the constraint holds, the amount it is exceeded by otherwise."""
        return value - self.bound if self.op == "<=" else self.bound - value


def parse_constraint(text: str) -> Constraint:
    """`NAME<=BOUND` or `NAME>=BOUND` (the config's validation names the key)."""
    match = _CONSTRAINT.match(str(text))
    try:
        bound = float(match.group(3)) if match else None
    except ValueError:
        bound = None
    if bound is None:
        raise ConfigError(f"{text!r}: expected NAME<=BOUND or NAME>=BOUND, e.g. params<=5e6")
    return Constraint(match.group(1), match.group(2), bound)


def check_names(objectives: list[tuple[str, str]], constraints: list[Constraint], reported: list[str]) -> None:
    """Every name is reported by the task or measured by the platform; no objective twice."""
    for key, names in (("objective (--objective)", [n for n, _ in objectives]),
                       ("constraints (--constraints)", [c.name for c in constraints])):
        for name in names:
            if name not in reported and name not in MEASURED:
                raise ConfigError(f"{key} {name}: not reported or measured; reported: {', '.join(reported)}; "
                                  f"measured: {', '.join(MEASURED)}")
    names = [n for n, _ in objectives]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"objective (--objective) {twice}: given twice")


def measured_names(objectives: list[tuple[str, str]], constraints: list[Constraint]) -> tuple[str, ...]:
    """What the trials must measure: the measured values the objectives and constraints name."""
    named = [n for n, _ in objectives] + [c.name for c in constraints]
    return tuple(m for m in MEASURED if m in named)


def pareto_mask(values):
    """Which rows of `values` ([n, k], every objective to be minimised) no other row dominates (as good in
    every objective and better in one). Rows with a NaN are never on the front."""
    import numpy as np  # only where a table is marked (config checks stay fast)

    ok = ~np.isnan(values).any(axis=1)
    front = np.zeros(len(values), dtype=bool)
    points = values[ok]
    keep = np.ones(len(points), dtype=bool)
    for i in range(len(points)):  # O(n^2 k) in chunks of one row: 10,000 trials take well under a second
        dominated_by = (points <= points[i]).all(axis=1) & (points < points[i]).any(axis=1)
        keep[i] = not dominated_by.any()
    front[np.flatnonzero(ok)] = keep
    return front


def mark_front(table, objectives: list[tuple[str, str]], constraints: list[Constraint]):
    """`table` with `feasible` (every constraint holds; with constraints) and, for several objectives,
    `pareto` (on the front of the feasible trials, by each objective's last reported value: what the
    searcher was told)."""
    import numpy as np  # only where a table is marked (config checks stay fast)
    import pandas as pd

    if table.empty or not (constraints or len(objectives) > 1):
        return table
    table = table.copy()
    feasible = pd.Series(True, index=table.index)
    for c in constraints:
        values = pd.to_numeric(table[c.name], errors="coerce") if c.name in table else pd.Series(np.nan, table.index)
        feasible &= values.map(lambda v: v == v and c.violation(v) <= 0)
    if constraints:
        table["feasible"] = feasible
    if len(objectives) > 1:
        signs = np.array([1.0 if mode == "min" else -1.0 for _, mode in objectives])
        values = np.stack([pd.to_numeric(table[n], errors="coerce").to_numpy(float) for n, _ in objectives], axis=1)
        values[~feasible.to_numpy()] = np.nan
        done = table["status"].isin(["finished", "early-stopped"]).to_numpy() if "status" in table else True
        values[~done] = np.nan  # a running trial's values are not its last yet
        table["pareto"] = pareto_mask(values * signs)
    return table


FLOP_SAMPLES = 4  # training samples the FLOP count runs on (per sample: the count over this)


def measure_member(task, hp: dict, train, names: tuple[str, ...]) -> dict[str, float]:
    """The per-member measured values `names` asks for (`PER_MEMBER`): the parameters of `model(hp)` and its
    model FLOPs per training sample, counted on the CPU with a few training samples (the forward's, by torch's
    counter, times 3: the backward computes a gradient for each operand, twice the forward's work)."""
    import torch  # only in trial processes

    from rayhpc.engine.step import batch_size_of
    from rayhpc.monitor.flops import StepFlops
    from rayhpc.task.batches import collate

    wanted = [n for n in PER_MEMBER if n in names]
    if not wanted:
        return {}
    torch.manual_seed(hp["seed"])
    model = task.model(hp)
    out = {"params": float(sum(p.numel() for p in model.parameters()))}
    if "flops" in wanted:
        batch = collate(train, list(range(min(FLOP_SAMPLES, len(train)))))
        counter = StepFlops()
        with counter.once():
            task.loss(model, batch)
        out["flops"] = 3 * counter.flops / batch_size_of(batch)  # the forward, and twice it for the backward
    return {n: out[n] for n in wanted}


def peak_memory_mb(device) -> float:
    """The trial process's peak memory so far, MiB: its GPU's allocated peak, else its resident set."""
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
