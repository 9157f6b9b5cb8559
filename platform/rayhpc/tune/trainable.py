"""The Ray Tune function trainable: trains one pack of trials of a task, checkpointing every epoch.

A pack is one trial or several trained together (see `rayhpc.tune.packing`). Every
member takes the same batches, in `DistributedSampler` order from the trial's seed and
the epoch, and the checkpoint holds torch's RNG state too, so a trial restarted from
its checkpoint continues exactly as if it had never stopped.
"""

from __future__ import annotations

import functools
import logging
import math
import socket
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from rayhpc.config import ModelOptions, Optim, Schedule
from rayhpc.data import DataConfig
from rayhpc.devices import cuda_device
from rayhpc.engine import Module, checkpoint, train_step
from rayhpc.engine.loop import Best, Plan, Runner, fit
from rayhpc.engine.step import batch_size_of
from rayhpc.monitor.startup import process_start
from rayhpc.optim import lr_factor
from rayhpc.precision import autocast, set_matmul_precision
from rayhpc.study.folder import PACKS_DIR, save_pack_checkpoint
from rayhpc.task.batches import Batches, epoch_steps, eval_batch, loader_workers, to_device
from rayhpc.task.load import LoadedTask
from rayhpc.tune.objectives import PER_MEMBER, measure_member, peak_memory_mb
from rayhpc.tune.packing import SinglePack, make_pack, member_slice
from rayhpc.tune.pbt import MUTABLE, PbtRules, exploit_explore


@dataclass(frozen=True)
class TrialSettings:
    """What every trial of a sweep shares."""

    epochs: int | None  # per trial, or
    steps: int | None  # optimizer steps per trial (the epochs they take, by the trial's batch size)
    threads: int  # torch threads per trial process
    defaults: dict  # every hyperparameter's value where the trial's config does not set it
    data_keys: tuple[str, ...]  # hyperparameters data() reads: trials that agree on them share the data
    data: DataConfig  # the sweep's data section: the validation hold-out
    objective: tuple[str, str]  # (reported name, "min" or "max")
    precision: str = "tf32"  # `rayhpc.precision`'s vocabulary
    model_options: ModelOptions = ModelOptions()  # compile and activation checkpointing (unpacked trials only)
    pbt: PbtRules | None = None  # population-based training of each pack's members
    study: str | None = None  # a study's folder (`rayhpc.study`): packs checkpoint there, for any slice to resume
    keep: int | None = None  # else a pack's latest `keep` checkpoints in its Tune trial's folder (None: Tune keeps them)
    measure: tuple[str, ...] = ()  # what the objectives and constraints need measured (`rayhpc.tune.objectives`)

    @classmethod
    def of(cls, cfg, task: LoadedTask, objective: tuple[str, str], threads: int | None = None, **more) -> TrialSettings:
        """What the trials of the sweep `cfg` share (`more`: what its checks found: the data keys, what to measure,
        PBT's rules, the study); `threads`: per trial process (default: its CPUs). Where the data keys are not
        known (no task check ran), every hyperparameter is one: trials share their data only where they agree."""
        defaults = cfg.defaults(task.hp_model)
        return cls(epochs=cfg.epochs, steps=cfg.steps, threads=threads or max(1, int(cfg.cpus_per_trial)),
                   defaults=defaults, data=cfg.data, objective=objective, precision=cfg.precision,
                   model_options=ModelOptions(**cfg.model_dump(include=set(ModelOptions.model_fields))),
                   **{"data_keys": tuple(sorted(defaults)), **more})


def members_of(config: dict, packs: list[list[dict]] | None) -> list[dict]:
    """The trials a Tune config stands for: a planned pack, or one searcher-made config."""
    if "pack" in config and packs is not None:
        return packs[config["pack"]]
    if "members" in config:  # a pack proposed by a searcher (`rayhpc.tune.adaptive.PackedOptunaSearch`)
        return [dict(m) for m in config["members"]]
    return [dict(config)]


_DATA: dict = {}  # the last trial's datasets, kept for the next trial in this process (reuse_actors)
PACK_CHECKPOINTS = "pack"  # in a Tune trial's folder: the checkpoints its pack keeps (`train_pack`)


