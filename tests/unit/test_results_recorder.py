"""The sweep's results recorder (`rayhpc.tune.results.ResultsRecorder`): the table the progress line and the
monitor ask for every second or two is made from rows kept per trial, a running trial's made again only when
its status or its last result changed."""

from __future__ import annotations

from types import SimpleNamespace

from rayhpc.task.check import TaskInfo
from rayhpc.tune import results
from rayhpc.tune.results import ResultsRecorder


def trial(trial_id: str, status: str, val_loss: float | None) -> SimpleNamespace:
    result = {"epoch": 1, "val_loss": val_loss, "best_val_loss": val_loss} if val_loss is not None else {}
    return SimpleNamespace(trial_id=trial_id, status=status, config={"lr": 0.1}, last_result=result)


def test_a_running_trials_rows_are_made_again_only_when_it_reports_or_changes_status(tmp_path, monkeypatch):
    made = []
    real = results.trial_rows

    def counted(t, *args, **kwargs):
        made.append(t.trial_id)
        return real(t, *args, **kwargs)

    monkeypatch.setattr(results, "trial_rows", counted)  # (our own function: counted, not changed)
    info = TaskInfo(model_reads=frozenset(), data_reads=frozenset(), metric_names=(), has_val=True,
                    objective=("val_loss", "min"))
    recorder = ResultsRecorder(tmp_path, None, 10, ["lr"], info)
    a, b = trial("a", "RUNNING", 0.5), trial("b", "RUNNING", 0.7)
    recorder.trials = [a, b]
    assert list(recorder.table()["val_loss"]) == [0.5, 0.7] and made == ["a", "b"]
    recorder.table()
    assert made == ["a", "b"], "rows made again though nothing changed"
    a.last_result = {"epoch": 2, "val_loss": 0.4, "best_val_loss": 0.4}  # a new report: a new dict, as Tune's
    assert list(recorder.table()["val_loss"]) == [0.4, 0.7] and made == ["a", "b", "a"]
    b.status = "TERMINATED"
    assert list(recorder.table()["status"]) == ["early-stopped", "running"] and made == ["a", "b", "a", "b"]  # (1 of 10 epochs)
    recorder.table()
    assert made == ["a", "b", "a", "b"]
