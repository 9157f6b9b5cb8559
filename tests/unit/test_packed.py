"""A pack of trials trained as one batched model equals each trial trained alone by a plain PyTorch
loop (its own torch.optim, DataLoader over a DistributedSampler order), for the built-in MLP (members
of different widths, padded) and for a CNN task with dropout (torch.func stacked members)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import ROOT, mlp_split, plain_trial
from rayhpc.data import DataConfig, SyntheticTask
from rayhpc.task import task_for
from rayhpc.task.batches import Batches
from rayhpc.task.check import check_task
from rayhpc.task.hparams import full_hparams
from rayhpc.tune.packing import FuncPack, PaddedMLPPack, make_pack, packing_problem
from rayhpc.tune.pbt import PbtRules, exploit_explore
from rayhpc.tune.space import ParamSpec
from rayhpc.tune.trainable import train_epoch

CPU = torch.device("cpu")




def steps(train, members: list[dict], epochs: int) -> int:
    """Optimizer steps of `epochs` epochs at the pack's batch size (the last step of an epoch may be short)."""
    return epochs * math.ceil(len(train) / members[0]["batch_size"])


def packed_trials(task, members, train, val, epochs: int):
    """The same trials as one pack, through the platform's pack, packed optimiser and epoch loop."""
    pack = make_pack(task, members, CPU)
    opt = pack.optimizer(members)
    train_batches, val_batches = Batches(train, CPU), Batches(val, CPU)
    history = []
    for epoch in range(epochs):
        loss = train_epoch(pack, opt, train_batches, members, epoch, steps(train, members, epochs))
        history.append({"train_loss": loss, **pack.evaluate(val_batches.all(1000))})
    return pack, history


@pytest.fixture(scope="module")
def mlp():
    return task_for("mlp", DataConfig(synthetic=SyntheticTask(num_samples=300)))




@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_padded_mlp_members_equal_plain_trials(mlp, optimizer):
    members = [full_hparams(mlp.hp_model, dict(hidden=h, lr=lr, momentum=mom, weight_decay=wd, optimizer=optimizer,
                                               batch_size=14, seed=7))  # 240 samples: a partial last batch
               for h, lr, mom, wd in [(4, 0.05, 0.0, 0.0), (16, 0.01, 0.9, 1e-3), (9, 0.002, 0.5, 0.0)]]
    train, val = mlp_split(mlp)
    pack, history = packed_trials(mlp, members, train, val, epochs=3)
    assert isinstance(pack, PaddedMLPPack)
    for i, hp in enumerate(members):
        torch.manual_seed(hp["seed"])
        model = torch.nn.Sequential(torch.nn.Linear(6, hp["hidden"]), torch.nn.ReLU(), torch.nn.Linear(hp["hidden"], 2))
        want, plain = plain_trial(model, train, val, hp, 3, F.mse_loss)
        got = pack.member(i).state_dict()
        for key in want:
            torch.testing.assert_close(got[key.replace("0.", "layers.0.").replace("2.", "layers.2.")], want[key])
        for name, at in (("val_loss", 0), ("train_loss", 2)):  # the epoch's train_loss: the mean over its samples
            torch.testing.assert_close(torch.stack([h[name][i] for h in history]),
                                       torch.tensor([p[at] for p in plain]), rtol=1e-5, atol=1e-6)


def test_padded_units_do_not_change_outputs(mlp):
    members = [full_hparams(mlp.hp_model, {"hidden": h}) for h in (3, 8)]
    pack = make_pack(mlp, members, CPU)
    x = torch.randn(20, 6)
    with torch.no_grad():
        out = pack.model(x)
        for i in range(2):
            torch.testing.assert_close(out[i], pack.member(i)(x))


def accuracy(logits, y):
    return (logits.argmax(dim=1) == y).float().mean()


