"""Every GPU path of the platform on this machine's GPUs, in one table; writes gpu_check.json.

    python jobs/gpu_check.py [--out gpu_check.json]

Lines: no host sync in a training step; the packed sweep with half a GPU per pack; DDP and
FSDP2 (bf16) against raw PyTorch at the H100 anchor size (MLP 4096 -> 8192 -> 4096, batch 8192),
with MFU and the share of time waiting for data; fit() to done; the TP/PP worker group on NCCL
against one process; the NCCL collectives; the pipeline bubble with CUDA events (2+ GPUs); the
digits CNN sweep; an array-mode task on its GPU. Exit 1 if a line fails. Without a GPU it says
so, runs the lines that need none, and exits 0.
"""

import argparse
import logging
from pathlib import Path

from bench.gpu_check import format_table, run_checks, write


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="the table as JSON")
    parser.add_argument("--only", help="run only the lines whose check name contains this (e.g. 'TP/PP', "
                        "'no host sync'); the first line always runs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    lines, where = run_checks(Path(args.out), args.only)
    write(Path(args.out), lines, where)
    print(format_table(lines, where))
    if "no GPU" in where:
        print("no GPU on this machine: the GPU lines did not run (the line above needs none)")
    return 1 if any(line.status == "FAIL" for line in lines) else 0


if __name__ == "__main__":
    raise SystemExit(main())
