"""``torch.library`` registration of the attention ops under the ``flashcore::`` namespace.

``custom_op`` (not ``triton_op``) keeps the ops opaque to ``torch.compile`` and lets
``torch.library.opcheck`` run them through Triton's interpreter on the CPU.

Autograd: ``attn_fwd`` saves only its inputs q, k, v (and the ALiBi slopes, which get no
gradient) and its outputs out, lse; its backward is the ``attn_bwd`` op, which recomputes the
probabilities from the LSE. The mask options (``window_left``, ``window_right``, ``softcap``,
``alibi_slopes``) are ``flashcore.attention``'s, validated; their defaults are off.
``attn_varlen_fwd`` and ``attn_varlen_bwd`` are the same pair on packed variable-length batches;
they also save the cu_seqlens offsets, whose contents are never read on the host (the fake kernels
derive every shape from q alone). ``attn_kvcache`` (decoding from a KV cache) is inference-only: it
registers no autograd formula, so a backward through it raises PyTorch's "no autograd formula"
error.

Eager calls on plain tensors skip the op dispatch (``attention``, ``attention_varlen``,
``kvcache``): the ``torch.library`` layer costs about 80 us per call on the H100 machine's host,
several times a small kernel (docs/performance.md, "Host overhead"). They run the same launchers
directly, through a ``torch.autograd.Function`` with the ops' context and backward when a gradient
is needed. Anything that needs the ops themselves (torch.compile and export tracing, FakeTensor
and other dispatch modes such as FlopCounterMode, functorch transforms, tensor subclasses) gets
them.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from flashcore.ops import bwd, decode, fwd


def direct(*tensors: torch.Tensor | None) -> bool:
    """Whether a call may run the launchers directly rather than through the registered op."""
    return (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._are_functorch_transforms_active()
        and all(t is None or type(t) is torch.Tensor for t in tensors)
    )


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out, lse)`` for validated ``(B, H, Sq, D)`` / ``(B, Hkv, Sk, D)`` inputs."""
    return fwd.attn_fwd(
        q,
        k,
        v,
        causal,
        scale,
        window=(window_left, window_right),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
    )


attn_fwd = torch.library.custom_op("flashcore::attn_fwd", mutates_args=())(_attn_fwd)


@attn_fwd.register_fake
def _attn_fwd_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seqlen_q, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


def _attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``attn_fwd``: ``(dq, dk, dv)`` from ``dout`` and, if not None, ``dlse``."""
    return bwd.attn_bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dlse,
        causal,
        scale,
        window=(window_left, window_right),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
    )


attn_bwd = torch.library.custom_op("flashcore::attn_bwd", mutates_args=())(_attn_bwd)


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
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# window_left, window_right, softcap, alibi_slopes: off.
_MASK_DEFAULTS = (-1, -1, 0.0, None)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, scale, *masks = inputs
    # Trailing arguments left at their defaults may be missing from ``inputs``.
    *options, alibi_slopes = (causal, scale, *masks, *_MASK_DEFAULTS[len(masks) :])
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
    ctx.options = tuple(options)
    # An output whose gradient is not needed (usually lse) then arrives as None instead of a
    # materialised tensor of zeros.
    ctx.set_materialize_grads(False)


def _out_grad(dout: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    if dout is None:
        # Only the LSE is differentiated: delta = -dlse and dV = 0 (dO = 0).
        dout = torch.zeros_like(out)
    return fwd.unit_stride_last_dim(dout)


def _backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None, op=attn_bwd):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    # No gradient for the options, the ALiBi slopes included.
    no_grads = (None,) * (len(ctx.options) + 1)
    if dout is None and dlse is None:
        return None, None, None, *no_grads
    dout = _out_grad(dout, out)
    dq, dk, dv = op(dout, q, k, v, out, lse, dlse, *ctx.options, alibi_slopes)
    return dq, dk, dv, *no_grads


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _eager_function(forward, setup_context, backward, bwd_op) -> type[torch.autograd.Function]:
    """A registered forward op's autograd formula as a ``torch.autograd.Function``, without the
    op dispatch (eager calls): ``forward`` and ``bwd_op`` are the ops' Python functions.

    ``forward`` takes ``ctx`` itself: with a separate ``setup_context`` every ``apply`` would bind
    its arguments through ``inspect.signature`` (tens of microseconds a call).
    """

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = forward(*inputs)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        @once_differentiable
        def backward(ctx, dout, dlse):
            return backward(ctx, dout, dlse, op=bwd_op)

    return Eager


def _call(op, eager: type[torch.autograd.Function], forward, args: tuple, tensors: tuple):
    """``op(*args)``, or its Python function (through ``eager`` when a gradient is needed) when
    ``direct`` allows; ``tensors`` are the tensor arguments, q, k, v first."""
    if not direct(*tensors):
        return op(*args)
    if needs_grad(*tensors[:3]):
        return eager.apply(*args)
    return forward(*args)


_Attention = _eager_function(_attn_fwd, _setup_context, _backward, _attn_bwd)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attn_fwd`` (differentiable), called directly when ``direct`` allows."""
    args = (q, k, v, causal, scale, window_left, window_right, softcap, alibi_slopes)
    return _call(attn_fwd, _Attention, _attn_fwd, args, (q, k, v, alibi_slopes))


