"""Isolation probes: one stage of the forward at a time, from the real kernel and its helpers.

When ``flashcore.attention`` disagrees with the reference, these say which stage is wrong:

==============================  ===================================  ============================
probe                           returns                              compare with
==============================  ===================================  ============================
``probe_scores(q, k, ...)``     ``S``: scaled, softcapped, ALiBi     ``reference.scores``
                                scores (fp32), -inf where hidden
``probe_probs(q, k, ...)``      ``exp(S - lse)`` (fp32) with the     ``reference.probs``
                                forward kernel's own LSE
``probe_uniform_pv(v, ...)``    the forward kernel with ``q = 0``:   ``reference.attention``
                                the mean of the V rows a query sees  with ``q = 0``
==============================  ===================================  ============================

``probe_scores`` runs ``kernels/probes.py``, the forward's score stage built from the forward's
helpers with the forward's tile split (a wrong split shows as finite scores where the reference
has -inf). ``probe_probs`` normalises those scores with the LSE that the forward kernel itself
computed (``ops.fwd``): if S is right and P is wrong, the online softmax is the culprit.
``probe_uniform_pv`` is the forward kernel on zero queries, so every visible score is 0 and only
the accumulate path (rescale, P @ V, V tile loads, the final division) is left to be wrong.

Inputs and options follow ``flashcore.attention`` (validated the same way): q ``(B, H, Sq, D)``,
k/v ``(B, Hkv, Sk, D)``, GQA, ``causal`` bottom-right aligned, ``scale``, ``window``,
``softcap``, ``alibi_slopes``; CUDA, or the CPU with ``TRITON_INTERPRET=1`` set before triton is
first imported. The probes write ``Sq x Sk`` matrices, so they are for small shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashcore.checks import (
    check_alibi,
    check_flag,
    check_inputs,
    check_scale,
    check_softcap,
    check_tensor,
    check_window,
)
from flashcore.ops import fwd, runtime
from flashcore.ops import problem as pb
from flashcore.tuning import fwd_config

__all__ = ["ProbeProbs", "probe_probs", "probe_scores", "probe_uniform_pv"]


class ProbeProbs(NamedTuple):
    probs: torch.Tensor
    """(B, H, Sq, Sk) float32 softmax of the scores; 0 for hidden keys and rows that see none."""
    lse: torch.Tensor
    """(B, H, Sq) float32 natural-log logsumexp (the forward kernel's); -inf for rows that see no
    key."""


class _Options(NamedTuple):
    causal: bool
    scale: float
    window: tuple[int, int]
    softcap: float
    alibi_slopes: torch.Tensor | None


def _options(q, k, causal, scale, window, softcap, alibi_slopes) -> _Options:
    """``flashcore.attention``'s checks (k stands in for v)."""
    check_inputs(q, k, k)
    return _Options(
        check_flag("causal", causal),
        check_scale(scale, q.shape[-1]),
        check_window(window),
        check_softcap(softcap),
        check_alibi(alibi_slopes, q.shape[0], q.shape[1], q.device),
    )


def _scores(q: torch.Tensor, k: torch.Tensor, opts: _Options) -> torch.Tensor:
    q, k = pb.unit_stride_last_dim(q), pb.unit_stride_last_dim(k)
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    s = torch.empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.float32, device=q.device)
    if s.numel() == 0:
        return s
    interpreted = runtime.is_interpreted()
    cfg = fwd_config(head_dim, q.element_size(), interpreted=interpreted, seqlen_q=seqlen_q)
    # Natural units (exp_e): S comes out as the reference's quantity, not in base 2.
    sc = pb.scores(
        opts.causal, opts.window, opts.softcap, opts.scale, opts.alibi_slopes is not None,
        seqlen_q, seqlen_k, exp_e=True,
    )  # fmt: skip
    alibi, stride_ab = pb.alibi_arg(opts.alibi_slopes, s)
    with runtime.launch_on(q):
        runtime.kernel("probes", "probe_scores_kernel", 4)(
            (pb.cdiv(seqlen_q, cfg.block_m) * batch * heads,),
            (
                q, k, s, alibi, *q.stride()[:3], *k.stride()[:3], *s.stride()[:3], stride_ab,
                heads, heads // kv_heads, seqlen_q, seqlen_k, *sc.scalars(),
            ),
            dict(
                **pb.type_flags(q.dtype, head_dim, interpreted),
                **sc.flags(),
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                EVEN_M=seqlen_q % cfg.block_m == 0,
                EXP_E=True,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            ),
        )  # fmt: skip
    return s


def probe_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores as the forward kernel forms them: float32 ``(B, H, Sq, Sk)``, -inf where hidden."""
    return _scores(q, k, _options(q, k, causal, scale, window, softcap, alibi_slopes))


def probe_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> ProbeProbs:
    """``exp(S - lse)`` from ``probe_scores`` and the forward kernel's LSE (k stands in for v)."""
    opts = _options(q, k, causal, scale, window, softcap, alibi_slopes)
    s = _scores(q, k, opts)
    _, lse = fwd.launch(
        q, k, k, opts.causal, opts.scale, window=opts.window, softcap=opts.softcap,
        alibi_slopes=opts.alibi_slopes,
    )  # fmt: skip
    # Rows that see no key (lse -inf) and hidden keys (s -inf) get exactly 0, never NaN.
    empty = torch.isneginf(lse)[..., None]
    p = torch.where(empty, 0.0, torch.exp(s - torch.where(empty, 0.0, lse[..., None])))
    return ProbeProbs(p, lse)


def probe_uniform_pv(
    v: torch.Tensor, *, seqlen_q: int, num_heads: int | None = None, causal: bool = False
) -> torch.Tensor:
    """``P @ V`` for uniform scores: the forward kernel on zero queries.

    Args:
        v: ``(B, Hkv, Sk, D)`` values.
        seqlen_q: number of queries Sq (their values play no part: every score is 0).
        num_heads: query heads H, a multiple of Hkv (GQA); defaults to Hkv.
        causal: bottom-right aligned causal mask, as in ``flashcore.attention``.

    Returns:
        ``(B, H, Sq, D)`` in v's dtype: each query's mean of the V rows it sees (0 for none).
    """
    v = check_tensor("v", v)
    if isinstance(seqlen_q, bool) or not isinstance(seqlen_q, int) or seqlen_q < 0:
        raise ValueError(f"seqlen_q must be a non-negative int, got {seqlen_q!r}")
    batch, kv_heads, _, head_dim = v.shape
    heads = kv_heads if num_heads is None else num_heads
    bad = isinstance(heads, bool) or not isinstance(heads, int) or heads < 1
    if bad or kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"num_heads must be a positive multiple of v's heads ({kv_heads}), got {num_heads!r}"
        )
    q = torch.zeros((batch, heads, seqlen_q, head_dim), dtype=v.dtype, device=v.device)
    check_inputs(q, v, v)
    causal = check_flag("causal", causal)
    out, _ = fwd.launch(q, v, v, causal, 1.0)
    return out
