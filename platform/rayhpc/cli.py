"""The job commands, shared by `jobs/*.py` and the `rayhpc` command, and their flags (run through
`rayhpc.entry.run_main`: bad input is one `error: ...` line on stderr and exit status 2).

Each command imports its own job's modules inside its function: `rayhpc status`, `--help` or a bad flag
answer without importing torch, Ray Train or Ray Tune (seconds each), and no command pays for another's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import types
import typing
from pathlib import Path
from typing import Callable, NoReturn, Sequence, TypeVar

import yaml
from pydantic import BaseModel

from rayhpc import cluster, interrupt
from rayhpc.config import ConfigError, explicit_keys, field_at, is_model, load_yaml, merge, unwrap_annotation, validate
from rayhpc.entry import USAGE_ERROR, run_main
from rayhpc.monitor.startup import mark

M = TypeVar("M", bound=BaseModel)


class ArgParser(argparse.ArgumentParser):
    """argparse with one-line errors (`error: ...`, exit status 2) instead of usage dumps."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def derived_flags(model: type[BaseModel]) -> dict[str, str]:
    """flag -> dotted key, for every scalar or list field of the config and of its sections (one level
    down): `--` and the field's name with dashes (`compute.num_workers` -> `--num-workers`), unless the
    field names its own flag (`json_schema_extra={"flag": "--data"}`). Dict fields (`space`) have none
    unless they name one (`hparams`: `--hp KEY=VALUE,...`)."""
    flags: dict[str, str] = {}
    for key, field in _flag_fields(model):
        flag = (field.json_schema_extra or {}).get("flag") or "--" + key.rsplit(".", 1)[-1].replace("_", "-")
        if flag in flags:
            raise TypeError(f"{model.__name__}: {flags[flag]} and {key} would both be {flag}; name one's flag")
        flags[flag] = key
    return flags


def _flag_fields(model: type[BaseModel], prefix: str = "", depth: int = 0):
    for name, field in model.model_fields.items():
        sub = unwrap_annotation(field.annotation)
        if is_model(sub):
            if depth == 0:
                yield from _flag_fields(sub, f"{prefix}{name}.", depth + 1)
        elif _kind(field.annotation) is not dict or "flag" in (field.json_schema_extra or {}):
            yield f"{prefix}{name}", field


def add_config_arguments(parser: argparse.ArgumentParser, model: type[BaseModel]) -> dict[str, str]:
    """`--config FILE` plus one flag per config key; returns the flags (flag -> dotted key).

    Every flag defaults to None, so an unset flag leaves the YAML value alone;
    bool keys become switches, list keys take comma-separated values, and dict
    keys KEY=VALUE pairs (comma-separated or repeated; values read as YAML).
    """
    flags = derived_flags(model)
    parser.add_argument("--config", metavar="FILE", help="YAML file of these keys; flags override its values")
    for flag, key in flags.items():
        field = field_at(model, key)
        kind = _kind(field.annotation)
        text = (field.description or "").replace("%", "%%")  # argparse %-formats help text
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=None, help=text)
        elif kind is dict:
            parser.add_argument(flag, action="append", metavar="KEY=VALUE[,...]", help=text)
        else:
            choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else ()
            metavar = "{" + ",".join(choices) + "}" if choices else key.split(".")[-1].upper()
            parser.add_argument(flag, metavar=metavar + ("[,...]" if kind is list else ""), help=text)
    return flags


def config_from_args(args: argparse.Namespace, model: type[M], flags: dict[str, str]) -> tuple[M, set[str]]:
    """The validated config, and the dotted keys the user set explicitly (in the YAML or by flags)."""
    data = load_yaml(args.config) if args.config else {}
    overrides = {}
    for flag, key in flags.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            continue
        kind = _kind(field_at(model, key).annotation)
        overrides[key] = value.split(",") if kind is list else key_value_pairs(flag, value) if kind is dict else value
    merged = merge(data, overrides)
    named = {key: flag for flag, key in flags.items() if key in overrides}
    return validate(model, merged, named), explicit_keys(model, merged)


