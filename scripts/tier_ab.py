"""Device-side: the forward on each tier (use_tier) beside cuDNN's SDPA, bf16, do_bench medians.

Usage: PYTHONPATH=src python scripts/tier_ab.py
"""

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashcore

SHAPES = [  # (B, H, S, D), B*S = 32768
    (64, 16, 512, 128), (8, 16, 4096, 128), (2, 16, 16384, 128),
    (64, 32, 512, 64), (8, 32, 4096, 64), (2, 32, 16384, 64),
]  # fmt: skip


def main() -> None:
    print(f"{'shape':>18} causal  portable     sm90    cudnn   (TFLOP/s)")
    for b, h, s, d in SHAPES:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
        for causal in (False, True):
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            row = []
            for tier in ("portable", "sm90"):
                with flashcore.use_tier(tier):
                    call = functools.partial(flashcore.attention, q, k, v, causal=causal)
                    ms = do_bench(call, return_mode="median")
                row.append(flops / ms / 1e9)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                call = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal)
                ms = do_bench(call, return_mode="median")
            row.append(flops / ms / 1e9)
            print(f"{b},{h},{s},{d}".rjust(18), f"{causal!s:>6}", *(f"{x:8.0f}" for x in row))


if __name__ == "__main__":
    main()
