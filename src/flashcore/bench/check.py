"""Correctness of every provider against ``flashcore.reference``, before it is timed.

The reference runs once per (case, dtype) and serves every provider and mode: in float64 on the
CPU, in float32 on a GPU (float64 would double the memory of the ``Sq x Sk`` scores for no
visible gain against fp16/bf16 errors). It is computed in chunks of heads so that the scores of a
chunk stay under a memory budget (a 16k x 16k fp32 score matrix is 1 GiB per head).

The verdict is FlashAttention's rule, as in the tests: ``max|x - ref| <= 2 * max|pt - ref| + floor``
where ``pt`` is the same reference math in the inputs' dtype and ``floor`` one unit roundoff of the
dtype at the reference's scale. The reported relative error is ``max|x - ref| / max|ref|``.

A varlen case's reference is on its packed tokens: each sequence as its own ``(1, H, S_b, D)``
problem (``flashcore.reference.attention_varlen``'s definition, here under the memory budget),
concatenated. Providers on the padded batch are checked on the real tokens only.

A provider with attention sinks (``flashcore-sinks``) gets a reference of its own, with the same
sinks (``flashcore.reference``'s definition); in backward modes it includes their gradient,
``dsinks``, checked by the same rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch

from flashcore import reference

GRAD_NAMES = ("dq", "dk", "dv")
SINKS_GRAD = "dsinks"


class Reference(NamedTuple):
    """Reference results for one (case, dtype); ``ref`` in the reference dtype, ``pt`` in the
    inputs' dtype. Gradients (dq, dk, dv, and dsinks with sinks) are present when a backward mode
    is benchmarked."""

    out: torch.Tensor
    pt_out: torch.Tensor
    grads: tuple[torch.Tensor, ...] | None
    pt_grads: tuple[torch.Tensor, ...] | None


class TensorError(NamedTuple):
    err: float
    """max|x - ref| (inf when x has NaN or a wrong shape)."""
    pt_err: float
    """max|pt - ref|: what plain PyTorch math in the inputs' dtype gets."""
    ref_max: float
    floor: float
    """One unit roundoff of the checked dtype at the reference's scale."""

    @property
    def bound(self) -> float:
        return 2 * self.pt_err + self.floor

    @property
    def ok(self) -> bool:
        return self.err <= self.bound

    @property
    def rel(self) -> float:
        return self.err / self.ref_max if self.ref_max > 0 else self.err


