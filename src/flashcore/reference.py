"""The one reference implementation: plain PyTorch math with the kernels' exact semantics.

Tests and the benchmark compare against it. It materialises the full (Sq, Sk) score matrix, so it is
meant for checking, not for speed. Run it in float64 for the ground truth, or in the inputs' own
dtype for "what plain PyTorch math would give" (the baseline of FlashAttention's error rule).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class RefResult(NamedTuple):
    out: torch.Tensor
    """(B, H, Sq, D) in the compute dtype."""
    lse: torch.Tensor
    """(B, H, Sq) natural-log logsumexp of the scaled scores, in the compute dtype; -inf for rows
    that see no key."""


def causal_mask(
    seqlen_q: int, seqlen_k: int, device: torch.device | str = "cpu", *, top_left: bool = False
) -> torch.Tensor:
    """Causal mask: ``mask[i, j]`` is True iff query i sees key j.

    Bottom-right aligned by default: query i sees key j iff ``j <= i + seqlen_k - seqlen_q``
    (FlashAttention-2's convention, ``flashcore.attention``). With ``top_left``: iff ``j <= i``
    (PyTorch's ``scaled_dot_product_attention(is_causal=True)``).
    """
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (0 if top_left else seqlen_k - seqlen_q)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
    top_left: bool = False,
) -> RefResult:
    """Attention computed in ``dtype`` from q ``(B, H, Sq, D)``, k/v ``(B, Hkv, Sk, D)``.

    Same semantics as ``flashcore.attention``: GQA by repeating each kv head over its ``H // Hkv``
    query heads, bottom-right causal, rows that see no key give out 0 and lse -inf. ``top_left``
    aligns the causal mask as ``flashcore.scaled_dot_product_attention`` does (see ``causal_mask``).
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        mask = causal_mask(q.shape[2], k.shape[2], device=q.device, top_left=top_left)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(s - lse) is 0 for masked keys; a row with no visible key has lse = -inf: keep it at 0.
    empty = (lse == float("-inf")).unsqueeze(-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).masked_fill(empty, 0.0)).masked_fill(empty, 0.0)
    out = torch.matmul(probs, v)
    return RefResult(out, lse)
