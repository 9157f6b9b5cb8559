"""A task's data on the platform: the validation hold-out, the data order, and batches.

The order is `DistributedSampler(shuffle=True, seed=seed, drop_last=False)` with
`set_epoch(epoch)`, exactly what the seed documents' listings and most users' scripts
use, so a user can reproduce their own numbers; a single process is rank 0 of 1.
Batches are what the default collate makes of the dataset's items. For in-memory
tensor datasets (`TensorDataset`, and `Subset`s of one) whole batches are indexed out
of tensors that already sit on the worker's device, which gives the same batch without
a per-sample Python loop; any other dataset goes through a `DataLoader` (worker processes,
prefetch, and pinned memory on GPUs, as Ray Train users set it up).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset, default_collate

from rayhpc.engine.step import batch_size_of

EVAL_BATCH = 256  # validation batches hold at least this many samples (no gradients are kept)


def eval_batch(batch_size: int) -> int:
    """Samples per validation batch for a run that trains with `batch_size`."""
    return max(batch_size, EVAL_BATCH)


def holdout(train: Dataset, val: Dataset | None, fraction: float | None, seed: int) -> tuple[Dataset, Dataset | None]:
    """`(train, val)` as given, or with a `fraction` of `train` held out when there is no `val`."""
    if val is not None or not fraction:
        return train, val
    n = len(train)
    n_val = min(n - 1, max(1, round(n * fraction)))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return Subset(train, order[n_val:]), Subset(train, order[:n_val])


class _Sized:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def epoch_indices(n: int, seed: int, epoch: int, rank: int = 0, world: int = 1) -> list[int]:
    """Rank `rank`'s sample indices of epoch `epoch`, in order (DistributedSampler's)."""
    sampler = DistributedSampler(_Sized(n), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=False)
    sampler.set_epoch(epoch)
    return list(sampler)


def epoch_steps(n: int, batch_size: int, world: int = 1) -> int:
    """Steps of a whole epoch of `n` samples on `world` ranks of `batch_size` each, the last one partial where
    it does not fill: DistributedSampler gives every rank ceil(n / world) samples (padding with the first)."""
    return math.ceil(math.ceil(n / world) / batch_size)


def draw_as_a_loader() -> None:
    """What iterating a DataLoader draws from torch's global RNG (its base seed), drawn where a job batches
    tensors itself: every dropout mask after it then matches a plain `for batch in DataLoader(...)` loop's."""
    torch.empty((), dtype=torch.int64).random_()


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor in a batch (tensors, lists, tuples, dicts of them) moved to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def collate(dataset: Dataset, indices: Sequence[int]) -> Any:
    """The batch the default collate makes of these items (for checks on one small batch)."""
    return default_collate([dataset[i] for i in indices])