def trial_data(task: LoadedTask, hp: dict, settings: TrialSettings):
    """(train, val) of a trial; read once per process for every trial that agrees on data()'s inputs."""
    key = (task.spec, tuple(repr(hp[k]) for k in settings.data_keys), settings.data)
    if _DATA.get("key") != key:
        _DATA.clear()
        _DATA.update(key=key, value=task.split_data(hp, settings.data))
    return _DATA["value"]


def train_pack(config: dict, *, task: LoadedTask, packs: list[list[dict]] | None, settings: TrialSettings,
               keeper=None) -> None:
    """Tune's trainable: the pack `config` stands for, trained by `run_pack` (its reports Tune's, or a
    study's: its checkpoints in the study's folder, where any slice resumes it)."""
    from ray import tune  # Ray: only where a cluster is used (config checks and --help stay fast)

    # members are ASHA's trials by plan position (a searcher's packs: by Tune trial; a study's: by study pack)
    pack_id = config["pack"] if "pack" in config else tune.get_context().get_trial_id()
    if settings.study is not None:
        reports = Reports(Path(settings.study, PACKS_DIR, str(pack_id)), tune.report)
    elif settings.keep is not None:
        # Tune, keeping few checkpoints of a trial, saves its whole experiment state after each one it is given
        # (the state grows with the trials: a big sweep's largest cost per trial in its driver). A pack keeps its
        # own in its Tune trial's folder and gives Tune one, empty, with its first report: Tune saves its state
        # once per trial (a resume knows every trial that ran), and otherwise on its own schedule (every 10 s
        # or more). `get_storage` (a developer API): the trial's folder in the storage path, where export and
        # tracking read (`get_trial_dir` is the worker's working folder)
        folder = Path(tune.get_context().get_storage().trial_fs_path, PACK_CHECKPOINTS)
        reports = Reports(folder, FirstReportCheckpointed(), keep=settings.keep)
    else:  # keep_best: Tune keeps the best checkpoints by the objective
        reports = Reports()
    run_pack(config, task, packs, settings, reports, keeper, pack_id)


def pack_checkpoints(trial_dir: Path) -> Path:
    """Where a Tune trial's pack keeps its checkpoints: its own folder in the trial's (`train_pack`), else the
    trial's (Tune keeps them: `keep_best`)."""
    own = trial_dir / PACK_CHECKPOINTS
    return own if own.is_dir() else trial_dir


class FirstReportCheckpointed:
    """`tune.report`, its first report with an empty checkpoint (see `train_pack`)."""

    def __init__(self):
        self.first = True

    def __call__(self, metrics: dict) -> None:
        from ray import tune  # Ray: only where a cluster is used (config checks and --help stay fast)

        if not self.first:
            return tune.report(metrics)
        self.first = False
        with tempfile.TemporaryDirectory() as tmp:
            return tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))


@dataclass
class Reports:
    """Where a pack's reports and checkpoints go. Tune's (`then` None): each report with its checkpoint. Else each
    report is handed to `then` (`tune.report`; an array task's log), whose True stops the run, and the latest
    `keep` checkpoints are kept in `folder`, each whole (a plain sweep's trial's; a study's pack folder, where any
    slice resumes it; an array task's own), or nowhere. `device`: the trial's (None: the GPU Ray gave it, else
    the CPU)."""

    folder: Path | None = None
    then: Callable[[dict], bool | None] | None = None
    device: torch.device | None = None
    keep: int = 1  # the latest checkpoints kept in `folder`

    def restore(self) -> dict | None:
        """The pack's state from its latest checkpoint (Tune's, or the folder's: another slice's too), or None."""
        if self.then is not None:
            found = checkpoint.latest_checkpoint(self.folder) if self.folder is not None else None
            return None if found is None else load_pack_state(found)
        from ray import tune  # Ray: only where a cluster is used (config checks and --help stay fast)

        if (ckpt := tune.get_checkpoint()) is None:
            return None
        with ckpt.as_directory() as d:
            return load_pack_state(Path(d))

    def report(self, metrics: dict, save: Callable[[Path], None] | None, step: int) -> bool:
        """`metrics`, with the checkpoint `save` writes (None: none) after optimizer step `step`; whether to stop."""
        if self.then is None:
            from ray import tune  # Ray: only where a cluster is used (config checks and --help stay fast)

            if save is None:
                tune.report(metrics)
                return False
            with tempfile.TemporaryDirectory() as tmp:
                save(Path(tmp))
                tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))
            return False
        if save is not None and self.folder is not None:
            save_pack_checkpoint(self.folder, step, save, self.keep)
        return bool(self.then(metrics))


