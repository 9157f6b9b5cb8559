"""Model parallelism on the platform's worker group: every layout equals one process on the whole model."""

from __future__ import annotations

import logging
import shutil
import sys
import time

import pandas as pd
import pytest
import ray
import torch
import torch.nn.functional as F
from bench.parallel_layouts import GPT_LAYOUTS as GPT_BENCH

from helpers import CPUS, ROOT, run_job, run_job_warm, too_many_gpu_workers
from parallel_reference import batches, plain_optimizer, plain_schedule, reference_run
from rayhpc.config import ConfigError, JobFailed, validate
from rayhpc.parallel import ParallelConfig, run_parallel, worker
from rayhpc.parallel.trainer import make_recipe
from rayhpc.workers import WorkerGroup, WorkerGroupError
from torch.utils.data import TensorDataset

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank functions defined below

GPT = f"{ROOT}/jobs/tasks/gpt.py:GPT"
PLANS = f"{ROOT}/tests/tasks/plans.py"  # a plan or a split that cannot work, one task each
OWN_FORWARD = f"{ROOT}/tests/tasks/own_forward.py"  # models whose forward calls what a cut stage lacks
MLP_HP = {"hidden": 32, "depth": 4}  # the built-in task, 4 Linear layers: 2 per stage under pp 2
LAYOUTS = {  # the GPT's runs every pipeline schedule too (GPT_LAYOUTS)
    "tp2 mlp": dict(tp=2),
    "tp2 x pp2 mlp": dict(tp=2, pp=2, microbatches=4, schedule="1f1b"),
    "dp2 x fsdp2 mlp": dict(dp=2, fsdp=2),  # HSDP: sharded in pairs, the pairs replicas
}  # FSDP2 x TP: the GPT's layouts, the options test and the sharded resume
PIPELINES = {"pp2 gpipe": dict(pp=2, microbatches=4, schedule="gpipe"),
             "pp2 1f1b": dict(pp=2, microbatches=4, schedule="1f1b")}
PARALLELISM = ("tp", "pp", "dp", "fsdp", "microbatches", "schedule", "stages_per_rank")


def parallel_cfg(**kw) -> ParallelConfig:
    """A config from a flat layout (the MLP's `MLP_HP` unless it names a task): the degrees and the pipeline's
    `schedule` go to its `parallelism:` section, `lr_schedule` to `schedule:`, `optimizer` and `lr` to `optim:`."""
    parallelism = {k: kw.pop(k) for k in PARALLELISM if k in kw}
    optim = {k: kw.pop(k) for k in ("optimizer", "lr") if k in kw}
    hparams = kw.pop("hparams", {} if "task" in kw else MLP_HP)
    return ParallelConfig(parallelism=parallelism, optim={**optim, **kw.pop("optim", {})}, hparams=hparams,
                          schedule=kw.pop("lr_schedule", {}), **kw)


def assert_equal_to_reference(result, cfg: ParallelConfig) -> None:
    losses, weights, validation = reference_run(cfg)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(losses), msg=lambda m: (  # fp32 tolerances
        f"the loss per step differs from one process training with {cfg.optim.optimizer} (lr {cfg.optim.lr}): {m}"))
    assert sorted(result.weights) == sorted(weights)
    for name, expected in weights.items():
        torch.testing.assert_close(result.weights[name], expected, msg=lambda m: f"{name}: {m}")
    assert (result.validation is None) == (validation is None), (result.validation, validation)
    if validation is not None:  # the validation loss and the task's metrics (bits per byte), by name
        torch.testing.assert_close({k: torch.tensor(v) for k, v in result.validation.items()},
                                   {k: torch.tensor(v) for k, v in validation.items()})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_step_and_the_final_weights_equal_one_process(layout, ray_address, tmp_path):
    cfg = parallel_cfg(storage_path=tmp_path, steps=4, **LAYOUTS[layout])
    result = run_parallel(cfg, log_level=logging.DEBUG)
    assert len(result.losses) == 4
    assert_equal_to_reference(result, cfg)


# the traced ResNet: BatchNorm's statistics saved and restored too (lr 0.02: at 0.1 the rounding of the traced
# graph against eager grows past fp32's tolerance by step 7, to 1.8e-5 relative, the resumed run equal to the full one)
@pytest.mark.parametrize("layout", [dict(fsdp=2, tp=2), dict(
    task=f"{OWN_FORWARD}:ResNet", hparams={}, pp=2, microbatches=1, optimizer="sgd", lr=0.02)], ids=["fsdp2 x tp2",
                                                                                                 "traced resnet pp2"])
def test_resume_from_a_sharded_checkpoint_ends_equal(layout, ray_address, tmp_path):
    """FSDP2 x TP shards, or traced pipeline stages, saved with torch.distributed.checkpoint every 3 steps and at the
    end (the run's last step, 7), the latest 2 kept; the run is resumed from step 6 as if it had been stopped before
    step 7 was saved."""
    cfg = parallel_cfg(storage_path=tmp_path, steps=7, checkpoint={"every": 3, "keep": 2}, **layout)
    full = run_parallel(cfg, log_level=logging.DEBUG)
    assert full.checkpoint == tmp_path / cfg.name / "checkpoint_000007"
    assert sorted(p.name for p in (tmp_path / cfg.name).glob("checkpoint_*")) == ["checkpoint_000006",
                                                                                  "checkpoint_000007"]
    shutil.rmtree(full.checkpoint)
    resumed = run_parallel(cfg.model_copy(update={"resume": True}), log_level=logging.DEBUG)
    assert len(resumed.step_seconds) == 1, "the resumed run did not start from step 6"
    assert resumed.losses == pytest.approx(full.losses, rel=1e-6)
    assert_equal_to_reference(resumed, cfg)


