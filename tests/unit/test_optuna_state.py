"""The packed Optuna searcher's state (`rayhpc.tune.adaptive.PackedOptunaSearch`) round-trips through pickle with
either sampler, on the Optuna the venv holds: Optuna 5's NSGA-II sampler holds a `threading.Lock`, which no pickle
carries, and Tune pickles its searcher as the Tuner is made and at every save."""

import pickle

import pytest
from ray import tune

from rayhpc.tune.adaptive import PackedOptunaSearch

pytest.importorskip("optuna")
# on the newest releases (CI's second session): the floors' Optuna 3.1 samplers hold no lock, Optuna 5's NSGA-II does
pytestmark = pytest.mark.newest


def searcher(tmp_path, sampler: str) -> PackedOptunaSearch:
    return PackedOptunaSearch({"lr": tune.loguniform(1e-3, 1e-1), "hidden": tune.choice([4, 8])}, pack=2, total=8,
                              shared=["hidden"], metric="val_loss", mode="min", seed=0, exp_dir=str(tmp_path),
                              sampler=sampler)


@pytest.mark.parametrize("sampler", ["tpe", "nsga2"])
def test_the_searcher_saved_and_restored_goes_on_asking_as_the_one_that_was_not(sampler, tmp_path):
    first, again = searcher(tmp_path, sampler), searcher(tmp_path, sampler)
    first.suggest("a")
    first.on_trial_complete("a", {"members/val_loss": [1.0, 2.0]})
    first.save(str(tmp_path / "state.pkl"))
    again.restore(str(tmp_path / "state.pkl"))
    copied = pickle.loads(pickle.dumps(first))  # as Tune pickles it
    assert again.suggest("b") == copied.suggest("b") == first.suggest("b")  # the sampler's RNG state carried too
    assert len(again.study.trials) == 4 and again.asked == 4


def test_a_state_saved_before_its_locks_were_left_out_is_restored(tmp_path):
    old = searcher(tmp_path, "tpe")
    old.suggest("a")
    (tmp_path / "state.pkl").write_bytes(pickle.dumps(old.__dict__))  # the earlier form: the attributes themselves
    restored = searcher(tmp_path, "tpe")
    restored.restore(str(tmp_path / "state.pkl"))
    assert restored.asked == 2 and list(restored.pending) == ["a"]
