"""The training options (`rayhpc.optim`): AdamW, warm-up and decay, clipping, accumulation. Each run
equals plain PyTorch with the same global batch, written here with torch's own optimizers, schedulers
(`LinearLR` then `CosineAnnealingLR`) and `clip_grad_norm_`, on one process and one full batch."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers import (
    EPOCHS,
    ROOT,
    KillWorkerOnce,
    assert_restarted_after,
    assert_same_weights,
    reference_schedule,
    run_job_warm,
)
from rayhpc.config import Optim, Schedule, validate
from rayhpc.data import synthetic_tensors
from rayhpc.engine import Module, train_step
from rayhpc.engine.checkpoint import load_full_state_dict, load_progress
from rayhpc.engine.parallelize import apply_ac, apply_compile, model_blocks
from rayhpc.models import MLP
from rayhpc.optim import lr_factor
from rayhpc.task.hparams import full_hparams
from rayhpc.train.config import TrainConfig
from rayhpc.train.trainer import run_training

# every option away from its default: a test that ignored one would differ
OPTIONS = {"optim": {"optimizer": "adamw", "lr": 0.02, "weight_decay": 0.1, "beta1": 0.8, "clip_grad_norm": 0.3},
           "schedule": {"warmup_steps": 40, "decay": "cosine", "min_lr_ratio": 0.1}, "accumulate": 4}




def plain_run(cfg: TrainConfig, batch: int) -> tuple[dict, list[float]]:
    """The mlp task's training split (its 20% hold-out removed, as the task splits it) in one process:
    AdamW, the schedule, clipping, one full `batch` per step. Returns the weights and each step's lr."""
    x, y = synthetic_tensors(cfg.data.synthetic)
    keep = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[round(0.2 * len(x)):]
    train = TensorDataset(x[keep], y[keep])
    torch.manual_seed(cfg.seed)
    model = MLP(6, 16, 2)
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    total = cfg.epochs * math.ceil(len(train) / batch)
    schedule = reference_schedule(opt, cfg.schedule.warmup_steps, total, cfg.schedule.min_lr_ratio)
    sampler, lrs = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed), []
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in DataLoader(train, batch_size=batch, sampler=sampler):
            opt.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad_norm)
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            schedule.step()
    return model.state_dict(), lrs


def options_cfg(tmp_path, name: str, **kw) -> TrainConfig:
    return validate(TrainConfig, {"storage_path": str(tmp_path), "name": name, "epochs": EPOCHS,
                                  "compute": {"num_workers": 2}, "batch_size_per_worker": 32,
                                  "hparams": {"hidden": 16}, **OPTIONS, **kw})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return plain_run(options_cfg(tmp_path_factory.mktemp("ref"), "ref"), batch=64)


@pytest.mark.parametrize("decay", ["cosine", "linear", "step", "constant"])
def test_the_schedule_is_a_warm_up_then_the_decay_down_to_the_floor(decay):
    ours, total = Schedule(warmup_steps=4, decay=decay, min_lr_ratio=0.1), 24
    factors = [lr_factor(ours, s, total) for s in range(total)]
    torch.testing.assert_close(factors[:5], [0.2, 0.4, 0.6, 0.8, 1.0])  # warm-up, then the peak
    if decay == "cosine":  # torch's own schedulers, independently
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        schedule, want = reference_schedule(opt, 4, total, 0.1), []
        for _ in range(total):
            want.append(opt.param_groups[0]["lr"])
            opt.step()
            schedule.step()
        torch.testing.assert_close(factors, want)
    ends = {"cosine": 0.1, "linear": 0.1, "step": 0.1, "constant": 1.0}
    assert math.isclose(factors[-1], ends[decay]) and min(factors[4:]) >= 0.1 - 1e-12, factors
    if decay == "linear":
        torch.testing.assert_close(factors[4:], [1 - 0.9 * k / 19 for k in range(20)])
    if decay == "step":  # x0.1 at half the 20 decay steps, held at the floor after three quarters
        assert factors[4:] == [1.0] * 10 + [0.1] * 10, factors


