"""Command-line plumbing shared by `jobs/*.py` and the `rayhpc` command.

Bad input never produces a traceback: `ConfigError`s and argparse errors are
printed as one `error: ...` line on stderr and the process exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import types
import typing
from typing import Callable, NoReturn, Sequence, TypeVar

from pydantic import BaseModel

from rayhpc import cluster
from rayhpc.config import ConfigError, explicit_keys, field_at, load_yaml, merge, validate

USAGE_ERROR = 2
M = TypeVar("M", bound=BaseModel)


class ArgParser(argparse.ArgumentParser):
    """argparse with one-line errors (`error: ...`, exit status 2) instead of usage dumps."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def add_config_arguments(parser: argparse.ArgumentParser, model: type[BaseModel], flags: dict[str, str]) -> None:
    """`--config FILE` plus one flag per config key (`flags` maps flag -> dotted key).

    Every flag defaults to None, so an unset flag leaves the YAML value alone;
    bool keys become switches and list keys take comma-separated values.
    """
    parser.add_argument("--config", metavar="FILE", help="YAML file of these keys; flags override its values")
    for flag, key in flags.items():
        field = field_at(model, key)
        kind = _kind(field.annotation)
        text = (field.description or "").replace("%", "%%")  # argparse %-formats help text
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=None, help=text)
        else:
            choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else ()
            metavar = "{" + ",".join(choices) + "}" if choices else key.split(".")[-1].upper()
            parser.add_argument(flag, metavar=metavar + ("[,...]" if kind is list else ""), help=text)


def config_from_args(args: argparse.Namespace, model: type[M], flags: dict[str, str]) -> tuple[M, set[str]]:
    """The validated config, and the dotted keys the user set explicitly (in the YAML or by flags)."""
    data = load_yaml(args.config) if args.config else {}
    overrides = {}
    for flag, key in flags.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            overrides[key] = value.split(",") if _kind(field_at(model, key).annotation) is list else value
    if os.environ.get("RAYHPC_RESUME") == "1" and "resume" in model.model_fields:
        # set by the sbatch startup in a requeued job: continue where the preempted run stopped
        overrides.setdefault("resume", True)
    merged = merge(data, overrides)
    named = {key: flag for flag, key in flags.items() if key in overrides}
    return validate(model, merged, named), explicit_keys(model, merged)


def _kind(annotation) -> type | None:
    """bool or list for switch and comma-list flags; None for everything else."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    for a in options or (annotation,):
        if a is bool or typing.get_origin(a) is list:
            return bool if a is bool else list
    return None


def run_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> NoReturn:
    """Run `main`, turning user-input errors into `error: ...` and exit status 2.

    SIGUSR1 (Slurm's warning before a time limit or preemption, forwarded by the sbatch
    startup) stops the job like Ctrl-C: checkpoints already written are kept, and a resumed
    run continues from them. Ray Tune installs its own USR1 handler while a sweep runs.
    """
    signal.signal(signal.SIGUSR1, signal.default_int_handler)
    cluster.use_token_if_present()
    try:
        code = main(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    sys.exit(code or 0)


def tune_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc tune` / `python jobs/tune_mlp.py`: run a hyperparameter sweep."""
    from rayhpc.tune.config import FLAGS, SweepConfig
    from rayhpc.tune.results import format_best
    from rayhpc.tune.sweep import run_sweep

    parser = ArgParser(prog="tune_mlp.py", description="Hyperparameter sweep of the MLP on Ray Tune.")
    add_config_arguments(parser, SweepConfig, FLAGS)
    args = parser.parse_args(argv)
    cfg, explicit = config_from_args(args, SweepConfig, FLAGS)
    with ray_session():
        table = run_sweep(cfg, explicit=explicit)
    print(format_best(table))
    print(f"results: {cfg.experiment_dir / 'results.parquet'} ({len(table)} trials)")
    errored = int((table["status"] == "error").sum())
    return 1 if errored == len(table) else 0


@contextlib.contextmanager
def ray_session():
    """Disconnect from (and stop, if this process started it) a Ray connection made inside."""
    import ray

    was_connected = ray.is_initialized()
    try:
        yield
    finally:
        if not was_connected and ray.is_initialized():
            ray.shutdown()


def train_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc train` / `python jobs/train_mlp.py`: data-parallel training with Ray Train."""
    from rayhpc.train.config import FLAGS, TrainConfig
    from rayhpc.train.trainer import format_summary, run_training

    parser = ArgParser(prog="train_mlp.py", description="Data-parallel (DDP or FSDP2) training of the MLP on Ray Train.")
    return _run_training_job(parser, argv, TrainConfig, FLAGS, run_training, format_summary)


def parallel_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc parallel` / `python jobs/train_parallel.py`: TP, PP and DP on the platform's worker group."""
    from rayhpc.parallel.config import FLAGS, ParallelConfig
    from rayhpc.parallel.trainer import format_summary, run_parallel

    parser = ArgParser(prog="train_parallel.py",
                       description="Tensor-, pipeline- and data-parallel training on a group of Ray actors.")
    return _run_training_job(parser, argv, ParallelConfig, FLAGS, run_parallel, format_summary)


