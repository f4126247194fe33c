"""Device-side: the Hopper tier's causal work order, A/B in one process.

Forward: the launcher's choice (``ops/fwd_sm90_configs.py: causal_order``) against the order before
it (each head's query tiles last-first on ``min(#SMs, work)`` programs), the same kernel. Backward
(``--bwd``): key blocks heaviest first across ``lpt_group`` heads against head-major. cuDNN
beside; causal, bf16; rotated rounds, medians of ``do_bench`` medians, TFLOP/s.

Usage::

    ROUNDS=3 PYTHONPATH=src python scripts/causal_order_ab.py 1,16,4096,128 2,16,4096,128
    ROUNDS=3 PYTHONPATH=src python scripts/causal_order_ab.py --bwd 1,16,4,4096,128

Shapes are ``B,H,S,D`` (forward) and ``B,H,Hkv,S,D`` (backward).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashcore
from flashcore.ops import bwd, bwd_sm90, fwd, fwd_sm90_configs

CHOSEN = {"fwd": fwd_sm90_configs.causal_order, "bwd": bwd_sm90.lpt_group}


def previous_order(costs, heads, sms, persistent, kv_bytes):
    n_work = len(costs) * heads
    return (min(sms, n_work) if persistent else n_work), 1


def use(mode: str, name: str) -> None:
    """Switch the launcher to ``name``'s order ("new" or "old") and drop the kept plans (and
    the launches kept per signature, ops.express's and the quick backwards)."""
    if mode == "fwd":
        fwd_sm90_configs.causal_order = CHOSEN["fwd"] if name == "new" else previous_order
        fwd.forget()
    else:
        bwd_sm90.lpt_group = CHOSEN["bwd"] if name == "new" else (lambda heads, nbytes: 1)
        bwd_sm90._PLANS.clear()
        bwd.forget()


def ab(text: str, bwd: bool, rounds: int) -> None:
    """One shape: both orders and cuDNN, checked against cuDNN, then timed."""
    mode = "bwd" if bwd else "fwd"
    dims = [int(x) for x in text.split(",")]
    b, h, hk, s, d = dims if bwd else (dims[0], dims[1], dims[1], *dims[2:])
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    g = torch.randn_like(q)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hk != h)
    flops = 4 * b * h * s * s * d / 2 * (2.5 if bwd else 1)
    with flashcore.use_tier("sm90"):
        out = flashcore.attention(q, k, v, causal=True)

    def run(name: str):
        if name == "cudnn":
            if bwd:
                return torch.autograd.grad(ref, (q, k, v), g, retain_graph=True)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return (F.scaled_dot_product_attention(q, k, v, is_causal=True),)
        if bwd:
            return torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        with flashcore.use_tier("sm90"):
            return (flashcore.attention(q, k, v, causal=True),)

    errors = {}
    expect = run("cudnn")
    for name in ("old", "new"):
        use(mode, name)
        got = run(name)
        errors[name] = max(
            (x.float() - y.float()).abs().max().item() for x, y in zip(got, expect, strict=True)
        )
    rows = []
    for r in range(rounds):
        names = ["old", "new", "cudnn"]
        row = {}
        for name in names[r % 3 :] + names[: r % 3]:
            if name != "cudnn":
                use(mode, name)
            row[name] = flops / do_bench(lambda name=name: run(name)) / 1e9
        rows.append(row)
    m = {n: statistics.median(row[n] for row in rows) for n in ("old", "new", "cudnn")}
    print(
        f"{mode} {text} TFLOP/s old {m['old']:6.1f} new {m['new']:6.1f} cudnn "
        f"{m['cudnn']:6.1f}  new/old {m['new'] / m['old']:.3f} new/cudnn "
        f"{m['new'] / m['cudnn']:.3f}  max |diff| vs cuDNN {errors}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bwd", action="store_true")
    p.add_argument("shapes", nargs="+")
    args = p.parse_args()
    for text in args.shapes:
        ab(text, args.bwd, int(os.environ.get("ROUNDS", "3")))


if __name__ == "__main__":
    main()
