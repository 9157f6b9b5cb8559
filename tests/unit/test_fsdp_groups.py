"""FSDP2's groups and optimizer (`rayhpc.engine.parallelize`, `rayhpc.optim`), on real gloo ranks: on one rank the whole
model is one group (a group per unit would cost each unit a gather, a gradient reduction and hooks, and save
no memory); on two, every unit is a group of its own (one unit's weights gathered at a time). Over sharded
parameters the optimizer is the multi-tensor form, and steps them as torch's per-parameter loop steps a
plain model."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 5


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 2))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)) for _ in range(STEPS)]


def _rank(rank: int, world: int, folder: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    from rayhpc.config import Optim
    from rayhpc.engine.parallelize import apply_fsdp, default_units
    from rayhpc.optim import make_optimizer

    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", world), rank=rank, world_size=world)
    try:
        model = mlp()
        apply_fsdp(model, default_units(model))
        opt = make_optimizer(Optim(optimizer="adamw", lr=0.05, weight_decay=0.1), model.parameters())
        for x, y in batches():  # each rank the same batch: the step is the plain model's
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        weights = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
        groups = [name or "(root)" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        if rank == 0:
            with open(f"{folder}/out.json", "w") as out:
                json.dump({"groups": groups, "foreach": opt.defaults["foreach"], "weights": weights}, out)
        # neither rank tears gloo down while the other still has a collective in flight: a rank that exited
        # first once made gloo abort the other ("terminate called without an active exception", seen in CI)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_one_rank_shards_the_model_as_one_group_more_each_unit_and_steps_as_plain_torch(world, tmp_path):
    mp.start_processes(_rank, args=(world, str(tmp_path)), nprocs=world, start_method="spawn")
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["groups"] == (["(root)"] if world == 1 else ["(root)", "0", "2", "4"]), got["groups"]
    assert got["foreach"] is True

    plain = mlp()  # the reference: torch's AdamW, its per-parameter loop on CPU
    opt = torch.optim.AdamW(plain.parameters(), lr=0.05, weight_decay=0.1, foreach=False)
    for x, y in batches():
        torch.nn.functional.mse_loss(plain(x), y).backward()
        opt.step()
        opt.zero_grad()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(torch.tensor(got["weights"][key]), value, msg=lambda m: f"{key}: {m}")


class TiedLM(torch.nn.Module):
    """A head tied to its token embedding (GPT-2's `lm_head` and `wte`), both under `ends`, and a body."""

    def __init__(self):
        super().__init__()
        self.ends = torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)})
        self.body = torch.nn.Linear(4, 4)
        self.ends["head"].weight = self.ends["embed"].weight


def test_a_unit_sharing_a_parameter_with_a_module_outside_it_stays_with_the_root_and_a_task_may_name_units():
    from rayhpc.engine.parallelize import fsdp_units, untied

    model = TiedLM()
    embed, head = model.ends["embed"], model.ends["head"]
    units = fsdp_units(object(), model)  # no hook: the modules that hold parameters
    assert units == [embed, head, model.body]
    assert untied(model, units) == [model.body]  # each tied module alone would be a second group of one weight
    assert untied(model, [model.ends, model.body]) == [model.ends, model.body]  # both ties in one unit

    class Task:
        def fsdp_units(self, model):
            return [model.ends]

    assert fsdp_units(Task(), model) == [model.ends]
