"""Device-side: fp32 attention whose outputs are long sums, against float64 and the FA rule.

Forward: a few queries against many near-uniform keys (q at 0.02 of unit scale, values near 3),
through ``attention`` and ``attention_with_kvcache``; backward: one or a few keys seen by many
query rows, and one query against many keys. Each line prints max|x - ref64| over the rule's
bound (2 x PyTorch's fp32 error + the rounding floor). docs/performance.md ("The long sums") has
the H200 results of these problems (measured with the same problems from scratch code; this
script gathers them).

Usage: PYTHONPATH=src python scripts/fp32_long_sums.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import flashcore
from flashcore import reference
from helpers import alibi_slopes, reference_grads
from numerics import rounding_floor


def verdict(name: str, got, pt, ref) -> str:
    err = (got.double() - ref).abs().max().item()
    bound = 2 * (pt.double() - ref).abs().max().item() + rounding_floor(torch.float32, ref)
    return f"{name} {err:.2e}/{bound:.2e}{'' if err <= bound else ' OUTSIDE'}"


def forward(seqlen_q: int, seqlen_k: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(1, 4, seqlen_q, 128, device="cuda") * 0.02
    k = torch.randn(1, 4, seqlen_k, 128, device="cuda")
    v = torch.randn(1, 4, seqlen_k, 128, device="cuda") + 3.0
    ref = reference.attention(q, k, v, causal=False, dtype=torch.float64).out
    pt = reference.attention(q, k, v, causal=False, dtype=torch.float32).out
    line = [verdict("attention", flashcore.attention(q, k, v), pt, ref)]
    lens = torch.full((1,), seqlen_k, dtype=torch.int32, device="cuda")
    for splits in (1, None):
        out = flashcore.attention_with_kvcache(
            q, k, v, cache_seqlens=lens, causal=False, num_splits=splits
        )
        line.append(verdict(f"kvcache splits={splits}", out, pt, ref))
    print(f"forward Sq {seqlen_q} Sk {seqlen_k}: " + " | ".join(line), flush=True)


def backward(tag: str, heads: int, kv_heads: int, seqlen_q: int, seqlen_k: int, **kw) -> None:
    torch.manual_seed(0)
    q_scale, v_shift = kw.pop("q_scale", 1.0), kw.pop("v_shift", 0.0)
    q = (torch.randn(1, heads, seqlen_q, 128, device="cuda") * q_scale).requires_grad_()
    k = torch.randn(1, kv_heads, seqlen_k, 128, device="cuda").requires_grad_()
    v = (torch.randn(1, kv_heads, seqlen_k, 128, device="cuda") + v_shift).requires_grad_()
    out = flashcore.attention(q, k, v, causal=False, **kw)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = reference_grads(q, k, v, dout, None, causal=False, dtype=torch.float64, **kw)
    pt = reference_grads(q, k, v, dout, None, causal=False, dtype=torch.float32, **kw)
    names = ("dq", "dk", "dv")
    line = [verdict(n, g, p, r) for n, g, p, r in zip(names, got, pt, ref, strict=True)]
    print(f"backward {tag}: " + " | ".join(line), flush=True)


def main() -> None:
    for seqlen_k in (16384, 65536):
        for seqlen_q in (1, 4, 16, 64):
            forward(seqlen_q, seqlen_k)
    slopes = alibi_slopes(8, None, "cuda")
    backward("one key, 1803 rows, ALiBi", 8, 2, 1803, 1, scale=0.3, alibi_slopes=slopes)
    backward("one key, 16384 rows, ALiBi", 8, 2, 16384, 1, scale=0.3, alibi_slopes=slopes)
    backward("8 keys, 16384 rows, v + 3", 8, 2, 16384, 8, v_shift=3.0)
    backward("1 query, 65536 keys, v + 3", 4, 4, 1, 65536, q_scale=0.02, v_shift=3.0)


if __name__ == "__main__":
    main()
