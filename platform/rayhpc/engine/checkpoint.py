"""Checkpoints, one manager for every job: `save`, `load`, `latest_checkpoint`, `prune`.

A checkpoint folder (`checkpoint_<global step, zero-padded>`) holds `progress.json` (where training
stands; written last, it marks the folder complete), the model and optimizer state either whole in
`model.pt` (where some rank holds the whole model: DDP, one process, a pack's stacked members) or as the
files of `torch.distributed.checkpoint` (where none does: FSDP, a model-parallel mesh; one shard file per
rank plus metadata), `rng.pt` (every rank's RNG states, CPU and CUDA on a GPU, a list by rank, so that
dropout after a resume draws the masks the uninterrupted run draws) and `extra.pt`, the runner's own state
beside the model's: a pack's members (`rayhpc.tune.trainable`), an array task's values, the model-parallel
job's losses, the metrics rows a training run's report carried (a process killed after Ray Train
registered the checkpoint but before the run's table had those rows loses none: `rayhpc.engine.metrics`).
The parameter server's servers each save their flat shard as a checkpoint of its own inside the step's folder
(`server_<index>/`, its pieces of the parameters its extra state), which `load_full_state_dict` reads as the
whole model too; the driver writes the step's progress file once every server's is there. The engine imports
no Ray: `rayhpc.train.loop` hands a checkpoint to Ray Train, the sweep's runners to Tune.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from rayhpc.engine.parallelize import unwrap
from rayhpc.private import private_dir, replace_whole

PROGRESS_FILE = "progress.json"
DDP_FILE = "model.pt"
RNG_FILE = "rng.pt"
SERVER_DIR = "server_{index}"  # the parameter server's: each server's checkpoint of its flat shard, in the step's
EXTRA_FILE = "extra.pt"  # the runner's own state beside the model's (`save`'s `extra`)
# an exported model's folder (`rayhpc export`, a run's tracked artifact): its state dict, hyperparameters, metrics
EXPORT_FILES = ("model.pt", "hp.json", "metrics.json")


@dataclasses.dataclass
class Progress:
    """Where training stands; a checkpoint restores it exactly."""

    epoch: int = 0  # epochs completed
    step_in_epoch: int = 0  # optimizer steps done in the epoch under way
    global_step: int = 0
    best_val_loss: float = math.inf
    best_objective: float | None = None  # the best of the task's objective, when it is not val_loss
    train_seconds: float = 0.0
    # the epoch under way, over every rank: its steps' loss x samples and its samples (a run resumed mid-epoch
    # reports the whole epoch's loss at its end)
    epoch_loss_sum: float = 0.0
    epoch_samples: int = 0


def save(folder: str | Path, parts: list[tuple], progress: Progress, *, sharded: bool, device: torch.device,
         rank: int = 0, world: int = 1, extra=None) -> Path:
    """One checkpoint of every job into `folder`, every rank calling it: the model and optimizer states of
    `parts` ((module, optimizer) pairs), whole from rank 0 into `model.pt` or, `sharded` (the rule: no rank
    holds the whole model, as under FSDP or a model-parallel mesh), each rank's shards by DCP; every rank's
    RNG states; rank 0's `extra` (what the runner keeps beside the model: a pack's members, the rows of a
    report) into `extra.pt`; and the progress file last, which marks the folder complete."""
    folder = Path(folder)
    if rank == 0:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # a killed run's half-written one is rewritten
    save_rng(folder, device, rank, world)
    if sharded:
        save_sharded(parts, folder)
    elif rank == 0:
        (model, optimizer), = parts
        save_whole(folder, model, optimizer)
    if rank == 0:
        if extra is not None:
            torch.save(extra, folder / EXTRA_FILE)
        write_progress(folder, progress)
    return folder


def load(folder: str | Path, parts: list[tuple], *, sharded: bool, device: torch.device,
         rank: int = 0) -> tuple[Progress, object]:
    """`save`'s checkpoint in `folder` back into `parts` and this rank's RNG (call it after the model's seeded
    initialisation): (the progress, the extra state or None)."""
    folder = Path(folder)
    if sharded:
        load_sharded(parts, folder)
    else:
        (model, optimizer), = parts
        state = torch.load(folder / DDP_FILE, map_location=device, weights_only=True)
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    load_rng(folder, device, rank)
    return load_progress(folder), load_extra(folder)


def load_extra(folder: str | Path):
    """What the runner saved beside the model (`save`'s `extra`), on CPU; None where it saved none."""
    path = Path(folder) / EXTRA_FILE
    return torch.load(path, map_location="cpu", weights_only=True) if path.exists() else None


def save_whole(folder: str | Path, model, optimizer) -> None:
    """The model's whole state dict (unwrapped from DDP) and its optimizer's into `folder`'s `model.pt`."""
    torch.save({"model": unwrap(model).state_dict(), "optim": optimizer.state_dict()}, Path(folder) / DDP_FILE)


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG states: torch's CPU generator, and the device's on a GPU."""
    states = {"cpu": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_state(states: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def save_rng(folder: Path, device: torch.device, rank: int = 0, world: int = 1) -> None:
    """Every rank's RNG states into `folder`'s `rng.pt`, a list by rank, written by rank 0 (a collective
    where `world` > 1: every rank calls it)."""
    mine = rng_state(device)
    states = [mine]
    if world > 1 and dist.is_initialized():
        states = [None] * world
        dist.all_gather_object(states, mine)
    if rank == 0:
        torch.save(states, Path(folder) / RNG_FILE)


def load_rng(folder: Path, device: torch.device, rank: int = 0) -> None:
    """Rank `rank`'s RNG states as `save_rng` wrote them. A run resumed on more ranks than saved them
    (its data order differs anyway) keeps the seeded streams of the ranks it adds, as does a checkpoint
    written before checkpoints held them."""
    path = Path(folder) / RNG_FILE
    states = torch.load(path, weights_only=True) if path.exists() else []
    if rank < len(states):
        set_rng_state(states[rank], device)


def save_sharded(parts: list[tuple], folder: str | Path) -> None:
    """Each rank's shards of `parts`, its (module, optimizer) pairs (FSDP's one, or a model-parallel rank's
    stages), into `folder` with DCP, every rank calling it; no rank holds the whole model."""
    import torch.distributed.checkpoint as dcp  # DCP: about 1 s to import, only for sharded checkpoints

    dcp.save(_merged(_sharded_states(parts)), checkpoint_id=str(folder))


def load_sharded(parts: list[tuple], folder: str | Path) -> None:
    """Read this rank's shards of `parts` back in place (the layout may differ from the one that saved them)."""
    import torch.distributed.checkpoint as dcp  # DCP: about 1 s to import, only for sharded checkpoints
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    states = _sharded_states(parts)
    loaded = _merged(states)
    dcp.load(loaded, checkpoint_id=str(folder))  # tensors in place; non-tensor entries (lr, betas) replaced
    for (part, optimizer), state in zip(parts, states):
        set_state_dict(part, optimizer, model_state_dict={k: loaded["model"][k] for k in state["model"]},
                       optim_state_dict={k: loaded["optim"][k] for k in state["optim"]},
                       options=StateDictOptions(flatten_optimizer_state_dict=True))


