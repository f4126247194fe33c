"""Isolation probes: run one stage of the forward kernel on its own.

When ``flashcore.attention`` disagrees with the reference, these say which stage is wrong. Each
probe launches a kernel from ``flashcore.kernels.probes`` built from the same ``@triton.jit``
helpers as the forward kernel (tile loads, the causal key range, score masking, the online
softmax step), with the same block sizes, and returns what that stage computed:

==========================  ===================================  ===============================
probe                       returns                              compare with
==========================  ===================================  ===============================
``probe_scores(q, k)``      ``S = scale * q @ k^T`` (fp32),      ``reference.scores``
                            -inf where a key is hidden
``probe_probs(q, k)``       normalised ``P`` (fp32) and LSE      ``reference.probs``
``probe_uniform_pv(v, ..)`` ``P @ V`` for uniform P: the mean    ``reference.attention`` with
                            of the V rows each query sees        ``q = 0``
==========================  ===================================  ===============================

If S is right and P is wrong, the online softmax (or its empty-row guard) is the culprit; if S and
P are right and the uniform P @ V is wrong, the accumulate path (rescale, second dot, V tile loads)
is. ``probe_scores`` also checks the causal tile split: tiles it calls full are computed without a
mask, so a wrong split shows as finite scores where the reference has -inf.

Inputs follow ``flashcore.attention``: q ``(B, H, Sq, D)``, k/v ``(B, Hkv, Sk, D)``, GQA, causal
bottom-right aligned, any strides, CUDA or CPU with ``TRITON_INTERPRET=1`` set before the first
call. The probes write ``Sq x Sk`` matrices, so they are for small shapes.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import NamedTuple

import torch

from flashcore.checks import (
    check_flag,
    check_inputs,
    check_scale,
    check_tensor,
)
from flashcore.ops.fwd import LOG2E, cdiv, unit_stride_last_dim
from flashcore.tuning import FwdConfig, fwd_config, head_block

__all__ = ["ProbeProbs", "probe_probs", "probe_scores", "probe_uniform_pv"]


class ProbeProbs(NamedTuple):
    probs: torch.Tensor
    """(B, H, Sq, Sk) float32 softmax of the scores; 0 for hidden keys and rows that see none."""
    lse: torch.Tensor
    """(B, H, Sq) float32 natural-log logsumexp; -inf for rows that see no key."""


@functools.cache
def kernels() -> ModuleType:
    """The probe kernels, imported (with triton) at the first probe, like ``ops.fwd.kernels``."""
    from flashcore.kernels import probes

    return probes


def is_interpreted() -> bool:
    """True when the probe kernels were defined under Triton's interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernels().probe_scores_kernel, InterpretedFunction)


def _config(t: torch.Tensor, head_dim: int) -> tuple[FwdConfig, bool]:
    interpreted = is_interpreted()
    return fwd_config(head_dim, t.element_size(), interpreted=interpreted), interpreted


def _flags(
    t: torch.Tensor, cfg: FwdConfig, interpreted: bool, seqlen_q: int, seqlen_k: int, causal: bool
) -> dict:
    head_dim = t.shape[-1]
    return {
        "HEAD_DIM": head_dim,
        "BLOCK_D": head_block(head_dim),
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "IS_CAUSAL": causal,
        "EVEN_M": seqlen_q % cfg.block_m == 0,
        "EVEN_N": seqlen_k % cfg.block_n == 0,
        "UPCAST": interpreted and t.dtype == torch.bfloat16,
        "DOT_PRECISION": "ieee" if t.dtype == torch.float32 else "tf32",
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }


