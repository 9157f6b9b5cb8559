"""What every rank of a model-parallel run needs to build, split and train the model: the task (the
built-in MLP, or `--task FILE.py:NAME`) with its `tp_plan` and `pipeline_split` (see
`rayhpc.parallel.plan`). Made once in the driver, checked there, and shipped to the ranks."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rayhpc.config import ConfigError, Optim, Schedule
from rayhpc.parallel import hf
from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.hf import check_hf_heads, hf_tp_plan, output_field
from rayhpc.parallel.plan import check_divisible, check_tp_plan, choose_stage_starts, keep_stage, tied, units


class _Returns(nn.Module):
    """A stand-in model that returns the model's output (a pipeline's last-stage output), so a task's
    `loss(model, batch)` and `metrics(model, batch)` can score it: `loss(_Returns(output), (None, target))`
    is the task's loss of that output, however the loss calls the model (`model(x)`, `model(input_ids=x)`)
    and whatever the model returns (a tensor, a Hugging Face `ModelOutput` with `.logits`)."""

    def __init__(self, output: Any):
        super().__init__()
        self.output = output

    def forward(self, *_args, **_kwargs) -> Any:
        return self.output


@dataclass
class Recipe:
    cfg: ParallelConfig
    hp: dict  # the platform's hyperparameters (lr, optimizer, seed...) and the task's own
    task: Any  # rayhpc.task.LoadedTask: the built-in MLP unless --task names another
    # a transformers model's output class and first field: a pipeline's last stage returns that field (a tensor:
    # only tensors go through a schedule), and the task's loss gets the class again (`.logits`)
    output: tuple[type, str] | None = None
    # the stages are traced (`rayhpc.parallel.traced`), not cut: a split point that is not a pipeline unit, or a
    # model whose forward calls the units a cut stage lacks (set by `check`)
    traced: bool = False

    @functools.cached_property
    def optim(self) -> Optim:
        """The run's `optim:` values, typed (`hp` holds them flat, as the task's own hooks take them)."""
        return Optim.of(self.hp)

    @functools.cached_property
    def schedule(self) -> Schedule:
        return Schedule.of(self.hp)

    def build(self) -> nn.Module:
        """The whole model, initialised from torch's current RNG state (seed it first)."""
        return self.task.obj.model(self.hp)

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The mean loss of a (micro)batch's output; the pipeline schedule averages over microbatches."""
        return self.task.obj.loss(_Returns(self.as_output(output)), (None, target))

    def metrics(self, output: Any, target: torch.Tensor) -> dict:
        """The task's own metrics of a batch's output (`metrics(model, batch)`, e.g. bits per byte)."""
        return self.task.metrics(_Returns(self.as_output(output)), (None, target))

    def as_output(self, output: Any) -> Any:
        """What the model returns, from what a stage returned (a pipeline's last stage: the first field)."""
        if self.output is None or not isinstance(output, torch.Tensor):
            return output
        cls, field = self.output
        return cls(**{field: output})

    def hook(self, name: str, needed_for: str):
        """The task's `name` method, which `needed_for` requires."""
        method = getattr(self.task.obj, name, None)
        if method is None:
            raise ConfigError(f"{self.task.where()}: has no {name}(model), which {needed_for} needs")
        return method

    def tp_plan(self, stage: nn.Module) -> dict:
        """The task's TP plan of this stage's modules (a stage may start anywhere: the plan is asked of it); a
        task without one whose model is a Hugging Face `transformers` model gets the model's own plan."""
        present, needs = dict(stage.named_modules()), f"tensor parallelism (--tp {self.cfg.parallelism.tp})"
        if getattr(self.task.obj, "tp_plan", None) is None and hf.is_transformers(stage):
            if (plan := hf_tp_plan(stage, self.cfg.parallelism.replicas)) is None:
                raise ConfigError(f"{self.task.where()}: {type(stage).__name__} has no tensor-parallel plan in "
                                  f"transformers or rayhpc, and the task no tp_plan(model), which {needs} needs")
            return plan
        plan = self.hook("tp_plan", needs)(stage)
        return {path: style for path, style in plan.items() if path in present}

    def stage_starts(self, model: nn.Module) -> list[str]:
        """Where pipeline stages 1, 2, ... begin (none without pipeline parallelism)."""
        p = self.cfg.parallelism
        if p.n_stages == 1:
            return []
        if getattr(self.task.obj, "pipeline_split", None) is None and hf.decoder_stack(model) is not None:
            points = units(model)[1:]  # a transformers model: at any decoder layer
        else:
            points = list(self.hook("pipeline_split", f"pipeline parallelism (--pp {p.pp})")(model))
        label = f"parallelism.pp (--pp) {p.pp}" + (f" x stages_per_rank {p.per_rank_stages}"
                                                    if p.per_rank_stages > 1 else "")
        return choose_stage_starts(model, points, p.n_stages, label=label)

    def tokens(self, samples_per_s: float) -> str:
        """", N tokens/s" for a task that says how many tokens a sample holds, else ""."""
        per_sample = self.task.tokens_per_sample(self.hp)
        return f", {samples_per_s * per_sample:,.0f} tokens/s" if per_sample else ""

    def check_stand_in(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The task's loss as every rank computes it (the model called once on the batch's inputs, the loss given
        the stand-in that returns that output) equals its loss of the model itself, on a few samples in the
        driver, before any actor starts: a loss that calls the model another way is one line now."""
        from rayhpc.task.load import one_line

        torch.manual_seed(self.cfg.seed)
        model, where = self.build().eval(), self.task.where()  # eval: the two forwards draw no dropout
        with torch.no_grad():
            try:
                direct = self.task.obj.loss(model, (x, y))
            except Exception as exc:  # noqa: BLE001 - the user's code: any failure is their input's
                raise ConfigError(f"{where}: loss(model, batch) raised {one_line(exc)}") from None
            try:
                output = model(x)
                self.output = output_field(output)
                served = self.loss(output, y)
            except Exception as exc:  # noqa: BLE001
                raise ConfigError(f"{where}: loss(model, batch) fails on the model's output for the batch's inputs, "
                                  f"as model parallelism gives it ({one_line(exc)}); the loss must call the model "
                                  "once, on batch[0], and score what it returns") from None
        if not torch.allclose(torch.as_tensor(served, dtype=torch.float64), torch.as_tensor(direct, dtype=torch.float64),
                              rtol=1e-4, atol=1e-6):
            raise ConfigError(f"{where}: loss(model, batch) is {float(direct):.6g} on the model but {float(served):.6g} "
                              "on its output for the batch's inputs, which is what model parallelism gives it; the "
                              "loss must call the model once, on batch[0], and score what it returns")

    def check(self, x: torch.Tensor) -> None:
        """Every plan error, before any actor starts: each stage built on the meta device (shapes only), its TP
        plan checked, and the stages run in order on the shapes of `x` (`dry_run`); or, for a split the stages
        cannot be cut at, the model traced (`check_traced`)."""
        tp = self.cfg.parallelism.tp
        with torch.device("meta"):
            model = self.build()
            starts = self.stage_starts(model)
        if tp > 1:
            divisible = getattr(self.task.obj, "tp_divisible", None)
            check_divisible(divisible(self.hp) if divisible else {}, tp)
            check_hf_heads(model, tp)
        if not starts and tp == 1:
            return  # one stage, nothing sharded
        if not all(start in units(model) for start in starts):
            return self.check_traced(model, starts, x, f"the split at {', '.join(starts)} is not at the model's units "
                                                       f"({', '.join(units(model))})")
        for stage_id in range(len(starts) + 1):
            with torch.device("meta"):
                stage = keep_stage(self.build(), starts, stage_id)  # a stage's own errors (tied embeddings)
            if tp > 1:
                check_tp_plan(stage, self.tp_plan(stage), tp)
        self.dry_run(starts, x.to("meta"))

    def check_traced(self, model: nn.Module, starts: list[str], x: torch.Tensor, why: str) -> None:
        """The stages traced (`rayhpc.parallel.traced`), on the meta device, in train mode on `x`'s shapes: one
        line for a model torch.export cannot trace, a split point its forward never calls, a weight tied across
        stages, or a parallelism a traced stage does not take."""
        from rayhpc.parallel.traced import route, stage_names, trace
        from rayhpc.task.load import one_line

        p, cfg, key = self.cfg.parallelism, self.cfg, "pipeline_split"
        if p.tp > 1:
            raise ConfigError(f"parallelism.tp (--tp) {p.tp}: {why}, so its stages are traced, and a traced stage is "
                              "not tensor-parallel (its Linear layers are traced away); split at units, or drop --tp")
        if cfg.activation_checkpointing != "none" or cfg.compile != "none":
            raise ConfigError(f"activation_checkpointing {cfg.activation_checkpointing}, compile {cfg.compile}: "
                              f"{why}, so its stages are traced, and they take neither; set both to none")
        try:
            pipe = trace(self.build, starts, x, training=len(x) > 1)
            names = stage_names(pipe)
            for stage_id in range(len(names)):
                route(pipe, stage_id)  # (a model that returns what its last stage does not make)
        except Exception as exc:  # noqa: BLE001 - the user's model: any failure is their input's
            raise ConfigError(f"{key}: {why}, so its stages are traced, and torch.export cannot trace its forward "
                              f"on the check batch: {one_line(exc.__cause__ or exc)}") from None
        if len(names) != len(starts) + 1:
            raise ConfigError(f"{key}: {', '.join(starts)}: the traced forward makes {len(names)} stage(s), not "
                              f"{len(starts) + 1}: a split point the forward never calls, or two with nothing between")
        for group in tied(model):
            if len(held := sorted({k for k, stage in enumerate(names) for path in group if path in stage})) > 1:
                raise ConfigError(f"{key}: {', '.join(group)} are one tied weight, and stages {held} would each "
                                  "hold a copy that trains apart; untie them (or split where one stage holds them)")
        self.traced = True

    def dry_run(self, starts: list[str], x: torch.Tensor) -> None:
        """The stages, each tensor-parallel as rank 0 holds it (on a `fake` process group of tp ranks, which
        communicates nothing), run in order on the meta device on `x`'s shapes: a stage whose forward calls a
        module the split removed, or a plan whose shards do not fit the model's reshapes (heads that tp does not
        divide), is one line before any actor starts. A model that does not run on the meta device whole, unsplit
        and unsharded, is left to the ranks."""
        from torch.distributed import destroy_process_group, init_process_group, is_initialized

        p = self.cfg.parallelism
        try:
            with torch.device("meta"), torch.no_grad():
                self.build()(x)
        except Exception:  # noqa: BLE001 - nothing to compare a failure with
            return
        if p.tp > 1 and is_initialized():
            return  # this process has a world of its own (a test's): no fake one beside it
        key, where = (f"parallelism.tp (--tp) {p.tp}" if p.tp > 1 else f"parallelism.pp (--pp) {p.pp}"), "the model"
        if p.tp > 1:
            init_process_group("fake", rank=0, world_size=p.tp)
        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import parallelize_module

            mesh = init_device_mesh("cpu", (p.tp,)) if p.tp > 1 else None
            act = x
            for stage_id in range(len(starts) + 1):
                where = f"pipeline stage {stage_id}" + (f" (from {starts[stage_id - 1]})" if stage_id else "") \
                    if starts else "the model"
                with torch.device("meta"), torch.no_grad():
                    stage = keep_stage(self.build(), starts, stage_id) if starts else self.build()
                    if mesh is not None:
                        parallelize_module(stage, mesh, self.tp_plan(stage))
                    act = stage(act)
        except Exception as exc:  # noqa: BLE001 - the user's model or plan: any failure is their input's
            from rayhpc.task.load import one_line

            if not starts or p.tp > 1:
                sharded = " as tensor-parallel rank 0 holds it" if p.tp > 1 else ""
                raise ConfigError(f"{key}: {where}{sharded} fails on the check batch's shapes (run on the meta device "
                                  f"before any actor starts): {one_line(exc)}") from None
            # its forward calls the units a cut stage lacks (a final norm by name, a class token): traced instead
            with torch.device("meta"):
                model = self.build()
            self.check_traced(model, starts, x, f"{where} cut from the model fails ({one_line(exc)})")
        finally:
            if p.tp > 1:
                destroy_process_group()