def key_value_pairs(flag: str, values: list[str]) -> dict:
    """`KEY=VALUE` pairs (comma-separated or repeated flags); values are read as YAML scalars."""
    out = {}
    for item in ",".join(values).split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} hidden=16")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _kind(annotation) -> type | None:
    """bool, list or dict for switch, comma-list and KEY=VALUE flags; None for everything else."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    for a in options or (annotation,):
        if a is bool or typing.get_origin(a) in (list, dict):
            return bool if a is bool else typing.get_origin(a)
    return None


def parse_config(parser: ArgParser, model: type[M], argv) -> tuple[M, set[str]]:
    """Flags derived from `model`, parsed: the validated config and the keys set explicitly."""
    flags = add_config_arguments(parser, model)
    return config_from_args(parser.parse_args(argv), model, flags)


def tune_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc tune` / `python jobs/tune_mlp.py`: a hyperparameter sweep of a task on Ray Tune."""
    # imported here, not at the top: only this command's modules (see the module docstring)
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.results import SUMMARY_FILE, format_best, format_summary
    from rayhpc.tune.sweep import run_sweep

    parser = ArgParser(prog="tune_mlp.py", description="Hyperparameter sweep of a task (the built-in MLP by "
                       "default) on Ray Tune.")
    cfg, explicit = parse_config(parser, SweepConfig, argv)
    with ray_session(cfg):
        table = run_sweep(cfg, explicit=explicit)
    print(format_best(table, table.attrs["objective"]))
    where = cfg.study.expanduser().resolve() if cfg.study else cfg.experiment_dir  # a slice: the study's union
    if (where / SUMMARY_FILE).exists():  # repeats
        import pandas as pd

        summary = pd.read_parquet(where / SUMMARY_FILE)
        print(format_summary(summary))
        print(f"summary: {where / SUMMARY_FILE} ({len(summary)} configurations)")
    print(f"results: {where / 'results.parquet'} ({len(table)} trials)")
    errored = int((table["status"] == "error").sum())
    return 1 if errored == len(table) else 0


@contextlib.contextmanager
def ray_session(cfg=None):
    """Disconnect from (and stop, if this process started it) a Ray connection made inside; a stop
    signal inside ends the job `cfg` with the line that says how to resume it (`interrupt.report`)."""
    # imported here, not at the top: only this command's modules (see the module docstring)
    import ray

    if cfg is not None:
        interrupt.running(cfg)
    was_connected = ray.is_initialized()
    try:
        yield
    finally:
        mark("work")
        if not was_connected and ray.is_initialized():
            cluster.disconnect()
        mark("shutdown")


def train_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc train` / `python jobs/train_mlp.py`: data-parallel training of a task with Ray Train."""
    # imported here, not at the top: only this command's modules (see the module docstring)
    from rayhpc.train.config import TrainConfig
    from rayhpc.train.trainer import format_summary, run_training

    parser = ArgParser(prog="train_mlp.py", description="Data-parallel (DDP or FSDP2) training of a task (the "
                       "built-in MLP by default) on Ray Train.")

    def run(cfg: TrainConfig, explicit: set[str]):
        from rayhpc.tune.weights import trial_weights  # a sweep's checkpoints (torch): only with --init-from

        weights = trial_weights(cfg.init_from) if cfg.init_from is not None else None
        return run_training(cfg, explicit=explicit, weights=weights)

    return _run_job(parser, argv, TrainConfig, run, format_summary)


def parallel_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc parallel` / `python jobs/train_parallel.py`: TP, PP and DP on the platform's worker group."""
    # imported here, not at the top: only this command's modules (see the module docstring)
    from rayhpc.parallel.config import ParallelConfig
    from rayhpc.parallel.trainer import format_summary, run_parallel

    parser = ArgParser(prog="train_parallel.py",
                       description="Tensor-, pipeline- and data-parallel training on a group of Ray actors.")
    return _run_job(parser, argv, ParallelConfig, run_parallel, format_summary)


