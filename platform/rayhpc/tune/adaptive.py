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
import pickle
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.tune.schedulers import ASHAScheduler, TrialScheduler
from ray.tune.search import Searcher

STATE_FILE = "asha_members.pkl"


@dataclass(frozen=True)
class MemberTrial:
    """What Tune's ASHA reads of a trial: its id."""

    trial_id: str


class RungKeeper:
    """ASHA decisions for pack members (run as a Ray actor: `RungKeeper.remote(...)` via `start_keeper`)."""

    def __init__(self, path: str, metric: str, mode: str, max_t: int, grace_period: int, reduction_factor: float,
                 lock: str | None = None):
        """`lock`: a study's lock file (`rayhpc.study`): the state is then shared by every slice's keeper,
        read again and written back under the lock at each decision."""
        self.path, self.lock = Path(path), lock
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
                    self.scheduler.on_trial_add(None, trial)  # ASHA reads no controller
                    self.added.add(member)
                action = self.scheduler.on_trial_result(None, trial, {"epoch": epoch, metric: value})
                self.decided[(member, epoch)] = action == TrialScheduler.STOP
            answers.append(self.decided[(member, epoch)])
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps({"scheduler": self.scheduler, "decided": self.decided, "added": self.added}))
        tmp.replace(self.path)  # atomic: a killed driver leaves the previous state whole
        return answers


def start_keeper(exp_dir: Path, objective: tuple[str, str], epochs: int, grace_period: int,
                 reduction_factor: float, lock: Path | None = None):
    """The sweep's keeper actor (no CPU: it only does bookkeeping), resuming its saved state if any;
    `lock`: a study's, whose slices share the state."""
    actor = ray.remote(num_cpus=0)(RungKeeper)
    return actor.remote(str(exp_dir / STATE_FILE), objective[0], objective[1], epochs, grace_period,
                        reduction_factor, None if lock is None else str(lock))


OPTUNA_TRIALS_FILE = "optuna_trials.json"


def ask_pack(study, distributions: dict, shared: list[str], n: int) -> list:
    """`n` Optuna trials asked of `study` at once, the first sampled freely and the hyperparameters a pack
    shares (`shared`) fixed to the first's for the rest (Optuna's own `enqueue_trial`; the sampler draws the
    others)."""
    batch = []
    for i in range(n):
        if i and shared:
            study.enqueue_trial({k: batch[0].params[k] for k in shared}, skip_if_exists=False)
        batch.append(study.ask(distributions))
    return batch


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
                 exp_dir: str):
        import optuna  # optional: only Optuna searches
        from ray.tune.search.optuna import OptunaSearch

        super().__init__(metric=metric, mode=mode)
        searched = {k: v for k, v in space.items() if hasattr(v, "sample")}  # Tune domains; the rest are constants
        self.constants = {k: v for k, v in space.items() if k not in searched}
        self.distributions = OptunaSearch.convert_search_space(searched)
        self.shared = [k for k in shared if k in self.distributions]
        self.pack, self.total, self.asked, self.exp_dir = pack, total, 0, exp_dir
        direction = "minimize" if mode == "min" else "maximize"
        self.study = optuna.create_study(direction=direction, sampler=optuna.samplers.TPESampler(seed=seed))
        self.pending: dict[str, list] = {}  # Tune trial id -> its members' Optuna trials

    def suggest(self, trial_id: str) -> dict | None:
        if self.asked >= self.total:
            return self.FINISHED
        batch = ask_pack(self.study, self.distributions, self.shared, min(self.pack, self.total - self.asked))
        self.asked += len(batch)
        self.pending[trial_id] = batch
        return {"members": [{**self.constants, **t.params} for t in batch]}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        from optuna.trial import TrialState  # optional: only Optuna searches

        result = result or {}  # Tune hands searchers the last result flattened: members/<j>/<metric>
        for j, trial in enumerate(self.pending.pop(trial_id, [])):
            value = result.get(f"members/{j}/{self.metric}")
            if error or value is None or value != value:  # NaN: a diverged member
                self.study.tell(trial, state=TrialState.FAIL)
            else:
                self.study.tell(trial, value)
        self._write_trials()

    def _write_trials(self) -> None:
        """Every Optuna trial (number, state, value, params) beside the results, for a reader of the study."""
        rows = [{"number": t.number, "state": t.state.name, "value": t.value, "params": t.params}
                for t in self.study.trials]
        path = Path(self.exp_dir) / OPTUNA_TRIALS_FILE
        path.with_suffix(".tmp").write_text(json.dumps(rows, indent=1))
        path.with_suffix(".tmp").replace(path)

    def save(self, checkpoint_path: str) -> None:
        Path(checkpoint_path).write_bytes(pickle.dumps(self.__dict__))

    def restore(self, checkpoint_path: str) -> None:
        self.__dict__.update(pickle.loads(Path(checkpoint_path).read_bytes()))