def run_pack(config: dict, task: LoadedTask, packs: list[list[dict]] | None, settings: TrialSettings,
             reports: Reports, keeper=None, pack_id: int | str = 0) -> _Trial | None:
    """Train the pack `config` stands for, one report and checkpoint per epoch, whatever runs it: a Tune trial, a
    study's slice, an array task (a pack of one). With `keeper` (a `rayhpc.tune.adaptive.RungKeeper` actor), ASHA
    may stop members: they leave the pack (the survivors are repacked), their weights and last values kept as
    they were. With `settings.pbt`, the members are a PBT population (`rayhpc.tune.pbt`). Its runner (the trained
    pack, `.pack`), None where it was restored from its final checkpoint."""
    entered, started = time.perf_counter(), {"trial_process_time": process_start(), "trial_entered_time": time.time()}
    # Ray Train logs every persisted checkpoint at INFO; a sweep makes one per trial-epoch.
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    torch.set_num_threads(settings.threads)
    set_matmul_precision(settings.precision)
    device = reports.device or _device()
    members = [{**settings.defaults, **m} for m in members_of(config, packs)]
    hp = members[0]  # what every member shares: batch size, optimiser kind, seed, data
    train, val = trial_data(task, hp, settings)
    if val is None and settings.objective[0] == "val_loss":  # as the task check decides: no validation data
        settings = replace(settings, objective=("train_loss", settings.objective[1]))
    plan = Plan.of(epoch_steps(len(train), hp["batch_size"]), settings.epochs, settings.steps)
    state = reports.restore()
    if state is not None and (state["epoch"] >= plan.epochs or not state["slots"]):
        # restored from its final checkpoint (the driver died before recording the end):
        # report the final metrics again instead of training anything twice
        reports.report(state["metrics"], None, plan.total)
        return None
    pack, opt, state = _build(task, members, device, state, settings)
    state["pack"] = config.get("pack")  # the plan's pack it trains (None: a searcher's): what a cut-short resume reads
    if settings.measure and not state.get("measured"):
        with torch.random.fork_rng(devices=[]):  # the training's random draws stay as without measuring
            state["measured"] = [measure_member(task, m, train, settings.measure) for m in members]
    workers = loader_workers(device, settings.threads)
    trial = _Trial(pack, opt, Batches(train, device, workers), members, plan, state=state, settings=settings,
                   keeper=keeper, pack_id=pack_id, val=Batches(val, device, workers) if val is not None else None,
                   entered=entered, reports=reports)
    trial.started = {**started, "trial_ready_time": time.time()}  # in its first report (start-up benchmarks)
    fit(plan, trial, state["epoch"] * plan.per_epoch)
    return trial


