"""``torch.func`` support: reverse-mode transforms (``grad``, ``vjp``, ``jacrev``) through a
Function they accept, and ``vmap`` rules for the registered ops.

Under a functorch transform ``ops.registry.attention`` calls ``attention`` here instead of the
``attn_fwd`` op: PyTorch refuses an op's ``register_autograd`` formula under ``torch.func.grad``
(its generated Function takes ``ctx`` in ``forward``), while ``_FuncAttention`` has the form the
transforms take (``forward`` without ``ctx``, ``setup_context``, ``generate_vmap_rule``). Its
forward is the ``attn_fwd`` op and its backward the ``attn_bwd`` op, with the context and the
gradients of the op's own autograd formula (``registry._setup_context``,
``registry.op_backward``), so the gradients are the eager path's. The backward's op has no
autograd formula: differentiating a gradient again (``grad`` of ``grad``, ``hessian``) raises.
Forward-mode transforms (``jvp``, ``jacfwd``) are refused before this (``checks``).

vmap. ``attn_fwd`` and ``attn_bwd`` fold the vmapped dim into the batch dim of dense inputs: N
samples of a ``(B, H, S, D)`` problem run as one ``(N * B, H, S, D)`` launch (an input that is
not vmapped is repeated N times), which gives each sample exactly what the call of the folded
batch gives it. Packed batches (offsets), sinks and vmapped non-tensor arguments run one op call
per sample instead: a packed batch has no batch dim to fold into, and each sample's sinks
gradient is its own sum over its rows. ``vmap(grad(f))`` (per-sample gradients) is these two
together. ``attn_kvcache`` runs one call per sample: folding would copy a cache that is not
vmapped once per sample.
"""

from __future__ import annotations

import torch

from flashcore.ops import registry


class _FuncAttention(torch.autograd.Function):
    """``registry.attn_fwd`` with the op's autograd formula, in the form functorch transforms
    take. Inputs and outputs as the op's (``(out, lse)``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args):
        return registry.attn_fwd(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        registry._setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, dout, dlse):
        return registry.op_backward(ctx, dout, dlse, _FuncAttentionBackward.apply)


class _FuncAttentionBackward(torch.autograd.Function):
    """The ``attn_bwd`` op, for ``_FuncAttention``'s backward: under ``torch.func.grad`` the
    gradients come out of a Function one level down (the op's own autograd kernel is refused
    there, as ``attn_fwd``'s is). Not differentiable: a gradient of these gradients raises."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args):
        return registry.attn_bwd(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(registry._TWICE.decode())


def attention(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """``registry.attn_fwd(*args)`` (all 16 arguments) under functorch transforms."""
    return _FuncAttention.apply(*args)


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


def _foldable(in_dims: tuple, tensor_slots: int, *per_sample_only: object) -> bool:
    """Dense inputs whose only vmapped arguments are the first ``tensor_slots`` tensors (and the
    ALiBi slopes, handled by the caller), none of ``per_sample_only`` present."""
    return all(d is None for d in in_dims[tensor_slots:]) and all(
        x is None for x in per_sample_only
    )


def _sample_batch(q: torch.Tensor, bdim: int | None) -> int:
    """B of one sample's ``(B, H, S, D)`` q."""
    return q.shape[0] if bdim is None else q.movedim(bdim, 0).shape[1]


# The ops' arguments after the first 13 (attn_fwd) or 17 (attn_bwd): their defaults.
_FWD_TAIL = (None, None, False)  # sinks, block_table, deterministic
_BWD_TAIL = (None, False)  # sinks, deterministic


@registry.attn_fwd.register_vmap
def _attn_fwd_vmap(info, in_dims, q, k, v, cu_seqlens_q, cu_seqlens_k, *rest):
    rest = (*rest, *_FWD_TAIL[len(rest) - 8 :])
    in_dims = (*in_dims, *(None,) * (16 - len(in_dims)))
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, *rest)
    alibi, sinks, block_table = rest[7], rest[8], rest[9]
    dims = list(in_dims)
    alibi_dim, dims[12] = dims[12], None
    if cu_seqlens_q is not None or not _foldable(dims, 3, sinks, block_table):
        return _per_sample(registry.attn_fwd, info, in_dims, args)
    n = info.batch_size
    batch = _sample_batch(q, in_dims[0])
    q, k, v = (_fold(t, d, n) for t, d in zip((q, k, v), in_dims[:3], strict=True))
    rest = (*rest[:7], _alibi_folded(alibi, alibi_dim, n, batch), *rest[8:])
    out, lse = registry.attn_fwd(q, k, v, None, None, *rest)
    return (_unfold(out, n), _unfold(lse, n)), (0, 0)


@registry.attn_bwd.register_vmap
def _attn_bwd_vmap(info, in_dims, dout, q, k, v, out, lse, dlse, cu_seqlens_q, *rest):
    rest = (*rest, *_BWD_TAIL[len(rest) - 9 :])
    in_dims = (*in_dims, *(None,) * (19 - len(in_dims)))
    args = (dout, q, k, v, out, lse, dlse, cu_seqlens_q, *rest)
    alibi, sinks = rest[8], rest[9]
    dims = list(in_dims)
    alibi_dim, dims[16] = dims[16], None
    if cu_seqlens_q is not None or not _foldable(dims, 7, sinks):
        return _per_sample(registry.attn_bwd, info, in_dims, args)
    n = info.batch_size
    batch = _sample_batch(q, in_dims[1])
    tensors = (_fold(a, b, n) for a, b in zip(args[:7], in_dims[:7], strict=True))
    rest = (*rest[:8], _alibi_folded(alibi, alibi_dim, n, batch), *rest[9:])
    dq, dk, dv, dsinks = registry.attn_bwd(*tensors, None, *rest)
    return (_unfold(dq, n), _unfold(dk, n), _unfold(dv, n), dsinks), (0, 0, 0, None)


@registry.attn_kvcache.register_vmap
def _attn_kvcache_vmap(info, in_dims, *args):
    # One call a sample: folding would repeat a cache that is not vmapped once per sample.
    return _per_sample(registry.attn_kvcache, info, in_dims, args)
