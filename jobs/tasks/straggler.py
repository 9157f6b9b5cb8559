"""The built-in MLP task with one slow worker: the last rank sleeps `straggler_ms` per step, as a node with
a slower GPU, a noisy neighbour or a slow file system makes one rank lag. It shows what the asynchronous
parameter server is for (the others do not wait) and what synchronous training pays (everyone waits).

    python jobs/train_ps.py --task jobs/tasks/straggler.py:Straggler --mode async --hp straggler_ms=20
    python jobs/bench_ps.py --task jobs/tasks/straggler.py:Straggler --hp hidden=256,depth=3,straggler_ms=20

Ranks come from the environment every job sets (RANK, WORLD_SIZE: Ray Train's and the parameter
server's workers, as torchrun does).
"""

import os
import time

from pydantic import Field

from rayhpc.task.mlp import MLPHParams, MLPTask


class StragglerHParams(MLPHParams):
    straggler_ms: float = Field(20.0, ge=0, description="the last rank's extra time per training step")


class Straggler(MLPTask):
    hparams = StragglerHParams

    def loss(self, model, batch):
        if model.training and os.environ.get("RANK") == str(int(os.environ.get("WORLD_SIZE", "1")) - 1):
            time.sleep(self._delay_s)
        return super().loss(model, batch)

    def model(self, hp):
        self._delay_s = hp["straggler_ms"] / 1000
        return super().model(hp)