class PackSteps(Runner):
    """A pack's steps as `rayhpc.engine.fit` runs them: its members (`members`: their hyperparameters, in
    pack order) take the same batches, in `DistributedSampler` order from the seed (unless the members are
    repeated runs of different seeds: then each takes its own batches, in its own order, stacked member
    first); an epoch's end keeps each member's mean loss over the epoch's samples."""

    watch_loss = False  # each member's loss is looked at at the epoch's end (`_Trial.end_epoch`)

    def __init__(self, pack, opt, train: Batches, members: list[dict], plan: Plan):
        self.pack, self.opt, self.train, self.members, self.plan = pack, opt, train, members, plan
        self.stacked, self.epoch_loss = False, None

    def batches(self, epoch: int, steps: range):
        """(batch, samples) of each step (batch size and accumulation are the pack's)."""
        hp, seeds = self.members[0], [m["seed"] for m in self.members]
        self.stacked = len(set(seeds)) > 1
        # the members step the epoch alike (ASHA changes them between epochs); stacked: no micro-batches (repeats
        # refuse accumulate)
        self.trained = trained_pack(self.pack, self.opt, self.members, steps.start, self.stacked)
        self.accumulate = 1 if self.stacked else hp["accumulate"]
        self.pack.train()
        if not self.stacked:
            stream = self.train.steps(hp["seed"], epoch, steps, self.plan.per_epoch, hp["batch_size"])
            return ((batch, batch_size_of(batch)) for batch in stream)
        # one batch per seed, each member given its seed's: a gather of the stacked batches
        distinct = list(dict.fromkeys(seeds))
        which = torch.tensor([distinct.index(s) for s in seeds], device=self.train.device)
        orders = (self.train.steps(s, epoch, steps, self.plan.per_epoch, hp["batch_size"]) for s in distinct)
        return ((stack_members(parts, which), batch_size_of(parts[0])) for parts in zip(*orders))

    def step(self, step: int, item) -> tuple[torch.Tensor, int]:
        """One optimizer step of every member; each member's loss on the batch ([members])."""
        batch, samples = item
        return train_step(self.trained, batch, self.accumulate, step, self.plan.total).reshape(-1), samples

    def end_epoch(self, epoch: int, window) -> bool:
        self.epoch_loss = window.loss.cpu()
        return False


def train_epoch(pack, opt, batches: Batches, members: list[dict], epoch: int, total_steps: int) -> torch.Tensor:
    """One pass of `PackSteps` over the training data (cut short at optimizer step `total_steps`, the run's
    last); each member's mean loss over the epoch's samples."""
    plan = Plan(epoch_steps(len(batches), members[0]["batch_size"]), total_steps)
    steps = PackSteps(pack, opt, batches, members, plan)
    fit(plan, steps, epoch * plan.per_epoch, (epoch + 1) * plan.per_epoch)
    return steps.epoch_loss


class _Trial(PackSteps):
    """A Tune trial's pack: at each epoch's end its validation, ASHA's and PBT's decisions, its metrics
    reported to Tune with a checkpoint (or in the study, where any slice resumes it)."""

    def __init__(self, pack, opt, train: Batches, members: list[dict], plan: Plan, *, state: dict,
                 settings: TrialSettings, keeper, pack_id, val: Batches | None, entered: float, reports: Reports):
        super().__init__(pack, opt, train, members, plan)
        self.all, self.state, self.settings, self.keeper = members, state, settings, keeper
        self.pack_id, self.reports = pack_id, reports
        self.val, self.entered, self.resumed_from = val, entered, state["epoch"]
        self.best = Best(settings.objective, state["best"])
        self.started: dict = {}  # this process's start-up marks, until the first report (unix times)

    def batches(self, epoch: int, steps: range):
        self.members = [self.all[j] for j in self.state["slots"]]  # the members ASHA left in the pack
        return super().batches(epoch, steps)

    def step(self, step: int, item) -> tuple[torch.Tensor, int]:
        with autocast(self.settings.precision, self.train.device):
            return super().step(step, item)

    def end_epoch(self, epoch: int, window) -> bool:
        state, settings, device = self.state, self.settings, self.train.device
        step_ms = 1000 * (time.perf_counter() - window.started) / max(window.steps, 1)
        values = {"train_loss": window.loss}
        if self.val is not None:
            with autocast(settings.precision, device):
                values.update(self.pack.evaluate(self.val.all(eval_batch(self.all[0]["batch_size"]))))
        values = _scatter(state["values"], values, state["slots"], len(self.all))  # stopped members' frozen
        values.update(_measured(settings.measure, state, step_ms, device))
        self.best.update(values)
        state["best"], state["epoch"] = self.best.so_far, epoch + 1
        if settings.pbt is None:  # (PBT's exploit replaces a diverged member with a copy of a better one)
            _diverged(self.pack, self.opt, state, values)
        if self.keeper is not None and state["slots"]:
            _asha(self.keeper, self.pack_id, self.pack, self.opt, state, values, settings, self.all)
        if settings.pbt is not None and state["epoch"] < self.plan.epochs:
            exploit_explore(self.pack, self.opt, state, values, settings.pbt, state["epoch"], self.pack_id)
        stop = self._report(values, self.plan.span(epoch).stop)
        return stop or not state["slots"]  # every member stopped

    def _report(self, values: dict, step: int) -> bool:
        state, settings = self.state, self.settings
        seconds = state["seconds"] + time.perf_counter() - self.entered
        metrics = {**_metrics(values, state, settings.objective, seconds, self.resumed_from), **self.started}
        self.started = {}
        save = functools.partial(_save, state={**state, "seconds": seconds, "metrics": metrics}, pack=self.pack,
                                 opt=self.opt, step=step, device=self.train.device)
        return self.reports.report(metrics, save, step)