def head_chunks(
    batch: int, heads: int, kv_heads: int, per_head_bytes: int, budget_bytes: int
) -> Iterator[tuple[int, slice, slice]]:
    """``(b, q_heads, kv_heads)`` slices covering every head, each under the budget.

    A chunk never splits a GQA group across two kv slices: it holds whole groups, or a divisor of
    one group (then its kv slice is that group's single head).
    """
    group = heads // kv_heads
    n = max(1, budget_bytes // max(per_head_bytes, 1))
    if n >= group:
        n = min(heads, n - n % group)
    else:
        n = max(d for d in range(1, n + 1) if group % d == 0)
    for b in range(batch):
        for h0 in range(0, heads, n):
            h1 = min(h0 + n, heads)
            yield b, slice(h0, h1), slice(h0 // group, (h1 - 1) // group + 1)


def compute_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor | None,
    *,
    causal: bool,
    ref_dtype: torch.dtype,
    budget_bytes: int = 1 << 30,
    sinks: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
) -> Reference:
    """Reference output (and gradients for the upstream gradient ``do``, when given) of q
    ``(B, H, Sq, D)``, k ``(B, Hkv, Sk, D)``, v ``(B, Hkv, Sk, Dv)``; ``sinks`` ``(H,)`` adds
    attention sinks (and ``dsinks`` to the gradients); ``window`` a local window, as
    ``flashcore.attention`` takes it."""
    batch, heads, seqlen_q, _ = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    out_shape = (*q.shape[:3], v.shape[-1])
    per_head = seqlen_q * seqlen_k * torch.finfo(ref_dtype).bits // 8
    results = {}
    for dtype in (ref_dtype, q.dtype):
        out = torch.empty(out_shape, dtype=dtype, device=q.device)
        grads = None
        if do is not None:
            grads = (
                torch.empty(q.shape, dtype=dtype, device=q.device),
                torch.zeros(k.shape, dtype=dtype, device=q.device),
                torch.zeros(v.shape, dtype=dtype, device=q.device),
            )
            if sinks is not None:
                grads += (torch.zeros(sinks.shape, dtype=dtype, device=q.device),)
        for b, hq, hkv in head_chunks(batch, heads, kv_heads, per_head, budget_bytes):
            chunk = [q[b : b + 1, hq], k[b : b + 1, hkv], v[b : b + 1, hkv]]
            if sinks is not None:
                chunk.append(sinks[hq])
            if do is None:
                with torch.no_grad():
                    out[b : b + 1, hq] = _attention(chunk, causal, dtype, window)
                continue
            leaves = [t.detach().to(dtype).requires_grad_() for t in chunk]
            oc = _attention(leaves, causal, dtype, window)
            oc.backward(do[b : b + 1, hq].to(dtype))
            out[b : b + 1, hq] = oc.detach()
            grads[0][b : b + 1, hq] = leaves[0].grad
            # Several chunks share a kv head when a chunk holds part of a GQA group.
            grads[1][b : b + 1, hkv] += leaves[1].grad
            grads[2][b : b + 1, hkv] += leaves[2].grad
            if sinks is not None:
                grads[3][hq] += leaves[3].grad  # summed over the batch
        results[dtype] = (out, grads)
    (out, grads), (pt_out, pt_grads) = results[ref_dtype], results[q.dtype]
    return Reference(out, pt_out, grads, pt_grads)


def _attention(
    tensors: list[torch.Tensor], causal: bool, dtype: torch.dtype, window: tuple[int, int] | None
) -> torch.Tensor:
    """``reference.attention`` of ``[q, k, v]`` or ``[q, k, v, sinks]``."""
    q, k, v, *sinks = tensors
    return reference.attention(
        q, k, v, causal=causal, dtype=dtype, sinks=sinks[0] if sinks else None, window=window
    ).out


def compute_reference_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor | None,
    seqlens: tuple[int, ...],
    *,
    causal: bool,
    ref_dtype: torch.dtype,
    budget_bytes: int = 1 << 30,
    window: tuple[int, int] | None = None,
) -> Reference:
    """:func:`compute_reference` of packed q ``(total, H, D)``, k/v ``(total, Hkv, D)`` whose
    sequence b has ``seqlens[b]`` tokens (queries and keys); results packed the same way."""
    parts = []
    start = 0
    for n in seqlens:
        q_b, k_b, v_b, do_b = (
            None if t is None else t[start : start + n].transpose(0, 1)[None] for t in (q, k, v, do)
        )
        parts.append(
            compute_reference(
                q_b,
                k_b,
                v_b,
                do_b,
                causal=causal,
                ref_dtype=ref_dtype,
                budget_bytes=budget_bytes,
                window=window,
            )
        )
        start += n

    def packed(pick) -> torch.Tensor:
        return torch.cat([pick(p)[0].transpose(0, 1) for p in parts])

    out, pt_out = packed(lambda p: p.out), packed(lambda p: p.pt_out)
    if do is None:
        return Reference(out, pt_out, None, None)
    grads = tuple(packed(lambda p, i=i: p.grads[i]) for i in range(3))
    pt_grads = tuple(packed(lambda p, i=i: p.pt_grads[i]) for i in range(3))
    return Reference(out, pt_out, grads, pt_grads)


def compare(x: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor) -> TensorError:
    """FlashAttention's rule for one tensor of a provider (x) against the reference."""
    ref_max = ref.abs().max().item() if ref.numel() else 0.0
    pt_err = (pt.to(ref.dtype) - ref).abs().max().item() if ref.numel() else 0.0
    floor = torch.finfo(pt.dtype).eps * max(ref_max, 1.0)
    if x.shape != ref.shape:
        return TensorError(math.inf, pt_err, ref_max, floor)
    err = (x.detach().to(ref.dtype) - ref).abs().max().item() if ref.numel() else 0.0
    return TensorError(math.inf if math.isnan(err) else err, pt_err, ref_max, floor)