@pytest.mark.parametrize("optimizer, lrs", [("sgd", (0.3, 0.1, 0.03)), ("adam", (0.01, 0.003, 0.03))])
def test_cnn_members_with_dropout_equal_plain_trials(optimizer, lrs):
    """torch.func packing of a CNN task: members with their own lr, momentum and weight decay, dropout on
    (one mask for all members, as each drew alone from the same seed), equal to each trained alone."""
    digits = task_for(str(ROOT / "jobs" / "tasks" / "digits.py:DigitsCNN"), DataConfig())
    members = [full_hparams(digits.hp_model, dict(channels=4, dropout=0.25, lr=lr, momentum=mom, weight_decay=wd,
                                                  optimizer=optimizer, batch_size=64, seed=3))
               for lr, mom, wd in zip(lrs, (0.0, 0.9, 0.5), (0.0, 1e-3, 0.0))]
    train, val = digits.data(members[0])
    pack, history = packed_trials(digits, members, train, val, epochs=2)
    assert isinstance(pack, FuncPack) and pack.size == 3
    for i, hp in enumerate(members):
        torch.manual_seed(hp["seed"])
        want, plain = plain_trial(digits.obj.model(hp), train, val, hp, 2, F.cross_entropy, accuracy)
        got = pack.member(i).state_dict()
        assert got.keys() == want.keys()
        # batched convolutions sum in another order than one member's: rounding (1e-5 after 46 steps at
        # lr 0.3 with momentum) grows with lr x steps; a wrong lr or dropout mask differs by 1e-2 and more
        close = dict(rtol=1e-4, atol=1e-4)
        for key in want:
            torch.testing.assert_close(got[key], want[key], **close, msg=lambda m: f"member {i} {key}: {m}")
        torch.testing.assert_close(torch.stack([h["val_loss"][i] for h in history]),
                                   torch.tensor([p[0] for p in plain], dtype=torch.float32), **close)
        torch.testing.assert_close(torch.stack([h["val_accuracy"][i] for h in history]),
                                   torch.tensor([p[1] for p in plain], dtype=torch.float32), **close)
    assert history[-1]["val_accuracy"].max() > 0.5  # it learns (10 classes: chance is 0.1)


LLAMA = str(ROOT / "jobs" / "tasks" / "llama.py:Llama")
LLAMA_HP = {"block": 16, "dim": 32, "heads": 4, "kv_heads": 2, "layers": 2, "corpus_bytes": 6000}


@pytest.mark.parametrize("spec", [LLAMA, str(ROOT / "tests" / "tasks" / "hf_models.py:GPT2")])
def test_members_of_a_hugging_face_model_equal_the_trial_alone(spec):
    """The example Llama task, and GPT-2, built by transformers and used unchanged (the loss reads `.logits` of
    `model(input_ids=x)`): packed members with their own lr equal each trained alone."""
    pytest.importorskip("transformers", reason="the hf extra (pip install 'rayhpc[hf]')")
    llama = task_for(spec, DataConfig())
    members = [full_hparams(llama.hp_model, dict(LLAMA_HP, lr=lr, optimizer="adam", batch_size=16, seed=3))
               for lr in (3e-3, 1e-3)]
    train, val = llama.data(members[0])
    pack, history = packed_trials(llama, members, train, val, epochs=1)
    assert isinstance(pack, FuncPack) and pack.size == 2
    for i, hp in enumerate(members):
        torch.manual_seed(hp["seed"])
        want, plain = plain_trial(llama.obj.model(hp), train, val, hp, 1,
                                  lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()))
        got = pack.member(i).state_dict()
        for key in want:  # batched matmuls round in another order than one member's
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-4, msg=lambda m: f"{i} {key}: {m}")
        torch.testing.assert_close(history[0]["val_loss"][i], torch.as_tensor(plain[0][0], dtype=torch.float32),
                                   rtol=1e-4, atol=1e-4)


ODD = ROOT / "tests" / "tasks" / "odd.py"


@pytest.mark.parametrize("name, problem", [
    ("Norm", None),  # BatchNorm's running statistics stay per member under vmap: packable
    ("Branchy", "vmap: RuntimeError: vmap: It looks like you're attempting to use a Tensor in some data-dependent"),
    ("ItemLoss", "vmap: RuntimeError: vmap: It looks like you're calling .item() on a Tensor"),
])
def test_packing_problems_are_found_before_training(name, problem):
    task = task_for(f"{ODD}:{name}", DataConfig())
    hp = full_hparams(task.hp_model, {})
    _, batch = check_task(task, hp, DataConfig())
    found = packing_problem(task, hp, batch)
    assert found == problem if problem is None else found.startswith(problem), found


