"""Eager calls by signature: a repeated call skips the checks and the plan lookups of its first.

An eager ``flashcore.attention`` or ``flashcore.attention_with_kvcache`` call spends most of its
host time before its launch: the input checks, the registry's dispatch, the normalisation of
strides, the plan keys of the launcher (each a tuple of shapes, strides, dtypes and options,
hashed per call) and the tier's choice. Each of those is a function of the call's signature:
the type, shape, strides, dtype and device of every tensor argument and the values of the
options. This module keys a call by exactly that signature, once, and keeps what its first call
launched (``ops.fwd.learned``, ``ops.decode.learned``): a later call of the same signature
allocates its outputs and launches the kept plan, and nothing else.

Sound because every check the API makes of these calls depends only on what the key holds, so
a key seen before is a key that passed them: a call whose key is new, or that differs in
anything the key leaves out, takes the full path (``forward`` and ``decode`` return None).
What a key leaves out and is therefore checked per call, each under a microsecond:

- the options other than ``causal``, ``scale`` (None or a float) and, for decoding,
  ``num_splits`` (None or an int): any other option given takes the full path, as does a flag
  that is not a ``bool`` or a scale of another type (the full path raises or converts);
- autograd: a call that records a graph (grad mode on and a tensor that requires grad), and
  the dispatch states ``ops.registry.direct`` sends to the registered ops (torch.compile
  tracing, dispatch modes, functorch transforms, tensor subclasses: the key holds each
  tensor's exact type);
- CUDA graphs: a call being captured (or under ``flashcore.warmup``'s ``as_captured``) plans
  as a capture does; under ``flashcore.checked()`` the API reads values and does not ask;
- the device: the launch goes to the current device, which must be the tensors';
- alignment: the forward's plans hold for 16-byte aligned addresses.

The tier in effect (``use_tier``) is part of the key. A launch is kept only where it depends on
nothing else: dense tensors used as given (none copied for its strides), aligned, a problem
that launches (not an empty one). Measured on the H200 machine's host: docs/performance_host.md,
"Eager calls by signature".
"""

from __future__ import annotations

import torch

from flashcore.ops import decode as _decode
from flashcore.ops import fwd as _fwd
from flashcore.ops import runtime

_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_dispatch_depth = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_current_device = torch.cuda.current_device


def _plain_call(t: torch.Tensor) -> bool:
    """What every kept launch needs of the call beyond its key (module docstring): no dispatch
    state that sends it to the registered ops, no capture, ``t``'s device the current one."""
    if _compiling() or _dispatch_depth() or _functorch_active() or runtime.capturing(t):
        return False
    return not t.is_cuda or t.get_device() == _current_device()


def _options_plain(causal: object, scale: object, return_lse: object) -> bool:
    return (
        type(causal) is bool
        and type(return_lse) is bool
        and (scale is None or type(scale) is float)
    )


def forward_key(q: object, k: object, v: object, causal: object, scale: object) -> tuple | None:
    """The key of a dense ``attention`` call with only these arguments (and ``return_lse``,
    which changes no launch), or None where the call cannot take a kept launch: not three plain
    tensors, one of them recording autograd, or a state ``_plain_call`` excludes."""
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return None
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    if not _plain_call(q):
        return None
    return (
        q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
        v.shape, v.stride(), v.dtype, v.device, causal, scale, runtime.current_tier(),
    )  # fmt: skip


def forward(
    q: object, k: object, v: object, causal: object, scale: object, return_lse: object
) -> tuple[tuple | None, tuple | None]:
    """``(key, (out, lse))`` where a call of this signature was learned (and its tensors are
    aligned), ``(key, None)`` otherwise: the caller checks the inputs and calls ``forward_first``
    with the key (None where the call cannot take a kept launch)."""
    if not _options_plain(causal, scale, return_lse):
        return None, None
    key = forward_key(q, k, v, causal, scale)
    if key is None:
        return None, None
    run = _fwd.learned(key)
    if run is None or (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
        return key, None
    return key, run(q, k, v)


def forward_first(
    key: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A checked call of ``forward``'s key (``scale`` resolved): the launch the registry's
    direct path makes for it (``ops.registry.attention`` without autograd), kept under the key."""
    return _fwd.launch(q, k, v, causal, scale, learn=key)


def decode_key(
    q: object,
    k_cache: object,
    v_cache: object,
    cache_seqlens: object,
    block_table: object,
    causal: object,
    scale: object,
    num_splits: object,
    return_lse: object,
) -> tuple | None:
    """The key of an ``attention_with_kvcache`` call with only these arguments, or None where it
    cannot take a kept launch (as ``forward_key``). Not under ``flashcore.checked()``, which
    reads the lengths and the block table each call: the caller does not ask then."""
    if not _options_plain(causal, scale, return_lse) or not (
        num_splits is None or type(num_splits) is int
    ):
        return None
    if (
        type(q) is not _Tensor
        or type(k_cache) is not _Tensor
        or type(v_cache) is not _Tensor
        or type(cache_seqlens) is not _Tensor
    ):
        return None
    if block_table is None:
        table = None
    elif type(block_table) is _Tensor:
        table = (block_table.shape, block_table.stride(), block_table.dtype, block_table.device)
    else:
        return None
    if _grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        return None
    if not _plain_call(q):
        return None
    return (
        q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype,
        k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
        cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device,
        table, causal, scale, num_splits, runtime.current_tier(),
    )  # fmt: skip


def decode(
    key: tuple | None,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out, lse)`` where a call of ``key`` was learned, else None (the caller checks the
    inputs and calls ``decode_first``)."""
    if key is None:
        return None
    run = _decode.learned(key)
    # Its plan holds for any addresses (the launcher takes its full key for misaligned ones).
    return None if run is None else run(q, k_cache, v_cache, cache_seqlens, block_table)


def decode_first(key: tuple, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """A checked call of ``decode``'s key: ``ops.decode.launch(*args)`` (as the registry's direct
    path calls it), its launches kept under the key."""
    return _decode.launch(*args, learn=key)
