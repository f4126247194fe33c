"""``torch.library`` registration of the attention ops under the ``flashcore::`` namespace.

``custom_op`` (not ``triton_op``) keeps the ops opaque to ``torch.compile`` and lets
``torch.library.opcheck`` run them through Triton's interpreter on the CPU.

Two ops carry ``flashcore.attention`` and ``flashcore.attention_varlen`` alike: ``attn_fwd`` and
its backward ``attn_bwd`` take the packing of a varlen batch as optional arguments
(``cu_seqlens_q``/``cu_seqlens_k`` None and maxima 0 for dense ``(B, H, S, D)`` inputs; packed
``(total, heads, D)`` ones otherwise), so there is one fake kernel per op, one autograd context and
one backward. Autograd: ``attn_fwd`` saves only its inputs q, k, v (with the offsets and the ALiBi
slopes, which get no gradient, and the sinks, which do) and its outputs out, lse; ``attn_bwd``
recomputes the probabilities from the LSE. The fakes derive every shape from q
(``problem.lse_shape``, the launcher's own), never from the offsets' contents. ``attn_kvcache``
(decoding from a KV cache) is inference-only: it registers no autograd formula, so a backward
through it raises PyTorch's "no autograd formula" error.

Eager calls on plain tensors skip the op dispatch (``attention``, ``attention_with_kvcache``):
the ``torch.library`` layer costs about 80 us per call on the H100 machine's host, several times
a small kernel (docs/performance_host.md, "Host overhead"). They run the same launchers directly,
through a ``torch.autograd.Function`` (``_Attention``) that saves what the op's context saves and
runs the launcher of its backward op when a gradient is needed. Anything that needs the ops
themselves (torch.compile and export tracing, FakeTensor and other dispatch modes such as
FlopCounterMode, tensor subclasses) gets them; functorch transforms get ``ops.transforms``'s
Functions, whose forward and backward are the ops.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from flashcore.ops import bwd, decode, fwd, runtime
from flashcore.ops.problem import empty_rows_like, lse_shape, unit_stride_last_dim, varlen_of

_functorch_active = torch._C._are_functorch_transforms_active
_grad_tracked = torch._C._functorch.is_gradtrackingtensor


def direct(*tensors: torch.Tensor | None) -> bool:
    """Whether a call may run the launchers directly rather than through the registered op.
    Meta tensors (q's device, which the checks made every tensor's) take the op, whose fake
    implementations give them their outputs' shapes."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or _functorch_active():
        return False
    return _PLAIN.issuperset(map(type, tensors)) and not tensors[0].is_meta


# Plain tensors and absent optional ones (not subclasses: those take the op).
_PLAIN = frozenset((torch.Tensor, type(None)))


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out, lse)`` for validated dense or packed inputs (lse ``(B, H, Sq)`` or
    ``(H, total_q)``); packed ones with ``block_table`` read k and v from paged caches
    (forward only). ``deterministic`` is for the backward (the forward always is)."""
    del deterministic
    return fwd.launch(
        q, k, v, causal, scale,
        varlen=varlen_of(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        window=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, block_table=block_table,
    )  # fmt: skip


attn_fwd = torch.library.custom_op("flashcore::attn_fwd", mutates_args=())(_attn_fwd)


@attn_fwd.register_fake
def _attn_fwd_fake(q: torch.Tensor, k, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None, *args):
    packed = cu_seqlens_q is not None
    out = empty_rows_like(q, v.shape[-1])
    return out, q.new_empty(lse_shape(q, packed), dtype=torch.float32)


def _attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``attn_fwd``: ``(dq, dk, dv, dsinks)`` from ``dout`` and, if not None,
    ``dlse``; ``dsinks`` is an empty ``(0,)`` tensor without sinks (an op returns tensors).
    ``deterministic``: bit-identical over runs (``bwd.launch``)."""
    dq, dk, dv, dsinks = bwd.launch(
        dout, q, k, v, out, lse, dlse, causal, scale,
        varlen=varlen_of(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        window=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, deterministic=deterministic,
    )  # fmt: skip
    return dq, dk, dv, _no_sinks_grad(q) if dsinks is None else dsinks


def _no_sinks_grad(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty((0,), dtype=torch.float32)


attn_bwd = torch.library.custom_op("flashcore::attn_bwd", mutates_args=())(_attn_bwd)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args):
    # After out, lse, dlse, the offsets, the 7 scalars and the slopes (a default when left out).
    sinks = args[13] if len(args) > 13 else None
    dsinks = _no_sinks_grad(q) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _save(ctx, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, scalars,
          block_table, deterministic) -> None:  # fmt: skip
    """What a backward needs, kept on ``ctx`` (the op's ``setup_context`` and ``_Attention``)."""
    ctx.deterministic = deterministic
    # The backward runs on autograd's device thread, outside the caller's use_tier block.
    ctx.tier = runtime.current_tier()
    # A paged cache (attention_varlen's block_table) has no backward; the API refuses a
    # gradient before the forward, the op's backward raises.
    ctx.paged = block_table is not None
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks)
    ctx.scalars = scalars
    # An output whose gradient is not needed (usually lse) then arrives as None instead of a
    # materialised tensor of zeros.
    ctx.set_materialize_grads(False)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, *scalars, alibi_slopes, sinks, block_table = inputs[:15]
    out, lse = output
    ctx.num_inputs = len(inputs)
    # deterministic (the last argument) may be left to its default by a direct call of the op.
    _save(
        ctx, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, tuple(scalars),
        block_table, bool(inputs[15]) if len(inputs) > 15 else False,
    )  # fmt: skip


