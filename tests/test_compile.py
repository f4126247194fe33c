"""The kernels compile for a Hopper GPU (sm_90a), checked on any machine.

Triton's interpreter accepts code the compiler rejects (a module global annotated as a constexpr,
say), so the interpreter tier alone cannot tell whether the GPU tier will even start. Triton lowers
to PTX and runs its bundled ptxas without a GPU; scripts/ptxas_report.py does that for the configs
``flashcore.tuning`` picks: the widest flag set (bf16, causal, ragged lengths, a padded and the
largest head dim) and the narrowest (no mask, block multiples).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Hopper's shared memory per block (227 KiB): a config above it compiles but cannot launch.
MAX_SHARED = 227 * 1024


@pytest.mark.parametrize(
    "variant",
    [["--head-dim", "80", "--head-dim", "256"], ["--head-dim", "64", "--full-even"]],
    ids=["causal-ragged", "full-even"],
)
def test_kernels_compile_for_sm90(variant):
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"this Triton build ships no ptxas ({ptxas})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(ROOT / "scripts" / "ptxas_report.py"), "--dtype", "bf16", *variant]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 4 * variant.count("--head-dim"), run.stdout  # fwd, delta, dkdv, dq
    for line in lines:
        shared = int(re.search(r"smem=(\d+)", line).group(1))
        assert shared <= MAX_SHARED, f"needs {shared} bytes of shared memory: {line}"