def test_norm_statistics_stay_per_member():
    """What the probe passed is really so: after a packed step each member's BatchNorm statistics are its own."""
    task = task_for(f"{ODD}:Norm", DataConfig())
    members = [full_hparams(task.hp_model, {"seed": s}) for s in (0, 1)]
    train, _ = task.data(members[0])
    batch = [t[:16] for t in train.tensors]
    pack = FuncPack(task, [task.initial_model(hp) for hp in members])
    alone = [copy.deepcopy(pack.member(i)) for i in range(2)]
    pack.losses(batch).sum().backward()
    for i, model in enumerate(alone):
        task.loss(model, batch)
        torch.testing.assert_close(pack.buffers["1.running_mean"][i], model[1].running_mean)
    assert not torch.allclose(pack.buffers["1.running_mean"][0], pack.buffers["1.running_mean"][1])


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("kind", ["padded mlp", "func"])
def test_members_that_leave_a_pack_keep_their_weights_and_the_others_train_on(mlp, optimizer, kind):
    """ASHA stops member 1 after epoch 1: the pack keeps members 0 and 2 only (its tensors and the
    optimizer's per-member state cut to them), and they go on exactly as plain trials; member 1's
    weights stay those of a plain trial stopped after one epoch."""
    members = [full_hparams(mlp.hp_model, dict(hidden=h, lr=lr, momentum=0.9, optimizer=optimizer, batch_size=16,
                                               seed=7)) for h, lr in [(8, 0.05), (8, 0.01), (8, 0.002)]]
    if kind == "func":  # the generic pack: the task's own model under vmap
        members = [{**m, "depth": 3} for m in members]
    train, val = mlp_split(mlp)
    pack = make_pack(mlp, members, CPU)
    assert isinstance(pack, PaddedMLPPack if kind == "padded mlp" else FuncPack)
    opt = pack.optimizer(members)
    batches = Batches(train, CPU)
    train_epoch(pack, opt, batches, members, 0, steps(train, members, 3))
    stopped = pack.member(1).state_dict()
    pack.keep([0, 2])
    opt.keep([0, 2], pack.parameters())
    assert pack.size == 2 and all(p.shape[0] == 2 for p in pack.parameters())
    for epoch in (1, 2):
        train_epoch(pack, opt, batches, [members[0], members[2]], epoch, steps(train, members, 3))
    for position, (i, epochs) in enumerate([(0, 3), (2, 3)]):
        want = plain_member(mlp, members[i], train, val, epochs)
        for key, value in pack.member(position).state_dict().items():
            torch.testing.assert_close(value, want[key], msg=lambda m: f"member {i} {key}: {m}")
    want = plain_member(mlp, members[1], train, val, 1)
    for key, value in stopped.items():
        torch.testing.assert_close(value, want[key])


def plain_member(task, hp, train, val, epochs):
    """The member's own model (the task's, from its seed) trained the plain way; its state dict."""
    model = task.initial_model(hp)
    return plain_trial(model, train, val, hp, epochs, lambda out, y: F.mse_loss(out, y))[0]


@pytest.mark.parametrize("kind", ["padded mlp", "func"])
def test_pbt_exploit_copies_weights_and_optimizer_state_then_explore_perturbs_lr(mlp, kind):
    """The worst of 3 members (by val_loss) takes the best one's weights, buffers and Adam state (its
    moments) in its own slot, then its learning rate is the best one's x0.8 or x1.2."""
    members = [full_hparams(mlp.hp_model, dict(hidden=h, lr=lr, optimizer="adam", batch_size=16, seed=7))
               for h, lr in [(8, 0.05), (16, 0.01), (4, 0.002)]]
    if kind == "func":
        members = [{**m, "hidden": 8, "depth": 3} for m in members]
    train, _ = mlp_split(mlp)
    pack = make_pack(mlp, members, CPU)
    opt = pack.optimizer(members)
    train_epoch(pack, opt, Batches(train, CPU), members, 0, steps(train, members, 1))
    state = {"hp": [{"lr": m["lr"]} for m in members], "pbt": []}
    rules = PbtRules(interval=1, quantile=0.34, resample=0.0, space={"lr": ParamSpec(loguniform=(1e-4, 1.0))},
                     metric="val_loss", mode="min", seed=0)
    # every member's weights and Adam moments taken before the round: the best one's are what the worst
    # must hold after it (a copy the wrong way would leave the two equal, but equal to the worst's)
    before = [pack.member(i).state_dict() for i in range(3)]
    moments = {name: [t.clone() for t in opt.state[name]] for name in ("exp_avg", "exp_avg_sq")}
    exploit_explore(pack, opt, state, {"val_loss": torch.tensor([0.1, 0.5, 0.9])}, rules, epoch=1, pack_id=0)
    assert [(e["member"], e["copied"]) for e in state["pbt"]] == [(2, 0)]
    after = [pack.member(i).state_dict() for i in range(3)]
    assert sorted(after[2]) == sorted(before[0])
    for key in before[0]:
        torch.testing.assert_close(after[2][key], before[0][key], msg=lambda m: f"worst member's {key} is not the "
                                   f"best one's from before the round: {m}")
        torch.testing.assert_close(after[0][key], before[0][key], msg=lambda m: f"the best member's {key} changed: {m}")
        torch.testing.assert_close(after[1][key], before[1][key], msg=lambda m: f"a middle member's {key} changed: {m}")
    for name, tensors in moments.items():
        for t, was in zip(opt.state[name], tensors):
            torch.testing.assert_close(t[2], was[0], msg=lambda m: f"worst member's Adam {name}: {m}")
            torch.testing.assert_close(t[0], was[0], msg=lambda m: f"best member's Adam {name} changed: {m}")
    lr = state["hp"][2]["lr"]
    assert lr == pytest.approx(0.05 * 0.8) or lr == pytest.approx(0.05 * 1.2), lr
    assert float(opt.hyper["lr"][2]) == pytest.approx(lr) and float(opt.hyper["lr"][0]) == pytest.approx(0.05)