def ps_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc ps` / `python jobs/train_ps.py`: training with a sharded parameter server, sync or async (Downpour)."""
    # imported here, not at the top: only this command's modules (see the module docstring)
    from rayhpc.ps.config import PSConfig
    from rayhpc.ps.driver import format_summary, run_ps

    parser = ArgParser(prog="train_ps.py", description="Training of a task (the built-in MLP by default) with a "
                       "parameter server on Ray actors: sync (equal to DDP) or async (Downpour, bounded staleness).")
    return _run_job(parser, argv, PSConfig, run_ps, format_summary)


def collectives_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc collectives` / `python jobs/bench_collectives.py`: the collective-primitive benchmark."""
    # imported here, not at the top: only this command's modules (see the module docstring)
    from rayhpc.collectives.bench import PLOT_FILE, RESULTS_FILE, run_collectives
    from rayhpc.collectives.config import CollectivesConfig

    parser = ArgParser(prog="bench_collectives.py", description="Check, then time, each collective primitive "
                       "over message sizes on a worker group (gloo on CPU, NCCL with --gpu).")
    cfg, explicit = parse_config(parser, CollectivesConfig, argv)
    with ray_session():
        table = run_collectives(cfg, explicit)
    wrong = table[~table["correct"]]
    print(f"results: {cfg.experiment_dir / RESULTS_FILE}, plot: {cfg.experiment_dir / PLOT_FILE}"
          + (f"; {wrong['primitive'].nunique()} primitive(s) NOT timed (wrong or unsupported): "
             f"{', '.join(wrong['primitive'].unique())}" if len(wrong) else ""))
    return 1 if len(wrong) else 0


def scaling_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc scaling` / `python jobs/scaling_study.py`: strong and weak scaling of DDP training."""
    # imported here, not at the top: only this command's modules (see the module docstring)
    from rayhpc.scaling.config import ScalingConfig
    from rayhpc.scaling.study import PLOT_FILE, RESULTS_FILE, format_table, run_scaling

    parser = ArgParser(prog="scaling_study.py", description="Strong and weak scaling of DDP training.")
    cfg, explicit = parse_config(parser, ScalingConfig, argv)
    with ray_session():
        table = run_scaling(cfg, explicit)
    print(format_table(table))
    print(f"results: {cfg.experiment_dir / RESULTS_FILE}, plot: {cfg.experiment_dir / PLOT_FILE}")
    return 0


def _run_job(parser: ArgParser, argv, model: type[M], run: Callable, summary: Callable) -> int:
    """Parse flags into the job's config, run it in a Ray session, print its summary."""
    cfg, explicit = parse_config(parser, model, argv)
    with ray_session(cfg):
        result = run(cfg, explicit=explicit)
    print(summary(result))
    return 0


