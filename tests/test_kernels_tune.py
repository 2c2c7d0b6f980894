import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchgen.kernels.moe_config import moe_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.triton_cpu
def test_tune_moe_writes_a_config_the_kernel_reads(tmp_path, monkeypatch):
    """Plumbing only (interpreter timings mean nothing): tuned file lands where moe_config finds it."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = ["--experts", "4", "--inter", "32", "--dim", "32", "--dtype", "float32", "--device", "cpu"]
    args += ["--quick", "--batch-sizes", "2", "16", "--reps", "1", "--out-dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tune_moe.py"), *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "E=4,N=32,device_name=cpu.json").is_file()
    monkeypatch.setenv("BATCHGEN_MOE_CONFIG_DIR", str(tmp_path))
    config = moe_config(3, 4, 32, torch.device("cpu"))
    assert config["BLOCK_SIZE_M"] in (16, 64) and config["BLOCK_SIZE_K"] == 64
