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
    top_left: bool = False,
) -> torch.Tensor:
    """``scale * q @ k^T`` in ``dtype``, ``(B, H, Sq, Sk)``; -inf where the causal mask hides a key.

    q is ``(B, H, Sq, D)``, k is ``(B, Hkv, Sk, D)``; scale defaults to ``1 / sqrt(D)``.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    k = _repeat_kv(k.to(dtype), q.shape[1])
    s = torch.matmul(q.to(dtype), k.transpose(-1, -2)) * scale
    if causal:
        mask = causal_mask(q.shape[2], k.shape[2], device=q.device, top_left=top_left)
        s = s.masked_fill(~mask, float("-inf"))
    return s


def probs(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
    top_left: bool = False,
) -> ProbsResult:
    """Softmax of :func:`scores` along the keys, and its logsumexp, in ``dtype``."""
    s = scores(q, k, causal=causal, scale=scale, dtype=dtype, top_left=top_left)
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
    top_left: bool = False,
) -> RefResult:
    """Attention computed in ``dtype`` from q ``(B, H, Sq, D)``, k/v ``(B, Hkv, Sk, D)``.

    Same semantics as ``flashcore.attention``: GQA by repeating each kv head over its ``H // Hkv``
    query heads, bottom-right causal, rows that see no key give out 0 and lse -inf. ``top_left``
    aligns the causal mask as ``flashcore.scaled_dot_product_attention`` does (see ``causal_mask``).
    """
    p, lse = probs(q, k, causal=causal, scale=scale, dtype=dtype, top_left=top_left)
    out = torch.matmul(p, _repeat_kv(v.to(dtype), q.shape[1]))
    return RefResult(out, lse)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> RefResult:
    """:func:`attention` on each sequence of a packed batch, concatenated.

    q is ``(total_q, H, D)``, k/v ``(total_k, Hkv, D)``, sequence b their rows
    ``cu_seqlens_*[b]:cu_seqlens_*[b + 1]`` (as ``flashcore.attention_varlen``). Returns out
    ``(total_q, H, D)`` and lse ``(H, total_q)`` in ``dtype``. Reads the offsets on the host.
    """
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(bounds_q) - 1):
        # (S, H, D) slices as (1, H, S, D) problems.
        q_b, k_b, v_b = (
            t[bounds[b] : bounds[b + 1]].transpose(0, 1)[None]
            for t, bounds in ((q, bounds_q), (k, bounds_k), (v, bounds_k))
        )
        ref = attention(q_b, k_b, v_b, causal=causal, scale=scale, dtype=dtype)
        outs.append(ref.out[0].transpose(0, 1))
        lses.append(ref.lse[0])
    out = torch.cat(outs) if outs else q.new_empty(q.shape, dtype=dtype)
    lse = torch.cat(lses, dim=1) if lses else q.new_empty((q.shape[1], 0), dtype=dtype)
    return RefResult(out, lse)
