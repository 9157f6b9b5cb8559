"""The one training loop (`rayhpc.engine.fit`): which steps run, in which epochs, and what is due when."""

from __future__ import annotations

import math
import types

import pytest
import torch

from rayhpc.engine.loop import Best, Diverged, Plan, Runner, fit


class Recorder(Runner):
    """A runner that records what `fit` asks of it; step s has loss s (`bad`: the steps whose loss is NaN or inf
    instead) and takes 10 samples (the epoch's last step 5, a partial batch)."""

    def __init__(self, plan: Plan, stop_after: int | None = None, bad: dict[int, float] | None = None):
        self.plan, self.stop_after, self.calls, self.bad = plan, stop_after, [], bad or {}

    def batches(self, epoch, steps):
        self.calls.append(("batches", epoch, steps.start, steps.stop))
        return iter(range(100))  # more than any epoch takes: the loop stops drawing at its last step

    def step(self, step, batch):
        self.calls.append(("step", step))
        last = step + 1 == self.plan.span(step // self.plan.per_epoch).stop
        return torch.tensor(self.bad.get(step, float(step))), 5 if last else 10

    def mid_epoch(self, step, due, window, epoch):
        self.calls.append(("mid", step, due.checkpoint, due.metrics, due.evaluate, window.steps))
        return due.metrics

    def end_epoch(self, epoch, window):
        self.calls.append(("end", epoch, window.steps, window.loss))
        return self.stop_after is not None and epoch + 1 >= self.stop_after


def test_steps_run_epoch_by_epoch_with_the_last_epoch_cut_short_and_a_sample_weighted_loss():
    plan = Plan.of(3, None, 7)
    runner = Recorder(plan)
    assert fit(plan, runner) == 3
    ends = [c for c in runner.calls if c[0] == "end"]
    # epoch 0: steps 0, 1, 2 (10, 10, 5 samples); epoch 2: step 6 alone (its last: 5 samples)
    assert ends == [("end", 0, 3, (0 * 10 + 1 * 10 + 2 * 5) / 25), ("end", 1, 3, (3 * 10 + 4 * 10 + 5 * 5) / 25),
                    ("end", 2, 1, 6.0)]
    assert [c[1] for c in runner.calls if c[0] == "step"] == list(range(7))
    assert ("batches", 2, 6, 7) in runner.calls


def test_a_resumed_run_starts_mid_epoch_and_a_finished_one_runs_nothing():
    plan = Plan.of(4, 3, None)
    runner = Recorder(plan)
    assert fit(plan, runner, start=6) == 3
    assert runner.calls[0] == ("batches", 1, 6, 8)
    assert [c[1] for c in runner.calls if c[0] == "step"] == [6, 7, 8, 9, 10, 11]
    done = Recorder(plan)
    assert fit(plan, done, start=12) == 3 and done.calls == []
    cut = Plan.of(4, None, 10)  # ends mid-epoch: restored at its end, its last epoch is not run again
    again = Recorder(cut)
    assert fit(cut, again, start=10) == 3 and again.calls == []


def test_the_cadence_is_every_k_steps_within_an_epoch_and_the_epochs_end_is_its_own():
    plan = Plan(per_epoch=4, total=8, checkpoint_every=2, metrics_every=3, eval_every=4)
    runner = Recorder(plan)
    fit(plan, runner)
    mids = [c[1:5] for c in runner.calls if c[0] == "mid"]
    # after steps 1 (2 done: checkpoint), 2 (3 done: metrics), 5 (6: checkpoint and metrics); steps 3 and 7 end
    # their epochs (4 and 8 done: the epoch's end, not a mid-epoch report)
    assert mids == [(1, True, False, False), (2, False, True, False), (5, True, True, False)]
    # a mid-epoch report covers the steps since the last one (a checkpoint alone reports nothing here, a metrics
    # row does); an epoch's end covers the whole epoch, whatever was reported within it
    assert [c[5] for c in runner.calls if c[0] == "mid"] == [2, 3, 2]
    ends = [c[2:] for c in runner.calls if c[0] == "end"]
    assert ends == [(4, (0 + 10 + 20 + 3 * 5) / 35), (4, (40 + 50 + 60 + 7 * 5) / 35)]
    never = Plan(per_epoch=4, total=8)
    quiet = Recorder(never)
    fit(never, quiet)
    assert not [c for c in quiet.calls if c[0] == "mid"]


def test_a_runner_stops_the_run_at_an_epochs_end_and_a_stop_step_ends_a_workers_share():
    plan = Plan.of(2, 5, None)
    runner = Recorder(plan, stop_after=2)
    assert fit(plan, runner) == 2 and [c[1] for c in runner.calls if c[0] == "step"] == [0, 1, 2, 3]
    share = Recorder(plan)
    assert fit(plan, share, start=2, stop=3) == 1  # half of epoch 1: no epoch end
    assert [c[0] for c in share.calls] == ["batches", "step"]


@pytest.mark.parametrize("bad", [{4: math.nan}, {4: math.inf, 5: 5.0}, {0: -math.inf}])
def test_a_loss_that_is_not_finite_ends_the_run_before_the_next_report_naming_its_step(bad):
    """Step 4's loss (the 5th) NaN or inf, even where step 5's is finite again: the run ends before the
    metrics row due after step 5, naming step 5 and step 4's (the 4th's) loss, 3.0; a first step that is
    not finite has no finite loss before it. A run whose every loss is finite reports as before."""
    plan = Plan(per_epoch=4, total=8, metrics_every=2)
    runner = Recorder(plan, bad=bad)
    with pytest.raises(Diverged) as raised:
        fit(plan, runner)
    first = min(bad)
    before = "no finite loss before" if first == 0 else f"its last finite loss {first - 1:g} at step {first}"
    assert str(raised.value).startswith(f"the loss is not finite (nan or inf) at optimizer step {first + 1}, {before}: "
                                        "the run diverged; lower optim.lr (--lr)"), raised.value
    reported = [c for c in runner.calls if c[0] in ("mid", "end")]
    assert all(c[1] < first for c in reported if c[0] == "mid") and (first >= 4) == any(c[0] == "end" for c in reported)
    assert runner.calls[-1] == ("step", first | 1)  # the step that made the report due
    clean = Recorder(plan)
    fit(plan, clean)
    assert len([c for c in clean.calls if c[0] == "end"]) == 2


def test_a_nan_is_never_the_best_so_far():
    """A diverged pack member keeps its best before (tensors: per member), as a scalar run would."""
    best = Best(("val_loss", "min"))
    best.update({"val_loss": math.nan})
    best.update({"val_loss": 2.0})
    assert best.update({"val_loss": math.nan}) == {"best_val_loss": 2.0}
    members = Best(("val_loss", "min"))
    members.update({"val_loss": torch.tensor([1.0, 4.0])})
    assert members.update({"val_loss": torch.tensor([math.nan, 3.0])})["best_val_loss"].tolist() == [1.0, 3.0]


@pytest.mark.parametrize("mode", ["min", "max"])
def test_the_best_so_far_follows_the_objectives_direction_for_scalars_and_per_member(mode):
    best = Best(("val_acc", mode))
    best.update({"val_loss": 2.0, "val_acc": 0.5})
    out = best.update({"val_loss": 3.0, "val_acc": 0.7})
    assert out == {"best_val_loss": 2.0, "best_val_acc": 0.5 if mode == "min" else 0.7}
    members = Best(("val_loss", mode))  # val_loss is always minimised
    members.update({"val_loss": torch.tensor([1.0, 4.0])})
    assert members.update({"val_loss": torch.tensor([2.0, 3.0])})["best_val_loss"].tolist() == [1.0, 3.0]


def test_fit_to_first_step_is_split_into_phases_of_this_sessions_worker_group():
    """The phases of the first row at or after fit() (an earlier session's rows are not this run's start), each
    from the previous mark; a worker process Ray started before fit() (its idle pool) takes 0 s."""
    import pandas as pd

    from rayhpc.train.trainer import ON_GPUS, STARTUP_PHASES, TrainResult

    fit = 1000.0
    marks = {"worker_start_time": 998.0, "process_group_start_time": 1002.0, "process_group_time": 1003.0,
             "train_fn_time": 1003.5, "device_time": 1003.625, "collective_time": 1003.75,
             "worker_ready_time": 1004.0, "first_batch_time": 1004.25,
             "first_step_time": 1005.0}
    earlier = {column: t - 500 for column, t in marks.items()}  # a session before a resume
    result = TrainResult(None, pd.DataFrame([earlier, marks, {**marks, "first_step_time": 1009.0}]), None, 0.0,
                         fit, 0.0)
    assert result.startup_phases() == dict(zip(STARTUP_PHASES, [0.0, 2.0, 1.0, 0.5, 0.125, 0.125, 0.25, 0.25, 0.75],
                                                strict=True))
    assert sum(result.startup_phases().values()) == result.fit_to_first_step == 5.0
    # on GPUs the phases say what they hold there (a CPU run's name no CUDA context or NCCL communicator)
    on_gpus = TrainResult(types.SimpleNamespace(compute=types.SimpleNamespace(gpu=True)), result.metrics, None, 0.0,
                          fit, 0.0).startup_phases()
    assert list(on_gpus) == [ON_GPUS.get(name, name) for name in STARTUP_PHASES] != list(STARTUP_PHASES)
    assert "device (CUDA context)" in on_gpus and not any("CUDA" in name or "NCCL" in name for name in STARTUP_PHASES)
    without = TrainResult(None, pd.DataFrame([{"first_step_time": 1005.0}]), None, 0.0, fit, 0.0)
    assert without.startup_phases() == {}  # a warm group's rows: no marks


def test_a_mark_another_process_timed_never_goes_before_the_last_and_a_phase_counts_once(tmp_path, monkeypatch):
    """A trial's process Ray started before the driver's last phase ended takes 0 s (its mark is the last one's
    time); a later time is kept as measured; a phase marked again keeps its first time. Each goes to
    RAYHPC_TIMINGS too."""
    from rayhpc.monitor import startup

    monkeypatch.setattr(startup, "_marks", [])
    monkeypatch.setenv(startup.VARIABLE, str(tmp_path / "marks"))
    startup.mark("ray", 100.0)
    startup.mark("trial process", 90.0)  # earlier than Ray's mark
    startup.mark("trial set-up", 103.5)
    startup.mark("trial set-up", 104.0)  # again: ignored
    assert startup._marks == [("ray", 100.0), ("trial process", 100.0), ("trial set-up", 103.5)]
    assert startup.read(tmp_path / "marks") == dict(startup._marks)
