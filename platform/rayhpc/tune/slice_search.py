"""A slice's Ray Tune searcher: every Tune trial is a pack claimed from the study, and its rows go back there.

Tune asks the searcher for a trial whenever a slot is free; `StudySearcher.suggest` claims the study's
next pack under the study's lock (one a dead slice left, the plan's next, or new members proposed by
Optuna from the study's shared journal), and returns FINISHED once nothing is left to claim: the packs
still running belong to live slices. When a pack ends, its rows are recorded once in the study, and
Optuna is told each member's value.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from ray.tune.search import Searcher

from rayhpc import interrupt
from rayhpc.study.folder import Study, file_lock
from rayhpc.tune.results import trial_rows
from rayhpc.tune.trainable import flat_members, member_values

OPTUNA_JOURNAL = "optuna.journal"


class OptunaProposer:
    """Optuna's study of the study folder (`JournalStorage` on a file, locked with the study's own kind of
    lock, so a SIGKILLed slice leaves no stale lock): asks packs of members and tells their values."""

    def __init__(self, folder: Path, space: dict, shared: list[str], mode: str, seed: int, slice_name: str):
        import optuna  # optional: only Optuna searches
        from ray.tune.search.optuna import OptunaSearch

        searched = {k: v for k, v in space.items() if hasattr(v, "sample")}  # Tune domains; the rest constants
        self.constants = {k: v for k, v in space.items() if k not in searched}
        self.distributions = OptunaSearch.convert_search_space(searched)
        self.shared = [k for k in shared if k in self.distributions]
        # each slice samples with its own stream: two slices with the same history must not propose the same
        sampler = optuna.samplers.TPESampler(seed=(seed * 1_000_003 + zlib.crc32(slice_name.encode())) % 2**31)
        self.study = optuna.create_study(study_name="rayhpc", storage=_journal(folder), sampler=sampler,
                                         direction="minimize" if mode == "min" else "maximize", load_if_exists=True)

    def __call__(self, n: int) -> tuple[list[dict], list[int]]:
        from rayhpc.tune.adaptive import ask_pack

        batch = ask_pack(self.study, self.distributions, self.shared, n)
        return [{**self.constants, **t.params} for t in batch], [t.number for t in batch]

    def tell(self, numbers: list[int], values: list[float | None]) -> None:
        from optuna.trial import TrialState  # optional: only Optuna searches

        for number, value in zip(numbers, values):
            if value is None or math.isnan(value):  # an errored or diverged member
                self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
            else:
                self.study.tell(number, value, skip_if_finished=True)


def _journal(folder: Path):
    import optuna  # optional: only Optuna searches

    path = str(folder / OPTUNA_JOURNAL)
    try:  # Optuna 4+
        from optuna.storages.journal import JournalFileBackend
    except ImportError:  # Optuna 3.1-3.6 (the declared floor)
        JournalFileBackend = optuna.storages.JournalFileStorage
    # Optuna's own lock files outlive a SIGKILLed holder (Optuna 3.x has no grace period), a flock never does;
    # its backend only calls the lock's acquire() and release()
    return optuna.storages.JournalStorage(JournalFileBackend(path, lock_obj=file_lock(folder / "optuna.lock")))


@dataclass
class _Ended:
    """What `trial_rows` reads of a Tune trial, for a pack that ended."""

    trial_id: str
    config: dict
    last_result: dict
    status: str
    error_file: str | None = None


@dataclass
class SliceRecorder:
    """How a pack's final result becomes the study's rows."""

    epochs: int | None
    searched: list[str]
    columns: list[str]
    metric: str
    running: dict = field(default_factory=dict)  # Tune trial id -> the claimed pack

    def rows(self, pack: dict, result: dict, error: bool) -> list[dict]:
        ended = _Ended(str(pack["pack"]), {"members": pack["members"]}, _unflatten(result),
                       "ERROR" if error else "TERMINATED")
        rows = trial_rows(ended, None, self.epochs, self.searched, self.columns)
        for j, row in enumerate(rows):
            row["trial_id"] = f"{pack['pack']}-{j}"  # the study's id: unique across slices
        return rows

    def finished(self, result: dict, error: bool) -> bool:
        """Whether the pack ran to its end (or errored, or every member was stopped), not cut short by a stop
        signal: an interrupted pack is left claimed, for this slice's successor to resume."""
        if error:
            return True
        if interrupt.received():
            return False
        epoch = result.get("epoch", 0)
        return self.epochs is None or epoch >= self.epochs or result.get("active_members", 1) == 0


class StudySearcher(Searcher):
    """Claims packs from the study for Tune's free slots; records each pack's rows once when it ends."""

    def __init__(self, study: Study, me: str, recorder: SliceRecorder, size: int, budget: int,
                 propose: OptunaProposer | None, metric: str, mode: str):
        super().__init__(metric=metric, mode=mode)
        self.study, self.me, self.recorder = study, me, recorder
        self.size, self.budget, self.propose = size, budget, propose

    def suggest(self, trial_id: str) -> dict | None:
        with self.study.locked():
            pack = self.study.claim(self.me, self.propose, self.size, self.budget)
        if pack is None:
            return self.FINISHED
        self.recorder.running[trial_id] = pack
        return {"pack": pack["pack"], "members": pack["members"]}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        pack = self.recorder.running.pop(trial_id, None)
        result = result or {}
        if pack is None or not self.recorder.finished(result, error):
            return
        rows = self.recorder.rows(pack, result, error)
        with self.study.locked():
            first = self.study.finish(self.me, pack["pack"], rows)
            if first and pack.get("optuna") and self.propose is not None:
                self.propose.tell(pack["optuna"], [member_values(flat_members(result), j).get(self.recorder.metric)
                                                   for j in range(len(pack["members"]))])

    def save(self, checkpoint_path: str) -> None:
        """The state is the study folder's; Tune's copy of the searcher holds nothing."""
        Path(checkpoint_path).write_text("{}")

    def restore(self, checkpoint_path: str) -> None:
        pass


def _unflatten(result: dict) -> dict:
    """Tune hands searchers the last result flattened (members/<name>); `trial_rows` reads it nested."""
    out: dict = {}
    for key, value in result.items():
        *path, leaf = key.split("/")
        target = out
        for part in path:
            target = target.setdefault(part, {})
        target[leaf] = value
    return out