def _tensor_rows(dataset: Dataset) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None] | None:
    """(tensors, row of each item or None for identity) when items are rows of in-memory tensors."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors, None
    if isinstance(dataset, Subset):
        inner = _tensor_rows(dataset.dataset)
        if inner is not None:
            tensors, rows = inner
            sub = torch.as_tensor(dataset.indices, dtype=torch.long)
            return tensors, sub if rows is None else rows[sub]
    return None


def loader_workers(device: torch.device, cpus: float) -> int:
    """DataLoader worker processes for a dataset that is not in-memory tensors: on a GPU, enough to keep
    it fed (collating on the training process would stall it); on CPUs none, since every worker
    process would take cores from the training step itself."""
    return max(2, min(8, int(cpus) - 1)) if torch.device(device).type == "cuda" else 0


class Batches:
    """Batches of one dataset on one device: `batches(indices, batch_size)` yields them in order.
    `workers`: DataLoader processes for datasets that are not in-memory tensors."""

    def __init__(self, dataset: Dataset, device: torch.device, workers: int = 0):
        self.dataset, self.device, self.workers = dataset, torch.device(device), workers
        fast = _tensor_rows(dataset)
        self.tensors = None
        if fast is not None:  # this dataset's rows on the device once; batches are index gathers there
            tensors, rows = fast
            self.rows = None
            if rows is not None and tensors[0].device != self.device:
                # a Subset's own rows only, gathered where they are: the train and validation subsets of one
                # tensor would otherwise each put the whole tensor on the device (2x its size per process)
                self.tensors = [t[rows].to(self.device) for t in tensors]
            else:  # where the tensors already are (CPU training), the subsets share them: no copy at all
                self.tensors = [t.to(self.device) for t in tensors]
                self.rows = None if rows is None else rows.to(self.device)

    def __len__(self) -> int:
        return len(self.dataset)

    def __call__(self, indices: Sequence[int], batch_size: int, fresh: bool = True) -> Iterator[Any]:
        """`fresh`: these are an epoch's first batches. An epoch resumed part-way (not fresh) draws nothing
        from torch's RNG: the restored RNG state already holds its start's draw."""
        if self.tensors is None:
            cuda = self.device.type == "cuda"
            # pinned host batches copy to the GPU asynchronously (`non_blocking` in to_device)
            loader = DataLoader(self.dataset, batch_size=batch_size, sampler=list(indices), pin_memory=cuda,
                                num_workers=self.workers, prefetch_factor=4 if self.workers else None,
                                persistent_workers=False, generator=None if fresh else torch.Generator())
            for batch in loader:
                yield to_device(batch, self.device)
            return
        if fresh:
            draw_as_a_loader()
        index = torch.as_tensor(list(indices), dtype=torch.long, device=self.device)
        for start in range(0, len(index), batch_size):
            rows = index[start:start + batch_size]
            if self.rows is not None:
                rows = self.rows[rows]
            # a list, as the default collate makes of tuple items
            yield [t[rows] for t in self.tensors]

    def steps(self, seed: int, epoch: int, steps: range, per_epoch: int, batch_size: int, rank: int = 0,
              world: int = 1) -> Iterator[Any]:
        """The batches of global optimizer steps `steps` of epoch `epoch` (`per_epoch` steps each), rank `rank`'s of
        `world` in the data order of every job (`epoch_indices`): an epoch resumed part-way skips the steps done."""
        first, stop = steps.start - epoch * per_epoch, steps.stop - epoch * per_epoch
        indices = epoch_indices(len(self.dataset), seed, epoch, rank, world)
        return self(indices[first * batch_size:stop * batch_size], batch_size, fresh=first == 0)

    def all(self, batch_size: int) -> Iterator[Any]:
        """Every item once, in dataset order (validation)."""
        return self(range(len(self.dataset)), batch_size)


@torch.no_grad()
@torch.no_grad()
def score_sums(score: Callable[[Any], dict], batches: Iterable, modules: Iterable[torch.nn.Module]
               ) -> tuple[dict[str, torch.Tensor], int]:
    """Every job's validation loop: each batch's scores (`score(batch)`: name -> a scalar, or one per pack
    member; {} where a rank computes none) times its samples, summed in float64 over `batches` on their
    device (no host sync per batch), with `modules` in eval mode (no dropout, BatchNorm's running statistics)
    and put back as they were; and the samples. Divided by them, the mean over every sample."""
    modules = list(modules)
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    sums: dict[str, torch.Tensor] = {}
    total = 0
    try:
        for batch in batches:
            n = batch_size_of(batch)
            for name, value in score(batch).items():
                sums[name] = sums.get(name, 0) + torch.as_tensor(value).detach().double() * n
            total += n
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)
    return sums, total


def named_scores(loss, metrics: dict) -> dict:
    """A batch's scores as every job reports them: `val_loss` and `val_<metric>` for the task's metrics."""
    return {"val_loss": loss, **{f"val_{k}": v for k, v in metrics.items()}}


def evaluate(task, model: torch.nn.Module, batches: Iterator[Any]) -> dict[str, float]:
    """`val_loss` and `val_<metric>` of one model (in eval mode), averaged over the samples of `batches`."""
    sums, n = score_sums(lambda b: named_scores(task.loss(model, b), task.metrics(model, b)), batches, [model])
    return {name: float(s) / n for name, s in sums.items()}
