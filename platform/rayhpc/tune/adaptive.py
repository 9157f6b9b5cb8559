"""Adaptive search on packed trials: ASHA stopping members of packs, and Optuna proposing packs.

ASHA: every member of a pack is a trial to Ray Tune's own ASHA.

Tune's schedulers stop Tune trials, and a pack is one Tune trial. So the packs ask one
`RungKeeper` actor per sweep, which holds a real `ray.tune.schedulers.ASHAScheduler` and feeds
it each member's result as the result of a trial of its own (the member's id: pack index and
position in the plan): the rung records and cutoffs are Tune's, shared by all packs, exactly as
if every member were an unpacked trial reporting the same values in the same order. A member
told to stop leaves its pack (`rayhpc.tune.trainable`): the survivors are repacked at once, so a
pack of 2 survivors computes 2 members, not 16.

The keeper writes its state (the scheduler and every decision it made) next to the results after
each call, so a resumed sweep replays the same decisions for the epochs it runs again and keeps
the rung records of the trials that had finished.

Optuna: `PackedOptunaSearch`, a Tune searcher that proposes a whole pack per Tune trial from one
study and tells each member's result back to its own Optuna trial.
"""

from __future__ import annotations

import json
import math
import pickle
import threading
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import cloudpickle
from ray.tune.schedulers import ASHAScheduler, MedianStoppingRule, TrialScheduler
from ray.tune.search import Searcher

from rayhpc.private import replace_whole
from rayhpc.tune.trainable import flat_members, member_values

STATE_FILE = "asha_members.pkl"
LOCKS = (type(threading.Lock()), type(threading.RLock()))  # what no pickle carries


@dataclass(frozen=True)
class MemberTrial:
    """What Tune's ASHA reads of a trial: its id."""

    trial_id: str


class _NoController:
    """What Tune's schedulers may ask of the controller: the median rule asks for the live trials to pause one
    for another (its soft mode, which the keeper does not use: a pack member is stopped or goes on)."""

    @staticmethod
    def get_live_trials() -> list:
        return []


class RungKeeper:
    """ASHA (or median stopping) decisions for pack members (run as a Ray actor: `RungKeeper.remote(...)` via
    `start_keeper`)."""

    def __init__(self, path: str, metric: str, mode: str, max_t: int, grace_period: int, reduction_factor: float,
                 lock: str | None = None, kind: str = "asha", min_samples: int = 3):
        """`lock`: a study's lock file (`rayhpc.study`): the state is then shared by every slice's keeper,
        read again and written back under the lock at each decision. `kind`: asha, or median (Tune's
        `MedianStoppingRule`: a member whose best so far is worse than the median of the others' running
        means at the same epoch stops, once `min_samples` others reported)."""
        self.path, self.lock = Path(path), lock
        if kind == "median":
            self.scheduler = MedianStoppingRule(time_attr="epoch", metric=metric, mode=mode,
                                                grace_period=grace_period, min_samples_required=min_samples,
                                                hard_stop=True)
        else:
            self.scheduler = ASHAScheduler(time_attr="epoch", metric=metric, mode=mode, max_t=max_t,
                                           grace_period=grace_period, reduction_factor=reduction_factor)
        self.decided: dict[tuple[str, int], bool] = {}  # (member, epoch) -> stop
        self.added: set[str] = set()
        self._load()

    def _load(self) -> None:
        if self.path.exists():
            saved = pickle.loads(self.path.read_bytes())
            self.scheduler, self.decided, self.added = saved["scheduler"], saved["decided"], saved["added"]

    def decide(self, metric: str, results: list[tuple[str, int, float]]) -> list[bool]:
        """Whether each (member id, epoch, metric value) must stop, in order; a result already decided
        (a resumed pack running an epoch again) gets the same answer."""
        if self.lock is None:
            return self._decide(metric, results)
        from rayhpc.study.folder import file_lock  # only a study's keepers share their state

        with file_lock(Path(self.lock)):
            self._load()  # what the other slices decided since
            return self._decide(metric, results)

    def _decide(self, metric: str, results: list[tuple[str, int, float]]) -> list[bool]:
        answers = []
        for member, epoch, value in results:
            if (member, epoch) not in self.decided:
                trial = MemberTrial(member)
                if member not in self.added:
                    self.scheduler.on_trial_add(_NoController, trial)
                    self.added.add(member)
                action = self.scheduler.on_trial_result(_NoController, trial, {"epoch": epoch, metric: value})
                self.decided[(member, epoch)] = action == TrialScheduler.STOP
            answers.append(self.decided[(member, epoch)])
        # cloudpickle: the median rule holds a lambda (its defaultdict of running means)
        state = cloudpickle.dumps({"scheduler": self.scheduler, "decided": self.decided, "added": self.added})
        replace_whole(self.path, lambda tmp: tmp.write_bytes(state))  # a killed driver leaves the previous one
        return answers


