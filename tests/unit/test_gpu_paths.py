"""The GPU paths' rules, proven where they can be on any machine: no host-device traffic per step
(counted at torch's dispatcher on the meta device, where any copy from the host shows up as an
op), the sweep's GPU placement rules on a described GPU cluster, GPU id order, collective timing
without the refill, DataLoader batches, counted FLOPs. `jobs/gpu_check.py` runs them on GPUs."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import Dataset, Subset, TensorDataset

from helpers import GPUS, run_job
from rayhpc.cluster import Resources
from rayhpc.collectives.bench import _timed_runs
from rayhpc.collectives.primitives import Case
from rayhpc.config import ConfigError, validate
from rayhpc.models import MLP
from rayhpc.monitor.flops import StepFlops, peak_flops
from rayhpc.task.batches import Batches
from rayhpc.train.loop import Window
from rayhpc.tune.config import SweepConfig
from rayhpc.tune.optim import PackedAdam, PackedSGD
from rayhpc.tune.plan import slots
from rayhpc.tune.sweep import check_resources, trial_gpus
from rayhpc.workers.group import gpu_key

MOVES = {"_to_copy", "lift_fresh", "_local_scalar_dense", "copy_"}  # host <-> device traffic, or a sync


class Ops(TorchDispatchMode):
    """Names of the aten ops dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("make", [
    lambda ps: PackedSGD(ps, lr=[0.1, 0.2], momentum=[0.0, 0.9], weight_decay=[0.0, 1e-4], max_norm=[None, 1.0]),
    lambda ps: PackedAdam(ps, lr=[0.1, 0.2], weight_decay=[0.0, 1e-4], decoupled=True, max_norm=[1.0, 2.0]),
])
def test_the_packed_optimizer_step_moves_nothing_from_the_host(make):
    params = [torch.nn.Parameter(torch.empty(2, 3, 4, device="meta")), torch.nn.Parameter(torch.empty(2, 5, device="meta"))]
    for p in params:
        p.grad = torch.empty_like(p)
    opt = make(params)
    assert {h.device.type for h in opt.hyper.values()} == {"meta"}
    for _ in range(2):  # the first step creates state; the second is every later step
        with Ops() as ops:
            opt.clip_()  # each member's norm and limit on the device
            opt.step()
    assert not MOVES & set(ops.names), sorted(MOVES & set(ops.names))


def test_a_training_step_adds_its_loss_on_the_device_without_a_host_sync():
    win = Window(torch.zeros((), device="meta"))
    with Ops() as ops:
        for n in (32, 32, 7):
            win.add(torch.empty((), device="meta"), n)
    assert not MOVES & set(ops.names), sorted(MOVES & set(ops.names))
    assert (win.samples, win.steps) == (71, 3)


GPU_NODE = Resources(cpus=16, gpus=2, nodes=1, node_cpus=16, node_gpus=2, address="x", per_node=((16, 2),))


def sweep(**kw) -> SweepConfig:
    return validate(SweepConfig, kw)


def test_a_sweep_on_gpus_puts_one_pack_per_gpu_or_per_stated_share():
    assert trial_gpus(sweep(), GPU_NODE) == 1.0 and slots(sweep(), GPU_NODE, 1.0) == 2
    quarter = sweep(gpus_per_trial=0.25)
    assert trial_gpus(quarter, GPU_NODE) == 0.25 and slots(quarter, GPU_NODE, 0.25) == 8
    no_gpus = Resources(cpus=16, gpus=0, nodes=1, node_cpus=16, node_gpus=0, address="x", per_node=((16, 0),))
    assert trial_gpus(sweep(), no_gpus) == 0.0 and slots(sweep(), no_gpus, 0.0) == 16
    two = sweep(workers_per_trial=2)  # a whole GPU per worker: one trial of 2 workers on 2 GPUs
    assert trial_gpus(two, GPU_NODE) == 1.0 and slots(two, GPU_NODE, 1.0) == 1


@pytest.mark.parametrize("kw, message", [
    ({"workers_per_trial": 3}, "workers_per_trial (--workers-per-trial) 3: the cluster can place 2 worker(s) of "
                               "1 CPU + 1 GPU each"),
    ({"gpus_per_trial": 0.1}, "gpus_per_trial (--gpus-per-trial) 0.1: at most 8 trial processes share a GPU"),
])
def test_gpu_requests_the_cluster_cannot_serve_are_refused(kw, message):
    with pytest.raises(ConfigError) as err:
        check_resources(sweep(**kw), GPU_NODE)
    assert str(err.value).startswith(message), err.value
    check_resources(sweep(precision="bf16"), GPU_NODE)  # bf16 is fine where trials get GPUs


def test_gpu_ids_sort_by_number():
    assert sorted(["10", "2", "1", "11", "0"], key=gpu_key) == ["0", "1", "2", "10", "11"]


def test_collective_timing_leaves_out_the_refill():
    case = Case(run=lambda: time.sleep(0.002), check=lambda: None, size_bytes=4, refill=lambda: time.sleep(0.05))
    assert 0.002 <= _timed_runs(case, 3, torch.device("cpu")) < 0.03


