"""Device-side: the sm90 tier's forward and backward under this process's Triton, beside cuDNN's
SDPA (the same GPU, the same process: the anchor when two Tritons are compared in two processes),
bf16, ``do_bench`` medians. Opens the tier's Triton gate (``sm90_gate``): for comparing the tier
built by another Triton (``scripts/triton_payload.sh``) with the verified one.

Usage: PYTHONPATH=src:scripts python scripts/triton_version_ab.py
"""

from __future__ import annotations

import functools

import sm90_gate
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashcore

SHAPES = [  # (B, H, S, D, Dv, causal): the builds whose registers moved between Tritons
    (2, 16, 8192, 128, 128, False), (2, 16, 8192, 128, 128, True),
    (4, 16, 4096, 64, 64, False), (4, 16, 4096, 64, 64, True), (8, 16, 2048, 64, 64, True),
    (2, 16, 4096, 192, 128, True), (2, 16, 4096, 256, 256, True),
]  # fmt: skip


def median_ms(fn) -> float:
    return do_bench(fn, warmup=50, rep=200, return_mode="median")


def fwd_bwd_ms(run, do) -> tuple[float, float]:
    """The median forward and backward (through q, k, v) of ``run``, ``do`` the output's grad."""
    fwd = median_ms(run)
    o = run()
    return fwd, median_ms(lambda: torch.autograd.grad(o, run.args[:3], do, retain_graph=True))


def main() -> None:
    gate = sm90_gate.open_gate()
    print(f"triton {triton.__version__} (gate {gate}), torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    print(f"{'B,H,S,D,Dv':>20} causal   fwd: sm90  cudnn  bwd: sm90  cudnn   (TFLOP/s)")
    torch.manual_seed(0)
    for b, h, s, d, dv, causal in SHAPES:
        q, k = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in "qk")
        v = torch.randn(b, h, s, dv, device="cuda", dtype=torch.bfloat16)
        for t in (q, k, v):
            t.requires_grad_(True)
        fwd_flops = 2 * b * h * s * s * (d + dv) / (2 if causal else 1)
        bwd_flops = 2.5 * fwd_flops
        do = torch.randn(b, h, s, dv, device="cuda", dtype=torch.bfloat16)
        with flashcore.use_tier("sm90"):
            ours = fwd_bwd_ms(functools.partial(flashcore.attention, q, k, v, causal=causal), do)
        cudnn = (float("nan"), float("nan"))
        if d == dv:
            sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal)
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn = fwd_bwd_ms(sdpa, do)
            except RuntimeError as err:  # a head dim cuDNN does not take
                print(f"cudnn: {str(err).splitlines()[0][:100]}")
        fwd = [fwd_flops / ms / 1e9 for ms in (ours[0], cudnn[0])]
        bwd = [bwd_flops / ms / 1e9 for ms in (ours[1], cudnn[1])]
        label = f"{b},{h},{s},{d},{dv}"
        cells = f"{fwd[0]:9.0f} {fwd[1]:6.0f} {bwd[0]:10.0f} {bwd[1]:6.0f}"
        print(f"{label:>20} {causal!s:>6}   {cells}", flush=True)


if __name__ == "__main__":
    main()
