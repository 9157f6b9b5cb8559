"""Pipeline stages of a model whose own forward calls the modules a split removes (a class token and a
position embedding added between modules, a loop over blocks, a final norm called by name: timm's ViT, litgpt's
GPT, a `transformers` ViT or ResNet), traced rather than cut.

torch's `pipeline()` traces the model with torch.export and splits the graph where each start module begins
(`SplitPoint.BEGINNING`); a stage module keeps the whole model's parameter names (`vit.layers.2.mlp.fc1.weight`),
so checkpoints, gathered weights and the optimizer line up with an unsplit run, and passes on whatever the later
stages use (an activation, an attention mask, RoPE's cos and sin) as several tensors.

export fixes the batch size and the train/eval mode it traced (BatchNorm's statistics, dropout), so a stage holds
one trace per (mode, batch size) it meets, each made on the meta device and bound to the stage's one set of
parameters and buffers: the shapes an epoch meets are few (a micro-batch, an epoch's partial last one, a
validation batch). A traced stage is not tensor-parallel: DTensor's styles act on `nn.Linear` modules, which a
trace no longer calls.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable

import torch
from torch import nn


def trace(build: Callable[[], nn.Module], starts: list[str], example: torch.Tensor, training: bool):
    """torch's `Pipe` of the model `build()` makes on the meta device, split before each of `starts`, traced on
    `example`'s shapes in train or eval mode."""
    # about 1 s to import, only for pipeline runs
    from torch.distributed.pipelining import SplitPoint, pipeline

    with torch.device("meta"):
        model = build()
    with warnings.catch_warnings():
        # torch 2.13's own pytree code, on every trace: nothing for the user to act on
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        return pipeline(model.train(training), (example.to("meta"),),
                        split_spec={start: SplitPoint.BEGINNING for start in starts})


def route(pipe, stage_id: int) -> tuple[list, list, dict, list | None]:
    """How stage `stage_id` of `pipe` takes and passes on values, as nodes of the pipe's root graph: (what it is
    given, in order: the model's inputs for the first stage; the arguments of its graph; what its graph makes, each
    with its index in the graph's output tuple or None for the output itself; what it passes on, or None for the last
    stage). torch's root graph may hand a value to any later stage (RoPE's cos and sin, made once, to every block);
    a schedule passes values from each stage to the next only, so a stage passes on what it did not use too."""
    graph = pipe.split_gm.graph
    calls = [node for node in graph.nodes if node.op == "call_module"]
    source: dict = {}  # value -> the stage that makes it (-1: the model's input)
    for node in graph.nodes:
        if node.op == "placeholder":
            source[node] = -1
        elif node.op == "call_module":
            source[node] = calls.index(node)
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in source:
            source[node] = source[node.args[0]]

    def crossing(boundary: int) -> list:  # the values made before `boundary` that a later stage takes
        later = [value for call in calls[boundary:] for value in call.args]
        return list(dict.fromkeys(value for value in later if source[value] < boundary))

    output = next(node for node in graph.nodes if node.op == "output")
    if any(source.get(value) != len(calls) - 1 for value in output.all_input_nodes):
        raise ValueError("the model returns a value its last pipeline stage does not make")
    made = {node: (None if node.op == "call_module" else node.args[1])
            for node in source if source[node] == stage_id and node.op != "placeholder"}
    given = [node for node in graph.nodes if node.op == "placeholder"] if stage_id == 0 else crossing(stage_id)
    return given, list(calls[stage_id].args), made, crossing(stage_id + 1) if stage_id + 1 < len(calls) else None


def leading_sizes(pipe, values: list) -> list[int]:
    """The first dimension of each of `values` (nodes of the pipe's root graph) as traced (the model's input: -1)."""
    calls = [node for node in pipe.split_gm.graph.nodes if node.op == "call_module"]
    sizes = []
    for value in values:
        if value.op == "placeholder":
            sizes.append(-1)
            continue
        call, index = (value, None) if value.op == "call_module" else value.args
        stage = pipe.get_stage_module(calls.index(call))
        made = next(node for node in stage.graph.nodes if node.op == "output").args[0]
        sizes.append((made if index is None else made[index]).meta["val"].shape[0])
    return sizes


def stage_names(pipe) -> list[set[str]]:
    """Each stage's parameter and buffer names."""
    return [tensor_names(pipe.get_stage_module(k)) for k in range(pipe.num_stages)]