def _attn_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on packed ``(total_q, H, D)`` / ``(total_k, Hkv, D)``: ``(out, lse)``, with lse
    ``(H, total_q)``."""
    varlen = fwd.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return fwd.attn_fwd(
        q, k, v, causal, scale, varlen=varlen, window=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes,
    )  # fmt: skip


attn_varlen_fwd = torch.library.custom_op("flashcore::attn_varlen_fwd", mutates_args=())(
    _attn_varlen_fwd
)


@attn_varlen_fwd.register_fake
def _attn_varlen_fwd_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    total_q, heads, _ = q.shape
    return torch.empty_like(q), q.new_empty((heads, total_q), dtype=torch.float32)


def _attn_varlen_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``attn_varlen_fwd``: ``(dq, dk, dv)`` from ``dout`` and ``dlse`` (or None)."""
    varlen = fwd.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return bwd.attn_bwd(
        dout, q, k, v, out, lse, dlse, causal, scale, varlen=varlen,
        window=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
    )  # fmt: skip


attn_varlen_bwd = torch.library.custom_op("flashcore::attn_varlen_bwd", mutates_args=())(
    _attn_varlen_bwd
)


@attn_varlen_bwd.register_fake
def _attn_varlen_bwd_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, *masks = inputs
    # Trailing arguments left at their defaults may be missing from ``inputs``.
    *options, alibi_slopes = (causal, scale, *masks, *_MASK_DEFAULTS[len(masks) :])
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.options = tuple(options)
    ctx.set_materialize_grads(False)


def _varlen_backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None, op=attn_varlen_bwd):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    # cu_seqlens_q/k, max_seqlen_q/k, then the options and the ALiBi slopes: no gradient.
    none = (None,) * (4 + len(ctx.options) + 1)
    if dout is None and dlse is None:
        return None, None, None, *none
    dout = _out_grad(dout, out)
    dq, dk, dv = op(
        dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens,
        *ctx.options, alibi_slopes,
    )  # fmt: skip
    return dq, dk, dv, *none


attn_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


_VarlenAttention = _eager_function(
    _attn_varlen_fwd, _varlen_setup_context, _varlen_backward, _attn_varlen_bwd
)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attn_varlen_fwd`` (differentiable), called directly when ``direct`` allows."""
    args = (
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
        window_left, window_right, softcap, alibi_slopes,
    )  # fmt: skip
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    return _call(attn_varlen_fwd, _VarlenAttention, _attn_varlen_fwd, args, tensors)


def _attn_kvcache(
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


attn_kvcache = torch.library.custom_op("flashcore::attn_kvcache", mutates_args=())(_attn_kvcache)


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


def kvcache(
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
    """``attn_kvcache``, called directly when ``direct`` allows and no gradient is asked for
    (the op has no autograd formula, so such a call goes through it to raise PyTorch's error)."""
    args = (
        q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, causal, scale,
        window_left, window_right, softcap, num_splits,
    )  # fmt: skip
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes)
    if direct(*tensors) and not needs_grad(q, k_cache, v_cache):
        return _attn_kvcache(*args)
    return attn_kvcache(*args)