def submit_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc submit --cluster FILE [--nodes N] [--dry-run] -- COMMAND...`: a Ray cluster in a Slurm job."""
    # imported here, not at the top: only this command's modules (see the module docstring)
    from rayhpc.slurm.config import load_cluster
    from rayhpc.slurm.submit import submit

    parser = ArgParser(prog="rayhpc submit", description="Run COMMAND on a Ray cluster started inside a Slurm job.")
    parser.add_argument("--cluster", required=True, metavar="FILE", help="cluster config, e.g. cluster_configs/x.yaml")
    parser.add_argument("--nodes", type=int, metavar="N", help="Slurm nodes (overrides slurm.nodes)")
    parser.add_argument("--dry-run", action="store_true", help="print the sbatch script instead of submitting it")
    parser.add_argument("--array", action="store_true",
                        help="run a sweep as a Slurm array job, one trial per task: give tune_mlp.py's flags after --")
    parser.add_argument("--study", metavar="DIR", help="a study folder the nodes share: the sweep COMMAND runs as "
                        "a slice of it (tune --study DIR)")
    parser.add_argument("--slices", type=int, default=1, metavar="K", help="with --study: K jobs, each its own Ray "
                        "cluster running a slice (submit more at any time; each joins)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- python -u jobs/tune_mlp.py")
    args = parser.parse_args(argv)
    if args.nodes is not None and args.nodes < 1:
        parser.error(f"nodes (--nodes) {args.nodes}: must be at least 1")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    cfg = load_cluster(args.cluster)
    if args.array:
        return _submit_array(cfg, command, args.dry_run, args.study, args.slices)
    if args.study is not None or args.slices != 1:
        command = _slice_command(parser, command, args.study, args.slices)
    out = [submit(cfg, command, nodes=args.nodes, dry_run=args.dry_run) for _ in range(args.slices)]
    if args.dry_run:
        print(out[0])
    else:
        logs = ", ".join(f"{cfg.log_dir}/rayhpc-{cfg.name}-{job}.log" for job in out)
        print(f"submitted job {', '.join(out)}: log {logs}" + (f"; rayhpc status --study {command[-1]}"
                                                             if args.study else ""))
    return 0


def _slice_command(parser: ArgParser, command: list[str], study: str | None, slices: int) -> list[str]:
    """The sweep command with `--study DIR` (the folder made private here, before anything is submitted)."""
    from rayhpc.study.slice import open_study  # only submissions of slices

    if study is None:
        parser.error(f"slices (--slices) {slices}: give --study DIR, the folder the slices share")
    if slices < 1:
        parser.error(f"slices (--slices) {slices}: must be at least 1")
    if any(arg == "--study" or arg.startswith("--study=") for arg in command):
        parser.error("study (--study): give it to rayhpc submit, not in the command after --")
    if not any(arg.endswith("tune_mlp.py") or arg == "tune" for arg in command):
        parser.error(f"study (--study): the command must be a sweep (jobs/tune_mlp.py or rayhpc tune), got "
                     f"{' '.join(command) or 'none'}")
    return [*command, "--study", str(open_study(Path(study)).path)]


def _submit_array(cluster_cfg, command: list[str], dry_run: bool, study: str | None = None, slices: int = 1) -> int:
    """`rayhpc submit --array`: the sweep flags (after an optional `python [-u] jobs/tune_mlp.py`); with `study`,
    array tasks that are slices of it (`rayhpc.tune.study_array`: Optuna and ASHA too)."""
    # imported here, not at the top: only this command's modules (see the module docstring)
    from rayhpc.tune.array import prepare_array, submit_array
    from rayhpc.tune.config import SweepConfig

    while command and (command[0].startswith("python") or command[0] == "-u" or command[0].endswith("tune_mlp.py")):
        command = command[1:]
    parser = ArgParser(prog="rayhpc submit --array -- ", description="The sweep to run as an array job.")
    if study is not None:
        from rayhpc.tune.study_array import submit_study_array  # only arrays of slices

        if slices < 1:
            parser.error(f"slices (--slices) {slices}: must be at least 1")
        sweep, explicit = parse_config(parser, SweepConfig, [*command, "--study", study])
        out = submit_study_array(cluster_cfg, sweep, explicit, slices if slices > 1 else None, dry_run)
        print(out if dry_run else f"submitted array job {out} of slices of study {Path(study).expanduser().resolve()}"
                                  f": rayhpc status --study {Path(study).expanduser().resolve()}")
        return 0
    sweep, task, configs, columns = prepare_array(*parse_config(parser, SweepConfig, command))
    out = submit_array(cluster_cfg, sweep, task, configs, columns, dry_run=dry_run)
    print(out if dry_run else f"submitted array job {out} ({len(configs)} tasks) and a job collecting their results "
                              f"into {sweep.experiment_dir / 'results.parquet'}")
    return 0


def status_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc status [JOBID]`: the platform's Slurm jobs, one job as Slurm and Ray see it, or (--address) a Ray cluster."""
    parser = ArgParser(prog="rayhpc status", description="rayhpc's Slurm jobs; with JOBID, that job as Slurm sees "
                       "it (state, time left, nodes) and as its Ray cluster does (nodes, resources in use, sweeps); "
                       "with --address, a Ray cluster's nodes, resources in use, running jobs and sweeps.")
    parser.add_argument("job", nargs="?", metavar="JOBID", help="a Slurm job id of a rayhpc job")
    parser.add_argument("--address", metavar="ADDR", help="a running Ray cluster (host:port); default $RAY_ADDRESS")
    parser.add_argument("--study", metavar="DIR", help="a study folder (tune --study): its slices, trials by state "
                        "and the best so far")
    args = parser.parse_args(argv)
    # each form of the command imports only what it needs (see the module docstring)
    if args.study is not None:
        from rayhpc.study.slice import study_status  # the study folder only: no Ray, no Slurm

        print(study_status(Path(args.study)))
        return 0
    if args.job is not None:
        from rayhpc.slurm.control import job_status  # Slurm's view, then the job's Ray

        print(job_status(_job_id(parser, args.job)))
        return 0
    address = args.address or os.environ.get("RAY_ADDRESS")
    mine = None
    if address is None:
        from rayhpc.up.control import current, describe  # the user's own cluster on this machine, if up

        mine = current()
        address = mine and cluster.resolve_address(None, same_environment=False)  # its token; Ray's state only
        if mine:
            print(describe(mine))
    if address is None and shutil.which("squeue") is None:
        parser.error("no Ray cluster to ask: give --address HOST:PORT (or set RAY_ADDRESS), or start one with "
                     "rayhpc up; no Slurm here (squeue not found)")
    if address is None:
        from rayhpc.slurm.submit import format_jobs, jobs  # squeue only: no Ray

        print(format_jobs(jobs()))
        return 0
    from rayhpc.monitor.status import cluster_status  # Ray's state API: only this form needs it

    os.environ["RAY_ADDRESS"] = address  # Ray's state API reads it; without, it stops at two clusters on the node
    with ray_session():
        cluster.connect(address, log_to_driver=False)
        print(cluster_status())
    return 0


