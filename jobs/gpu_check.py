"""Every GPU path of the platform on this machine's GPUs, in one table; writes gpu_check.json.

    python jobs/gpu_check.py [--out gpu_check.json]

Lines: no host sync in a training step; the packed sweep with half a GPU per pack; DDP and
FSDP2 (bf16, a worker per GPU) against raw PyTorch on one GPU at the H100 anchor size (MLP 4096 ->
8192 -> 4096, batch 8192), with MFU and each side's share of time waiting for data; fit() to first step,
phase by phase;
and with 2+ GPUs the TP/PP worker group on NCCL against one process, the NCCL collectives, the
pipeline bubble with CUDA events and a warm distributed-trial sweep; the digits CNN sweep; an
array-mode task on its GPU. A line that cannot run its subject here is SKIP with the reason. Exit 1
if a line fails, or if the machine has GPUs that this torch cannot use (it names the build); without
a GPU every GPU line is SKIP and it exits 0.
"""

import argparse
import logging
from pathlib import Path

from bench.gpu_check import format_table, run_checks, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="the table as JSON")
    parser.add_argument("--only", help="run only the lines whose check name contains this (e.g. 'TP/PP', "
                        "'no host sync'); the first line always runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    lines, where = run_checks(Path(args.out), args.only)
    write(Path(args.out), lines, where)
    print(format_table(lines, where))
    if where.startswith("no GPU"):
        print("no GPU on this machine: every GPU line is SKIP (the first line needs none)")
    return 1 if any(line.status == "FAIL" for line in lines) else 0


if __name__ == "__main__":
    raise SystemExit(main())