def tensor_names(module: nn.Module) -> set[str]:
    return {name for name, _ in [*module.named_parameters(remove_duplicate=False),
                                 *module.named_buffers(remove_duplicate=False)]}


class TracedStage(nn.Module):
    """Stage `stage_id` of the model `build()` makes, split before each of `starts`: the model's own modules with
    only this stage's parameters and buffers left (on the meta device until `to_empty`, as any stage is built), and
    a trace per (mode, batch size) of the model on `example`'s sample shape, run on them (the batch size the
    input that carries the batch has)."""

    def __init__(self, build: Callable[[], nn.Module], starts: list[str], stage_id: int, example: torch.Tensor,
                 group=None):
        super().__init__()
        self.build, self.starts, self.stage_id, self.group = build, starts, stage_id, group  # group: the pipeline's
        self.example = example[:1].to("meta")
        self.traces: dict[tuple[bool, int], tuple] = {}  # (mode, batch size) -> `_trace`'s; not submodules
        # what the stage's traces read in either mode (BatchNorm counts its batches only in train mode; 2 samples:
        # it trains on no fewer), and which input's first dimension is the batch (a later stage may be given RoPE's
        # cos and sin first, whose first dimension is the sequence)
        (_, one, _, ones), (_, two, _, twos) = self._trace(False, 1, sizes=True), self._trace(True, 2, sizes=True)
        keep = one | two
        self.batch_input = next((i for i, (a, b) in enumerate(zip(ones, twos)) if (a, b) in ((1, 2), (-1, -1))), None)
        if self.batch_input is None:
            raise ValueError(f"pipeline stage {stage_id} is given no tensor whose first dimension is the batch")
        with torch.device("meta"):
            model = build()
        persistent = model.state_dict(keep_vars=True)
        for name in tensor_names(model) - keep:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, None)  # another stage's
        for path, module in reversed(list(model.named_modules())):  # and the modules left with none, deepest first:
            if path and next(module.parameters(), None) is None and next(module.buffers(), None) is None:
                parent, _, leaf = path.rpartition(".")  # (a BatchNorm without its buffers would load a count of 0)
                delattr(model.get_submodule(parent), leaf)
        for name, child in model.named_children():
            self.add_module(name, child)  # under the whole model's names
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)  # the model's own (a class token, a position embedding)
        for name, buffer in model.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name in persistent)  # (RoPE's cos and sin: not)

    def _trace(self, training: bool, batch: int, device: torch.device | None = None, sizes: bool = False) -> tuple:
        """(this stage's graph, the names of its tensors, its `route`, and with `sizes` the first dimensions of what
        it is given), traced on a batch of `batch` samples."""
        example = self.example.expand(batch, *self.example.shape[1:])
        pipe = trace(self.build, self.starts, example, training)
        if sizes:
            graph, given = pipe.get_stage_module(self.stage_id), route(pipe, self.stage_id)[0]
            return graph, tensor_names(graph), given, leading_sizes(pipe, given)
        # traced on the meta device, the graph makes its own tensors there (an `arange` for a mask, a `zeros`):
        # torch's `build_stage` moves them to `device` (its PipelineStage is not used: the schedule's stage is this
        # module, which FSDP2 wraps, given a route from each stage to the next)
        graph = pipe.build_stage(self.stage_id, device, self.group).submod
        return graph, tensor_names(graph), route(pipe, self.stage_id)

    def forward(self, *inputs: torch.Tensor):
        key = (self.training, len(inputs[self.batch_input]))
        if key not in self.traces:
            self.traces[key] = self._trace(*key, inputs[0].device)
        graph, names, (given, args, made, passed) = self.traces[key]
        # the trace's own tensors are meta: it reads this stage's parameters and buffers as the stage holds them now
        # (`to_empty`, and FSDP2, which gathers the whole parameters before each forward, replace them)
        held = dict([*self.named_parameters(remove_duplicate=False), *self.named_buffers(remove_duplicate=False)])
        for name in names:
            owner, _, leaf = name.rpartition(".")
            setattr(graph.get_submodule(owner), leaf, held[name])
        values = dict(zip(given, inputs))
        output = graph(*(values[arg] for arg in args))
        if passed is None:
            return output  # the model's
        values |= {node: output if index is None else output[index] for node, index in made.items()}
        # sent to the next stage as they are, and a trace's outputs can be views (a transpose): gloo and NCCL send
        # only contiguous tensors
        return tuple(values[node].contiguous() for node in passed)