def _measured(names: tuple[str, ...], state: dict, step_ms: float, device: torch.device) -> dict:
    """Each member's measured values (`rayhpc.tune.objectives`): its own parameters and FLOPs, and the pack's
    step time and the process's peak memory, which its members share."""
    members = len(state.get("measured") or [])
    out = {n: torch.tensor([m[n] for m in state["measured"]]) for n in names if n in PER_MEMBER}
    if "step_ms" in names:
        out["step_ms"] = torch.full((members,), step_ms)
    if "peak_mem_mb" in names:
        out["peak_mem_mb"] = torch.full((members,), peak_memory_mb(device))
    return out


def _build(task: LoadedTask, members: list[dict], device: torch.device, state: dict | None,
           settings: TrialSettings):
    """(pack, optimizer, state): fresh, or as the checkpoint `state` left them (its surviving members)."""
    pack = make_pack(task, members, device, settings.model_options)
    if state is None:
        state = _fresh(len(members), settings.objective)
        # what differs between members (PBT's exploit copies it all: the padded MLP's width too), as PBT changes it
        varies = [k for k in members[0] if len({repr(m.get(k)) for m in members}) > 1 or k in MUTABLE]
        state["hp"] = [{k: m[k] for k in varies if k in m} for m in members]
        return pack, pack.optimizer(members), state
    if len(state["slots"]) < len(members):
        pack.keep(state["slots"])
    opt = pack.optimizer([members[j] for j in state["slots"]])
    pack.load_state_dict(to_device(state.pop("model"), device))
    opt.load_state_dict(to_device(state.pop("optim"), device))
    checkpoint.set_rng_state(state.pop("rng")[0], device)
    return pack, opt, state


def _scatter(kept: dict, values: dict, slots: list[int], members: int) -> dict:
    """Every member's values: the pack's members' new ones at `slots`, a stopped member's as it left them."""
    for name, v in values.items():
        kept.setdefault(name, torch.full((members,), math.nan))[slots] = v.detach().float().cpu()
    return {name: v.clone() for name, v in kept.items()}


def _asha(keeper, pack_id: int | str, pack, opt, state: dict, values: dict, settings: TrialSettings,
          members: list[dict]) -> None:
    """Report each member in the pack to ASHA; the ones it stops before the last epoch leave the pack.
    Repeated runs of one configuration (members that differ only in their seed) are one trial to ASHA,
    reported their mean, and stop together."""
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    epoch, (metric, _) = state["epoch"], settings.objective
    configs = config_groups(members)
    active = {}  # ASHA's trial id -> the positions (in the pack) of its runs
    for pos, j in enumerate(state["slots"]):
        active.setdefault(f"{pack_id}-{j}" if len(set(configs)) == len(members) else f"{pack_id}-c{configs[j]}",
                          []).append(pos)
    results = [(tid, epoch, float(sum(values[metric][state["slots"][p]] for p in ps) / len(ps)))
               for tid, ps in active.items()]
    stops = [False] * len(state["slots"])  # by position in the pack
    for (tid, positions), stop in zip(active.items(), ray.get(keeper.decide.remote(metric, results))):
        for pos in positions:
            stops[pos] = stop
    leaving = [pos for pos, stop in enumerate(stops) if stop] if epoch < settings.epochs else []  # asha: epochs
    _leave(pack, opt, state, leaving, "stopped")