class Squares(Dataset):
    """Not in-memory tensors: batches go through a DataLoader."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor([float(i * i)])


def test_loader_workers_give_the_same_batches_in_the_same_order():
    order = list(range(49, -1, -3))
    alone = list(Batches(Squares(), torch.device("cpu"))(order, 8))
    helped = list(Batches(Squares(), torch.device("cpu"), workers=2)(order, 8))
    assert len(alone) == len(helped) == 3 and [b[0].flatten().tolist() for b in helped][0] == order[:8]
    for a, b in zip(alone, helped):
        torch.testing.assert_close(a, b)
    x = torch.arange(10.0).unsqueeze(1)  # in-memory tensors: indexed whole, the same batches
    torch.testing.assert_close(next(Batches(TensorDataset(x, x), torch.device("cpu"))([3, 1], 2)), [x[[3, 1]]] * 2)


def test_the_train_and_validation_subsets_each_put_only_their_own_rows_on_the_device():
    """On another device (meta here, a GPU in use) the two subsets of one tensor hold its bytes once in all;
    on the tensors' own device (CPU training) they share the tensors, copying nothing. Either way item i of
    a subset is row indices[i]."""
    x, y = torch.randn(1000, 16), torch.randn(1000, 1)  # 64,000 + 4,000 bytes
    train, val = Subset(TensorDataset(x, y), list(range(200, 1000))), Subset(TensorDataset(x, y), list(range(200)))
    placed = [Batches(part, torch.device("meta")) for part in (train, val)]
    stored = sum(t.untyped_storage().nbytes() for b in placed for t in b.tensors)
    assert stored == x.nbytes + y.nbytes, (stored, x.nbytes + y.nbytes)  # once in all, not once per subset
    shared = [Batches(part, torch.device("cpu")) for part in (train, val)]
    assert all(t.untyped_storage().data_ptr() in (x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr())
               for b in shared for t in b.tensors)
    assert [tuple(t.shape) for t in next(placed[0]([5, 0, 799], 3))] == [(3, 16), (3, 1)]
    for batches, items, rows in [(shared[0], [5, 0, 799], [205, 200, 999]), (shared[1], [5, 0, 199], [5, 0, 199])]:
        torch.testing.assert_close(next(batches(items, 3)), [x[rows], y[rows]])


def test_model_flops_are_the_forward_and_backward_matmuls_of_the_anchor_mlp():
    """The anchor's shape at 1/64 of its width: 2 x weights x samples forward, as much for the weights'
    gradients, and as much again for the inputs' gradients but the first layer's (the data needs none, and
    autograd skips it): the 6 x parameters x samples convention less that (bias adds aside)."""
    model, batch = MLP(64, 128, 64, depth=4), 128
    x, y = torch.randn(batch, 64), torch.randn(batch, 64)
    assert not x.requires_grad
    counter = StepFlops()
    with counter.once():
        torch.nn.functional.mse_loss(model(x), y).backward()
    weights = sum(p.numel() for name, p in model.named_parameters() if name.endswith("weight"))
    params = sum(p.numel() for p in model.parameters())
    first = model.layers[0].weight.numel()
    expected = 6 * weights * batch - 2 * first * batch
    assert counter.flops == expected, (counter.flops, expected)
    assert abs(counter.flops / (6 * params * batch) - 1) < 0.2  # the first layer's input gradient, the biases
    assert counter.conv_flops == 0
    with counter.once():  # counted once only
        model(x).sum().backward()
    assert counter.flops == expected


def test_convolutions_are_counted_apart_for_their_own_tf32_peak():
    conv, counter = torch.nn.Conv2d(3, 8, 3, bias=False), StepFlops()
    with counter.once():
        conv(torch.randn(2, 3, 10, 10)).sum().backward()
    # 2 x outputs x kernel forward, as much for the weight's gradient; none for the input's (it needs none)
    assert counter.flops == counter.conv_flops == 2 * 2 * (2 * 8 * 8 * 8 * 3 * 3 * 3)
    assert peak_flops(torch.device("cpu"), bf16=True) is None


@pytest.mark.parametrize("name, bf16, conv_share, peak", [
    ("NVIDIA H200 NVL", True, 0.0, 835e12),
    ("NVIDIA H200", True, 0.0, 989.4e12),
    ("NVIDIA GH200 480GB", False, 0.0, 66.9e12),  # fp32 matmuls
    ("NVIDIA H100 80GB HBM3", False, 1.0, 494.7e12),  # fp32 convolutions: cuDNN runs them in TF32
    ("NVIDIA H100 80GB HBM3", False, 0.5, 1 / (0.5 / 66.9e12 + 0.5 / 494.7e12)),
])
def test_the_peak_is_the_named_gpus_at_the_precision_each_flop_runs_in(monkeypatch, name, bf16, conv_share, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    settings = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = [s.fp32_precision for s in settings]
    for setting, value in zip(settings, ("ieee", "tf32")):  # the fp32 job's settings, cuDNN's default kept
        setting.fp32_precision = value
    try:
        assert peak_flops(torch.device("cuda", 0), bf16, conv_share) == pytest.approx(peak)
    finally:
        for setting, value in zip(settings, before):
            setting.fp32_precision = value


def test_the_gpu_check_runs_on_any_machine_and_says_where(tmp_path):
    """Without a GPU every GPU line is SKIP with its reason (exit 0); on a GPU node only the first line runs
    here (the whole check is tests/gpu's)."""
    only = [] if GPUS == 0 else ["--only", "no host sync"]
    proc = run_job("gpu_check.py", "--out", str(tmp_path / "gpu_check.json"), *only, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    lines = [(line["name"], line["status"], line["figures"]) for line in report["lines"]]
    assert lines[0][:2] == ("no host sync in a step", "PASS")
    assert ("no GPU" in report["machine"]) == (GPUS == 0) and report["machine"] in proc.stdout
    if GPUS == 0:
        assert len(lines) >= 12 and {(status, why) for _, status, why in lines[1:]} == {("SKIP", "no GPU on this machine")}
        names = " | ".join(name for name, _, _ in lines)
        for subject in ("packed sweep", "DDP", "FSDP2", "TP/PP on NCCL: tp2", "pp2 1f1b", "NCCL collectives",
                        "pipeline bubble", "digits", "warm distributed-trial sweep", "array task"):
            assert subject in names, (subject, names)


def test_the_gpu_checks_array_task_line_runs_its_task():
    """The array-task line's own code (run on a GPU only by gpu_check) trains the built-in task: here on the CPU."""
    from bench.gpu_check import check_array_task

    line = check_array_task(0)
    assert line.status == "PASS" and "trained on cpu" in line.figures, line


def test_the_gpu_check_on_gpus_this_torch_cannot_use_fails_naming_the_build(tmp_path, monkeypatch, capsys):
    """A GPU machine (the driver lists a GPU) whose torch cannot use it: exit 1, not "no GPU" and exit 0."""
    import gpu_check
    from bench import gpu_check as checks

    monkeypatch.setattr(checks, "node_gpus", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "gpu_check.json")]) == 1
    out = capsys.readouterr().out
    assert "1 NVIDIA GPU(s) that torch cannot use" in out and "no GPU on this machine" not in out, out
    failed = [line for line in out.splitlines() if "FAIL" in line]
    assert len(failed) == 1 and f"torch {torch.__version__} (" in failed[0] and "is_available() is False" in failed[0]


