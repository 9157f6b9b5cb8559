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
from torch.utils.data import Dataset, TensorDataset

from helpers import GPUS, run_job
from rayhpc.cluster import Resources
from rayhpc.collectives.bench import _timed_runs
from rayhpc.collectives.primitives import Case
from rayhpc.config import ConfigError, validate
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


def test_model_flops_are_counted_from_a_real_step():
    layer, counter = torch.nn.Linear(64, 32), StepFlops()
    x = torch.randn(16, 64, requires_grad=True)
    with counter.once():
        layer(x).sum().backward()
    assert counter.flops == 6 * 16 * 64 * 32  # forward 2*B*in*out; backward that for weight and input grads
    with counter.once():  # counted once only
        layer(x.detach()).sum().backward()
    assert counter.flops == 6 * 16 * 64 * 32
    assert peak_flops(torch.device("cpu"), bf16=True) is None


def test_the_gpu_check_runs_on_any_machine_and_says_where(tmp_path):
    proc = run_job("gpu_check.py", "--out", str(tmp_path / "gpu_check.json"), "--only", "no host sync", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(line["name"], line["status"]) for line in report["lines"]] == [("no host sync in a step", "PASS")]
    assert ("no GPU" in report["machine"]) == (GPUS == 0) and report["machine"] in proc.stdout


def test_an_array_task_whose_torch_sees_no_gpu_is_one_error_line(monkeypatch):
    """A task Slurm gave a GPU that torch cannot see (a CPU build, an old driver) refuses to train on the CPU:
    a `ConfigError`, which the task's entry point prints as one `error:` line with exit 2."""
    from rayhpc.tune.single import task_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^gpus_per_trial 1: no GPU visible to this array task \(CUDA_VISIBLE_DEV"):
        task_device(1)
    assert task_device(None) == torch.device("cpu")
