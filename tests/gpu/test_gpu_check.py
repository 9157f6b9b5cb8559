"""On a GPU node: every GPU path of the platform through `jobs/gpu_check.py` (NCCL, bf16, packed sweeps on GPU
shares, the TP/PP worker group). Elsewhere these tests are skipped, saying why; `tests/unit/test_gpu_paths.py`
proves on any machine what can be proven without a GPU."""

import json

import pytest
import torch

from helpers import run_job

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason=f"needs a GPU that torch {torch.__version__} can use")


def test_every_gpu_line_of_the_gpu_check_passes(tmp_path):
    proc = run_job("gpu_check.py", "--out", str(tmp_path / "gpu_check.json"), timeout=3600)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = [line for line in report["lines"] if line.get("status") == "FAIL"]
    assert proc.returncode == 0 and not failed, proc.stdout[-4000:] + proc.stderr[-2000:]