def start_keeper(exp_dir: Path, objective: tuple[str, str], epochs: int, grace_period: int,
                 reduction_factor: float, lock: Path | None = None, kind: str = "asha", min_samples: int = 3):
    """The sweep's keeper actor (no CPU: it only does bookkeeping), resuming its saved state if any;
    `lock`: a study's, whose slices share the state; `kind`: asha or median."""
    actor = ray.remote(num_cpus=0)(RungKeeper)
    return actor.remote(str(exp_dir / STATE_FILE), objective[0], objective[1], epochs, grace_period,
                        reduction_factor, None if lock is None else str(lock), kind, min_samples)


OPTUNA_TRIALS_FILE = "optuna_trials.json"


def ask_pack(study, distributions: dict, shared: list[str], n: int, conditions: dict | None = None,
             constants: dict | None = None) -> list:
    """`n` Optuna trials asked of `study` at once, the first sampled freely and the hyperparameters a pack
    shares (`shared`) fixed to the first's for the rest (Optuna's own `enqueue_trial`; the sampler draws the
    others). `conditions` (name -> `ParamSpec` with `when`): those parameters are suggested only where their
    condition holds on the values so far (define-by-run, `distributions` in the space's order, parents first;
    `constants`: the fixed values a condition may name)."""
    batch = []
    for i in range(n):
        if i and shared:
            study.enqueue_trial({k: batch[0].params[k] for k in shared if k in batch[0].params},
                                skip_if_exists=False)
        if not conditions:
            batch.append(study.ask(distributions))
            continue
        trial = study.ask()
        for name, distribution in distributions.items():
            if name not in conditions or conditions[name].holds({**(constants or {}), **trial.params}):
                suggest(trial, name, distribution)
        batch.append(trial)
    return batch


def suggest(trial, name: str, distribution):
    """`trial.suggest_*` for an Optuna distribution (Tune's converted domain)."""
    from optuna.distributions import CategoricalDistribution, IntDistribution  # optional: only Optuna searches

    if isinstance(distribution, CategoricalDistribution):
        return trial.suggest_categorical(name, distribution.choices)
    kind = trial.suggest_int if isinstance(distribution, IntDistribution) else trial.suggest_float
    return kind(name, distribution.low, distribution.high, step=distribution.step, log=distribution.log)


CONSTRAINTS_ATTR = "constraints"  # each constraint's violation (<= 0: it holds), as Optuna's constraints_func returns


def violations(trial) -> list[float]:
    """Optuna's constraints_func (a module function: the searcher's state is pickled with its sampler)."""
    return trial.user_attrs[CONSTRAINTS_ATTR]


