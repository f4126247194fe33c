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
anything the key leaves out, takes the full path (``forward`` and ``decode`` give no result).
What a key leaves out and is therefore checked per call, each under a microsecond:

- the options other than ``causal``, ``scale`` (None or a float), ``window`` (None or a
  ``tuple`` of two ``int``s, held exactly), ``sinks`` (None or a tensor or parameter of unit
  stride, its signature held) and, for decoding, ``num_splits`` (None or an int): any other
  option given takes the full path, as does a flag that is not a ``bool``, a scale of another
  type, a window of other types or sinks of another stride (the full path raises or converts);
- autograd: a forward call that records a graph (grad mode on and a tensor that requires grad)
  runs its kept launch inside the registry's autograd Function (``ops.registry.attention_kept``),
  whose backward is the same as the full path's; a decoding call that records one takes the
  full path (the op has no backward, and raises). The dispatch states ``ops.registry.direct``
  sends to the registered ops (torch.compile tracing, dispatch modes, functorch transforms,
  tensor subclasses: the key holds each tensor's exact type) take the full path;
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

from flashcore.checks import check_scale
from flashcore.ops import decode as _decode
from flashcore.ops import fwd as _fwd
from flashcore.ops import registry as _registry
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
    if t.is_cuda:
        return t.get_device() == _current_device()
    return not t.is_meta  # the CPU (the interpreter); meta tensors take the registered ops


def _keyable(
    causal: object, scale: object, return_lse: object, *tensors: object, recording: bool = False
) -> bool:
    """Whether a call with these options and tensors (q first) may be keyed: flags that are
    bools, a scale None or a float, plain tensors, none recording autograd (unless
    ``recording``: the forward's kept launch runs inside the autograd Function too), and a state
    ``_plain_call`` allows."""
    if type(causal) is not bool or type(return_lse) is not bool:
        return False
    if scale is not None and type(scale) is not float:
        return False
    for t in tensors:
        if type(t) is not _Tensor:
            return False
    if not recording and _grad_enabled():
        for t in tensors:
            if t.requires_grad:
                return False
    return _plain_call(tensors[0])


def _records(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
) -> bool:
    """Whether a forward call records autograd (its output then needs the autograd Function)."""
    return _grad_enabled() and (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or (sinks is not None and sinks.requires_grad)
    )


def _signature(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


NOT_KEYED = object()


def window_key(window: object) -> object:
    """``window`` as a key holds it: None, or a ``tuple`` of two ``int``s (the first call's
    checks pass or refuse exactly these values); ``NOT_KEYED`` for anything else (a list, an
    integer of another type), which takes the full path."""
    if window is None:
        return None
    if type(window) is tuple and len(window) == 2:
        left, right = window
        if type(left) is int and type(right) is int:
            return window
    return NOT_KEYED


# Sinks are often a module's parameter (gpt-oss's ``sinks``): a Parameter is taken as it is.
_SINKS_TYPES = (torch.Tensor, torch.nn.Parameter)


def _keyable_sinks(sinks: object, recording: bool) -> bool:
    """Sinks a key may hold: None, or a tensor or parameter (no other subclass) of unit stride
    (the full path reads others through a copy, which no kept launch makes; other ranks it
    refuses), not requiring grad where the call may not record autograd (``recording``)."""
    if sinks is None:
        return True
    if type(sinks) not in _SINKS_TYPES or sinks.stride() != (1,):
        return False
    return recording or not (sinks.requires_grad and _grad_enabled())


def _window(key_window: tuple[int, int] | None) -> tuple[int, int]:
    """A keyed window as the launchers take it (None: ``(-1, -1)``, no window)."""
    return (-1, -1) if key_window is None else key_window


def forward(
    q: object,
    k: object,
    v: object,
    causal: object,
    scale: object,
    return_lse: object,
    window: tuple[int, int] | None = None,
    sinks: object = None,
) -> tuple[tuple | None, tuple | None]:
    """``(key, (out, lse))`` where a call of this signature was learned (and its tensors are
    aligned), ``(key, None)`` otherwise: the caller checks the inputs and calls ``forward_first``
    with the key (None where the call cannot take a kept launch). ``return_lse`` changes no
    launch: it is not in the key. ``window``: as ``window_key`` gives it (not ``NOT_KEYED``);
    ``sinks``: None, or a tensor the key holds the signature of (unit stride only: the full path
    would read others through a copy, which no kept launch makes)."""
    if not _keyable(causal, scale, return_lse, q, k, v, recording=True):
        return None, None
    if not _keyable_sinks(sinks, recording=True):
        return None, None
    try:
        key = (
            _signature(q), _signature(k), _signature(v), causal, scale, window,
            None if sinks is None else _signature(sinks), runtime.current_tier(),
        )  # fmt: skip
        run = _fwd.learned(key)
        if run is None or (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
            return key, None
    except RuntimeError:
        return None, None  # not a dense tensor (nested, sparse): the caller's checks name it
    if _records(q, k, v, sinks):
        # The backward takes the scale resolved, as the full path resolves it.
        scale = check_scale(scale, q.shape[-1])
        return key, _registry.attention_kept(run, q, k, v, causal, scale, _window(window), sinks)
    return key, run(q, k, v, sinks)


def forward_first(
    key: tuple,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    window: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A checked call of ``forward``'s key (``scale`` resolved, ``window`` and ``sinks``
    checked): the launch the registry's direct path makes for it (``ops.registry.attention``;
    through its autograd Function where the call records autograd), kept under the key."""
    if _records(q, k, v, sinks):

        def learn(q, k, v, sinks):
            return _fwd.launch(q, k, v, causal, scale, window=window, sinks=sinks, learn=key)

        return _registry.attention_kept(learn, q, k, v, causal, scale, window, sinks)
    return _fwd.launch(q, k, v, causal, scale, window=window, sinks=sinks, learn=key)


def decode(
    q: object,
    k_cache: object,
    v_cache: object,
    cache_seqlens: object,
    block_table: object,
    causal: object,
    scale: object,
    num_splits: object,
    return_lse: object,
    window: tuple[int, int] | None = None,
    sinks: object = None,
) -> tuple[tuple | None, tuple | None]:
    """``attention_with_kvcache``'s ``forward``: ``(key, (out, lse))`` where a call of this
    signature was learned, ``(key, None)`` otherwise (the caller checks the inputs and calls
    ``decode_first``). Not under ``flashcore.checked()``, which reads the lengths and the block
    table each call: the caller does not ask then. ``window`` as ``window_key`` gives it;
    ``sinks`` as ``forward`` takes them (none that require grad: the full path refuses those)."""
    if num_splits is not None and type(num_splits) is not int:
        return None, None
    tensors = (q, k_cache, v_cache, cache_seqlens)
    if block_table is not None:
        tensors += (block_table,)
    if not _keyable(causal, scale, return_lse, *tensors):
        return None, None
    if not _keyable_sinks(sinks, recording=False):
        return None, None
    # With a block table the key holds five signatures, else four: the two never meet.
    try:
        key = (
            *map(_signature, tensors), causal, scale, num_splits, window,
            None if sinks is None else _signature(sinks), runtime.current_tier(),
        )  # fmt: skip
    except RuntimeError:
        return None, None  # not a dense tensor (nested, sparse): the caller's checks name it
    run = _decode.learned(key)
    # Its plan holds for any addresses (the launcher takes its full key for misaligned ones).
    if run is None:
        return key, None
    return key, run(
        q, k_cache, v_cache, cache_seqlens, block_table, lse_wanted=return_lse, sinks=sinks
    )


def decode_first(key: tuple, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """A checked call of ``decode``'s key: ``ops.decode.launch(*args)`` (as the registry's direct
    path calls it), its launches kept under the key."""
    return _decode.launch(*args, learn=key)