@pytest.mark.parametrize("kind", ["padded mlp", "func"])
def test_members_with_their_own_warm_up_and_clipping_each_equal_the_trial_alone(mlp, kind):
    """AdamW with a cosine schedule, two micro-batches per step: each member with its own lr, warm-up,
    clip limit and betas, packed, ends where it ends alone under torch's AdamW, schedulers and clipping
    (the limits are small enough that clipping acts on most steps)."""
    common = dict(optimizer="adamw", weight_decay=0.05, batch_size=16, seed=7, decay="cosine", min_lr_ratio=0.1,
                  accumulate=2)
    members = [full_hparams(mlp.hp_model, dict(hidden=8, lr=lr, warmup_steps=w, clip_grad_norm=c, beta1=b, **common))
               for lr, w, c, b in [(0.05, 0, None, 0.9), (0.02, 6, 0.5, 0.8), (0.01, 12, 0.05, 0.95)]]
    if kind == "func":
        members = [{**m, "depth": 3} for m in members]
    train, val = mlp_split(mlp)
    pack, _ = packed_trials(mlp, members, train, val, epochs=2)
    for i, hp in enumerate(members):
        want = plain_member(mlp, hp, train, val, 2)
        for key, value in pack.member(i).state_dict().items():
            torch.testing.assert_close(value, want[key], msg=lambda m: f"member {i} {key}: {m}")


def test_a_trial_trained_alone_takes_the_same_options(mlp):
    """A trial alone, a pack of one (`train_alone`: an array task, the benchmark's baseline): AdamW, warm-up then
    cosine, clipping, four micro-batches per step, equal to torch's own."""
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.single import train_alone

    # 240 samples in batches of 28: the last of each epoch holds 16, in 4 micro-batches of 4
    hp = full_hparams(mlp.hp_model, dict(hidden=8, optimizer="adamw", lr=0.02, weight_decay=0.05, batch_size=28, seed=7,
                                         warmup_steps=8, decay="cosine", min_lr_ratio=0.1, clip_grad_norm=0.1,
                                         accumulate=4))
    train, val = mlp_split(mlp)
    got = train_alone(mlp, hp, SweepConfig(epochs=2, data=mlp.obj.data_cfg))
    want, history = plain_trial(mlp.initial_model(hp), train, val, hp, 2, F.mse_loss)
    for key, value in got["model"].state_dict().items():
        torch.testing.assert_close(value, want[key], msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(torch.tensor([got["val_loss"], got["train_loss"]]),
                               torch.tensor([history[-1][0], history[-1][2]]).float())
    assert got["best_val_loss"] == pytest.approx(min(float(h[0]) for h in history), rel=1e-5)


@pytest.mark.parametrize("kind", ["padded mlp", "func"])
def test_a_members_weights_come_out_of_a_pack_checkpoint_as_its_own_models(mlp, kind):
    """What `--init-from` loads of a packed trial: each member's slice of the checkpointed pack, cut back
    to its own width, equals the plain MLP the member was made from; a member that left the pack (ASHA)
    too, from where it was kept. Checked: the width not cut back or the slot index off by one fail."""
    from rayhpc.tune.packing import member_slice, member_state_dict

    depth = 2 if kind == "padded mlp" else 3
    members = [full_hparams(mlp.hp_model, dict(hidden=h, depth=depth, seed=s))
               for h, s in ([(4, 0), (8, 1), (6, 2)] if depth == 2 else [(8, 0), (8, 1), (8, 2)])]
    models = [mlp.initial_model(hp) for hp in members]
    pack = make_pack(mlp, members, CPU)
    state = {"best": {"val_loss": torch.zeros(3)}, "slots": [0, 2], "retired": {1: member_slice(pack.state_dict(), 1)}}
    pack.keep([0, 2])
    state["model"] = pack.state_dict()
    for j, model in enumerate(models):
        got, want = member_state_dict(state, j), model.state_dict()
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], msg=lambda m: f"member {j} {key}: {m}")