def test_a_warm_up_given_as_a_fraction_is_that_share_of_the_steps():
    hp, total = {"decay": "cosine", "min_lr_ratio": 0.1}, 24
    by_fraction = [lr_factor(Schedule(**hp, warmup_fraction=0.25), s, total) for s in range(total)]
    assert by_fraction == [lr_factor(Schedule(**hp, warmup_steps=6), s, total) for s in range(total)]
    assert by_fraction[5] < 1.0 == by_fraction[6], by_fraction  # the peak after 6 = 0.25 x 24 steps


@pytest.mark.parametrize("clip", [0.5, None])
def test_accumulation_sums_micro_batch_gradients_into_the_full_batch_step(clip):  # rayhpc.engine.train_step
    """Four micro-batches of 8 (the loss sees each) make the step one batch of 32 makes, clipped or not (clipping
    alone would hide a gradient four times too large: it rescales both to the same norm)."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 6), torch.randn(32, 2)
    models = [MLP(6, 16, 2) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    seen = []

    def loss_fn(batch):
        seen.append(len(batch[0]))
        return F.mse_loss(models[0](batch[0]), batch[1])

    opt = torch.optim.SGD(models[0].parameters(), lr=0.1)
    train_step(Module(models[0], opt, loss_fn, Optim(optimizer="sgd", lr=0.1, clip_grad_norm=clip)), (x, y), 4, 0, 1)
    plain = torch.optim.SGD(models[1].parameters(), lr=0.1)
    F.mse_loss(models[1](x), y).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(models[1].parameters(), clip)
    plain.step()
    assert seen == [8, 8, 8, 8]
    assert_same_weights(models[0].state_dict(), models[1].state_dict())


def assert_reference_run(run, reference) -> None:
    """The run's final weights, and the lr of every 10th step (warm-up and decay), are the reference's."""
    weights, lrs = reference
    assert_same_weights(load_full_state_dict(run.checkpoint_dir), weights)
    steps = run.metrics[run.metrics["kind"] == "step"].drop_duplicates("global_step")
    got = dict(zip(steps["global_step"], steps["lr"]))
    assert len(got) >= 6 and all(s % 10 == 0 for s in got), got  # the optional per-step rows
    torch.testing.assert_close([got[s] for s in sorted(got)], [lrs[s - 1] for s in sorted(got)])


def test_fsdp2_with_every_option_on_two_ranks_equals_one_plain_process(ray_address, tmp_path, reference):
    """AdamW, warm-up and cosine, clipping and 4 micro-batches under FSDP2, with full activation
    checkpointing too (it changes no value), on the MLP's layers (FSDP2's units); the checkpoint is DCP's,
    one shard file per rank."""
    run = run_training(options_cfg(tmp_path, "fsdp", strategy="fsdp", metrics_every_steps=10,
                                   activation_checkpointing="full"))
    files = sorted(p.name for p in run.checkpoint_dir.iterdir())
    assert ".metadata" in files and sum(f.endswith(".distcp") for f in files) == 2, files
    assert_reference_run(run, reference)


@pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers)
def test_ddp_with_every_option_killed_mid_warm_up_and_mid_decay_equals_one_plain_process(ray_address, tmp_path,
                                                                                         reference):
    """The same options under DDP with selective activation checkpointing; a worker killed after step 30
    of 40 warm-up steps, and again after step 60 (of 78, in the cosine decay): the group restarts from the
    step-30 and step-60 checkpoints (AdamW's moments with them; the schedule follows the step count the
    checkpoint holds) and ends as the uninterrupted reference."""
    cfg = options_cfg(tmp_path, "resumed", checkpoint={"every": 10}, metrics_every_steps=10,
                      activation_checkpointing="selective")
    run = run_training(cfg, callbacks=(KillWorkerOnce(30, str(tmp_path / "reports.jsonl"), 60),))
    assert_restarted_after(tmp_path / "reports.jsonl", [30, 60])
    epochs = run.metrics[run.metrics["kind"] == "epoch"]
    assert epochs["epoch"].tolist() == [1, 2, 3] and load_progress(run.checkpoint_dir).epoch == EPOCHS
    assert_reference_run(run, reference)


def test_a_run_of_steps_ends_mid_epoch_and_its_schedule_spans_them(ray_address, tmp_path):
    """`steps` instead of epochs: the epochs they take, the last one cut short, and the linear decay
    reaches its floor (0) at the last of them."""
    cfg = validate(TrainConfig, {"storage_path": str(tmp_path), "name": "steps", "steps": 10, "hparams": {"hidden": 16},
                                 "compute": {"num_workers": 2}, "batch_size_per_worker": 256,
                                 "schedule": {"decay": "linear"}})
    run = run_training(cfg)
    epochs = run.metrics[run.metrics["kind"] == "epoch"]
    per_epoch = epochs["global_step"].iloc[0]
    assert 10 % per_epoch and list(epochs["global_step"]) == [*range(per_epoch, 10, per_epoch), 10], epochs
    assert epochs["lr"].iloc[-1] == 0.0 < epochs["lr"].iloc[-2], list(epochs["lr"])


@pytest.mark.parametrize("args, expected", [
    (["--warmup-steps", "-1"],
     "error: schedule.warmup_steps (--warmup-steps): Input should be greater than or equal to 0"),
    (["--accumulate", "3"], "error: accumulate (--accumulate) 3: does not divide the batch per worker 16"),
    (["--optimizer", "lion"], "error: optim.optimizer (--optimizer): unknown optimizer 'lion': expected "
                              "sgd, adam, adamw or a torch.optim class"),
    (["--warmup-steps", "3", "--warmup-fraction", "0.1"],
     "error: schedule: warmup_fraction (--warmup-fraction) 0.1 and warmup_steps (--warmup-steps) 3: give one"),
    (["--steps", "10", "--epochs", "2"], "error: steps (--steps) 10 and epochs (--epochs) 2: give one, not both"),
    (["--warmup-fraction", "1.5"], "error: schedule.warmup_fraction (--warmup-fraction): Input should be less than 1"),
])
def test_bad_training_options_exit_2_naming_the_key(args, expected, tmp_path):
    out = run_job_warm("train_mlp.py", "--storage-path", str(tmp_path), *args)
    assert out.returncode == 2 and out.stderr.startswith(expected) and out.stderr.count("\n") == 1, out.stderr


class OpCounter(TorchDispatchMode):
    """How many matmuls run while it is active (in backward: the gradients', and any recomputed forward's)."""

    def __init__(self):
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.matmuls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


def small_gpt():
    from rayhpc.data import DataConfig
    from rayhpc.task import task_for

    task = task_for(str(ROOT / "jobs" / "tasks" / "gpt.py") + ":GPT", DataConfig())
    hp = full_hparams(task.hp_model, {"block": 16, "dim": 32, "heads": 2, "layers": 2})
    batch = tuple(torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(2))
    return task, hp, batch


def saved_and_recomputed(task, model, batch) -> tuple[int, int, int, dict]:
    """(elements saved for backward outside checkpointed blocks, matmuls in forward, matmuls in backward,
    the gradients)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        with OpCounter() as forward:
            loss = task.loss(model, batch)
    with OpCounter() as backward:
        loss.backward()
    return sum(saved), forward.matmuls, backward.matmuls, {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_fewer_activations_and_changes_no_gradient(mode):
    """The GPT's two blocks checkpointed: far fewer elements saved for backward; `full` recomputes the
    blocks' matmuls in backward, `selective` keeps their outputs and recomputes none; the gradients are
    the eager ones."""
    task, hp, batch = small_gpt()
    eager = task.initial_model(hp)
    checkpointed = copy.deepcopy(eager)
    blocks = model_blocks(task.obj, checkpointed)
    assert blocks == list(checkpointed.blocks.values())
    apply_ac(blocks, mode)
    saved, forward, backward, grads = saved_and_recomputed(task, eager, batch)
    saved_ac, _, backward_ac, grads_ac = saved_and_recomputed(task, checkpointed, batch)
    assert saved_ac < 0.5 * saved, (saved_ac, saved)
    # full recomputes the blocks' forward matmuls (all but the head's) up to the last one backward needs
    # (torch stops recomputing there: each block's final output is saved by nobody); selective none
    recomputed = forward - 1 - len(blocks) if mode == "full" else 0
    assert backward_ac - backward == recomputed, (backward_ac, backward, forward)
    assert grads_ac.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_ac[name], grads[name], msg=lambda m: f"{name}: {m}")