def make_sampler(kind: str, seed: int, constrained: bool, total: int):
    """Optuna's TPE (single- and multi-objective) or NSGA-II, seeded; constrained: they read each trial's
    violations (`CONSTRAINTS_ATTR`). NSGA-II's generations: a quarter of the trials, 4 to 50 each."""
    import optuna  # optional: only Optuna searches

    constraints_func = violations if constrained else None
    if kind == "nsga2":
        return optuna.samplers.NSGAIISampler(population_size=max(4, min(50, total // 4)), seed=seed,
                                             constraints_func=constraints_func)
    return optuna.samplers.TPESampler(seed=seed, constraints_func=constraints_func)


def _mean(values: list) -> float | None:
    """The mean of the runs' values; None where one reported none; NaN where one diverged."""
    if any(v is None for v in values):
        return None
    return math.fsum(values) / len(values)


class PackedOptunaSearch(Searcher):
    """Optuna proposing a pack of trials at once: each Tune trial is a pack of `pack` configurations
    asked of one study in a batch (`study.ask()` k times, TPE by default); when the pack ends, each
    member's result is told back to its own Optuna trial. The study stays model-based across batches:
    every pack is proposed from all the members told before it.

    Members of a pack must step together (`rayhpc.tune.packing.pack_key`): the first member of a batch
    is sampled freely and the hyperparameters packing needs equal (`shared`) are fixed for the rest
    through Optuna's own `enqueue_trial` (the sampler draws the others).
    """

    def __init__(self, space: dict, pack: int, total: int, shared: list[str], metric: str, mode: str, seed: int,
                 exp_dir: str, objectives: list[tuple[str, str]] | None = None, constraints=(), sampler: str = "tpe",
                 conditions: dict | None = None, points: list[dict] | None = None, warm_start: list[str] = (),
                 repeats: int = 1, quanta: dict | None = None):
        """`objectives`: every objective, (name, mode), when there are several (else `metric`, `mode`);
        `constraints`: `rayhpc.tune.objectives.Constraint`s Optuna samples under; `sampler`: tpe or nsga2;
        `conditions`: the space's conditional parameters (`ask_pack`); `points`: configurations asked first
        (`total` counts them); `warm_start`: sweep folders, their ended trials told before any is asked;
        `repeats`: runs of each configuration (seeds `seed`, `seed`+1, ...), each Optuna trial told their mean;
        `quanta`: the step of each log-scale quantized parameter, its proposals rounded to (`space.log_quanta`)."""
        import optuna  # optional: only Optuna searches
        from ray.tune.search.optuna import OptunaSearch

        super().__init__(metric=metric, mode=mode)
        searched = {k: v for k, v in space.items() if hasattr(v, "sample")}  # Tune domains; the rest are constants
        self.constants = {k: v for k, v in space.items() if k not in searched}
        converted = OptunaSearch.convert_search_space(searched)
        self.distributions = {k: converted[k] for k in searched}  # the space's order: parents first
        self.shared = [k for k in shared if k in self.distributions]
        self.pack, self.total, self.asked, self.exp_dir = pack, total, 0, exp_dir
        self.conditions = conditions or {}
        self.objectives, self.constraints = list(objectives or [(metric, mode)]), list(constraints)
        directions = ["minimize" if m == "min" else "maximize" for _, m in self.objectives]
        self.study = optuna.create_study(directions=directions,
                                         sampler=make_sampler(sampler, seed, bool(self.constraints), total))
        self.pending: dict[str, list] = {}  # Tune trial id -> its members' Optuna trials
        self.points = [dict(p) for p in points or []]
        self.repeats, self.seed, self.quanta = repeats, seed, quanta or {}
        for folder in warm_start:
            from rayhpc.tune.warm_start import add_warm_trials  # only warm-started sweeps

            add_warm_trials(self.study, folder, self.distributions, self.objectives)

    def suggest(self, trial_id: str) -> dict | None:
        if self.asked >= self.total:
            return self.FINISHED
        n = min(self.pack, self.total - self.asked)
        if self.points:
            batch, extra = self._ask_points(n)
        else:
            batch = ask_pack(self.study, self.distributions, self.shared, n, self.conditions, self.constants)
            extra = [{}] * len(batch)
        self.asked += len(batch)
        self.pending[trial_id] = batch
        from rayhpc.tune.plan import seeded_runs
        from rayhpc.tune.space import quantize

        configs = [{**self.constants, **t.params, **e} for t, e in zip(batch, extra)]
        configs = [{k: quantize(v, self.quanta[k]) if k in self.quanta else v for k, v in c.items()} for c in configs]
        if self.repeats > 1:  # each configuration's runs, consecutive members of the pack
            configs = [run for c in configs for run in seeded_runs(c, self.repeats, self.seed)]
        return {"members": configs}

    def _ask_points(self, n: int) -> tuple[list, list[dict]]:
        """The next points to evaluate as one pack: the first, and those after it that agree with it on what
        a pack shares (at most `n`), each asked of Optuna as an enqueued trial (so it is told like any);
        and each point's values for keys the space does not search."""
        first = self.points[0]
        group = [p for p in self.points if all(p.get(k) == first.get(k) for k in self.shared)][:n]
        batch, extra = [], []
        for point in group:
            self.points.remove(point)
            fill = {k: batch[0].params[k] for k in self.shared if batch and k not in point and k in batch[0].params}
            self.study.enqueue_trial({**fill, **{k: v for k, v in point.items() if k in self.distributions}},
                                     skip_if_exists=False)
            batch += ask_pack(self.study, self.distributions, [], 1, self.conditions, self.constants)
            extra.append({k: v for k, v in point.items() if k not in self.distributions})
        return batch, extra

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        from optuna.trial import TrialState  # optional: only Optuna searches

        members = flat_members(result or {})  # Tune hands searchers the last result flattened: members/<name>
        for i, trial in enumerate(self.pending.pop(trial_id, [])):
            runs = range(i * self.repeats, (i + 1) * self.repeats)  # the configuration's members: their mean
            values = [_mean([member_values(members, j).get(name) for j in runs]) for name, _ in self.objectives]
            if error or any(v is None or v != v for v in values):  # NaN: a diverged member
                self.study.tell(trial, state=TrialState.FAIL)
                continue
            if self.constraints:  # read back by the sampler's constraints_func when the trial is told
                trial.set_user_attr(CONSTRAINTS_ATTR, [c.violation(_mean([member_values(members, j).get(c.name)
                                                                                  for j in runs]))
                                                       for c in self.constraints])
            self.study.tell(trial, values if len(values) > 1 else values[0])
        self._write_trials()

    def _write_trials(self) -> None:
        """Every Optuna trial (number, state, value(s), params, the constraints' violations) beside the results,
        for a reader of the study."""
        one = len(self.objectives) == 1
        rows = [{"number": t.number, "state": t.state.name, "value": (t.values or [None])[0] if one else None,
                 "values": t.values, "params": t.params,
                 # what the sampler recorded of the constraints (Optuna's own key), and so samples under
                 "sampler_constraints": t.system_attrs.get("constraints")} for t in self.study.trials]
        replace_whole(Path(self.exp_dir) / OPTUNA_TRIALS_FILE, lambda tmp: tmp.write_text(json.dumps(rows, indent=1)))

    def __getstate__(self) -> dict:
        """The searcher pickled without its sampler's locks, which no pickle carries (Optuna 5's genetic samplers,
        NSGA-II's, hold a `threading.Lock`; Tune pickles its searcher as the Tuner is made and at every save): each
        is made again where the state is loaded (`__setstate__`). Optuna's samplers name no public way to drop
        them, so any lock among the sampler's attributes is left out, whatever its name."""
        sampler = vars(self.study.sampler)
        held = {k: sampler.pop(k) for k, v in list(sampler.items()) if isinstance(v, LOCKS)}
        try:
            return {"searcher": pickle.dumps(self.__dict__), "sampler_locks": sorted(held)}
        finally:
            sampler.update(held)

    def __setstate__(self, state: dict) -> None:
        if "searcher" not in state:  # saved by rayhpc before this state's form: the searcher's own attributes
            self.__dict__.update(state)
            return
        self.__dict__.update(pickle.loads(state["searcher"]))
        vars(self.study.sampler).update({k: threading.Lock() for k in state["sampler_locks"]})

    def save(self, checkpoint_path: str) -> None:
        Path(checkpoint_path).write_bytes(pickle.dumps(self.__getstate__()))

    def restore(self, checkpoint_path: str) -> None:
        self.__setstate__(pickle.loads(Path(checkpoint_path).read_bytes()))
