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


def causal_mask(seqlen_q: int, seqlen_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bottom-right aligned causal mask: ``mask[i, j]`` is True iff query i sees key j.

    Query i sees key j iff ``j <= i + seqlen_k - seqlen_q`` (FlashAttention-2's convention).
    """
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


class ProbsResult(NamedTuple):
    probs: torch.Tensor
    """(B, H, Sq, Sk) normalised softmax of the scores in the compute dtype; 0 for hidden keys and
    for every key of a row that sees none."""
    lse: torch.Tensor
    """(B, H, Sq) natural-log logsumexp of the scaled scores; -inf for rows that see no key."""


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: repeat each kv head over its ``heads // Hkv`` query heads."""
    kv_heads = t.shape[1]
    return t if kv_heads == heads else t.repeat_interleave(heads // kv_heads, dim=1)


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``scale * q @ k^T`` in ``dtype``, ``(B, H, Sq, Sk)``; -inf where the causal mask hides a key.

    q is ``(B, H, Sq, D)``, k is ``(B, Hkv, Sk, D)``; scale defaults to ``1 / sqrt(D)``.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    k = _repeat_kv(k.to(dtype), q.shape[1])
    s = torch.matmul(q.to(dtype), k.transpose(-1, -2)) * scale
    if causal:
        mask = causal_mask(q.shape[2], k.shape[2], device=q.device)
        s = s.masked_fill(~mask, float("-inf"))
    return s


def probs(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> ProbsResult:
    """Softmax of :func:`scores` along the keys, and its logsumexp, in ``dtype``."""
    s = scores(q, k, causal=causal, scale=scale, dtype=dtype)
    lse = torch.logsumexp(s, dim=-1)
    # exp(s - lse) is 0 for masked keys; a row with no visible key has lse = -inf: keep it at 0.
    empty = (lse == float("-inf")).unsqueeze(-1)
    p = torch.exp(s - lse.unsqueeze(-1).masked_fill(empty, 0.0)).masked_fill(empty, 0.0)
    return ProbsResult(p, lse)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> RefResult:
    """Attention computed in ``dtype`` from q ``(B, H, Sq, D)``, k/v ``(B, Hkv, Sk, D)``.

    Same semantics as ``flashcore.attention``: GQA by repeating each kv head over its ``H // Hkv``
    query heads, bottom-right causal, rows that see no key give out 0 and lse -inf.
    """
    p, lse = probs(q, k, causal=causal, scale=scale, dtype=dtype)
    out = torch.matmul(p, _repeat_kv(v.to(dtype), q.shape[1]))
    return RefResult(out, lse)
