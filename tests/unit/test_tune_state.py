"""A resumed plan sweep whose Ray Tune state was cut short (its driver killed while Tune copied it) is seen
before Tune restores it: Tune would run only the trials its state names (tests/ray/test_sweep.py runs it)."""

from ray.tune.search import BasicVariantGenerator

from rayhpc.tune.sweep import cut_short_state


def _tune_state(folder):
    (folder / "experiment_state-2026-12-05_03-00-00.json").write_text('{"trial_data": []}')
    BasicVariantGenerator().save_to_dir(str(folder), session_str="2026-12-05_03-00-00")
    return folder / "experiment_state-2026-12-05_03-00-00.json", folder / "basic-variant-state-2026-12-05_03-00-00.json"


def test_whole_state_restores(tmp_path):
    _tune_state(tmp_path)
    assert cut_short_state(tmp_path) is None


def test_a_cut_experiment_state_is_named(tmp_path):
    state, _ = _tune_state(tmp_path)
    state.write_text('{"trial_da')
    assert cut_short_state(tmp_path).startswith("JSONDecodeError"), cut_short_state(tmp_path)


def test_a_cut_or_missing_searcher_state_is_named(tmp_path):
    _, searcher = _tune_state(tmp_path)
    searcher.write_bytes(searcher.read_bytes()[:40])
    assert cut_short_state(tmp_path) is not None
    searcher.unlink()
    assert cut_short_state(tmp_path).startswith("RuntimeError"), cut_short_state(tmp_path)