def _saved(ctx, dout: torch.Tensor | None) -> tuple:
    """``(dout, *saved tensors)`` for a backward that has a gradient to pass on: ``dout`` with a
    unit-stride last dim, zeros where only the LSE is differentiated (delta = -dlse and dV = 0
    then, as dO = 0)."""
    if ctx.paged:
        raise NotImplementedError("attention_varlen with a block_table is forward-only")
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dout = unit_stride_last_dim(dout)
    return dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks


def _backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None):
    """``attn_fwd``'s backward formula, through the ``attn_bwd`` op."""
    check_not_batched(dout, dlse)
    return op_backward(ctx, dout, dlse)


def op_backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None, run=attn_bwd):
    """``_backward`` for gradients that may be batched, ``run`` (``attn_bwd``'s signature)
    computing them: under ``torch.func`` transforms (``ops.transforms``), whose ``vmap``
    reaches the ``attn_bwd`` op's rule."""
    # No gradient for the offsets, the maxima, the options or the ALiBi slopes; nor, after the
    # sinks', for the block table and ``deterministic``.
    no_grads = (None,) * (2 + len(ctx.scalars) + 1)
    tail = (None,) * (ctx.num_inputs - 14)
    if dout is None and dlse is None:
        return None, None, None, *no_grads, None, *tail
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks = _saved(ctx, dout)
    with runtime.use_tier(ctx.tier):
        dq, dk, dv, dsinks = run(
            dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, *ctx.scalars,
            alibi_slopes, sinks, ctx.deterministic,
        )  # fmt: skip
    return dq, dk, dv, *no_grads, None if sinks is None else dsinks, *tail


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """``attn_fwd``'s autograd formula without the op dispatch (eager calls): the same saved
    tensors and the same launchers, so the same numbers bit for bit.

    Inputs ``(q, k, v, sinks, options)``, ``options`` a tuple of the op's other arguments in
    its order and a kept forward launch or None (``attention_kept``): only q, k, v and the
    sinks take a gradient, and every argument of ``apply`` costs the call (16 arguments ~2.5
    us more than 5 on the 2-core CPU machine). ``forward`` takes ``ctx`` itself: with a
    separate ``setup_context`` every ``apply`` would bind its arguments through
    ``inspect.signature`` (tens of microseconds a call).
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, options):
        cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, alibi, table, det, run = (
            options
        )
        if run is not None:
            # A dense call (no option but a window and sinks) whose launch ops.express kept.
            output = run(q, k, v, sinks)
        else:
            output = _attn_fwd(
                q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, alibi,
                sinks, table, det,
            )  # fmt: skip
        scalars = (max_q, max_k, causal, scale, left, right, softcap)
        _save(ctx, q, k, v, *output, cu_q, cu_k, alibi, sinks, scalars, table, det)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _first_order_backward(ctx, dout, dlse)


_TWICE = (
    b"flashcore's attention backward is not differentiable: a gradient it computed under "
    b"create_graph=True was differentiated again (a second derivative, e.g. a gradient penalty), "
    b"which FlashCore does not support"
)


_BATCHED = (
    "flashcore's attention backward does not run under torch.func.vmap (a vmap over a backward: "
    "torch.autograd.grad(..., is_grads_batched=True), torch.autograd.functional.jacobian(..., "
    "vectorize=True), a vmapped autograd.grad): take the gradients one batch element at a time"
)


def check_not_batched(*grad_outputs: torch.Tensor | None) -> None:
    """A backward refuses batched gradients: a functorch transform (only a vmap reaches one: the
    forward refuses jvp, and PyTorch refuses a custom op's autograd under grad) or the legacy
    vmap of ``is_grads_batched``. Its launchers would read the batched gradient's storage, which
    PyTorch forbids with an error naming none of this."""
    if _functorch_active() or any(g is not None and _legacy_batched(g) for g in grad_outputs):
        raise NotImplementedError(_BATCHED)


_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


def first_order(backward: Callable) -> Callable:
    """An autograd Function's ``backward`` that, in a ``create_graph=True`` backward (the only
    one run with grad mode on), runs under no_grad and returns its gradients (tensors or None)
    as tensors whose differentiation raises; otherwise ``backward`` itself, one call deeper.
    ``once_differentiable`` adds that error only where a gradient reaching the backward requires
    grad (``torch.autograd.grad(out.sum(), q, create_graph=True)``'s does not), yet the
    gradients depend on q, k and v too: with it a loss built from them took them as constants,
    silently (a gradient penalty's term lost)."""

    def wrapper(ctx, *grad_outputs):
        check_not_batched(*grad_outputs)
        if not torch.is_grad_enabled():
            return backward(ctx, *grad_outputs)
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        tensors = [g.detach().requires_grad_() for g in grads if g is not None]
        if not tensors:
            return grads
        wrapped = torch._C._functions.DelayedError(_TWICE, len(tensors))(*tensors)
        wrapped = iter((wrapped,) if isinstance(wrapped, torch.Tensor) else wrapped)
        return tuple(None if g is None else next(wrapped) for g in grads)

    return functools.wraps(backward)(wrapper)


def _direct_backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple:
    """``_Attention``'s gradients ``(dq, dk, dv, dsinks, None)``: ``_backward`` calling the
    launcher that ``attn_bwd`` runs, ``bwd.launch``, itself."""
    if dout is None and dlse is None:
        return None, None, None, None, None
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks = _saved(ctx, dout)
    max_q, max_k, causal, scale, left, right, softcap = ctx.scalars
    varlen = varlen_of(cu_seqlens_q, cu_seqlens_k, max_q, max_k)
    # use_tier's context manager costs a few microseconds; the tier usually is the one in effect.
    tier = ctx.tier
    with runtime.use_tier(tier) if tier != runtime.current_tier() else _SAME_TIER:
        dq, dk, dv, dsinks = bwd.launch(
            dout, q, k, v, out, lse, dlse, causal, scale, varlen=varlen, window=(left, right),
            softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
            deterministic=ctx.deterministic,
        )  # fmt: skip
    return dq, dk, dv, dsinks, None


_first_order_backward = first_order(_direct_backward)
_SAME_TIER = contextlib.nullcontext()
# Function.apply less its Python wrapper (torch/autograd/function.py), which binds the arguments
# where a Function defines setup_context (_Attention does not), sends calls under functorch
# transforms elsewhere (``direct`` has ruled those out) and unwraps each tensor argument left
# over from a finished transform (``attention`` does, with ``_unwrap``): the C++ apply that
# wrapper ends in, ~2.4 us a call less on the 2-core CPU machine. As read in torch 2.13 (an
# older release's wrapper has the same steps but the binding); other versions take the wrapper.
_WRAPPER_READ = ("2.11.", "2.12.", "2.13.")
if torch.__version__.startswith(_WRAPPER_READ):
    _apply = super(torch.autograd.Function, _Attention).apply
else:
    _apply = _Attention.apply
_unwrap = torch._C._functorch.unwrap_if_dead
# attn_fwd's defaults of its last three arguments (sinks, block_table, deterministic).
_OP_DEFAULTS = (None, None, False)


def attention(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """``attn_fwd(*args)`` (differentiable), called directly when ``direct`` allows; ``args`` as
    ``attn_fwd`` takes them (the offsets None for dense inputs; the last three may be left to
    their defaults)."""
    if len(args) < 16:
        args = (*args, *_OP_DEFAULTS[len(args) - 13 :])
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left,
     window_right, softcap, alibi_slopes, sinks, block_table, deterministic) = args  # fmt: skip
    if not direct(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, block_table):
        if _functorch_active() and not torch.compiler.is_compiling():
            from flashcore.ops import transforms  # imports this module

            if transforms.takes_transforms():
                return transforms.attention(*args)
        return attn_fwd(*args)
    if torch.is_grad_enabled() and (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or (sinks is not None and sinks.requires_grad)
    ):
        # What Function.apply does to each tensor argument before the C++ apply: a functorch
        # wrapper whose transform has finished becomes the tensor it wraps.
        if cu_seqlens_q is not None:
            cu_seqlens_q = _unwrap(cu_seqlens_q)
        if cu_seqlens_k is not None:
            cu_seqlens_k = _unwrap(cu_seqlens_k)
        if alibi_slopes is not None:
            alibi_slopes = _unwrap(alibi_slopes)
        if sinks is not None:
            sinks = _unwrap(sinks)
        if block_table is not None:
            block_table = _unwrap(block_table)
        options = (
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left,
            window_right, softcap, alibi_slopes, block_table, deterministic, None,
        )  # fmt: skip
        return _apply(_unwrap(q), _unwrap(k), _unwrap(v), sinks, options)
    return _attn_fwd(*args)


def attention_kept(
    run: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    window: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention`` of a dense call without options but ``window`` and ``sinks`` (no offsets,
    softcap, ALiBi or ``deterministic``) that records autograd, its forward launch being
    ``run(q, k, v, sinks)`` (``ops.express``: a kept launch, or the first call's that keeps it):
    the same autograd Function, saved tensors and backward as ``attention``'s. The caller has
    checked what ``direct`` checks, the window and the sinks."""
    options = (None, None, 0, 0, causal, scale, *window, 0.0, None, None, False, run)
    return _apply(
        _unwrap(q), _unwrap(k), _unwrap(v), None if sinks is None else _unwrap(sinks), options
    )


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
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoding from a KV cache: ``(out, lse)`` for validated inputs (see ``ops.decode``)."""
    return decode.launch(
        q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, causal, scale,
        window_left, window_right, softcap, num_splits, sinks,
    )  # fmt: skip


attn_kvcache = torch.library.custom_op("flashcore::attn_kvcache", mutates_args=())(_attn_kvcache)


@attn_kvcache.register_fake
def _attn_kvcache_fake(
    q: torch.Tensor, k_cache, v_cache: torch.Tensor, *args
) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty((*q.shape[:3], v_cache.shape[-1]))
    return out, q.new_empty(lse_shape(q, False), dtype=torch.float32)


def attention_with_kvcache(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """``attn_kvcache(*args)``, called directly when ``direct`` allows and no gradient is asked
    for (the op has no autograd formula, so such a call goes through it to raise PyTorch's
    error)."""
    if direct(*args[:6], args[-1]) and not needs_grad(*args[:3]):
        return _attn_kvcache(*args)
    if _functorch_active() and any(map(_grad_tracked, args[:3])):
        # torch.func.grad differentiates through this call (its input is the transform's):
        # PyTorch's error would name the op's Function's missing setup_context.
        raise NotImplementedError(KVCACHE_NO_GRAD)
    return attn_kvcache(*args)


KVCACHE_NO_GRAD = (
    "flashcore.attention_with_kvcache has no backward (it decodes from a cache, for inference), "
    "and a torch.func transform differentiates through it: use flashcore.attention or "
    "attention_varlen for a differentiable call"
)