def probe_scores(
    q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """Scores ``scale * q @ k^T`` as the forward kernel computes them: float32 ``(B, H, Sq, Sk)``.

    Keys a query may not see (causal, bottom-right aligned) are -inf. Validation and errors as in
    ``flashcore.attention`` (k stands in for v).
    """
    check_inputs(q, k, k)
    causal = check_flag("causal", causal)
    scale = check_scale(scale, q.shape[-1])
    q, k = unit_stride_last_dim(q), unit_stride_last_dim(k)
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    s = torch.empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.float32, device=q.device)
    if s.numel() == 0:
        return s
    cfg, interpreted = _config(q, head_dim)
    kernels().probe_scores_kernel[(cdiv(seqlen_q, cfg.block_m), batch * heads)](
        q, k, s, *q.stride(), *k.stride(), *s.stride(),
        heads, heads // kv_heads, seqlen_q, seqlen_k, scale,
        **_flags(q, cfg, interpreted, seqlen_q, seqlen_k, causal),
    )  # fmt: skip
    return s


def probe_probs(
    q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, scale: float | None = None
) -> ProbeProbs:
    """Normalised softmax of the scores and its LSE, from the forward kernel's online softmax.

    Returns ``ProbeProbs(probs, lse)``: float32 ``(B, H, Sq, Sk)`` and ``(B, H, Sq)``. Two passes
    over the keys: the first runs ``online_softmax_step`` to get each row's max and sum, the second
    writes ``exp(s - max) / sum``.
    """
    check_inputs(q, k, k)
    causal = check_flag("causal", causal)
    scale = check_scale(scale, q.shape[-1])
    q, k = unit_stride_last_dim(q), unit_stride_last_dim(k)
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    p = torch.empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    if lse.numel() == 0:
        return ProbeProbs(p, lse)
    if seqlen_k == 0:
        return ProbeProbs(p, lse.fill_(float("-inf")))
    cfg, interpreted = _config(q, head_dim)
    kernels().probe_probs_kernel[(cdiv(seqlen_q, cfg.block_m), batch * heads)](
        q, k, p, lse, *q.stride(), *k.stride(), *p.stride(), lse.stride(0), lse.stride(1),
        heads, heads // kv_heads, seqlen_q, seqlen_k, scale * LOG2E,
        **_flags(q, cfg, interpreted, seqlen_q, seqlen_k, causal),
    )  # fmt: skip
    return ProbeProbs(p, lse)


def probe_uniform_pv(
    v: torch.Tensor, *, seqlen_q: int, num_heads: int | None = None, causal: bool = False
) -> torch.Tensor:
    """``P @ V`` for uniform scores: each query's output is the mean of the V rows it sees.

    Args:
        v: ``(B, Hkv, Sk, D)`` values.
        seqlen_q: number of queries Sq (their values play no part: every score is 0).
        num_heads: query heads H, a multiple of Hkv (GQA); defaults to Hkv.
        causal: bottom-right aligned causal mask, as in ``flashcore.attention``.

    Returns:
        ``(B, H, Sq, D)`` in v's dtype; rows that see no key are 0.
    """
    v = check_tensor("v", v)
    if isinstance(seqlen_q, bool) or not isinstance(seqlen_q, int) or seqlen_q < 0:
        raise ValueError(f"seqlen_q must be a non-negative int, got {seqlen_q!r}")
    batch, kv_heads, seqlen_k, head_dim = v.shape
    heads = kv_heads if num_heads is None else num_heads
    bad = isinstance(heads, bool) or not isinstance(heads, int) or heads < 1
    if bad or kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"num_heads must be a positive multiple of v's heads ({kv_heads}), got {num_heads!r}"
        )
    out = torch.empty((batch, heads, seqlen_q, head_dim), dtype=v.dtype, device=v.device)
    # With q of the output's shape, flashcore's own checks cover head dim and device rules.
    check_inputs(out, v, v)
    causal = check_flag("causal", causal)
    v = unit_stride_last_dim(v)
    if out.numel() == 0:
        return out
    if seqlen_k == 0:
        return out.zero_()
    cfg, interpreted = _config(v, head_dim)
    kernels().probe_uniform_pv_kernel[(cdiv(seqlen_q, cfg.block_m), batch * heads)](
        v, out, *v.stride(), *out.stride(),
        heads, heads // kv_heads, seqlen_q, seqlen_k,
        **_flags(v, cfg, interpreted, seqlen_q, seqlen_k, causal),
    )  # fmt: skip
    return out