FAILS_ONCE = '''
import torch.distributed as dist

from rayhpc.task.mlp import MLPTask

MARKER = {marker!r}


class FailsOnce(MLPTask):
    calls = 0

    def loss(self, model, batch):  # rank 1's third step fails, the first time only (the marker says it did)
        if dist.is_initialized() and dist.get_rank() == 1:
            self.calls += 1
            if self.calls == 3 and not __import__("os").path.exists(MARKER):
                open(MARKER, "w").close()
                raise RuntimeError("rank 1 fails once")
        return super().loss(model, batch)
'''


@pytest.mark.parametrize("max_failures", [1, 0])
def test_a_failed_rank_restarts_the_group_from_the_latest_checkpoint_up_to_max_failures(max_failures, ray_address,
                                                                                       tmp_path):
    """As Ray Train restarts a failed worker group: rank 1 fails at step 3, the group starts again from step 2's
    checkpoint and ends equal to an uninterrupted run; with max_failures 0 the failure ends the run."""
    marker = tmp_path / "failed-once"
    (tmp_path / "fails.py").write_text(FAILS_ONCE.format(marker=str(marker)))
    cfg = parallel_cfg(task=f"{tmp_path / 'fails.py'}:FailsOnce", hparams=MLP_HP, dp=2, steps=4,
                       checkpoint={"every": 2}, max_failures=max_failures, storage_path=tmp_path)
    if not max_failures:
        with pytest.raises(JobFailed, match="RuntimeError: rank 1 fails once"):
            run_parallel(cfg, log_level=logging.DEBUG)
        return
    result = run_parallel(cfg, log_level=logging.DEBUG)
    assert marker.exists(), "rank 1 never failed"
    assert len(result.step_seconds) == 2, "the restarted group did not start from step 2's checkpoint"
    assert len(result.losses) == 4
    assert_equal_to_reference(result, cfg)


def test_the_job_script_trains_and_prints_an_epoch_line_and_a_metrics_row_each(ray_address, tmp_path):
    """Two epochs of 52 steps (the last batch of each 6 samples, which 2 microbatches split): a line and a
    `metrics.parquet` row per epoch (as the training job's), the loss of each the epoch's mean; no line per step."""
    proc = run_job("train_parallel.py", "--tp", "2", "--pp", "2", "--microbatches", "2", "--schedule", "1f1b",
                   "--hp", "hidden=32,depth=4", "--epochs", "2", "--name", "run", "--storage-path", str(tmp_path),
                   "--address", ray_address)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mesh pp(2) x dp(1) x fsdp(1) x tp(2)" in proc.stdout and "1f1b, 2 microbatches of 16 samples" in proc.stdout
    epochs = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == ["epoch 1/2", "epoch 2/2"], proc.stdout
    assert not any(line.startswith("step ") for line in proc.stdout.splitlines()), proc.stdout
    rows = pd.read_parquet(tmp_path / "run" / "metrics.parquet")
    assert rows["epoch"].tolist() == [1, 2] and rows["global_step"].tolist() == [52, 104], rows
    assert rows["loss"].iloc[1] < 0.5 * rows["loss"].iloc[0] and (rows["val_loss"] > 0).all(), rows
    for line, (_, row) in zip(epochs, rows.iterrows()):
        assert f"loss {row['loss']:.4g}, val_loss {row['val_loss']:.4g}" in line, (line, row)
    # every job's cadence without --checkpoint-every: a checkpoint at each epoch's end, the latest kept
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint_*")) == ["checkpoint_000104"]
    assert f"checkpoint: {tmp_path / 'run' / 'checkpoint_000104'}" in proc.stdout, proc.stdout


def test_an_epochs_row_is_the_mean_of_its_steps_losses_weighted_by_their_samples(ray_address, tmp_path):
    """dp 2 over the MLP's 1638 samples in batches of 32: 51 steps of 32 and one of 6; the epoch's row is
    the samples' mean of the per-step losses, with the schedule's lr of its last step."""
    cfg = parallel_cfg(dp=2, epochs=1, global_batch_size=32, name="rows", storage_path=tmp_path,
                       lr_schedule={"warmup_steps": 5, "decay": "cosine", "min_lr_ratio": 0.1})
    result = run_parallel(cfg, log_level=logging.DEBUG)
    (row,) = pd.read_parquet(tmp_path / "rows" / "metrics.parquet").to_dict("records")
    sizes = [32] * 51 + [6]
    assert row["global_step"] == 52 and row["world_size"] == 2 and row["global_batch_size"] == 32
    torch.testing.assert_close(row["loss"], sum(l * n for l, n in zip(result.losses, sizes)) / sum(sizes))
    torch.testing.assert_close(row["val_loss"], result.validation["val_loss"])
    torch.testing.assert_close(row["lr"], 0.1 * cfg.optim.lr)  # the cosine's floor, at the last step


