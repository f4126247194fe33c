"""``torch.func`` support: reverse-mode transforms (``grad``, ``vjp``, ``jacrev``) and
``vmap``, per-sample gradients (``vmap(grad(f))``) included.

Under a functorch transform ``ops.registry.attention`` calls ``attention`` here instead of the
``attn_fwd`` op: PyTorch refuses an op's ``register_autograd`` formula under ``torch.func.grad``
(its generated Function takes ``ctx`` in ``forward``). ``_FuncAttention`` has the form the
transforms take (``forward`` without ``ctx``, ``setup_context``, a ``vmap`` rule): its forward is
the ``attn_fwd`` op, its context and gradients those of the op's own formula
(``registry._setup_context``, ``registry.op_backward``), so the gradients are the eager path's.
Its backward computes them through ``_FuncAttentionBackward`` (the ``attn_bwd`` op), a Function
too, since under ``grad`` the backward runs on the transform's tensors; that one has no
derivative: differentiating a gradient again (``grad`` of ``grad``, ``hessian``) raises, as it
does eagerly. Forward-mode transforms (``jvp``, ``jacfwd``) are refused before this (``checks``);
under ``functionalize`` the op runs as before (``takes_transforms``).

vmap. Both Functions, and the ``attn_fwd`` and ``attn_bwd`` ops themselves (called under vmap
directly), fold the vmapped dim into the batch dim of dense inputs: N
samples of a ``(B, H, S, D)`` problem run as one ``(N * B, H, S, D)`` launch (an input that is
not vmapped is repeated N times), which gives each sample exactly what the call of the folded
batch gives it. Packed batches (offsets), paged caches and sinks run one call per sample
instead: a packed batch has no batch dim to fold into, and each sample's sinks gradient is its
own sum over its rows. ``attn_kvcache`` runs one call per sample: folding would copy a cache
that is not vmapped once per sample. The Functions take the ops' non-tensor arguments as one
``_Scalars`` argument, since functorch flattens every argument of every call as a pytree.
"""

from __future__ import annotations

import torch

from flashcore.ops import registry, runtime


class _Scalars:
    """The ops' non-tensor arguments (max_q, max_k, causal, scale, window_left, window_right,
    softcap, deterministic) as one argument of the Functions below: functorch flattens every
    argument of a Function's call as a pytree, several times a call at each level, and an
    object it does not know is one leaf (with the ops' 16 arguments, a vmapped forward took
    2.2x the host time on the 2-core CPU machine)."""

    __slots__ = ("values",)

    def __init__(self, values: tuple):
        self.values = values


def _fwd_split(args: tuple) -> tuple:
    """``attn_fwd``'s 16 arguments as ``_FuncAttention`` takes them: ``(q, k, v, cu_seqlens_q,
    cu_seqlens_k, alibi_slopes, sinks, block_table, scalars)``."""
    return (*args[:5], args[12], args[13], args[14], _Scalars((*args[5:12], args[15])))


def _bwd_split(args: tuple) -> tuple:
    """``attn_bwd``'s 19 arguments as ``_FuncAttentionBackward`` takes them: ``(dout, q, k, v,
    out, lse, dlse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, scalars)``."""
    return (*args[:9], args[16], args[17], _Scalars((*args[9:16], args[18])))


def _fwd_args(q, k, v, cu_q, cu_k, alibi, sinks, table, scalars: _Scalars) -> tuple:
    """``attn_fwd``'s 16 arguments in its order (``_fwd_split`` undone)."""
    max_q, max_k, causal, scale, left, right, softcap, deterministic = scalars.values
    return (
        q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, alibi, sinks,
        table, deterministic,
    )  # fmt: skip


class _FuncAttention(torch.autograd.Function):
    """``registry.attn_fwd`` with the op's autograd formula, in the form functorch transforms
    take: inputs ``(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, block_table,
    scalars)``, outputs ``(out, lse)``."""

    @staticmethod
    def forward(*args):
        return registry.attn_fwd(*_fwd_args(*args))

    @staticmethod
    def setup_context(ctx, inputs, output):
        registry._setup_context(ctx, _fwd_args(*inputs), output)

    @staticmethod
    def backward(ctx, dout, dlse):
        grads = registry.op_backward(ctx, dout, dlse, _backward)
        return (*grads[:3], None, None, None, grads[13], None, None)

    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_forward(_FuncAttention.apply, info, in_dims, *args)


def _backward(*args):
    """``attn_bwd``'s signature, for ``registry.op_backward``: through
    ``_FuncAttentionBackward``."""
    return _FuncAttentionBackward.apply(*_bwd_split(args))


class _FuncAttentionBackward(torch.autograd.Function):
    """The ``attn_bwd`` op, for ``_FuncAttention``'s backward: under ``torch.func.grad`` the
    gradients come out of a Function one level down (the op's own autograd kernel is refused
    there, as ``attn_fwd``'s is). Inputs ``(dout, q, k, v, out, lse, dlse, cu_seqlens_q,
    cu_seqlens_k, alibi_slopes, sinks, scalars)``, outputs ``(dq, dk, dv, dsinks)``. Not
    differentiable: a gradient of these gradients raises."""

    @staticmethod
    def forward(dout, q, k, v, out, lse, dlse, cu_q, cu_k, alibi, sinks, scalars):
        max_q, max_k, causal, scale, left, right, softcap, deterministic = scalars.values
        return registry.attn_bwd(
            dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, causal, scale, left, right,
            softcap, alibi, sinks, deterministic,
        )  # fmt: skip

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(registry._TWICE.decode())

    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_backward(_FuncAttentionBackward.apply, info, in_dims, *args)


