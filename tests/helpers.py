"""Input construction and the forward and backward checks shared by the test modules."""

from __future__ import annotations

import torch

import flashcore
from flashcore import reference
from numerics import assert_fa_rule
from shapes import Case


def make_qkv(case: Case, dtype: torch.dtype, device: str, *, layout: str = "bhsd"):
    """Random q, k, v for a case. ``layout='bshd'`` returns (B, S, H, D) storage viewed as
    (B, H, S, D); ``'sliced'`` returns views into larger tensors (no unit stride on any dim but D).
    """
    b, h, hkv, sq, sk, d = case

    def rand(heads: int, seqlen: int) -> torch.Tensor:
        if layout == "bshd":
            return torch.randn(b, seqlen, heads, d, dtype=dtype, device=device).transpose(1, 2)
        if layout == "sliced":
            big = torch.randn(b, heads + 1, seqlen + 3, d + 8, dtype=dtype, device=device)
            return big[:, 1:, 2 : seqlen + 2, 4 : d + 4]
        return torch.randn(b, heads, seqlen, d, dtype=dtype, device=device)

    return rand(h, sq), rand(hkv, sk), rand(hkv, sk)


def check_forward(out, lse, q, k, v, *, causal: bool, scale=None) -> None:
    ref = reference.attention(q, k, v, causal=causal, scale=scale, dtype=torch.float64)
    pt = reference.attention(q, k, v, causal=causal, scale=scale, dtype=q.dtype)
    assert out.dtype == q.dtype
    assert lse.dtype == torch.float32
    assert_fa_rule("out", out, pt.out, ref.out)
    assert_fa_rule("lse", lse, pt.lse, ref.lse)


def reference_grads(q, k, v, dout, dlse, *, causal: bool, scale=None, dtype: torch.dtype):
    """``(dq, dk, dv)`` by autograd through the reference computed in ``dtype``.

    Fresh leaves are made in ``dtype`` so a float64 gradient is not rounded back to q's dtype.
    ``dlse`` may be None (the LSE output is not differentiated).
    """
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, causal=causal, scale=scale, dtype=dtype)
    outputs, grads = [ref.out], [dout.to(dtype)]
    if dlse is not None:
        outputs.append(ref.lse)
        grads.append(dlse.to(dtype))
    return torch.autograd.grad(outputs, leaves, grads)


def check_backward(q, k, v, *, causal: bool, scale=None, dout=None, dlse=None):
    """Run flashcore.attention forward and backward and check dq, dk, dv with the FA rule.

    ``dout`` defaults to a random tensor shaped like the output; ``dlse`` (the gradient reaching
    the LSE) defaults to none. Returns the kernel's gradients.
    """
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flashcore.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    if dout is None:
        dout = torch.randn_like(out)
    outputs, grads = [out], [dout]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse)
    got = torch.autograd.grad(outputs, (q, k, v), grads)
    ref = reference_grads(q, k, v, dout, dlse, causal=causal, scale=scale, dtype=torch.float64)
    pt = reference_grads(q, k, v, dout, dlse, causal=causal, scale=scale, dtype=q.dtype)
    for name, g, t, p, r in zip(("dq", "dk", "dv"), got, (q, k, v), pt, ref, strict=True):
        assert g.dtype == t.dtype, f"{name}: dtype {g.dtype} != {t.dtype}"
        assert_fa_rule(name, g, p, r)
    return got
