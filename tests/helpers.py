"""Input construction and the forward check shared by the test modules."""

from __future__ import annotations

import torch

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
