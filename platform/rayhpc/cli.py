"""Command-line plumbing shared by `jobs/*.py` and the `rayhpc` command.

Bad input never produces a traceback: `ConfigError`s and argparse errors are
printed as one `error: ...` line on stderr and the process exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Callable, NoReturn, Sequence

from rayhpc.config import ConfigError

USAGE_ERROR = 2


class ArgParser(argparse.ArgumentParser):
    """argparse with one-line errors (`error: ...`, exit status 2) instead of usage dumps."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def run_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> NoReturn:
    """Run `main`, turning user-input errors into `error: ...` and exit status 2."""
    try:
        code = main(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    sys.exit(code or 0)


def tune_main(argv: Sequence[str] | None = None) -> int:
    """`rayhpc tune` / `python jobs/tune_mlp.py`: run a hyperparameter sweep."""
    from rayhpc.tune import config as sweep_config
    from rayhpc.tune.results import format_best
    from rayhpc.tune.sweep import run_sweep

    parser = ArgParser(prog="tune_mlp.py", description="Hyperparameter sweep of the MLP on Ray Tune.")
    sweep_config.add_arguments(parser)
    args = parser.parse_args(argv)
    cfg, explicit = sweep_config.from_args(args)
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


COMMANDS = {"tune": tune_main}


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The `rayhpc` command: `rayhpc <command> [options]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        given = repr(argv[0]) if argv else "nothing"
        print(f"error: command {given}: expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    run_main(COMMANDS[argv[0]], argv[1:])