def _sharded_states(parts: list[tuple]) -> list[dict]:
    """Each part's {"model", "optim"} state dicts in the flattened form (one key per parameter and setting,
    torchtitan's): in the nested form DCP drops the param groups' non-tensor settings (Adam's betas) on
    load. Keys are whole-model names, so the parts' dicts never collide."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    return [dict(zip(("model", "optim"), get_state_dict(part, optimizer, options=options)))
            for part, optimizer in parts]


def _merged(states: list[dict]) -> dict:
    return {key: {k: v for state in states for k, v in state[key].items()} for key in ("model", "optim")}


def load_full_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's state dict from a checkpoint folder of either strategy, on CPU."""
    folder = Path(folder)
    if (folder / DDP_FILE).exists():
        return torch.load(folder / DDP_FILE, map_location="cpu", weights_only=True)["model"]
    if servers := sorted(folder.glob(SERVER_DIR.format(index="*"))):
        return _gather_servers(servers)
    # DCP: about 1 s to import, only for sharded checkpoints
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(folder), f"{tmp}/full.pt")  # gathers every rank's shards
        return torch.load(f"{tmp}/full.pt", map_location="cpu", weights_only=True)["model"]


def _gather_servers(folders: list[Path]) -> dict[str, torch.Tensor]:
    """The whole parameters from the parameter server's checkpoints, each a flat tensor of the pieces
    (name, start, stop) of the flattened parameters its extra state lists."""
    flat: dict[str, torch.Tensor] = {}
    for folder in folders:
        param = torch.load(folder / DDP_FILE, map_location="cpu", weights_only=True)["model"]["param"]
        holds = load_extra(folder)
        shapes, offset = holds["shapes"], 0
        for name, start, stop in holds["pieces"]:
            whole = flat.setdefault(name, torch.empty(math.prod(shapes[name]), dtype=param.dtype))
            whole[start:stop] = param[offset:offset + stop - start]
            offset += stop - start
    return {name: tensor.reshape(shapes[name]) for name, tensor in flat.items()}