def test_an_array_task_whose_torch_sees_no_gpu_is_one_error_line(monkeypatch):
    """A task Slurm gave a GPU that torch cannot see (a CPU build, an old driver) refuses to train on the CPU:
    a `ConfigError`, which the task's entry point prints as one `error:` line with exit 2."""
    from rayhpc.tune.single import task_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^gpus_per_trial 1: array task: this process was given GPU\(s\) "
                       r"\(CUDA_VISIBLE_DEVICES=.*\) but torch .* cannot use them: torch.cuda.is_available\(\) is False"):
        task_device(1)
    assert task_device(None) == torch.device("cpu")


def test_bf16_data_parallel_on_the_cpu_computes_in_bf16_with_ddp_as_with_fsdp(tmp_path):
    """`precision: bf16` is applied by both strategies (autocast for DDP, FSDP2's mixed-precision policy),
    on one gloo rank in this process: the model's output is bf16 and the loss differs from fp32's by
    bf16's rounding only."""
    import torch.distributed as dist

    from rayhpc.task import task_for
    from rayhpc.task.hparams import full_hparams
    from rayhpc.train.config import TrainConfig
    from rayhpc.train.loop import make_worker

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        losses, dtypes = {}, {}
        for strategy in ("ddp", "fsdp"):
            for precision in ("fp32", "bf16"):
                cfg = validate(TrainConfig, {"strategy": strategy, "precision": precision,
                                             "storage_path": str(tmp_path), "compute": {"cpus_per_worker": 1}})
                task = task_for("mlp", cfg.data)
                hp = full_hparams(task.hp_model, {"hidden": 64})
                w = make_worker(cfg, task, hp, torch.device("cpu"), 0, 1, lambda model, optimizer: None)
                key = (strategy, precision)
                w.model.register_forward_hook(lambda _m, _i, out, key=key: dtypes.update({key: out.dtype}))
                losses[strategy, precision] = float(w.loss(next(w.train(range(64), 64))).detach())
    finally:
        dist.destroy_process_group()
    assert dtypes == {("ddp", "fp32"): torch.float32, ("ddp", "bf16"): torch.bfloat16,
                      ("fsdp", "fp32"): torch.float32, ("fsdp", "bf16"): torch.bfloat16}, dtypes
    for strategy in ("ddp", "fsdp"):
        fp32, bf16 = losses[strategy, "fp32"], losses[strategy, "bf16"]
        assert fp32 != bf16 and abs(bf16 / fp32 - 1) < 0.05, losses
