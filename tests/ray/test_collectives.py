"""The collectives benchmark (each primitive correct on 2 and 3 gloo ranks, nccl-tests bandwidth
formulas) and the scaling study end to end."""

from __future__ import annotations

import math
from types import SimpleNamespace

import matplotlib.image
import pandas as pd
import pytest
import torch

from helpers import assert_speedup_and_efficiency, run_job, run_job_warm
from rayhpc.collectives.bench import measure
from rayhpc.collectives.config import parse_size
from rayhpc.collectives.primitives import PRIMITIVES, _mismatch, bandwidths
from rayhpc.workers.group import WorkerGroup


@pytest.mark.parametrize("name, n, algbw, busbw", [
    # 1 MiB in 1 ms: algbw = 1,048,576 B / 0.001 s = 1.048576 GB/s; busbw by hand from the nccl-tests factors
    ("all_reduce", 4, 1.048576e9, 1.048576e9 * 2 * 3 / 4),   # 2(n-1)/n = 1.5
    ("all_reduce", 2, 1.048576e9, 1.048576e9),               # 2(n-1)/n = 1
    ("all_gather", 4, 1.048576e9, 1.048576e9 * 3 / 4),        # (n-1)/n
    ("reduce_scatter", 8, 1.048576e9, 1.048576e9 * 7 / 8),
    ("all_to_all", 3, 1.048576e9, 1.048576e9 * 2 / 3),
    ("scatter", 2, 1.048576e9, 1.048576e9 / 2),
    ("gather", 4, 1.048576e9, 1.048576e9 * 3 / 4),
    ("broadcast", 8, 1.048576e9, 1.048576e9),                 # 1
    ("reduce", 8, 1.048576e9, 1.048576e9),
    ("send_recv", 2, 1.048576e9, 1.048576e9),
])
def test_bus_bandwidth_follows_nccl_tests(name, n, algbw, busbw):
    got = bandwidths(name, 2**20, 1e-3, n)
    assert got == pytest.approx((algbw, busbw), rel=1e-12)


def test_sizes_parse_with_binary_units():
    assert [parse_size(s) for s in ("4096", "1KiB", "16MiB", "1gib")] == [4096, 1024, 16 * 2**20, 2**30]
    with pytest.raises(ValueError, match="'16MB' is not a size"):
        parse_size("16MB")


def test_a_wrong_result_is_named_with_the_element_and_both_values():
    want = torch.arange(6.0)
    got = want.clone()
    got[4] = -1
    assert _mismatch("all_reduce", got, want) == "all_reduce: element [4] is -1.0, expected 4.0"
    assert _mismatch("all_reduce", want.clone(), want) is None


def test_a_wrong_collective_is_reported_and_not_timed(tmp_path, monkeypatch):
    import torch.distributed as dist

    from rayhpc.collectives import bench
    from rayhpc.collectives.primitives import Case

    timed = []
    wrong = Case(run=lambda: timed.append(1), check=lambda: "all_reduce: element [0] is 1.0, expected 2.0",
                 size_bytes=1024)
    monkeypatch.setattr(bench, "make_case", lambda *args: wrong)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
        result = bench.measure(ctx, "all_reduce", 1024, warmup=3, iters=10)
    finally:
        dist.destroy_process_group()
    assert result["error"] == "all_reduce: element [0] is 1.0, expected 2.0" and math.isnan(result["seconds"])
    assert len(timed) == 1  # run once to check, never in the warm-up or timed loops
    row = bench._row("all_reduce", [result], 1, "gloo")
    assert not row["correct"] and math.isnan(row["busbw_GBps"]) and "NOT TIMED" in bench.format_row(row)


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_primitive_is_correct_on_gloo(ray_address, ranks):
    with WorkerGroup(ranks, cpus_per_worker=2 / 3) as group:  # 3 ranks fit the shared 2-CPU cluster
        for name in PRIMITIVES:
            for size in (1024, 12 * 1024):  # 12 KiB: chunks that do not divide evenly by 3 ranks are cut
                results = group.run(measure, name, size, 1, 2)
                assert [r["error"] for r in results] == [None] * ranks, (name, size, results)
                assert all(r["seconds"] > 0 for r in results), (name, results)


def test_the_benchmark_job_writes_its_table_and_plot(ray_address, tmp_path):
    proc = run_job("bench_collectives.py", "--address", ray_address, "--num-workers", "2", "--max-size", "8KiB",
                   "--iters", "3", "--storage-path", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = pd.read_parquet(tmp_path / "collectives" / "collectives.parquet")
    assert len(table) == len(PRIMITIVES) * 4 and table["correct"].all()  # 1, 2, 4, 8 KiB
    assert set(table["size_bytes"]) == {1024, 2048, 4096, 8192} and (table["busbw_GBps"] > 0).all()
    image = matplotlib.image.imread(tmp_path / "collectives" / "collectives_busbw.png")
    assert image.shape[0] > 300 and image.shape[1] > 500




def test_bad_input_names_the_key_before_ray_starts(tmp_path):
    proc = run_job_warm("bench_collectives.py", "--primitives", "all_reduce,allreduce", "--storage-path", str(tmp_path))
    assert proc.returncode == 2 and "allreduce: expected some of broadcast, scatter" in proc.stderr, proc.stderr
    proc = run_job_warm("scaling_study.py", "--workers", "0,2", "--storage-path", str(tmp_path))
    assert proc.returncode == 2 and "workers" in proc.stderr and "at least 1" in proc.stderr, proc.stderr


@pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers)
def test_a_short_scaling_study_runs_end_to_end(ray_address, tmp_path):
    """Weak scaling here; strong scaling runs across the two Slurm nodes (test_slurm)."""
    proc = run_job("scaling_study.py", "--address", ray_address, "--modes", "weak", "--workers", "1,2", "--epochs",
                   "2", "--hidden", "64", "--steps-per-epoch", "20", "--storage-path", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = pd.read_parquet(tmp_path / "scaling" / "scaling.parquet")
    assert sorted(zip(table["mode"], table["workers"])) == [("weak", 1), ("weak", 2)]
    assert set(table["nodes"]) == {1} and (table["samples_per_s"] > 0).all()
    weak = table.set_index("workers")
    assert weak["global_batch"].tolist() == [128, 256]
    assert set(table["steps_per_epoch"]) == {20}  # the data sized for the steps asked, whatever the batch
    assert_speedup_and_efficiency(weak)
    image = matplotlib.image.imread(tmp_path / "scaling" / "scaling.png")
    assert image.shape[0] > 300 and image.shape[1] > 800
    assert "samples/s: median over epochs after the first" in proc.stdout
