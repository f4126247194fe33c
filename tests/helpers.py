"""Input construction and the forward check shared by the test modules."""

from __future__ import annotations

import functools

import pytest
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


@functools.cache
def has_backward(device: str) -> bool:
    """True once ``flashcore::attn_fwd`` has an autograd formula (the backward has landed).

    Found by running one backward on a tiny input: until the formula is registered, PyTorch's
    custom_op raises a RuntimeError saying so. Any other error is a real failure and propagates.
    """
    q = torch.randn(1, 1, 4, 16, device=device, requires_grad=True)
    out = flashcore.attention(q, q.detach(), q.detach())
    try:
        out.sum().backward()
    except RuntimeError as e:
        if "no autograd formula" in str(e):
            return False
        raise
    return True


def skip_without_backward(device: str) -> None:
    """Skip the calling test until the backward is registered (see ``has_backward``)."""
    if not has_backward(device):
        pytest.skip(
            "flashcore::attn_fwd has no autograd formula yet (the backward is not registered)"
        )


def check_grads(grads: dict, q, k, v, dout, *, causal: bool, scale=None) -> None:
    """Assert gradients ``{"q": dq, ...}`` (any subset of q, k, v) with FlashAttention's rule."""

    def reference_grads(dtype: torch.dtype) -> dict:
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = reference.attention(*leaves, causal=causal, scale=scale, dtype=dtype).out
        out.backward(dout.to(dtype))
        return {name: t.grad for name, t in zip("qkv", leaves, strict=True)}

    ref, pt = reference_grads(torch.float64), reference_grads(q.dtype)
    for name, grad in grads.items():
        assert grad is not None, f"d{name} is None"
        assert_fa_rule(f"d{name}", grad, pt[name], ref[name])
