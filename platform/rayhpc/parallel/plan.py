"""A task's own model-parallel plan, checked before any actor starts.

A task states how its model splits, as torchtitan's `parallelize_llama` does:
`tp_plan(model) -> {module path: ColwiseParallel() | RowwiseParallel() | SequenceParallel() ...}`
(plain dicts of DTensor styles), `pipeline_split(model) -> [module path where a stage may
begin, ...]`, and optionally `tp_divisible(hp) -> {name: value}` for sizes that tensor
parallelism must divide and that no module shows (attention heads). Every error names the
path or value and the sizes, with close candidates for a path that is not in the model.
"""

from __future__ import annotations

import difflib

from torch import nn

from rayhpc.config import ConfigError
from rayhpc.parallel import hf


def _module(modules: dict[str, nn.Module], path: str, key: str) -> nn.Module:
    if path not in modules:
        close = difflib.get_close_matches(path, [p for p in modules if p], n=3, cutoff=0.5)
        hint = f"; close: {', '.join(close)}" if close else f"; top-level modules: {', '.join(_top(modules))}"
        raise ConfigError(f"{key}: {path!r} is not a module of the model{hint}")
    return modules[path]


def _top(modules: dict[str, nn.Module]) -> list[str]:
    return [p for p in modules if p and "." not in p]


def split_sizes(module: nn.Module, style) -> list[tuple[str, int]]:
    """(what, size) that `style` splits on `module`: a column-parallel Linear its output features,
    a row-parallel one its input features; an Embedding its width or its rows."""
    # DTensor: about 0.7 s to import, only where a run shards
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    column, row = isinstance(style, ColwiseParallel), isinstance(style, RowwiseParallel)
    if hf.is_conv1d(module):
        return [("nf", module.nf)] if column else [("nx", module.nx)] if row else []
    if isinstance(module, nn.Linear):
        return [("out_features", module.out_features)] if column else [("in_features", module.in_features)] if row else []
    if isinstance(module, nn.Embedding):
        return [("embedding_dim", module.embedding_dim)] if column else [("num_embeddings", module.num_embeddings)] if row else []
    return []


def check_tp_plan(model: nn.Module, plan: dict, tp: int, key: str = "tp_plan") -> None:
    """Every planned path is a module of `model`, and every size the plan splits divides by `tp`."""
    modules = dict(model.named_modules())
    if not plan:
        raise ConfigError(f"{key}: empty; tensor parallelism (--tp {tp}) needs at least one module to shard")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for path, style in plan.items():
        module = _module(modules, path, key)
        if type(style) in (ColwiseParallel, RowwiseParallel) and not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ConfigError(f"{key}: {path} ({type(module).__name__}): {type(style).__name__} shards only an "
                              "nn.Linear or nn.Embedding (torch's); plan the Linear layers inside it")
        for what, size in split_sizes(module, style):
            if size % tp:
                raise ConfigError(f"{key}: {path} ({type(module).__name__}, {type(style).__name__}) splits "
                                  f"{what} {size}, not divisible by tp (--tp) {tp}")


def check_divisible(sizes: dict[str, int], tp: int) -> None:
    """The task's own sizes that tensor parallelism must divide (`tp_divisible(hp)`)."""
    for name, size in sizes.items():
        if size % tp:
            raise ConfigError(f"hparams.{name} (--hp) {size}: not divisible by tp (--tp) {tp} "
                              f"(the task's tp_divisible)")


def choose_stage_starts(model: nn.Module, points: list[str], pp: int, key: str = "pipeline_split",
                        label: str | None = None) -> list[str]:
    """`pp - 1` of the task's split points, spread evenly, where stages 1..pp-1 begin (`pp`: the stages
    in all; `label` says where that count came from, `pp (--pp) N` by default). A point may be any module: one
    that is not a pipeline unit (`units`) makes the stages traced (`rayhpc.parallel.traced`)."""
    modules, order = dict(model.named_modules()), units(model)
    for path in points:
        _module(modules, path, key)
    at_units = all(path in order for path in points)
    order = order if at_units else list(modules)
    if sorted(points, key=order.index) != list(points) or len(set(points)) < len(points):
        raise ConfigError(f"{key}: {', '.join(points)}: not in the model's order, each once"
                          + (f" ({', '.join(order)})" if at_units else ""))
    if pp - 1 > len(points):
        raise ConfigError(f"{label or f'pp (--pp) {pp}'}: {pp} stages need {pp - 1} split points; the task's {key} gives "
                          f"{len(points)}: {', '.join(points) or 'none'}")
    return [points[round((i + 1) * (len(points) + 1) / pp) - 1] for i in range(pp - 1)]


def units(model: nn.Module) -> list[str]:
    """The model's pipeline units in order: a transformers model's decoder layers; any other model's top-level
    modules, a container's (ModuleDict, ModuleList, Sequential) children one by one."""
    if (stack := hf.decoder_stack(model)) is not None:
        return hf.layer_units(model, stack)
    found = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList, nn.Sequential)):
            found += [f"{name}.{sub}" for sub, _ in child.named_children()]
        else:
            found.append(name)
    return found


def keep_stage(model: nn.Module, starts: list[str], stage: int) -> nn.Module:
    """`model` with only stage `stage`'s units left (in place; torchtitan's manual split): a container's
    other children are removed, other top-level modules set to None, so parameter names stay the whole
    model's and `forward` runs the part it holds (the task's model skips what is None). A transformers
    model's stage: `rayhpc.parallel.hf.keep_stage`."""
    if (stack := hf.decoder_stack(model)) is not None:
        return hf.keep_stage(model, stack, starts, stage)
    order = units(model)  # `starts` come from choose_stage_starts, which checked them
    bounds = [0, *(order.index(s) for s in starts), len(order)]
    keep = set(order[bounds[stage]:bounds[stage + 1]])
    for unit in order:
        if unit in keep:
            continue
        parent, _, name = unit.rpartition(".")
        if parent:
            delattr(model.get_submodule(parent), name)
        else:
            setattr(model, name, None)
    return model


def tied(module: nn.Module) -> list[list[str]]:
    """The paths of each parameter that several modules share (a head tied to its token embedding)."""
    paths = {}
    for path, param in module.named_parameters(remove_duplicate=False):
        paths.setdefault(id(param), []).append(path)
    return [group for group in paths.values() if len(group) > 1]