def _job_id(parser: ArgParser, value: str) -> str:
    if not value.isdigit():
        parser.error(f"JOBID {value!r}: expected a Slurm job id (digits), e.g. 12345")
    return value


def stop_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc stop JOBID`: cancel a job and verify the clean-up on every node, reporting what was left."""
    # imported here, not at the top: only this command's modules (see the module docstring)
    from rayhpc.slurm.control import stop

    parser = ArgParser(prog="rayhpc stop", description="Cancel a rayhpc job and check, from each node's clean-up "
                       "report, that none of its processes or temp folders were left.")
    parser.add_argument("job", metavar="JOBID", help="the Slurm job id")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="S", help="longest wait for the job to end")
    args = parser.parse_args(argv)
    text, clean = stop(_job_id(parser, args.job), args.timeout)
    print(text)
    return 0 if clean else 1


def up_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc up`: start your own Ray cluster on this machine, which later commands join."""
    from rayhpc.up.control import up  # imported here: only this command's modules (see the module docstring)

    parser = ArgParser(prog="rayhpc up", description="Start a Ray cluster of your own on this machine, in the "
                       "background: every later command here (tune, train, parallel, ps, status) joins it instead of "
                       "starting and stopping a Ray of its own. Private temp folder, token auth, free ports. "
                       "rayhpc down stops it.")
    parser.add_argument("--num-cpus", type=float, metavar="N", help="CPUs it offers (default: this machine's)")
    parser.add_argument("--num-gpus", type=float, metavar="N", help="GPUs it offers (default: this machine's)")
    parser.add_argument("--no-dashboard", action="store_true", help="without Ray's dashboard")
    args = parser.parse_args(argv)
    for key in ("num_cpus", "num_gpus"):
        value = getattr(args, key)
        if value is not None and not 0 <= value < float("inf"):
            parser.error(f"{key} (--{key.replace('_', '-')}) {value:g}: expected a number >= 0")
    print(up(args.num_cpus, args.num_gpus, not args.no_dashboard))
    return 0


def down_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc down`: stop your cluster on this machine (its jobs first, each keeping its results)."""
    from rayhpc.up.control import JOB_STOP_TIMEOUT_S, down  # only this command's modules

    parser = ArgParser(prog="rayhpc down", description="Stop the cluster rayhpc up started on this machine: its "
                       "running jobs first (each saves its checkpoints and results and can be resumed), then Ray; "
                       "checks that none of its processes or files are left.")
    parser.add_argument("--timeout", type=float, default=JOB_STOP_TIMEOUT_S, metavar="S",
                        help="longest wait for its jobs to stop")
    text, clean = down(parser.parse_args(argv).timeout)
    print(text)
    return 0 if clean else 1