def boom_on_rank_1(ctx):
    import torch.distributed as dist

    if ctx.rank == 1:
        raise ValueError("boom")
    dist.barrier()  # rank 0 waits here for the rank that failed


def sleep_on_rank_1(ctx):
    time.sleep(60 if ctx.rank == 1 else 0)
    return ctx.rank


def placement_groups_left() -> int:
    return sum(pg["state"] != "REMOVED" for pg in ray.util.placement_group_table().values())


def test_group_ranks_environment_and_results(ray_address):
    with WorkerGroup(3, cpus_per_worker=0.5, timeout_s=60) as group:
        envs = group.run(lambda ctx: {k: __import__("os").environ[k] for k in
                                      ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")})
        sums = group.run(lambda ctx: __import__("torch.distributed").distributed.all_reduce(t := torch.ones(1)) or
                         t.item())
        assert group.run_on(2, lambda ctx: ctx.rank) == 2
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"] and {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert sums == [3.0, 3.0, 3.0]
    assert placement_groups_left() == 0


def test_a_failing_rank_is_named_with_its_traceback(ray_address):
    group = WorkerGroup(2, cpus_per_worker=0.5, timeout_s=60)
    started = time.monotonic()
    with pytest.raises(WorkerGroupError) as err:
        group.run(boom_on_rank_1)
    message = str(err.value)
    assert message.startswith("rank 1 failed in boom_on_rank_1; rank 0 still running"), message
    assert "ValueError: boom" in message and list(err.value.failed) == [1]
    assert time.monotonic() - started < 30, "the failure waited for the collective's timeout"
    assert group.actors == [] and placement_groups_left() == 0


def test_a_silent_rank_is_named_after_the_timeout(ray_address):
    group = WorkerGroup(2, cpus_per_worker=0.5, timeout_s=60)
    with pytest.raises(WorkerGroupError, match=r"^rank 1 did not answer sleep_on_rank_1 within 3 s") as err:
        group.run(sleep_on_rank_1, timeout_s=3)
    assert err.value.silent == [1] and placement_groups_left() == 0


LAYOUTS_TWO_EPOCHS = {"dp2 accumulate 2": dict(dp=2, accumulate=2), "pp2 gpipe": dict(pp=2, microbatches=2, schedule="gpipe")}


@pytest.mark.parametrize("layout", LAYOUTS_TWO_EPOCHS)
def test_each_epoch_ends_with_its_partial_last_batch_as_in_a_plain_loop(layout, ray_address, tmp_path):
    """Two epochs, each reshuffled, of the MLP's 1638 training samples in batches of 32: 51 whole batches,
    then one of 6 (3 per replica under dp 2, in micro-batches of 2 and 1 weighted by their samples; 2
    microbatches of 3 under the pipeline, which runs a schedule of that size for it)."""
    cfg = parallel_cfg(**LAYOUTS_TWO_EPOCHS[layout], epochs=2, global_batch_size=32, storage_path=tmp_path)
    result = run_parallel(cfg, log_level=logging.DEBUG)
    assert len(result.losses) == 2 * 52, len(result.losses)
    assert_equal_to_reference(result, cfg)


def test_a_batchnorm_model_in_a_pipeline_equals_a_plain_loop_over_the_same_micro_batches(ray_address, tmp_path):
    """BatchNorm on both stages: each micro-batch normalised by its own statistics, the running statistics
    updated once per micro-batch and by nothing else (torch's own shape inference ran the second stage on
    uninitialised memory: NaN), validation through them, as a plain loop over the same micro-batches."""
    cfg = parallel_cfg(task=f"{ROOT}/tests/tasks/batchnorm.py:BatchNormMLP", hparams={"hidden": 16}, steps=4, pp=2,
                       microbatches=2, schedule="gpipe", optimizer="sgd", lr=0.1, storage_path=tmp_path)
    result = run_parallel(cfg)
    recipe, data = make_recipe(cfg)
    torch.manual_seed(cfg.seed)
    model = recipe.build()
    optimizer = plain_optimizer(recipe.cfg, model.parameters())
    schedule, losses = plain_schedule(recipe.cfg, optimizer), []
    for x, y in batches(TensorDataset(*data["train"]), cfg.global_batch_size, cfg.seed, 4):
        optimizer.zero_grad()
        halves = [F.mse_loss(model(xm), ym) for xm, ym in zip(x.chunk(2), y.chunk(2))]
        (sum(halves) / 2).backward()
        optimizer.step()
        schedule.step()
        losses.append(sum(h.item() for h in halves) / 2)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(losses))
    for name, want in model.named_parameters():
        torch.testing.assert_close(result.weights[name], want.detach(), msg=lambda m: f"{name}: {m}")
    with torch.no_grad():
        val_loss = F.mse_loss(model.eval()(data["val"][0]), data["val"][1]).item()
    torch.testing.assert_close(result.validation["val_loss"], val_loss)


@pytest.mark.parametrize("task, dp", [("ViT", 1), ("ResNet", 1), ("LitGptShaped", 1), ("NormOnEveryStage", 1),
                                      ("LitGptShaped", 2)])
def test_a_model_with_its_own_forward_split_by_module_path_equals_one_process(task, dp, ray_address, tmp_path):
    """Split by module path with no wrapper, its stages traced: a `transformers` ViT (a class token, an attention mask
    passed on beside the activation) and ResNet (BatchNorm: one micro-batch, so its statistics are the whole batch's),
    a model of litgpt's shape (RoPE's cos and sin passed on), a forward that calls its final norm by name; and two
    replicas of each stage (FSDP2 over a traced stage). Steps of 32, 32, then 16 samples (each size its own trace),
    then validation in eval mode, as one process."""
    own = task != "NormOnEveryStage"
    cfg = parallel_cfg(task=f"{OWN_FORWARD if own else PLANS}:{task}", hparams={}, steps=4, pp=2, dp=dp,
                       microbatches=1 if task == "ResNet" else 2, schedule="gpipe", storage_path=tmp_path,
                       optimizer="sgd", lr=0.1)  # (Adam turns the rounding noise of a key bias's zero gradient into steps)
    result = run_parallel(cfg, log_level=logging.DEBUG)
    assert len(result.losses) == 4
    assert_equal_to_reference(result, cfg)


def test_a_traced_split_refuses_a_weight_tied_across_stages_and_the_options_it_cannot_take():
    with pytest.raises(ConfigError, match=r"^pipeline_split: lm_head.weight, transformer.wte.weight are one tied weight, "
                                          r"and stages \[0, 1\] would each hold a copy"):
        make_recipe(parallel_cfg(task=f"{OWN_FORWARD}:LitGptShapedTied", pp=2, hparams={}))
    for option in ({"compile": "blocks"}, {"activation_checkpointing": "full"}):
        with pytest.raises(ConfigError, match=r"so its stages are traced, and they take neither; set both to none$"):
            make_recipe(parallel_cfg(task=f"{OWN_FORWARD}:LitGptShaped", pp=2, hparams={}, **option))
    assert make_recipe(parallel_cfg(task=f"{OWN_FORWARD}:LitGptShaped", pp=2, hparams={}))[0].traced


def test_epochs_are_counted_in_steps_of_the_tasks_training_data_the_last_batch_partial():
    recipe, data = make_recipe(parallel_cfg(epochs=3, global_batch_size=64))
    n = len(data["train"][0])
    assert n % 64, f"{n} training samples fill every batch: no partial last batch to count"
    assert recipe.cfg.steps == 3 * (n // 64 + 1), recipe.cfg.steps


def test_a_model_that_does_not_run_on_the_meta_device_is_left_to_the_ranks():
    """The dry run of the stages needs the whole model to run on the meta device; one that reads a value (`.item()`)
    cannot, and is not refused for it (its split's error would be the ranks' to find)."""
    assert not make_recipe(parallel_cfg(task=f"{PLANS}:NotOnMeta", pp=2, hparams={}))[0].traced
    assert make_recipe(parallel_cfg(task=f"{PLANS}:NormOnEveryStage", pp=2, hparams={}))[0].traced  # cut, it fails
    with pytest.raises(ConfigError, match="the traced forward makes 1 stage"):
        make_recipe(parallel_cfg(task=f"{PLANS}:NeverCalled", pp=2, hparams={}))
    # a process with a world of its own: no fake one of tp ranks beside it, so the sharded dry run is left out
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        make_recipe(parallel_cfg(task=f"{PLANS}:Heads", tp=4, hparams={}))
    finally:
        dist.destroy_process_group()
    with pytest.raises(ConfigError, match="as tensor-parallel rank 0 holds it fails on the check batch's shapes"):
        make_recipe(parallel_cfg(task=f"{PLANS}:Heads", tp=4, hparams={}))


def test_mesh_mismatch_names_every_factor():
    with pytest.raises(ConfigError, match=r"^compute\.num_workers \(--num-workers\) 3: "
                                          r"dp\(1\) \* fsdp\(1\) \* pp\(2\) \* tp\(2\) = 4 != world size 3$"):
        validate(ParallelConfig, {"parallelism": {"tp": 2, "pp": 2}, "compute": {"num_workers": 3}})


@pytest.mark.parametrize("args, expected", [
    (["--tp", "2", "--pp", "2", "--num-workers", "3"],
     "error: compute.num_workers (--num-workers) 3: dp(1) * fsdp(1) * pp(2) * tp(2) = 4 != world size 3"),
    (["--tp", "3"], "error: hparams.hidden (--hp) 4: not divisible by tp (--tp) 3 (the task's tp_divisible)"),
    (["--tp", "4", "--hp", "depth=3", "--cpus-per-worker", "0.25"],  # the last layer, column-parallel: 2 outputs
     "error: tp_plan: layers.4 (Linear, ColwiseParallel) splits out_features 2, not divisible by tp (--tp) 4"),
    (["--pp", "5", "--microbatches", "4"], "error: parallelism.pp (--pp) 5: 5 stages need 4 split points; the task's pipeline_split gives "
                    "1: layers.2"),
    (["--pp", "2", "--stages-per-rank", "2"], "error: parallelism.stages_per_rank (--stages-per-rank) 2: schedule "
                                             "gpipe runs 1 per rank; for 2: interleaved1f1b, interleavedzb, zbv"),
    (["--pp", "2", "--schedule", "zbv", "--stages-per-rank", "3"],
     "error: parallelism.stages_per_rank (--stages-per-rank) 3: schedule zbv runs 2 per rank; for 3: "
     "interleaved1f1b, interleavedzb"),
    (["--pp", "2", "--schedule", "interleaved1f1b", "--microbatches", "5", "--global-batch-size", "40"],
     "error: parallelism.microbatches (--microbatches) 5: schedule interleaved1f1b runs them in max(1, m // pp 2) = "
     "2 rounds"),
    (["--task", GPT, "--pp", "2", "--schedule", "zbv", "--cpus-per-worker", "0.5"],
     "error: parallelism.pp (--pp) 2 x stages_per_rank 2: 4 stages need 3 split points; the task's pipeline_split "
     "gives 1: blocks.1"),
    (["--pp", "2", "--microbatches", "5"],
     "error: parallelism.microbatches (--microbatches) 5: do not divide the per-replica micro-batch 32"),
    (["--pp", "2", "--microbatches", "4", "--accumulate", "16"],
     "error: parallelism.microbatches (--microbatches) 4: do not divide the per-replica micro-batch 2 "
     "(global_batch_size 32 / dp 1 x fsdp 1 / accumulate 16)"),
    (["--fsdp", "2", "--accumulate", "3"],
     "error: accumulate (--accumulate) 3: does not divide the per-replica batch 16 (global_batch_size 32 / dp 1 x "
     "fsdp 2)"),
    (["--pp", "2", "--microbatches", "4", "--epochs", "1"],  # 1638 samples: 51 batches of 32, then one of 6
     "error: global_batch_size (--global-batch-size) 32: an epoch of 1638 training samples ends with a batch of 6 "
     "per replica, which the pipeline cannot split into accumulate 1 x parallelism.microbatches 4 equal "
     "microbatches"),
    (["--steps", "5", "--epochs", "2"], "error: steps (--steps) 5 and epochs (--epochs) 2: give one, not both"),
    (["--optimizer", "adamx"], "error: optim.optimizer (--optimizer): unknown optimizer 'adamx': expected sgd, adam, "
                               "adamw or a torch.optim class"),
    (["--warmup-steps", "-1"], "error: schedule.warmup_steps (--warmup-steps): Input should be greater than or equal "
                               "to 0 (got '-1')"),
    (["--tp", "2", "--dp", str(CPUS), "--cpus-per-worker", "1", "--global-batch-size", str(4 * CPUS)],
     f"error: compute.num_workers (--num-workers) {2 * CPUS}: the cluster can place {CPUS} worker(s) of 1 CPU each"),
    too_many_gpu_workers("--dp", "--global-batch-size", "{n}"),
    (["--task", GPT, "--tp", "3", "--cpus-per-worker", "0.5"],
     "error: hparams.heads (--hp) 4: not divisible by tp (--tp) 3 (the task's tp_divisible)"),
    (["--task", GPT, "--tp", "8", "--hp", "dim=128", "--cpus-per-worker", "0.25"],
     "error: hparams.heads (--hp) 4: not divisible by tp (--tp) 8 (the task's tp_divisible)"),
    (["--task", GPT, "--pp", "3", "--microbatches", "2", "--cpus-per-worker", "0.5"],
     "error: parallelism.pp (--pp) 3: 3 stages need 2 split points; the task's pipeline_split gives 1: blocks.1"),
    (["--hp", "dim=128"], "error: hparams.dim (--hp)"),
    (["--task", f"{PLANS}:ConvPlan", "--tp", "2", "--cpus-per-worker", "0.5"],
     "error: tp_plan: stem (Conv1d): ColwiseParallel shards only an nn.Linear or nn.Embedding"),
    (["--task", f"{PLANS}:Heads", "--tp", "4", "--cpus-per-worker", "0.25"],
     "error: parallelism.tp (--tp) 4: the model as tensor-parallel rank 0 holds it fails on the check batch's shapes "
     "(run on the meta device before any actor starts): RuntimeError: shape '[8, 5, -1, 8]' is invalid for input of "
     "size 480"),
    (["--task", f"{PLANS}:NeverCalled", "--pp", "2"],
     "error: pipeline_split: spare: the traced forward makes 1 stage(s), not 2: a split point the forward never "
     "calls"),
    (["--task", f"{OWN_FORWARD}:LitGptShaped", "--pp", "2", "--tp", "2", "--cpus-per-worker", "0.5"],
     "error: parallelism.tp (--tp) 2: the split at transformer.h.2 is not at the model's units (lm_head, "
     "transformer.wte, transformer.ln_f, transformer.h), so its stages are traced, and a traced stage is not "
     "tensor-parallel"),
    (["--task", f"{ROOT}/jobs/tasks/seed_listing.py:SeedListing", "--tp", "2"],
     f"error: task (--task) {ROOT}/jobs/tasks/seed_listing.py:SeedListing: has no tp_plan(model), which tensor "
     "parallelism (--tp 2) needs"),
])
def test_bad_input_exits_2_before_ray_starts(args, expected, tmp_path):
    proc = run_job_warm("train_parallel.py", "--storage-path", str(tmp_path), *args,
                        env={"RAY_TMPDIR": str(tmp_path / "ray")})
    assert proc.returncode == 2 and proc.stderr.strip().startswith(expected), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ray").exists(), "Ray was started before the input was rejected"


BENCH_GPT_HP = {"dim": 32, "layers": 4, "block": 16, "corpus_bytes": 20000}


@pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers)
def test_the_parallel_benchmark_prints_the_bubble_of_every_schedule_and_the_gpt_layouts(ray_address, tmp_path):
    proc = run_job("bench_parallel.py", "--microbatches", "1,2", "--hidden", "64", "--microbatch-size", "8",
                   "--steps", "1", "--gpt-steps", "2", "--gpt-batch-size", "8", "--address", ray_address,
                   "--gpt-hp", ",".join(f"{k}={v}" for k, v in BENCH_GPT_HP.items()), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    rows = [r for r in lines if r[:1] and r[0] in ("gpipe", "1f1b", "interleaved1f1b", "interleavedzb", "zbv")]
    assert [(r[0], r[1], r[2]) for r in rows] == [("gpipe", "1", "1"), ("gpipe", "1", "2"), ("1f1b", "1", "2"), (
        "interleaved1f1b", "2", "2"), ("interleavedzb", "2", "2"), ("zbv", "2", "2")]
    # the formula column: (p-1)/(m+p-1), (p-1)/(vm+p-1), (p-1)/(3vm+p-1), 0
    assert [r[-3] for r in rows] == ["0.500", "0.333", "0.333", "0.200", "0.077", "0.000"]
    assert all(0 <= float(r[-4]) <= 1 for r in rows)  # measured idle share
    assert all(float(r[-1].split("/")[2]) > 0 for r in rows if r[0] in ("interleavedzb", "zbv")), \
        "the zero-bubble schedules' weight-gradient pass was not timed"
    gpt = {" ".join(r[:-4]): r[-4:] for r in lines if len(r) >= 5 and r[-4].isdigit() and " ".join(r[:-4]) in GPT_BENCH}
    assert sorted(gpt) == sorted(name for name, (_, ranks) in GPT_BENCH.items() if ranks <= CPUS), proc.stdout
    assert all(float(row[2].replace(",", "")) > 0 for row in gpt.values())  # tokens/s
    # every layout trains the same model to the bits/byte of the one-process reference
    _, _, validation = reference_run(parallel_cfg(task=GPT, hparams=BENCH_GPT_HP, optimizer="adam", lr=1e-3,
                                                  steps=2, global_batch_size=8))
    assert {name: row[3] for name, row in gpt.items()} == {name: f"{validation['val_bits_per_byte']:.3f}" for name in gpt}


def shard_report(ctx) -> dict:
    """Every parameter of this rank: its placements (None: a plain tensor) and local data."""
    from torch.distributed.tensor import DTensor

    found = {}
    for name, p in ctx.state["run"].named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        placements = [f"Shard({pl.dim})" if pl.is_shard() else type(pl).__name__ for pl in p.placements] \
            if isinstance(p, DTensor) else None
        found[name] = (placements, local.detach().cpu().clone())
    return found


GPT_HP = {"corpus_bytes": 20000, "block": 16, "dim": 32, "heads": 4, "layers": 2}
# the built-in models' layouts, on the user's GPT (a batch of 8: 2 microbatches per stage for TP x PP)
GPT_LAYOUTS = {"tp2": LAYOUTS["tp2 mlp"], **PIPELINES,
               "tp2 x pp2": {**LAYOUTS["tp2 x pp2 mlp"], "microbatches": 2}, "fsdp2 x tp2": dict(fsdp=2, tp=2)}
# several stages per rank: 4 blocks, so 2 ranks hold 2 stages each (rank 0 holds stages 0 and 2 looped, 0 and 3 in a V)
FOUR_BLOCKS = {"hparams": {**GPT_HP, "layers": 4}, "pp": 2, "microbatches": 4}
GPT_LAYOUTS |= {f"pp2 {s}": {**FOUR_BLOCKS, "schedule": s} for s in ("interleaved1f1b", "interleavedzb", "zbv")}
GPT_LAYOUTS["fsdp2 x pp2 zbv"] = {**FOUR_BLOCKS, "fsdp": 2, "microbatches": 2, "schedule": "zbv"}


# the column- and row-parallel linears of each model by name (the Megatron pattern, written out here,
# independently of the tasks' `tp_plan`): column-parallel weights and biases split by rows (0), row-parallel
# weights by columns (1); row-parallel biases, norms, embeddings stay whole
MEGATRON = (("attn.wq", "attn.wk", "attn.wv", "mlp.up"), ("attn.wo", "mlp.down"))
SHARDED = {"tp2 mlp": LAYOUTS["tp2 mlp"], "tp2 users gpt": {"task": GPT, "hparams": GPT_HP, "tp": 2}}


@pytest.mark.parametrize("layout", SHARDED)
def test_tensor_parallelism_really_shards_every_planned_weight(layout, ray_address):
    """A no-op plan would leave whole replicas: every planned weight must be a DTensor whose local
    shard holds 1/tp of its rows (column-parallel) or columns (row-parallel), the shards must differ
    and concatenate to the whole weight, and each rank must hold the expected share of parameters
    (the built-in models' plans, and the user's GPT task's own `tp_plan`)."""
    cfg = parallel_cfg(**SHARDED[layout])
    recipe, data = make_recipe(cfg)
    torch.manual_seed(cfg.seed)
    whole = dict(recipe.build().named_parameters())  # the reference's initial weights
    recipe.task.ship()  # a task file travels to the ranks by value, as run_parallel sends it
    with WorkerGroup(2, cpus_per_worker=0.5, timeout_s=120) as group:
        group.run(worker.setup, recipe, data)
        ranks = group.run(shard_report)
    planned = expected_split(cfg, whole)
    assert planned, "the plan shards nothing"
    for name, dim in planned.items():
        (p0, s0), (p1, s1) = ranks[0][name], ranks[1][name]
        assert p0 == p1 == [f"Shard({dim})"], f"{name} is not sharded on dim {dim} on both ranks: {p0}, {p1}"
        assert s0.shape[dim] == whole[name].shape[dim] // 2 and not torch.equal(s0, s1), name
        torch.testing.assert_close(torch.cat([s0, s1], dim=dim), whole[name].detach(), msg=name)
    for rank in ranks:
        held = sum(local.numel() for _, local in rank.values())
        want = sum(p.numel() // 2 if name in planned else p.numel() for name, p in whole.items())
        assert held == want < 0.75 * sum(p.numel() for p in whole.values()), (held, want)


def expected_split(cfg: ParallelConfig, whole: dict) -> dict[str, int]:
    """The dimension each sharded parameter is split on (MEGATRON; the MLP's linears alternate
    column- and row-parallel)."""
    if cfg.task == "mlp":
        linears = sorted({int(n.split(".")[1]) for n in whole if n.endswith(".weight")})
        column = {f"layers.{i}" for k, i in enumerate(linears) if k % 2 == 0}
        row = {f"layers.{i}" for k, i in enumerate(linears) if k % 2 == 1}
    else:
        columns, rows = MEGATRON
        blocks = {n.rsplit(".", 3)[0] for n in whole if ".attn." in n}
        column = {f"{b}.{p}" for b in blocks for p in columns}
        row = {f"{b}.{p}" for b in blocks for p in rows}
    split = {f"{m}.weight": 0 for m in column} | {f"{m}.bias": 0 for m in column} | {f"{m}.weight": 1 for m in row}
    return {name: dim for name, dim in split.items() if name in whole}


def gpt_cfg(tmp_path, **layout) -> ParallelConfig:
    return parallel_cfg(**{"task": GPT, "hparams": GPT_HP, "optimizer": "adam", "lr": 1e-3, "steps": 3,
                           "global_batch_size": 8, "storage_path": tmp_path, "name": "gpt", **layout})


# the layouts the options test runs (with more: AdamW, schedule, clipping, accumulation) are not run twice
OPTION_LAYOUTS = ["tp2 x pp2", "fsdp2 x tp2"]


@pytest.mark.parametrize("layout", [name for name in GPT_LAYOUTS if name not in OPTION_LAYOUTS])
def test_the_users_gpt_under_every_layout_equals_one_process(layout, ray_address, tmp_path):
    """The task's own plan (tp_plan, pipeline_split) on the worker group, with Adam (state that is
    sharded like the weights): every step's loss and the final weights equal one process."""
    cfg = gpt_cfg(tmp_path, **GPT_LAYOUTS[layout])
    result = run_parallel(cfg, log_level=logging.DEBUG)
    assert_equal_to_reference(result, cfg)


# the resume tests' schedules: step 2, where they resume, is in the warm-up of the first and in the decay of the
# second
RESUMED_AT = {"tp2 x pp2": {"warmup_steps": 3, "decay": "cosine"}, "pp2 zbv": {"warmup_steps": 1, "decay": "linear"}}


@pytest.mark.parametrize("layout", list(RESUMED_AT))
def test_the_gpt_resumed_from_a_sharded_checkpoint_with_adam_state_ends_equal(layout, ray_address, tmp_path):
    """Shards of the weights and of Adam's state (TP x PP; two stages per rank in a V), saved every 2 steps;
    resumed from step 2 (mid-warm-up; mid-decay) it ends equal to one process only if the optimizer's state
    came back too (its moments and step count) and the schedule goes on at step 2."""
    cfg = gpt_cfg(tmp_path, **{**GPT_LAYOUTS[layout], "steps": 4, "checkpoint": {"every": 2, "keep": 2},
                               "lr_schedule": RESUMED_AT[layout]})
    full = run_parallel(cfg, log_level=logging.DEBUG)
    shutil.rmtree(full.checkpoint)
    resumed = run_parallel(cfg.model_copy(update={"resume": True}), log_level=logging.DEBUG)
    assert len(resumed.step_seconds) == 2, "the resumed run did not start from step 2"
    assert_equal_to_reference(resumed, cfg)


# every training option away from its default (AdamW, a warm-up then cosine decay, clipping that bites
# on every step, 4 micro-batches per step): a run that ignored one would differ from the reference, which
# is torch's own AdamW, LinearLR + CosineAnnealingLR and clip_grad_norm_ on the whole batch at once
OPTIONS = {"optim": {"optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.1, "beta1": 0.8, "clip_grad_norm": 0.05},
           "lr_schedule": {"warmup_steps": 2, "decay": "cosine", "min_lr_ratio": 0.1}, "accumulate": 4,
           "global_batch_size": 16, "steps": 5}


@pytest.mark.parametrize("layout", OPTION_LAYOUTS)
def test_the_gpt_with_every_training_option_equals_one_process(layout, ray_address, tmp_path):
    """AdamW, warm-up + cosine, clipping by the norm over every rank's shards (TP, FSDP and the pipeline's
    stages), 4 micro-batches per step (pipeline: 4 schedule steps of 2 microbatches): every step's loss
    and the final weights equal one process on the whole batch."""
    cfg = gpt_cfg(tmp_path, **{**GPT_LAYOUTS[layout], **OPTIONS, "microbatches": 2} if "pp" in layout
                  else {**GPT_LAYOUTS[layout], **OPTIONS})
    result = run_parallel(cfg, log_level=logging.DEBUG)
    assert_equal_to_reference(result, cfg)


def count_batches(ctx) -> None:
    ctx.state["seen"] = []
    ctx.state["run"].parts[0].register_forward_pre_hook(lambda _m, args: ctx.state["seen"].append(len(args[0])))


def test_accumulation_runs_the_model_on_micro_batches(ray_address):
    """One step in `accumulate` forward passes of batch / accumulate samples (what saves the memory) that
    equals one process's step on the whole batch: plain SGD, unclipped, so the gradient's scale shows."""
    cfg = parallel_cfg(tp=2, accumulate=4, global_batch_size=16, steps=1)
    recipe, data = make_recipe(cfg)
    with WorkerGroup(2, cpus_per_worker=0.5, timeout_s=120) as group:
        group.run(worker.setup, recipe, data)
        group.run(count_batches)
        group.run(worker.train_step, 0)
        seen = group.run(lambda ctx: ctx.state["seen"])
        weights = group.run(worker.gather_weights)[0]
    assert seen == [[4, 4, 4, 4]] * 2, seen
    _, expected, _ = reference_run(cfg)
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, msg=lambda m: f"{name}: {m}")



def count_attention(ctx) -> None:
    """Count the calls of every block's attention on this rank (inside a checkpointed block, its recomputation
    in backward calls them again)."""
    ctx.state["seen"] = 0

    def count(*_):
        ctx.state["seen"] += 1

    for part in ctx.state["run"].parts:
        for name, module in part.named_modules():
            if name.endswith(".attn"):
                module.register_forward_pre_hook(count)


def graphs_compiled(ctx) -> None:
    """What dynamo compiled in this rank's process (its counters start at 0 in a new worker)."""
    ctx.state["seen"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]


def one_tp2_step(cfg: ParallelConfig, before=None, after=None) -> tuple[list, dict]:
    """One step of `cfg` on two TP ranks: what `before` (run after set-up) or `after` (after the step) put in
    each rank's state["seen"], and the whole weights."""
    recipe, data = make_recipe(cfg)
    recipe.task.ship()  # the GPT's file travels to the ranks by value, as run_parallel sends it
    with WorkerGroup(2, cpus_per_worker=0.5, timeout_s=120) as group:
        group.run(worker.setup, recipe, data)
        if before is not None:
            group.run(before)
        group.run(worker.train_step, 0)
        if after is not None:
            group.run(after)
        return group.run(lambda ctx: ctx.state["seen"]), group.run(worker.gather_weights)[0]


def tp2_gpt(**options) -> ParallelConfig:
    return parallel_cfg(task=GPT, hparams=GPT_HP, optimizer="adam", lr=1e-3, steps=1, global_batch_size=8, tp=2,
                        **options)


def test_activation_checkpointing_recomputes_each_block_under_tp_and_changes_no_step(ray_address):
    """`activation_checkpointing: full` on the GPT under TP: each block's attention runs twice a step (the
    forward, then its recomputation in backward), and the step equals one process's without it."""
    calls, weights = one_tp2_step(tp2_gpt(activation_checkpointing="full"), before=count_attention)
    assert calls == [2 * GPT_HP["layers"]] * 2, calls
    _, expected, _ = reference_run(tp2_gpt())
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, msg=lambda m: f"{name}: {m}")


def test_compiled_blocks_under_tp_step_like_one_eager_process(ray_address):
    """`compile: blocks` on the GPT's TP-sharded blocks (DTensor): each rank's dynamo compiles graphs, and the
    step equals one eager process's within rtol 1e-4 / atol 1e-5 (fused kernels reorder float sums)."""
    graphs, weights = one_tp2_step(tp2_gpt(compile="blocks"), after=graphs_compiled)
    assert all(n > 0 for n in graphs), f"a rank ran its blocks eagerly: {graphs} graphs compiled"
    _, expected, _ = reference_run(tp2_gpt())
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
