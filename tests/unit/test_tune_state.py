"""A resumed plan sweep whose Ray Tune state was cut short (its driver killed while Tune copied it) is seen
before Tune restores it: Tune would run only the trials its state names (tests/ray/test_sweep.py runs it)."""

from ray.tune.search import BasicVariantGenerator

from rayhpc.tune.sweep import cut_short_state


def _tune_state(folder):
    (folder / "experiment_state-2026-12-05_03-00-00.json").write_text('{"trial_data": []}')
    BasicVariantGenerator().save_to_dir(str(folder), session_str="2026-12-05_03-00-00")
    return folder / "experiment_state-2026-12-05_03-00-00.json", folder / "basic-variant-state-2026-12-05_03-00-00.json"


def _cut(folder):
    return cut_short_state(folder, BasicVariantGenerator())  # a plan sweep's searcher


def test_whole_state_restores(tmp_path):
    _tune_state(tmp_path)
    assert _cut(tmp_path) is None


def test_a_cut_experiment_state_is_named(tmp_path):
    state, _ = _tune_state(tmp_path)
    state.write_text('{"trial_da')
    assert _cut(tmp_path).startswith("JSONDecodeError"), _cut(tmp_path)


def test_a_cut_or_missing_searcher_state_is_named(tmp_path):
    _, searcher = _tune_state(tmp_path)
    searcher.write_bytes(searcher.read_bytes()[:40])
    assert _cut(tmp_path) is not None
    searcher.unlink()
    assert _cut(tmp_path).startswith("RuntimeError"), _cut(tmp_path)


def test_a_pack_is_kept_where_every_member_ended_diverged_members_too(tmp_path):
    """`finished_packs`, which the cut-short resume keeps: a pack whose members finished, were stopped by ASHA or
    diverged has ended; one with a member still running runs again, and so does one whose trial folder's
    params.json is empty (CI once killed the driver as Tune wrote it: the resume failed on the JSON)."""
    import json

    import pandas as pd

    from rayhpc.tune.results import PARTS_DIR
    from rayhpc.tune.sweep import finished_packs

    statuses = {"a1b2c_00000": ["finished", "diverged"], "a1b2c_00001": ["early-stopped", "finished"],
                "a1b2c_00002": ["finished", "running"], "a1b2c_00003": ["finished", "finished"]}
    for pack, (tid, members) in enumerate(statuses.items()):
        folder = tmp_path / f"train_pack_{tid}_{pack}_pack={pack}"
        folder.mkdir()
        # the last pack's params.json as a driver killed while Tune wrote it leaves it: empty (its pack runs again)
        (folder / "params.json").write_text(json.dumps({"pack": pack}) if pack < 3 else "")
    (tmp_path / PARTS_DIR).mkdir()
    rows = [{"trial_id": f"{tid}-{j}", "status": s} for tid, members in statuses.items() for j, s in enumerate(members)]
    pd.DataFrame(rows).to_parquet(tmp_path / PARTS_DIR / "part-00000.parquet")
    kept, again = finished_packs(tmp_path, 4)
    assert again == [2, 3] and sorted(kept["trial_id"]) == ["a1b2c_00000-0", "a1b2c_00000-1", "a1b2c_00001-0",
                                                         "a1b2c_00001-1"]