def test_compiled_blocks_train_like_eager(tmp_path, monkeypatch):
    """`torch.compile` of each block (inductor on CPU, which writes the kernels it generates into its
    cache): three AdamW steps, losses and weights within rtol 1e-4 / atol 1e-5 of eager (fused kernels
    reorder float sums)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    task, hp, batch = small_gpt()
    runs = {}
    for mode in ("none", "blocks"):
        model = task.initial_model(hp)
        apply_compile(model, model_blocks(task.obj, model), mode)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = task.loss(model, batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs[mode] = losses, model.state_dict()
    assert list((tmp_path / "inductor").rglob("*.py")), "nothing was compiled"
    torch.testing.assert_close(runs["blocks"][0], runs["none"][0], rtol=1e-4, atol=1e-5)
    for name, value in runs["none"][1].items():
        torch.testing.assert_close(runs["blocks"][1][name], value, rtol=1e-4, atol=1e-5)


def test_the_training_loop_compiles_the_blocks_it_is_told_to(ray_cluster, tmp_path, monkeypatch):
    """One epoch of the GPT through the training job's own worker (`make_worker`, `run_epoch`) with
    `compile: blocks`: inductor generates code (a model run under the MFU FLOP counter's dispatch mode
    would have fallen back to eager for good), and the loss goes down."""
    from rayhpc.train.loop import make_worker, run_epoch

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    task, hp, _ = small_gpt()
    hp = {**hp, "corpus_bytes": 16_000, "lr": 3e-3, "optimizer": "adamw", "batch_size": 16}
    cfg = validate(TrainConfig, {"storage_path": str(tmp_path), "epochs": 1, "batch_size_per_worker": 16,
                                 "compute": {"num_workers": 1, "cpus_per_worker": 1}, "compile": "blocks",
                                 "task": task.spec})
    worker = make_worker(cfg, task, hp, torch.device("cpu"), 0, 1, lambda model, optimizer: None)
    rows = []
    worker.sink = lambda w, metrics, with_checkpoint: rows.append(metrics)
    run_epoch(worker, 0)
    assert list((tmp_path / "inductor").rglob("*.py")), "the loop ran the blocks eagerly"
    assert rows[-1]["val_loss"] < math.log(256), rows[-1]  # below a uniform guess over the 256 bytes


def test_sweep_trials_and_parameter_server_workers_checkpoint_the_tasks_blocks():
    """`activation_checkpointing` reaches every runner that builds the task's model: a sweep's trials (which then
    run unpacked, each the task's own model; distributed ones through their training run's config), its array
    tasks and the parameter server's workers recompute the blocks' matmuls in backward, as eager does not."""
    from rayhpc.config import ModelOptions
    from rayhpc.ps.config import PSConfig
    from rayhpc.ps.worker import PSWorker
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.packing import make_pack
    from rayhpc.tune.plan import can_pack, pack_size
    from rayhpc.tune.single import train_alone
    from rayhpc.tune.warm import trial_train_config

    task, hp, batch = small_gpt()
    sweep = validate(SweepConfig, {"activation_checkpointing": "full", "task": task.spec})
    assert not can_pack(sweep) and pack_size(sweep, n_trials=16, n_slots=2) == 1
    assert trial_train_config(sweep, {**hp, "batch_size": 4}, "t", gpu=False).activation_checkpointing == "full"
    full = ModelOptions(activation_checkpointing="full")
    trial = make_pack(task, [hp], torch.device("cpu"), full).model
    array_task = train_alone(task, hp, validate(SweepConfig, {"steps": 1, "activation_checkpointing": "full",
                                                              "task": task.spec}))["model"]
    ps = PSWorker(0, 1, validate(PSConfig, {"activation_checkpointing": "full", "task": task.spec,
                                            "compute": {"cpus_per_worker": 1}}), task, hp,
                  layout=None, servers=[], device="cpu")
    _, forward, eager, _ = saved_and_recomputed(task, task.initial_model(hp), batch)
    for runner, model in [("sweep trial", trial), ("array task", array_task), ("parameter-server worker", ps.model)]:
        _, _, backward, _ = saved_and_recomputed(task, model, batch)
        assert backward - eager == forward - 1 - hp["layers"], (runner, backward, eager, forward)


def test_every_job_takes_one_precision_vocabulary_and_bf16_computes_in_bf16():
    """`precision` is fp32 | tf32 | bf16 in the training, model-parallel and sweep jobs alike. On CPUs tf32 is
    fp32 exactly, and bf16 (autocast) gives a loss that differs from fp32 by bf16's rounding but no more:
    checked against a plain fp32 model evaluated here. Checked: autocast made a no-op fails."""
    from rayhpc.config import Precision
    from rayhpc.parallel.config import ParallelConfig
    from rayhpc.precision import autocast, set_matmul_precision
    from rayhpc.ps.config import PSConfig
    from rayhpc.tune.config import SweepConfig

    for job in (TrainConfig, ParallelConfig, SweepConfig, PSConfig):
        assert job.model_fields["precision"].annotation is Precision, job
    torch.manual_seed(0)
    model, x = MLP(64, 256, 8), torch.randn(128, 64)
    want = model(x)
    for precision, close in [("fp32", 0.0), ("tf32", 0.0), ("bf16", 2e-2)]:
        set_matmul_precision(precision)
        with autocast(precision, x.device):
            got = model(x)
        tf32 = "ieee" if precision == "fp32" else "tf32"
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == (tf32, tf32)
        assert (got.dtype == torch.bfloat16) is (precision == "bf16"), precision
        torch.testing.assert_close(got.float(), want, rtol=close, atol=close)
        if precision == "bf16":
            assert not torch.equal(got.float(), want), "bf16 computed in fp32"
    set_matmul_precision("fp32")
    # a runner: a trial alone (array tasks) trains in what it is told
    from rayhpc.task import task_for
    from rayhpc.tune.single import train_alone

    task = task_for("mlp", validate(TrainConfig, {}).data)
    hp = full_hparams(task.hp_model, {"hidden": 64})
    for value in ("train_loss", "val_loss"):
        runs = {p: train_alone(task, hp, SweepConfig(epochs=1, precision=p))[value] for p in ("fp32", "tf32", "bf16")}
        assert runs["fp32"] == runs["tf32"] != runs["bf16"] and abs(runs["bf16"] / runs["fp32"] - 1) < 0.05, runs
    # a parameter-server worker computes its loss (and so its gradient) in what it is told
    from rayhpc.ps.worker import PSWorker
    from rayhpc.task.batches import collate

    batch = collate(task.split_data(hp, validate(TrainConfig, {}).data)[0], range(64))
    losses = {p: PSWorker(0, 1, validate(PSConfig, {"precision": p, "compute": {"cpus_per_worker": 1}}), task, hp,
                          layout=None, servers=[], device="cpu").loss(batch) for p in ("fp32", "bf16")}
    assert losses["bf16"].item() != losses["fp32"].item(), losses
    torch.testing.assert_close(losses["bf16"].float(), losses["fp32"], rtol=5e-2, atol=0)
    set_matmul_precision("fp32")


@pytest.mark.parametrize("layout, fsdp", [({"dp": 2}, True), ({"fsdp": 2}, True), ({"pp": 2, "microbatches": 2}, False)])
def test_model_parallel_bf16_is_fsdps_policy_under_fsdp_and_autocast_elsewhere(ray_address, tmp_path, layout, fsdp):
    """One precision rule in every job: where the model-parallel job's replicas shard the stages with FSDP2,
    bf16 is its mixed-precision policy (the parameters cast: the probe's output is bf16); elsewhere it is
    autocast (the probe's last product is promoted to fp32). Either way the run trains in bf16: its losses
    differ from fp32's by bf16's rounding only. Checked: FSDP's policy left off fails the first two."""
    from rayhpc.parallel import ParallelConfig, run_parallel

    runs = {}
    for precision in ("fp32", "bf16"):
        cfg = ParallelConfig(task=f"{ROOT}/tests/tasks/bf16_probe.py:BF16Probe", parallelism=layout, steps=6,
                             global_batch_size=32, precision=precision, storage_path=tmp_path, name=precision,
                             compute={"cpus_per_worker": 0.5})
        runs[precision] = run_parallel(cfg)
    assert runs["fp32"].validation["val_bf16_output"] == 0.0
    assert runs["bf16"].validation["val_bf16_output"] == (1.0 if fsdp else 0.0), runs["bf16"].validation
    fp32, bf16 = torch.tensor(runs["fp32"].losses), torch.tensor(runs["bf16"].losses)
    assert not torch.equal(fp32, bf16), "bf16 computed in fp32"
    torch.testing.assert_close(bf16, fp32, rtol=5e-2, atol=0)