def takes_transforms() -> bool:
    """Whether the functorch transforms in effect are ones ``attention`` takes: grad and vmap
    (jvp is refused before this). Under ``torch.func.functionalize`` PyTorch has no rule for a
    Function (NYI), and the ``attn_fwd`` op, which mutates nothing, runs unchanged."""
    return not runtime.transform_active("Functionalize")


def attention(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """``registry.attn_fwd(*args)`` (its 16 arguments) under functorch transforms."""
    return _FuncAttention.apply(*_fwd_split(args))


def _fold(t: torch.Tensor | None, bdim: int | None, n: int) -> torch.Tensor | None:
    """``t`` with its vmapped dim (``bdim``; repeated ``n`` times where None) merged into its
    first dim: ``(N * B, ...)``."""
    if t is None:
        return None
    t = t.unsqueeze(0).expand(n, *t.shape) if bdim is None else t.movedim(bdim, 0)
    return t.reshape(n * t.shape[1], *t.shape[2:])


def _unfold(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.reshape(n, t.shape[0] // n, *t.shape[1:])


def _per_sample(op, info, in_dims: tuple, args: tuple) -> tuple[tuple, tuple]:
    """``op`` once per vmapped sample, results stacked along dim 0."""
    results = []
    for i in range(info.batch_size):
        sample = [a if d is None else a.select(d, i) for a, d in zip(args, in_dims, strict=True)]
        results.append(op(*sample))
    outputs = tuple(torch.stack(parts) for parts in zip(*results, strict=True))
    return outputs, (0,) * len(outputs)


def _alibi_folded(alibi: torch.Tensor | None, bdim: int | None, n: int, batch: int):
    """ALiBi slopes ``(H,)`` or ``(B, H)`` for the folded batch: ``(H,)`` kept where no sample
    has its own, ``(N * B, H)`` otherwise."""
    if alibi is None or (bdim is None and alibi.dim() == 1):
        return alibi
    if bdim is not None:
        alibi = alibi.movedim(bdim, 0)
        if alibi.dim() == 2:  # (N, H): one row of slopes a sample, for each of its B
            alibi = alibi.unsqueeze(1).expand(n, batch, alibi.shape[-1])
        return alibi.reshape(n * batch, alibi.shape[-1])
    return _fold(alibi, None, n)


def _sample_batch(q: torch.Tensor, bdim: int | None) -> int:
    """B of one sample's ``(B, H, S, D)`` q."""
    return q.shape[0] if bdim is None else q.movedim(bdim, 0).shape[1]


def _vmap_forward(apply, info, in_dims, q, k, v, cu_q, cu_k, alibi, sinks, table, scalars):
    """vmap of ``apply`` (``_FuncAttention``'s arguments, ``(out, lse)``): dense inputs folded
    (a dense call's only tensors are q, k, v and the slopes), the rest per sample."""
    args = (q, k, v, cu_q, cu_k, alibi, sinks, table, scalars)
    if cu_q is not None or sinks is not None or table is not None:
        return _per_sample(apply, info, in_dims, args)
    n, batch = info.batch_size, _sample_batch(q, in_dims[0])
    q, k, v = (_fold(t, d, n) for t, d in zip(args[:3], in_dims[:3], strict=True))
    out, lse = apply(q, k, v, None, None, _alibi_folded(alibi, in_dims[5], n, batch), None, None,
                     scalars)  # fmt: skip
    return (_unfold(out, n), _unfold(lse, n)), (0, 0)


def _vmap_backward(apply, info, in_dims, *args):
    """vmap of ``apply`` (``_FuncAttentionBackward``'s arguments, ``(dq, dk, dv, dsinks)``), as
    ``_vmap_forward``; without sinks, dsinks is the same empty tensor for every sample."""
    q, cu_q, alibi, sinks, scalars = args[1], args[7], args[9], args[10], args[11]
    if cu_q is not None or sinks is not None:
        return _per_sample(apply, info, in_dims, args)
    n, batch = info.batch_size, _sample_batch(q, in_dims[1])
    tensors = (_fold(t, d, n) for t, d in zip(args[:7], in_dims[:7], strict=True))
    alibi = _alibi_folded(alibi, in_dims[9], n, batch)
    dq, dk, dv, dsinks = apply(*tensors, None, None, alibi, None, scalars)
    return (_unfold(dq, n), _unfold(dk, n), _unfold(dv, n), dsinks), (0, 0, 0, None)


# The ops' arguments after the first 13 (attn_fwd) or 17 (attn_bwd): their defaults.
_FWD_TAIL = (None, None, False)  # sinks, block_table, deterministic
_BWD_TAIL = (None, False)  # sinks, deterministic


# The registered ops called under vmap directly (``torch.ops.flashcore``): the same rules, their
# arguments in the ops' order (the vmapped dims too; a non-tensor is never vmapped).
@registry.attn_fwd.register_vmap
def _attn_fwd_vmap(info, in_dims, *args):
    args = (*args, *_FWD_TAIL[len(args) - 13 :])
    dims = _fwd_split((*in_dims, *(None,) * (16 - len(in_dims))))[:8]
    return _vmap_forward(_FuncAttention.forward, info, (*dims, None), *_fwd_split(args))


@registry.attn_bwd.register_vmap
def _attn_bwd_vmap(info, in_dims, *args):
    args = (*args, *_BWD_TAIL[len(args) - 17 :])
    dims = _bwd_split((*in_dims, *(None,) * (19 - len(in_dims))))[:11]
    return _vmap_backward(_FuncAttentionBackward.forward, info, (*dims, None), *_bwd_split(args))


@registry.attn_kvcache.register_vmap
def _attn_kvcache_vmap(info, in_dims, *args):
    # One call a sample: folding would repeat a cache that is not vmapped once per sample.
    return _per_sample(registry.attn_kvcache, info, in_dims, args)
