"""Device-side: the Hopper backward on GQA/MQA shapes with the group split off and on.

``ops.bwd_sm90.split_group`` decides whether a GQA/MQA backward runs a program per kv head (its
group's query heads walked in turn) or per query head (K and V repeated, dK and dV summed per
group afterwards). This times ``torch.autograd.grad`` of ``flashcore.attention`` (bf16, the
Hopper tier forced) with the decision forced each way, interleaved, beside cuDNN's SDPA
(``enable_gqa``), ``do_bench`` medians in ms, two rounds.

    PYTHONPATH=src python scripts/gqa_split_ab.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashcore
from flashcore.ops import bwd_sm90

SHAPES = [  # (B, H, Hkv, S, D)
    (1, 16, 4, 4096, 128), (1, 32, 8, 8192, 128), (2, 32, 8, 4096, 64), (4, 32, 8, 4096, 128),
]  # fmt: skip


def backward(out: torch.Tensor, leaves: tuple, do: torch.Tensor):
    return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)


def main() -> None:
    default = bwd_sm90.split_group
    print("B H Hkv S D causal: grouped split (default picks) sdpa, ms; grouped/split")
    for rnd in (1, 2):
        for b, h, hkv, s, d in SHAPES:
            leaves = tuple(
                torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for n in (h, hkv, hkv)
            )
            for causal in (False, True):
                with flashcore.use_tier("sm90"):
                    out = flashcore.attention(*leaves, causal=causal)
                do = torch.randn_like(out)
                times = {}
                for name, rule in (("grouped", False), ("split", True)):
                    bwd_sm90.split_group = lambda *a, rule=rule: rule
                    times[name] = do_bench(backward(out, leaves, do), return_mode="median")
                bwd_sm90.split_group = default
                programs = -(-s // bwd_sm90.BLOCK_N) * b * hkv
                pick = default(h // hkv, programs, bwd_sm90.num_sms(0), causal, (-1, -1))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ref = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
                times["sdpa"] = do_bench(backward(ref, leaves, do), return_mode="median")
                print(
                    f"round {rnd} {b} {h} {hkv} {s} {d} {int(causal)}: {times['grouped']:.3f} "
                    f"{times['split']:.3f} ({'split' if pick else 'grouped'}) {times['sdpa']:.3f}; "
                    f"{times['grouped'] / times['split']:.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
