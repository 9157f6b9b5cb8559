"""The study folder: one sweep that several slices (Ray clusters, Slurm jobs) work on together.

    DIR/sweep.yaml        the sweep's definition: the first slice writes it, later ones must agree
    DIR/plan.json         search random or grid: every pack of trials, made once by the first slice
    DIR/ledger.jsonl      what happened, one JSON line per event, appended under the lock: a slice
                          joined, a pack was claimed (its members), a pack finished (its rows)
    DIR/optuna.journal    search optuna: Optuna's study (its JournalStorage file backend)
    DIR/asha_members.pkl  scheduler asha: the rung records every slice decides from
    DIR/packs/<id>/       each pack's latest checkpoint, from which any slice resumes it
    DIR/slices/<id>/      each slice's own Ray Tune experiment
    DIR/slices/<id>.lock  held (flock) by the slice's driver for as long as it lives
    DIR/results.parquet   the union of every finished trial, written by each slice as it ends

Every change goes through one lock, `flock` on `DIR/study.lock` (filelock's `UnixFileLock`), which the
kernel (or the shared filesystem's lock manager: NFSv4, Lustre mounted with `flock`) releases when its
holder dies, so a SIGKILLed slice never leaves the study locked. A slice is alive while it holds the lock on
its own file: another slice finds a dead one by taking that lock, with no clock or heartbeat to trust, and
claims its unfinished packs again (they resume from their checkpoints). A pack's rows are written
once, by the first slice to finish it: every trial ends exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import pandas as pd
from filelock import Timeout, UnixFileLock

from rayhpc.private import replace_whole

LOCK_FILE = "study.lock"
LEDGER_FILE = "ledger.jsonl"
PLAN_FILE = "plan.json"
RESULTS_FILE = "results.parquet"
SLICES_DIR = "slices"
PACKS_DIR = "packs"

# propose(n) -> (members' hyperparameters, their Optuna trial numbers): a searcher's next pack
Proposer = Callable[[int], tuple[list[dict], list[int]]]


class FileLock(UnixFileLock):
    """filelock's `UnixFileLock` as `file_lock` makes it, which pickles as its path: a slice's searcher holds one
    in its Optuna storage, and Tune saves the searcher whole (the copy is a new lock, not held)."""

    def __reduce__(self):
        return file_lock, (str(self.lock_file),)


def file_lock(path: Path) -> FileLock:
    """An exclusive `flock` on `path` (created 0600, never through a link), released on exit or death: the
    kernel's lock only, never filelock's soft fallback (a file that a SIGKILLed holder would leave behind)."""
    return FileLock(path, mode=0o600, fallback_to_soft=False)


def slice_id() -> str:
    """A name no other slice has: host, process and start time."""
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}-{time.time_ns() // 1_000_000 % 10**10}"


class Study:
    """What the ledger says, replayed: packs (claimed, by whom, finished with which rows) and slices.
    Read and change it only inside `with study.locked():`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.packs: dict[int, dict] = {}  # id -> {"members", "optuna", "holder", "claims", "rows"}
        self.slices: dict[str, dict] = {}
        self.plan: list[list[dict]] | None = None
        self._offset = 0
        self._dead: set[str] = set()
        self._alive: FileLock | None = None
        self.me: str | None = None  # this process's slice, once it joined

    @contextlib.contextmanager
    def locked(self) -> Iterator["Study"]:
        with file_lock(self.path / LOCK_FILE):
            self._refresh()
            yield self

    def _refresh(self) -> None:
        """Apply the ledger's events written since the last look (complete lines only)."""
        try:
            with open(self.path / LEDGER_FILE, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            self._apply(json.loads(line))
        self._offset += end
        if self.plan is None and (self.path / PLAN_FILE).exists():
            self.plan = json.loads((self.path / PLAN_FILE).read_text())

    def _apply(self, event: dict) -> None:
        kind = event["event"]
        if kind == "slice":
            self.slices[event["slice"]] = event
        elif kind == "claim":
            pack = self.packs.setdefault(event["pack"], {"members": event["members"], "optuna": event.get("optuna"),
                                                         "claims": [], "rows": None})
            pack["holder"] = event["slice"]
            pack["claims"].append(event["slice"])
        elif kind == "finish":
            self.packs[event["pack"]].update(rows=event["rows"], finished_by=event["slice"])

    def _append(self, event: dict) -> None:
        """One event, one write, under the lock; then read back like any other."""
        line = (json.dumps({**event, "time": time.time()}, default=str) + "\n").encode()
        fd = os.open(self.path / LEDGER_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        self._refresh()

    def join(self, slice_name: str, objective: tuple[str, str]) -> None:
        """This process becomes slice `slice_name` (`self.me`): it holds its liveness lock until it exits.
        `objective`: (reported name, "min" or "max"), for `rayhpc status --study`."""
        (self.path / SLICES_DIR).mkdir(mode=0o700, exist_ok=True)
        self._alive, self.me = file_lock(self._slice_lock(slice_name)), slice_name
        self._alive.acquire()  # held for the life of the process
        with self.locked():
            self._append({"event": "slice", "slice": slice_name, "host": socket.gethostname(), "pid": os.getpid(),
                          "objective": list(objective)})

    def _slice_lock(self, name: str) -> Path:
        return self.path / SLICES_DIR / f"{name}.lock"

    def alive(self, name: str) -> bool:
        """Whether slice `name`'s driver still runs: it holds the lock on its file (a dead one never comes back)."""
        if name in self._dead:
            return False
        if os.path.lexists(self._slice_lock(name)):  # (a missing one: a slice that never joined)
            lock = file_lock(self._slice_lock(name))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                return True  # (this process's own slice too: a second descriptor conflicts with the first)
            lock.release()
        self._dead.add(name)
        return False

    def ensure_plan(self, make: Callable[[], list[list[dict]]]) -> list[list[dict]]:
        """The study's plan of packs (random and grid), made by the first slice that asks."""
        if self.plan is None:
            plan = make()
            replace_whole(self.path / PLAN_FILE, lambda tmp: tmp.write_text(json.dumps(plan)))
            self.plan = plan
        return self.plan

    def claim(self, me: str, propose: Proposer | None, size: int, budget: int) -> dict | None:
        """The next pack for slice `me`: one a dead slice left unfinished (it resumes from its checkpoint),
        else the plan's next unclaimed pack, else (a searcher) `size` new members while fewer than `budget`
        were proposed; None when nothing is left to claim."""
        for pack_id, pack in sorted(self.packs.items()):
            if pack["rows"] is None and pack["holder"] != me and not self.alive(pack["holder"]):
                return self._claimed(me, pack_id, pack["members"], pack["optuna"])
        if self.plan is not None:
            for pack_id, members in enumerate(self.plan):
                if pack_id not in self.packs:
                    return self._claimed(me, pack_id, members, None)
            return None
        proposed = sum(len(p["members"]) for p in self.packs.values())
        if propose is None or proposed >= budget:
            return None
        members, numbers = propose(min(size, budget - proposed))
        return self._claimed(me, max(self.packs, default=-1) + 1, members, numbers)

    def _claimed(self, me: str, pack_id: int, members: list[dict], optuna: list[int] | None) -> dict:
        self._append({"event": "claim", "pack": pack_id, "slice": me, "members": members, "optuna": optuna})
        return {"pack": pack_id, **self.packs[pack_id]}

    def finish(self, me: str, pack_id: int, rows: list[dict]) -> bool:
        """Record pack `pack_id`'s rows, unless another slice finished it first (then False)."""
        if self.packs[pack_id]["rows"] is not None:
            return False
        self._append({"event": "finish", "pack": pack_id, "slice": me, "rows": rows})
        return True

    def results(self) -> pd.DataFrame:
        """Every finished trial's row, by pack."""
        return pd.DataFrame([row for _, p in sorted(self.packs.items()) if p["rows"] for row in p["rows"]])

    def write_results(self) -> Path:
        return replace_whole(self.path / RESULTS_FILE, lambda tmp: self.results().to_parquet(tmp, index=False))

    def pack_dir(self, pack_id: int) -> Path:
        return self.path / PACKS_DIR / str(pack_id)


def save_pack_checkpoint(folder: Path, step: int, write: Callable[[Path], None], keep: int = 1) -> Path:
    """A pack's checkpoint after optimizer step `step`, named as every job's (`checkpoint_<step>`), written by
    `write` (the checkpoint module's layout, progress last) into a new private folder and renamed into place
    whole, so that a slice on another allocation never reads half of one; all but the latest `keep` are removed
    (`rayhpc.engine.checkpoint`, whose `latest_checkpoint` finds the newest)."""
    from rayhpc.engine import checkpoint  # torch: only where a pack trains

    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".tmp-"))
    write(tmp)
    final = folder / f"checkpoint_{step:06d}"
    try:
        tmp.rename(final)  # a folder is renamed onto an empty one only: never onto a checkpoint
    except OSError:  # another slice saved this step first (the same state: a step's training is deterministic)
        shutil.rmtree(tmp, ignore_errors=True)
    checkpoint.prune(folder, keep)
    return final
