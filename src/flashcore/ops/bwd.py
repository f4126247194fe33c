"""Backward launcher: allocates ``dq``, ``dk``, ``dv`` and delta, picks the config, launches the
preprocess, dK/dV and dQ kernels."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from flashcore.ops.fwd import alibi_arg, cdiv, is_interpreted, unit_stride_last_dim, window_bounds
from flashcore.tuning import bwd_config, head_block


@functools.cache
def kernels() -> ModuleType:
    """The backward kernel module, imported (with triton) at the first launch (see ops.fwd)."""
    from flashcore.kernels import bwd

    return bwd


def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    *,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of the forward ``(out, lse) = attn_fwd(q, k, v, causal, scale,
    window=..., softcap=..., alibi_slopes=...)`` (same options).

    ``dout`` is the gradient of ``out`` (any strides with a unit-stride last dim), ``dlse`` that of
    ``lse`` or None. Each gradient has its input's memory layout when the input is dense. The
    slopes get no gradient.
    """
    # The kernels address the head dim with unit stride (see kernels/fwd.py, Invariants).
    q, k, v, out, dout = (unit_stride_last_dim(t) for t in (q, k, v, out, dout))
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    if q.numel() == 0 or k.numel() == 0:
        # No query or no key: nothing depends on the other inputs.
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    interpreted = is_interpreted()
    cfg = bwd_config(head_dim, q.element_size(), interpreted=interpreted)
    block_d = head_block(head_dim)
    upcast = interpreted and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    bwd = kernels()
    is_causal, has_window, window_left, window_right = window_bounds(
        causal, *window, seqlen_q, seqlen_k
    )
    alibi, stride_ab = alibi_arg(alibi_slopes, lse)
    masks = dict(
        IS_CAUSAL=is_causal,
        HAS_WINDOW=has_window,
        SOFTCAP=softcap > 0,
        HAS_ALIBI=alibi_slopes is not None,
    )

    # Triton launches on the current CUDA device, not on the tensors' (a no-op on the CPU).
    with torch.cuda.device_of(q):
        bwd.attn_bwd_preprocess_kernel[(cdiv(seqlen_q, cfg.block_m2), batch * heads)](
            out, dout, dlse if dlse is not None else lse, delta,
            *out.stride()[:3], *dout.stride()[:3],
            *(dlse.stride() if dlse is not None else (0, 0, 0)),
            lse.stride(0), lse.stride(1),
            heads, seqlen_q,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_M=cfg.block_m2,
            HAS_DLSE=dlse is not None,
            EVEN_M=seqlen_q % cfg.block_m2 == 0,
            num_warps=cfg.num_warps,
        )  # fmt: skip
        bwd.attn_bwd_dkdv_kernel[(cdiv(seqlen_k, cfg.block_n1), batch * kv_heads)](
            q, k, v, dout, lse, delta, dk, dv, alibi,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3],
            *dk.stride()[:3], *dv.stride()[:3],
            lse.stride(0), lse.stride(1), stride_ab,
            kv_heads, heads // kv_heads, seqlen_q, seqlen_k, scale,
            window_left, window_right, softcap,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_M=cfg.block_m1,
            BLOCK_N=cfg.block_n1,
            **masks,
            EVEN_M=seqlen_q % cfg.block_m1 == 0,
            EVEN_N=seqlen_k % cfg.block_n1 == 0,
            UPCAST=upcast,
            DOT_PRECISION=precision,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
        bwd.attn_bwd_dq_kernel[(cdiv(seqlen_q, cfg.block_m2), batch * heads)](
            q, k, v, dout, lse, delta, dq, alibi,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3],
            *dq.stride()[:3],
            lse.stride(0), lse.stride(1), stride_ab,
            heads, heads // kv_heads, seqlen_q, seqlen_k, scale,
            window_left, window_right, softcap,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_M=cfg.block_m2,
            BLOCK_N=cfg.block_n2,
            **masks,
            EVEN_M=seqlen_q % cfg.block_m2 == 0,
            EVEN_N=seqlen_k % cfg.block_n2 == 0,
            UPCAST=upcast,
            DOT_PRECISION=precision,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
    return dq, dk, dv