def _diverged(pack, opt, state: dict, values: dict) -> None:
    """Members whose training loss or val_loss this epoch was not finite leave the pack, marked diverged at
    this epoch (their values as they were: NaN); the others train on, unaffected (each member's weights and
    optimizer state are its own)."""
    bad = [pos for pos, j in enumerate(state["slots"])
           if not all(math.isfinite(values[name][j]) for name in ("train_loss", "val_loss") if name in values)]
    _leave(pack, opt, state, bad, "diverged")


def _leave(pack, opt, state: dict, leaving: list[int], why: str) -> None:
    """The members at positions `leaving` (in the pack) leave it, their weights kept as they were and the epoch
    they left at in `state[why]` ("stopped" by ASHA, or "diverged")."""
    if not leaving:
        return
    model = pack.state_dict()
    for pos in leaving:
        j = state["slots"][pos]  # its weights as they were when it stopped (a pack of one's are not stacked)
        state["retired"][j] = member_slice(model, None if isinstance(pack, SinglePack) else pos)
        state.setdefault(why, {})[j] = state["epoch"]  # (a state saved before 2026-12-05 has no "diverged")
    staying = [pos for pos in range(len(state["slots"])) if pos not in leaving]
    state["slots"] = [state["slots"][pos] for pos in staying]
    if staying:
        pack.keep(staying)
        opt.keep(staying, pack.parameters())


def config_groups(members: list[dict]) -> list[int]:
    """Each member's configuration, numbered in pack order: members that differ only in their seed (repeated
    runs) share one; where all share the seed, each member is its own."""
    if len({m["seed"] for m in members}) == 1:
        return list(range(len(members)))
    keys: dict[str, int] = {}
    return [keys.setdefault(repr(sorted((k, repr(v)) for k, v in m.items() if k != "seed")), len(keys))
            for m in members]


