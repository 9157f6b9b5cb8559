"""Population-based training on a pack: the pack's members are the population (Tune's PBT rules,
applied inside one process, with no checkpoint round trip through storage).

Every `interval` epochs the members are ranked by the objective; each of the worst `quantile`
copies the weights, buffers and optimizer state of one of the best `quantile` (exploit: a slice
copy between two slots of the stacked tensors) and then perturbs the optimizer's hyperparameters
it took over (explore): with probability `resample` a fresh draw from the space, else the value
times 0.8 or 1.2 (kept inside the space's bounds; a choice moves to a neighbouring value), as
Ray Tune's PopulationBasedTraining does. Only the packed optimizer's per-member hyperparameters
(lr, momentum, weight decay) can change inside a pack: everything else the members share.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from rayhpc.tune.space import ParamSpec, draw

MUTABLE = ("lr", "momentum", "weight_decay")  # the packed optimizer's per-member hyperparameters


@dataclass(frozen=True)
class PbtRules:
    interval: int  # epochs between exploit/explore rounds
    quantile: float  # share of the population that is copied, and that it copies from
    resample: float  # probability of a fresh draw instead of a x0.8 / x1.2 perturbation
    space: dict  # the mutable hyperparameters' ParamSpecs
    metric: str
    mode: str
    seed: int


def mutable(space: dict) -> dict[str, ParamSpec]:
    return {k: space[k] for k in MUTABLE if isinstance(space.get(k), ParamSpec)}


def perturb(value: float, spec: ParamSpec, resample: float, rng: random.Random) -> float:
    if rng.random() < resample:
        return draw(spec, rng) if spec.kind != "grid" else rng.choice(spec.args)
    if spec.kind in ("choice", "grid"):  # a neighbouring value of the list
        values = sorted(spec.args)
        i = min(range(len(values)), key=lambda k: abs(values[k] - value))
        return values[min(len(values) - 1, max(0, i + rng.choice([-1, 1])))]
    low, high = spec.args
    return min(high, max(low, value * rng.choice([0.8, 1.2])))


def exploit_explore(pack, opt, state: dict, values: dict, rules: PbtRules, epoch: int, pack_id) -> None:
    """One PBT round over the pack's members (all of them: PBT stops none) after `epoch` epochs."""
    size = len(state["hp"])
    if epoch % rules.interval or size < 2:
        return
    score = values[rules.metric]
    # best first; a diverged member (NaN) ranks last
    order = sorted(range(size), key=lambda j: (math.isnan(score[j]), score[j] if rules.mode == "min" else -score[j]))
    n = max(1, min(size // 2, int(size * rules.quantile)))
    rng = random.Random(f"{rules.seed}-{pack_id}-{epoch}")  # the same round again after a resume
    for dst in order[-n:]:
        src = rng.choice(order[:n])
        pack.copy_member(dst, src)
        opt.copy_member(dst, src)
        new = {k: perturb(state["hp"][src][k], spec, rules.resample, rng) for k, spec in rules.space.items()}
        opt.set_member(dst, new)
        state["hp"][dst] = {**state["hp"][src], **new}
        state["pbt"].append({"epoch": epoch, "member": dst, "copied": src, **new})
