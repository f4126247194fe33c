"""Device-side: the D = 64 Hopper backward with its dQ warpgroup at 80 and at 96 registers a
thread under this process's Triton (``ops/bwd_sm90.py: dq_regs``, which takes 80 where Triton
compiles sm_90 with CUDA 13's ptxas, 3.9 on, and 96 with CUDA 12's, 3.6-3.8), alternated over
two rounds; bf16, ``do_bench`` medians of the backward (TFLOP/s at 2.5x the forward's FLOPs).
Opens the tier's Triton gate (``sm90_gate``), as ``triton_version_ab.py`` does.

Usage: PYTHONPATH=src:scripts python scripts/dq_regs_ab.py
"""

from __future__ import annotations

import sm90_gate
import torch
import triton
from triton.testing import do_bench

import flashcore
from flashcore.ops import bwd, bwd_sm90

SHAPES = [(4, 16, 4096, True), (4, 16, 4096, False), (8, 16, 2048, True), (1, 16, 16384, True)]


def main() -> None:
    gate = sm90_gate.open_gate()
    print(f"triton {triton.__version__} (gate {gate}), {torch.cuda.get_device_name()}")
    torch.manual_seed(0)
    for _ in range(2):
        for regs in (80, 96):
            # dq_regs(cfg) is cfg.dq_regs, or min(cfg.dq_regs, DQ_REGS_PTXAS13) with a CUDA 13
            # ptxas: both set.
            bwd_sm90.DQ_REGS_PTXAS13 = regs
            bwd_sm90.CONFIGS[64] = bwd_sm90.CONFIGS[64]._replace(dq_regs=regs)
            bwd_sm90.dq_regs.cache_clear()
            bwd_sm90._PLANS.clear()
            bwd.forget()
            cells = []
            for b, h, s, causal in SHAPES:
                q, k, v = (
                    torch.randn(b, h, s, 64, device="cuda", dtype=torch.bfloat16,
                                requires_grad=True)
                    for _ in range(3)
                )  # fmt: skip
                do = torch.randn_like(q)
                with flashcore.use_tier("sm90"):
                    o = flashcore.attention(q, k, v, causal=causal)
                    ms = do_bench(
                        lambda o=o, q=q, k=k, v=v, do=do: torch.autograd.grad(
                            o, (q, k, v), do, retain_graph=True
                        ),
                        warmup=50, rep=200, return_mode="median",
                    )  # fmt: skip
                flops = 2.5 * 4 * b * h * s * s * 64 / (2 if causal else 1)
                kind = "causal" if causal else "full"
                cells.append(f"({b},{h},{s},{kind}) {flops / ms / 1e9:.0f}")
            print(f"dQ warpgroup {bwd_sm90.dq_regs(bwd_sm90.CONFIGS[64])}: " + "  ".join(cells),
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