def doctor_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc doctor [--cluster FILE]`: a pre-flight on this node or allocation, one line per check."""
    # imported here, not at the top: only this command's modules (see the module docstring)
    from rayhpc.slurm.config import load_cluster
    from rayhpc.slurm.doctor import doctor

    parser = ArgParser(prog="rayhpc doctor", description="Pre-flight checks on this node (or, inside salloc/sbatch, "
                       "this allocation): free ports, folder ownership, the address Ray would use, GPUs, storage, "
                       "requeue settings, versions on every node. OK / PROBLEM / SKIP, one line each.")
    parser.add_argument("--cluster", metavar="FILE", help="cluster config, e.g. cluster_configs/x.yaml")
    parser.add_argument("--storage-path", metavar="PATH", help="the folder sweeps and training write to")
    args = parser.parse_args(argv)
    cfg = load_cluster(args.cluster) if args.cluster else None
    text, ok = doctor(cfg, Path(args.storage_path).expanduser().resolve() if args.storage_path else None)
    print(text)
    return 0 if ok else 1


def export_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc export SWEEP_DIR --best K DEST`: the K best trials' weights, hyperparameters and metrics."""
    from rayhpc.tune.export import export_best  # only this command's modules (see the module docstring)

    parser = ArgParser(prog="rayhpc export", description="Write the best trials of a sweep, by its objective, to "
                       "DEST: a folder per trial with model.pt (its model's state dict, for the task's model(hp)), "
                       "hp.json and metrics.json (its row of the results table). Members of packs come out as "
                       "their own models.")
    parser.add_argument("sweep", metavar="SWEEP_DIR", help="the sweep's folder (STORAGE_PATH/NAME)")
    parser.add_argument("dest", metavar="DEST", help="where the trials' folders go (made only yours)")
    parser.add_argument("--best", type=int, default=1, metavar="K", help="how many trials (default 1)")
    args = parser.parse_args(argv)
    if args.best < 1:
        parser.error(f"--best {args.best}: expected 1 or more")
    for folder in export_best(Path(args.sweep), args.best, Path(args.dest)):
        print(folder)
    return 0


def sync_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc sync DIR`: upload a job's offline W&B runs (from a machine that reaches W&B)."""
    from rayhpc.tracking.sync import sync  # only this command's modules (see the module docstring)

    parser = ArgParser(prog="rayhpc sync", description="Upload the W&B runs that jobs wrote offline (--wandb, "
                       "wandb_mode offline: the default on compute nodes) with `wandb sync`, from a machine that "
                       "reaches W&B, such as a login node. Runs uploaded before are skipped.")
    parser.add_argument("folder", metavar="DIR", help="a job's folder, or a storage path of jobs")
    parser.add_argument("--dry-run", action="store_true", help="list the runs; upload nothing")
    args = parser.parse_args(argv)
    runs, status = sync(Path(args.folder), args.dry_run)
    print(f"{len(runs)} offline W&B run(s) in {Path(args.folder).resolve()}" + ("" if args.dry_run else
                                                                                  f": wandb sync exit {status}"))
    return status


COMMANDS = {"tune": tune_main, "train": train_main, "parallel": parallel_main, "ps": ps_main,
            "collectives": collectives_main, "scaling": scaling_main, "up": up_main, "down": down_main,
            "submit": submit_main, "status": status_main, "stop": stop_main, "doctor": doctor_main,
            "export": export_main, "sync": sync_main}


def usage() -> str:
    """`rayhpc --help`: every command with its one-line description."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {fn.__doc__.split(':', 1)[1].strip().rstrip('.')}" for name, fn in COMMANDS.items()]
    return ("usage: rayhpc COMMAND [options]   (rayhpc COMMAND --help for its options)\n\ncommands:\n"
            + "\n".join(lines))


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The `rayhpc` command (also `python -m rayhpc`): `rayhpc <command> [options]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        sys.exit(0)
    if not argv or argv[0] not in COMMANDS:
        given = repr(argv[0]) if argv else "nothing"
        print(f"error: command {given}: expected one of {', '.join(COMMANDS)} (see rayhpc --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    run_main(COMMANDS[argv[0]], argv[1:])


if __name__ == "__main__":
    main()
