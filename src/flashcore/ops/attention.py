"""``torch.library`` registration of the attention ops under the ``flashcore::`` namespace.

``custom_op`` (not ``triton_op``) keeps the ops opaque to ``torch.compile`` and lets
``torch.library.opcheck`` run them through Triton's interpreter on the CPU.

Autograd: ``attn_fwd`` saves only its inputs q, k, v and its outputs out, lse; its backward is the
``attn_bwd`` op, which recomputes the probabilities from the LSE. ``attn_kvcache`` (decoding from
a KV cache) is inference-only: it registers no autograd formula, so a backward through it raises
PyTorch's "no autograd formula" error.
"""

from __future__ import annotations

import torch

from flashcore.ops import bwd, decode, fwd


@torch.library.custom_op("flashcore::attn_fwd", mutates_args=())
def attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out, lse)`` for validated ``(B, H, Sq, D)`` / ``(B, Hkv, Sk, D)`` inputs."""
    return fwd.attn_fwd(q, k, v, causal, scale)


@attn_fwd.register_fake
def _attn_fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seqlen_q, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flashcore::attn_bwd", mutates_args=())
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``attn_fwd``: ``(dq, dk, dv)`` from ``dout`` and, if not None, ``dlse``."""
    return bwd.attn_bwd(dout, q, k, v, out, lse, dlse, causal, scale)


@attn_bwd.register_fake
def _attn_bwd_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal = causal
    ctx.scale = scale
    # An output whose gradient is not needed (usually lse) then arrives as None instead of a
    # materialised tensor of zeros.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None and dlse is None:
        return None, None, None, None, None
    if dout is None:
        # Only the LSE is differentiated: delta = -dlse and dV = 0 (dO = 0).
        dout = torch.zeros_like(out)
    dout = fwd.unit_stride_last_dim(dout)
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, dlse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("flashcore::attn_kvcache", mutates_args=())
def attn_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoding from a KV cache: ``(out, lse)`` for validated inputs (see ``ops.decode``)."""
    return decode.attn_decode(
        q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, causal, scale,
        window_left, window_right, softcap, num_splits,
    )  # fmt: skip


@attn_kvcache.register_fake
def _attn_kvcache_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seqlen_q, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