def stack_members(parts: tuple, which: torch.Tensor) -> object:
    """One step's batches, one per seed (`parts`), as one batch member first: member j's is the batch of
    seed `which[j]` (each tensor stacked along a new first dimension, then gathered)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(parts).index_select(0, which)
    if isinstance(first, dict):
        return {k: stack_members(tuple(p[k] for p in parts), which) for k in first}
    return type(first)(stack_members(tuple(p[i] for p in parts), which) for i in range(len(first)))


def trained_pack(pack, opt, members: list[dict], step: int, stacked: bool = False):
    """What `rayhpc.engine.train_step` trains of a pack (`rayhpc.optim`'s options, each member's own schedule and
    clipping; `stacked`: a batch per member, member first): a pack of one is the plain model and `torch.optim`
    (or the task's own optimizer, and its scheduler made at `step`, the first this process runs)."""
    if isinstance(pack, SinglePack):
        return Module(pack.model, opt, lambda part: pack.losses(part)[0], Optim.of(members[0]),
                      Schedule.of(members[0]), pack.scheduler(opt, members[0], step))
    return Members(pack, opt, members, stacked)


class Members:
    """A pack's members as `rayhpc.engine.train_step` trains them: each member's own lr factor and clipping
    (the pack's optimizer), its loss one entry of the pack's."""

    def __init__(self, pack, opt, members: list[dict], stacked: bool):
        self.pack, self.opt, self.members, self.stacked = pack, opt, members, stacked
        self.schedules = [Schedule.of(m) for m in members]

    def begin(self, step: int, total_steps: int) -> None:
        self.opt.scale_lr([lr_factor(s, step, total_steps) for s in self.schedules])
        self.opt.zero_grad()

    def backward(self, part, share: float, last: bool) -> torch.Tensor:
        losses = self.pack.losses(part, stacked=True) if self.stacked else self.pack.losses(part)
        (losses.sum() * share).backward()  # the sum's gradient is each member's own
        return losses.detach()

    def finish(self) -> None:
        self.opt.clip_()
        self.opt.step()


def _fresh(members: int, objective: tuple[str, str]) -> dict:
    names = {"val_loss": "min", objective[0]: objective[1]}
    best = {name: torch.full((members,), math.inf if mode == "min" else -math.inf) for name, mode in names.items()}
    # slots: the members still in the pack, in pack order; retired/stopped: by member, their weights and epoch
    return {"epoch": 0, "best": best, "seconds": 0.0, "metrics": None, "values": {},
            "slots": list(range(members)), "retired": {}, "stopped": {}, "diverged": {}, "hp": [], "pbt": []}


def _metrics(values: dict, state: dict, objective: tuple[str, str], seconds: float, resumed_from: int) -> dict:
    """Each member's values, one list per name in member order (`members`; for members ASHA stopped, the epoch
    it stopped at, 0 for the others); the pack's best member (by the objective) also at the top level, which
    drives Tune's own bookkeeping (a pack of one is a plain trial). Lists, not a dict per member: Tune keeps
    statistics of every numeric key of a result in its experiment state, which it saves after each checkpoint,
    so keys per member would make that save grow with every member of every pack (`member_values` reads them)."""
    members, best = len(values["train_loss"]), state["best"]
    reported = {**values, **{f"best_{name}": v for name, v in best.items() if name in values}}
    per_member = {k: [float(x) for x in v.tolist()] for k, v in reported.items()}
    for why in ("stopped", "diverged"):  # the epoch ASHA stopped a member at, or its loss was not finite at
        if state.get(why):
            per_member[f"{why}_epoch"] = [state[why].get(j, 0) for j in range(members)]
    if state["pbt"]:  # PBT changed some members' hyperparameters: report every member's current ones
        for k in dict.fromkeys(k for hp in state["hp"] for k in hp):
            per_member[f"config.{k}"] = [hp.get(k) for hp in state["hp"]]
    name, mode = objective
    sign = 1 if mode == "min" else -1  # a NaN (a diverged member's) leads only where every member's is
    lead = min(range(members), key=lambda i: (math.isnan(v := per_member[name][i]), sign * v if v == v else 0))
    return {**member_values(per_member, lead), "epoch": state["epoch"], "train_seconds": seconds,
            "resumed_from_epoch": resumed_from, "node": socket.gethostname(), "pack_size": members,
            "active_members": len(state["slots"]), "members": per_member}


def member_values(members: dict, j: int) -> dict:
    """Member `j`'s values from a pack's report (`members`: each name's values in member order, as `_metrics`
    writes them; Tune hands searchers them flattened, as `members/<name>`): none where the pack has fewer
    members, none it has no value for (not stopped: `stopped_epoch` 0)."""
    if str(j) in members:  # a dict per member, as packs reported before 2026-11-28 (a sweep or study resumed)
        return members[str(j)]
    return {k: v[j] for k, v in members.items() if j < len(v) and v[j] is not None
            and not (k in ("stopped_epoch", "diverged_epoch") and not v[j])}


def flat_members(result: dict) -> dict:
    """The `members` of a result Tune flattened (`members/<name>`), as `member_values` reads them."""
    return {k.split("/", 1)[1]: v for k, v in result.items() if k.startswith("members/")}


def _save(folder: Path, state: dict, pack, opt, step: int, device: torch.device) -> None:
    """The pack's checkpoint after optimizer step `step`: every job's (`rayhpc.engine.checkpoint`), what the
    members did as its extra state."""
    checkpoint.save(folder, [(pack, opt)], checkpoint.Progress(epoch=state["epoch"], global_step=step,
                                                               train_seconds=state["seconds"]),
                    sharded=False, device=device, extra={"pack": state})


def load_pack_state(folder: Path) -> dict | None:
    """A pack checkpoint's state as `train_pack` keeps it, with the model, optimizer and RNG; None where the
    checkpoint is not a pack's."""
    state = (checkpoint.load_extra(folder) or {}).get("pack")
    if state is None:
        return None
    weights = torch.load(folder / checkpoint.DDP_FILE, map_location="cpu", weights_only=True)
    return {**state, **weights, "rng": torch.load(folder / checkpoint.RNG_FILE, weights_only=True)}


def _device() -> torch.device:
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    # Ray sets CUDA_VISIBLE_DEVICES per trial, so the trial's GPU is always index 0.
    if ray.get_gpu_ids():
        return cuda_device(f"trial given GPU(s) {ray.get_gpu_ids()}")
    return torch.device("cpu")
