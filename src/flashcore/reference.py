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


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device | str = "cpu",
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    top_left: bool = False,
) -> torch.Tensor:
    """``mask[i, j]`` is True iff query i sees key j under the causal mask and the window.

    With ``d = seqlen_k - seqlen_q`` (0 with ``top_left``): causal hides ``j > i + d``; a window
    ``(left, right)`` hides ``j < i + d - left`` and ``j > i + d + right``, -1 meaning unbounded
    on that side; with ``causal`` the right side is 0 whatever the window says (FlashAttention-2).
    """
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = 0 if top_left else seqlen_k - seqlen_q
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    if left >= 0:
        mask &= j >= i + diag - left
    if right >= 0:
        mask &= j <= i + diag + right
    return mask


def alibi_bias(
    slopes: torch.Tensor,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    *,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """ALiBi's ``-slope * |i + Sk - Sq - j|`` as ``(B, H, Sq, Sk)`` (broadcast over B for ``(H,)``
    slopes), in ``dtype``."""
    device = slopes.device
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    dist = (i + (seqlen_k - seqlen_q) - j).abs().to(dtype)
    slopes = slopes.to(dtype).expand(batch, slopes.shape[-1])
    return -slopes[:, :, None, None] * dist


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
    top_left: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scores the softmax sees, in ``dtype``, ``(B, H, Sq, Sk)``.

    ``s = scale * q @ k^T``; with ``softcap`` c > 0 then ``c * tanh(s / c)``; with
    ``alibi_slopes`` then ``- slope * |i + Sk - Sq - j|`` (``alibi_bias``); finally -inf where the
    causal mask or the window (``visible_mask``) hides a key. q is ``(B, H, Sq, D)``, k is
    ``(B, Hkv, Sk, D)``; scale defaults to ``1 / sqrt(D)``; softcap None or 0 is off.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    k = _repeat_kv(k.to(dtype), q.shape[1])
    s = torch.matmul(q.to(dtype), k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if alibi_slopes is not None:
        bias = alibi_bias(alibi_slopes, q.shape[0], seqlen_q, seqlen_k, dtype=dtype)
        s = s + bias.to(s.device)
    if causal or window is not None:
        mask = visible_mask(
            seqlen_q, seqlen_k, q.device, causal=causal, window=window, top_left=top_left
        )
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
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> ProbsResult:
    """Softmax of :func:`scores` along the keys, and its logsumexp, in ``dtype``.

    With ``sinks`` (``(H,)``) each row's softmax has one more logit, ``sinks[h]``, which takes
    probability mass but is not among the returned keys (attention sinks): the probabilities of
    a row sum to less than 1 and the logsumexp includes the sink.
    """
    s = scores(
        q,
        k,
        causal=causal,
        scale=scale,
        dtype=dtype,
        top_left=top_left,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
    )
    if sinks is None:
        lse = torch.logsumexp(s, dim=-1)
    else:
        sink = sinks.to(device=s.device, dtype=dtype)[None, :, None, None]
        lse = torch.logsumexp(torch.cat((s, sink.expand(*s.shape[:-1], 1)), dim=-1), dim=-1)
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
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> RefResult:
    """Attention computed in ``dtype`` from q ``(B, H, Sq, D)``, k/v ``(B, Hkv, Sk, D)``.

    Same semantics as ``flashcore.attention``: GQA by repeating each kv head over its ``H // Hkv``
    query heads, bottom-right causal, sliding window, softcap, ALiBi (see ``scores``), sinks (see
    ``probs``), rows that see no key give out 0 and lse -inf (the sink with sinks). ``top_left``
    aligns the causal mask as ``flashcore.scaled_dot_product_attention`` does (see
    ``causal_mask``).
    """
    p, lse = probs(
        q,
        k,
        causal=causal,
        scale=scale,
        dtype=dtype,
        top_left=top_left,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
    )
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
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> RefResult:
    """:func:`attention` on each sequence of a packed batch, concatenated.

    ``window``, ``softcap`` as in :func:`attention`, per sequence; ``alibi_slopes`` ``(H,)`` or
    ``(B, H)`` with B the number of sequences (row b for sequence b).

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
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        ref = attention(
            q_b, k_b, v_b, causal=causal, scale=scale, window=window, softcap=softcap,
            alibi_slopes=slopes, sinks=sinks, dtype=dtype,
        )  # fmt: skip
        outs.append(ref.out[0].transpose(0, 1))
        lses.append(ref.lse[0])
    out = torch.cat(outs) if outs else q.new_empty((*q.shape[:2], v.shape[-1]), dtype=dtype)
    lse = torch.cat(lses, dim=1) if lses else q.new_empty((q.shape[1], 0), dtype=dtype)
    return RefResult(out, lse)


# ---- KV-cache decoding (flashcore.attention_with_kvcache) ----------------------------------------


def gather_kvcache(
    cache: torch.Tensor, b: int, seqlen: int, block_table: torch.Tensor | None
) -> torch.Tensor:
    """Sequence b's first ``seqlen`` keys (or values) as a dense ``(Hkv, seqlen, D)`` tensor.

    Contiguous cache ``(B, Hkv, S_max, D)``, or paged ``(num_blocks, Hkv, block_size, D)`` with key
    j in block ``block_table[b, j // block_size]``, row ``j % block_size``.
    """
    if block_table is None:
        return cache[b, :, :seqlen]
    block_size = cache.shape[2]
    j = torch.arange(seqlen, device=cache.device)
    blocks = block_table[b].long()[j // block_size]
    return cache[blocks, :, j % block_size].transpose(0, 1)


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> RefResult:
    """``flashcore.attention_with_kvcache`` in ``dtype``: each sequence's valid keys gathered
    dense, then :func:`attention` on them (the queries are the last Sq positions of a sequence of
    ``cache_seqlens[b]`` keys: bottom-right alignment, as there). ``alibi_slopes`` is ``(H,)`` or
    ``(B, H)``.
    """
    batch, heads, seqlen_q, _ = q.shape
    out = torch.zeros((*q.shape[:3], v_cache.shape[-1]), dtype=dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=dtype, device=q.device)
    for b in range(batch):
        seqlen = int(cache_seqlens[b])
        k = gather_kvcache(k_cache, b, seqlen, block_table)
        v = gather_kvcache(v_cache, b, seqlen, block_table)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        ref = attention(
            q[b][None], k[None], v[None], causal=causal, scale=scale, window=window,
            softcap=softcap, alibi_slopes=slopes, sinks=sinks, dtype=dtype,
        )  # fmt: skip
        out[b], lse[b] = ref.out[0], ref.lse[0]
    return RefResult(out, lse)