def collectives_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc collectives` / `python jobs/bench_collectives.py`: the collective-primitive benchmark."""
    from rayhpc.collectives.bench import PLOT_FILE, RESULTS_FILE, run_collectives
    from rayhpc.collectives.config import FLAGS, CollectivesConfig

    parser = ArgParser(prog="bench_collectives.py", description="Check, then time, each collective primitive "
                       "over message sizes on a worker group (gloo on CPU, NCCL with --gpu).")
    add_config_arguments(parser, CollectivesConfig, FLAGS)
    cfg, _ = config_from_args(parser.parse_args(argv), CollectivesConfig, FLAGS)
    with ray_session():
        table = run_collectives(cfg)
    wrong = table[~table["correct"]]
    print(f"results: {cfg.experiment_dir / RESULTS_FILE}, plot: {cfg.experiment_dir / PLOT_FILE}"
          + (f"; {wrong['primitive'].nunique()} primitive(s) NOT timed (wrong or unsupported): "
             f"{', '.join(wrong['primitive'].unique())}" if len(wrong) else ""))
    return 1 if len(wrong) else 0


def scaling_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc scaling` / `python jobs/scaling_study.py`: strong and weak scaling of DDP training."""
    from rayhpc.scaling.config import FLAGS, ScalingConfig
    from rayhpc.scaling.study import PLOT_FILE, RESULTS_FILE, format_table, run_scaling

    parser = ArgParser(prog="scaling_study.py", description="Strong and weak scaling of DDP training.")
    add_config_arguments(parser, ScalingConfig, FLAGS)
    cfg, _ = config_from_args(parser.parse_args(argv), ScalingConfig, FLAGS)
    with ray_session():
        table = run_scaling(cfg)
    print(format_table(table))
    print(f"results: {cfg.experiment_dir / RESULTS_FILE}, plot: {cfg.experiment_dir / PLOT_FILE}")
    return 0


def _run_training_job(parser: ArgParser, argv, model: type[M], flags: dict[str, str], run: Callable,
                      summary: Callable) -> int:
    """Parse flags into the job's config, run it in a Ray session, print its summary."""
    add_config_arguments(parser, model, flags)
    cfg, explicit = config_from_args(parser.parse_args(argv), model, flags)
    with ray_session():
        result = run(cfg, explicit=explicit)
    print(summary(result))
    return 0


def submit_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc submit --cluster FILE [--nodes N] [--dry-run] -- COMMAND...`: a Ray cluster in a Slurm job."""
    from rayhpc.slurm.config import load_cluster
    from rayhpc.slurm.submit import submit

    parser = ArgParser(prog="rayhpc submit", description="Run COMMAND on a Ray cluster started inside a Slurm job.")
    parser.add_argument("--cluster", required=True, metavar="FILE", help="cluster config, e.g. cluster_configs/x.yaml")
    parser.add_argument("--nodes", type=int, metavar="N", help="Slurm nodes (overrides slurm.nodes)")
    parser.add_argument("--dry-run", action="store_true", help="print the sbatch script instead of submitting it")
    parser.add_argument("--array", action="store_true",
                        help="run a sweep as a Slurm array job, one trial per task: give tune_mlp.py's flags after --")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- python -u jobs/tune_mlp.py")
    args = parser.parse_args(argv)
    if args.nodes is not None and args.nodes < 1:
        parser.error(f"nodes (--nodes) {args.nodes}: must be at least 1")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    cfg = load_cluster(args.cluster)
    if args.array:
        return _submit_array(cfg, command, args.dry_run)
    out = submit(cfg, command, nodes=args.nodes, dry_run=args.dry_run)
    print(out if args.dry_run else f"submitted job {out}: log {cfg.log_dir}/rayhpc-{cfg.name}-{out}.log")
    return 0


def _submit_array(cluster_cfg, command: list[str], dry_run: bool) -> int:
    """`rayhpc submit --array`: the sweep flags (after an optional `python [-u] jobs/tune_mlp.py`)."""
    from rayhpc.slurm.array import check_array_sweep, submit_array
    from rayhpc.tune.config import FLAGS, SweepConfig

    while command and (command[0].startswith("python") or command[0] == "-u" or command[0].endswith("tune_mlp.py")):
        command = command[1:]
    parser = ArgParser(prog="rayhpc submit --array -- ", description="The sweep to run as an array job.")
    add_config_arguments(parser, SweepConfig, FLAGS)
    sweep, explicit = config_from_args(parser.parse_args(command), SweepConfig, FLAGS)
    sweep, n_trials = check_array_sweep(sweep, explicit)
    out = submit_array(cluster_cfg, sweep, n_trials, dry_run=dry_run)
    print(out if dry_run else f"submitted array job {out} ({n_trials} tasks) and a job collecting their results "
                              f"into {sweep.experiment_dir / 'results.parquet'}")
    return 0


def status_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc status`: the platform's Slurm jobs; with --address, what that Ray cluster is doing."""
    import shutil

    parser = ArgParser(prog="rayhpc status", description="rayhpc's Slurm jobs, or (--address) a Ray cluster's "
                       "nodes, resources in use, running jobs and sweeps.")
    parser.add_argument("--address", metavar="ADDR", help="a running Ray cluster (host:port); default $RAY_ADDRESS")
    args = parser.parse_args(argv)
    address = cluster.resolve_address(args.address)
    if address is None and shutil.which("squeue") is None:
        parser.error("no Ray cluster to ask: give --address HOST:PORT (or set RAY_ADDRESS); "
                     "no Slurm here (squeue not found)")
    if address is None:
        from rayhpc.slurm.submit import format_jobs, jobs

        print(format_jobs(jobs()))
        return 0
    from rayhpc.monitor.status import cluster_status

    with ray_session():
        cluster.connect(address, log_to_driver=False)
        print(cluster_status())
    return 0


COMMANDS = {"tune": tune_main, "train": train_main, "parallel": parallel_main, "collectives": collectives_main,
            "scaling": scaling_main, "submit": submit_main, "status": status_main}


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The `rayhpc` command: `rayhpc <command> [options]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        given = repr(argv[0]) if argv else "nothing"
        print(f"error: command {given}: expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    run_main(COMMANDS[argv[0]], argv[1:])