@pytest.mark.parametrize("stopped, pbt", [(False, False), (True, True)])
def test_a_packs_report_adds_no_tune_statistics_per_member(stopped, pbt):
    """A pack reports each value once, as a list over its members: Tune keeps statistics of every numeric key of
    a result in the experiment state it saves after each checkpoint, so those keys must not grow with the
    members. Each member's values read back as reported, the best member's at the top level."""
    from ray.tune.experiment import Trial

    from rayhpc.tune.trainable import _fresh, _metrics, member_values

    keys = {}
    for members in (2, 64):
        state = _fresh(members, ("val_loss", "min"))
        if stopped:
            state["stopped"] = {0: 3}  # not the best member: its values are also at the top level
        if pbt:
            state["pbt"], state["hp"] = [{"round": 1}], [{"lr": 0.1 * (j + 1)} for j in range(members)]
        val_loss = torch.arange(members, 0, -1, dtype=torch.float32)  # the last member is the best
        values = {"train_loss": val_loss + 1, "val_loss": val_loss}
        state["best"] = {"val_loss": val_loss}
        result = _metrics(values, state, ("val_loss", "min"), 2.0, 0)
        trial = Trial("__fake", stub=True)
        trial.update_last_result({**result, "training_iteration": 1})
        keys[members] = set(trial.run_metadata.metric_analysis)
        for j in range(members):
            want = {"train_loss": members - j + 1.0, "val_loss": members - j, "best_val_loss": members - j,
                    **({"stopped_epoch": 3} if stopped and j == 0 else {}),
                    **({"config.lr": pytest.approx(0.1 * (j + 1))} if pbt else {})}
            assert member_values(result["members"], j) == want
        assert result["val_loss"] == 1.0 and result["train_loss"] == 2.0
    assert keys[2] == keys[64] and not any(k.startswith("members/") for k in keys[64]), keys[64]
    # a sweep resumed from results of earlier versions, which reported a dict per member
    assert member_values({"0": {"val_loss": 1.0}, "1": {"val_loss": 2.0}}, 1) == {"val_loss": 2.0}


SIZED = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class Sized:
    hparams = {"samples": 64}

    def model(self, hp):
        return nn.Linear(2, 1)

    def data(self, hp):
        x = torch.randn(hp["samples"], 2, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x.sum(1, keepdim=True)), None

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)
'''


def test_trials_alone_in_one_process_take_each_its_own_data(tmp_path):
    """A study's array task trains one trial after another in one process: a trial whose data() reads a
    hyperparameter the one before it set otherwise gets its own data (one epoch: 64 samples are 2 steps of 32,
    96 are 3), not the data the process kept for the one before. Checked: the data kept by the task alone fails."""
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.single import train_alone

    (tmp_path / "sized.py").write_text(SIZED)
    task = task_for(f"{tmp_path / 'sized.py'}:Sized", DataConfig())
    cfg = SweepConfig(epochs=1, global_batch_size=32, task=f"{tmp_path / 'sized.py'}:Sized")
    steps = {}
    for samples in (64, 96):
        hp = full_hparams(task.hp_model, {"samples": samples, "batch_size": 32})
        got = train_alone(task, hp, cfg, folder=tmp_path / str(samples))
        (saved,) = (tmp_path / str(samples)).glob("checkpoint_*")  # named by its step, the epoch's last
        steps[samples] = int(saved.name.removeprefix("checkpoint_"))
        # without validation data the objective is the training loss, as a sweep's task check makes it
        assert got["iterations"] == 1 and got["best_train_loss"] == got["train_loss"], got
    assert steps == {64: 2, 96: 3}, steps