def write_export(folder: Path, hp: dict, state: dict, metrics: dict) -> Path:
    """`folder` (made 0700) with a model's `model.pt` (its whole state dict), `hp.json` and `metrics.json`:
    `model = task.model(hp); model.load_state_dict(torch.load("model.pt"))`."""
    private_dir(folder)
    model_file, hp_file, metrics_file = (folder / name for name in EXPORT_FILES)
    torch.save(state, model_file)
    hp_file.write_text(json.dumps(_plain(hp), indent=1, sort_keys=True))
    metrics_file.write_text(json.dumps(_plain(metrics), indent=1, sort_keys=True))
    return folder


def _plain(values: dict) -> dict:
    """JSON-safe: numpy scalars as Python numbers, NaN as null."""
    out = {}
    for k, v in values.items():
        v = v.item() if hasattr(v, "item") else v
        out[k] = None if isinstance(v, float) and math.isnan(v) else v
    return out


def write_progress(folder: str | Path, progress: Progress) -> None:
    """Where training stands, written last into a checkpoint folder: it marks the folder complete."""
    # whole or not at all: a process killed while it writes (the parameter server's driver marks folders
    # complete) must not leave an empty progress file, which would stop every resume
    replace_whole(Path(folder) / PROGRESS_FILE, lambda tmp: tmp.write_text(json.dumps(dataclasses.asdict(progress))))


def load_progress(folder: str | Path) -> Progress:
    return Progress(**json.loads((Path(folder) / PROGRESS_FILE).read_text()))


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoint folders, the one furthest into training last: the training job's
    (Ray Train's copies of them) and the model-parallel job's."""
    folders = [p for p in Path(run_dir).glob("checkpoint_*") if (p / PROGRESS_FILE).exists()]
    return sorted(folders, key=lambda p: load_progress(p).global_step)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint furthest into training (None before the first checkpoint)."""
    return next(reversed(complete_checkpoints(run_dir)), None)


def forget_if_unstarted(job) -> None:
    """A run that failed before its first complete checkpoint has nothing to resume: its saved config (`job`'s)
    goes, so the command that started it starts it again instead of asking for --resume."""
    if latest_checkpoint(job.experiment_dir) is None:
        job.saved_file.unlink(missing_ok=True)


def prune(run_dir: str | Path, keep: int) -> None:
    """Remove all but the `keep` complete checkpoints furthest into training, and the incomplete folders
    before the oldest kept (a save a failure cut short: it never completes). Ray Train prunes the training
    job's itself; a folder still being written has no progress file yet and is named after the kept ones."""
    complete = complete_checkpoints(run_dir)
    if len(complete) <= keep:
        return
    oldest_kept = complete[-keep].name  # checkpoint_<step, zero-padded>: names sort as steps
    for folder in Path(run_dir).glob("checkpoint_*"):
        if folder.name < oldest_kept:
            shutil.rmtree(folder, ignore_errors=True)


def checkpoint_config(checkpoint, objective: tuple[str, str], make):
    """Tune's or Ray Train's `CheckpointConfig` (`make`): the latest `keep`, or the `keep_best` best by the
    objective and the latest (Ray always keeps the latest: resume needs it)."""
    if getattr(checkpoint, "keep_best", None) is None:
        return make(num_to_keep=checkpoint.keep)
    return make(num_to_keep=checkpoint.keep_best, checkpoint_score_attribute=objective[0],
                checkpoint_score_order=objective[1])
