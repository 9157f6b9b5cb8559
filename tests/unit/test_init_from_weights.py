"""`run_training` takes a sweep trial's weights with `init_from`, and only with it: the command reads them
(`rayhpc.tune.weights`, the layer above the training job), so a caller that forgets them is refused before
anything starts rather than training from a fresh model."""

import pytest

from rayhpc.config import ConfigError, validate
from rayhpc.train.config import TrainConfig
from rayhpc.train.trainer import run_training


@pytest.mark.parametrize("init_from, weights", [("/some/sweep", None), (None, object())])
def test_init_from_and_its_weights_come_together(init_from, weights, tmp_path):
    cfg = validate(TrainConfig, {"storage_path": str(tmp_path), "init_from": init_from})
    with pytest.raises(ConfigError, match="init_from"):
        run_training(cfg, weights=weights)
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written
