"""A pack of trials trained as one batched model equals each trial trained alone."""

import pytest
import torch

from rayhpc.data import DataConfig, SyntheticTask, load_dataset
from rayhpc.models import PackedMLP
from rayhpc.tune.optim import packed_optimizer
from rayhpc.tune.single import train_single
from rayhpc.tune.space import HParams
from rayhpc.tune.trainable import TrialSettings, _fresh, evaluate, train_epoch


@pytest.fixture(scope="module")
def dataset():
    return load_dataset(DataConfig(synthetic=SyntheticTask(num_samples=300)))


def train_packed(members, dataset, epochs, seed):
    state = _fresh(members, dataset, TrialSettings(epochs=epochs, seed=seed, threads=1))
    model = PackedMLP(dataset.in_features, [m["hidden"] for m in members], dataset.out_features)
    model.load_state_dict(state["model"])
    opt = packed_optimizer(members[0]["optimizer"], list(model.parameters()), members)
    for epoch in range(epochs):
        train_epoch(model, opt, dataset.x_train, dataset.y_train, members[0]["batch_size"], seed, epoch)
    return model


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_pack_members_equal_single_trials(dataset, optimizer):
    members = [
        HParams(hidden=h, lr=lr, momentum=mom, weight_decay=wd, optimizer=optimizer, batch_size=16).model_dump()
        for h, lr, mom, wd in [(4, 0.05, 0.0, 0.0), (16, 0.01, 0.9, 1e-3), (9, 0.002, 0.5, 0.0)]
    ]
    packed = train_packed(members, dataset, epochs=3, seed=7)
    val = evaluate(packed, dataset.x_val, dataset.y_val)
    for i, hp in enumerate(members):
        alone = train_single(hp, dataset, epochs=3, seed=7)
        for got, want in zip(packed.member(i).parameters(), alone["model"].parameters()):
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(val[i].item(), alone["val_loss"], rtol=1e-5, atol=1e-6)


def test_padded_units_do_not_change_outputs(dataset):
    members = [HParams(hidden=h).model_dump() for h in (3, 8)]
    packed = train_packed(members, dataset, epochs=1, seed=0)
    with torch.no_grad():
        out = packed(dataset.x_val)
        for i in range(2):
            torch.testing.assert_close(out[i], packed.member(i)(dataset.x_val))
