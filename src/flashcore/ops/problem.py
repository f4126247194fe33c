"""The problem a call describes, in the terms every kernel takes it: sizes, strides, the packed
(varlen) layout, the visibility bounds and the score units, folded once for every scheme.

Score units (one convention for every kernel, forward, backward and decode): the softmax runs on
``exp2`` of base-2 scores, so the host folds ``log2(e)`` into the score scale. ``qk_scale``
multiplies ``q . k``; with a softcap c it is ``scale / c`` in natural units (the kernels take
``tanh`` of that) and ``softcap`` is ``c`` in the scores' units, so ``tanh(.) * softcap`` is the
capped score in base 2. fp32 inputs keep natural units and an exact ``exp`` (``EXP_E``, see
``kernels/common.softmax_exp``): the same formulas with a unit of 1. The ALiBi
slopes are tensors, so the one kernel helper that loads them (``common.alibi_slope``) applies the
same unit. The backward works in the forward's units (base 2, natural for fp32) and
takes the raw ``scale`` once more, as ``grad_scale``, for ``dQ = scale * dS K`` and ``dK = scale *
dS^T Q``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashcore.ops.launch import Descriptor
from flashcore.tuning import head_block

LOG2E = 1.4426950408889634  # log2(e): folds the softmax's exp into exp2


class Varlen(NamedTuple):
    """A packed batch: q/out ``(total_q, H, D)``, k/v ``(total_k, Hkv, D)`` (kernels/varlen.py).

    The contents of the int32 offsets are trusted (reading them would sync with the device); the
    maxima only size the grid.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


def varlen_of(
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> Varlen | None:
    """The registered ops' optional packing arguments as a ``Varlen`` (None: dense inputs)."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        return None
    # The kernels read offset b at ``base + b``: a strided view (a slice with a step, an expand)
    # is copied (a 1-D tensor of B + 1 ints).
    return Varlen(
        unit_stride_last_dim(cu_seqlens_q),
        unit_stride_last_dim(cu_seqlens_k),
        max_seqlen_q,
        max_seqlen_k,
    )


class Dims(NamedTuple):
    """Sizes of a problem; with varlen, the sequence lengths are the longest ones."""

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int


def problem_dims(q: torch.Tensor, k: torch.Tensor, varlen: Varlen | None) -> Dims:
    """Sizes of ``(B, H, Sq, D)`` / ``(B, Hkv, Sk, D)`` inputs, or of packed ones."""
    if varlen is None:
        return Dims(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])
    return Dims(varlen.batch, q.shape[1], k.shape[1], varlen.max_seqlen_q, varlen.max_seqlen_k)


def packed_totals(
    q: torch.Tensor,
    k: torch.Tensor,
    varlen: Varlen | None,
    block_table: torch.Tensor | None = None,
) -> tuple[int, int]:
    """``(total_q, total_k)``: the rows a packed batch's offsets may address, which the kernels
    clamp them to (``kernels/varlen.seq_bounds``); a paged sequence's number of keys is bounded
    by its block-table row, ``max_blocks * block_size``. (0, 0) for dense inputs (never read)."""
    if varlen is None:
        return 0, 0
    if block_table is not None:
        return q.shape[0], block_table.shape[1] * k.shape[2]
    return q.shape[0], k.shape[0]


def lse_shape(q: torch.Tensor, packed: bool) -> tuple[int, ...]:
    """The LSE of ``q``'s rows: ``(B, H, Sq)``, or ``(H, total_q)`` for a packed q. The one shape
    function of the forward: its launcher allocates with it and its fake kernel reports it."""
    return (q.shape[1], q.shape[0]) if packed else tuple(q.shape[:3])


def row_strides(t: torch.Tensor, varlen: Varlen | None) -> tuple[int, int, int]:
    """(batch, head, row) strides of a ``(B, heads, S, D)`` tensor; of a packed ``(total, heads,
    D)`` one with batch stride 0 (its kernels find each sequence's first row in cu_seqlens)."""
    return t.stride()[:3] if varlen is None else (0, t.stride(1), t.stride(0))


def stride_align(strides: tuple[int, ...], element_size: int) -> int:
    """``ALIGN`` of the kernels that read rows by pointers (``kernels/common.py: aligned``): the
    elements in 16 bytes when every stride is a multiple of it but not every one of 16 (which
    Triton specialises on by itself), else 1."""
    vec = 16 // element_size
    if all(s % 16 == 0 for s in strides) or any(s % vec for s in strides):
        return 1
    return vec


def stats_strides(t: torch.Tensor, varlen: Varlen | None) -> tuple[int, ...]:
    """(batch, head) strides of row stats ``(B, H, Sq)``, or of packed ones ``(H, total_q)``."""
    return t.stride()[:-1] if varlen is None else (0, *t.stride()[:-1])


class Scores(NamedTuple):
    """How a kernel forms and masks its scores: flags (constexprs) and scalars, units folded.

    Built once per problem by ``scores``; ``flags()`` and ``scalars()`` are what every kernel
    takes, in its parameter order (``qk_scale, window_left, window_right, softcap``).
    """

    is_causal: bool
    has_window: bool
    window_left: int
    window_right: int
    qk_scale: float
    softcap: float
    has_softcap: bool
    has_alibi: bool
    exp_e: bool

    def flags(self) -> dict:
        return dict(
            IS_CAUSAL=self.is_causal,
            HAS_WINDOW=self.has_window,
            SOFTCAP=self.has_softcap,
            HAS_ALIBI=self.has_alibi,
        )

    def scalars(self) -> tuple[float, int, int, float]:
        return self.qk_scale, self.window_left, self.window_right, self.softcap


def scores(
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    scale: float,
    has_alibi: bool,
    seqlen_q: int,
    seqlen_k: int,
    *,
    exp_e: bool = False,
) -> Scores:
    """The score transform and visibility of ``flashcore.attention``'s options, as kernels take it.

    ``window`` is ``(left, right)`` with -1 unbounded; ``softcap`` 0 is off. ``exp_e``: natural
    units (fp32 on the GPU) instead of base 2 (module docstring).
    """
    is_causal, has_window, left, right = window_bounds(causal, *window, seqlen_q, seqlen_k)
    unit = 1.0 if exp_e else LOG2E
    if softcap > 0:
        # The kernels take tanh of scale * q.k / c in natural units and scale it back by c.
        qk_scale, cap = scale / softcap, softcap * unit
    else:
        qk_scale, cap = scale * unit, 0.0
    return Scores(
        is_causal, has_window, left, right, float(qk_scale), float(cap), softcap > 0, has_alibi,
        exp_e,
    )  # fmt: skip


def window_bounds(
    causal: bool, left: int, right: int, seqlen_q: int, seqlen_k: int
) -> tuple[bool, bool, int, int]:
    """``(IS_CAUSAL, HAS_WINDOW, window_left, window_right)`` as the kernels take a window.

    ``left``/``right`` are ``flashcore.attention``'s (-1: unbounded). A right side of 0 is the
    causal mask, which has its own flag (and causal overrides any right side). A side that hides
    no key is unbounded: the left one hides ``j < i + Sk - Sq - left``, nothing when
    ``left >= Sk - 1`` (the last query sits at key position ``Sk - 1``); the right one hides
    ``j > i + Sk - Sq + right``, nothing when ``right >= Sq - 1``. So transformers' sliding window
    W at exactly W tokens (``left = W - 1``) is plain causal. With packed sequences ``seqlen_q``
    and ``seqlen_k`` are the maxima, so a side unbounded here hides nothing in any sequence; for
    decoding, ``seqlen_k`` is the cache capacity (every sequence's length is at most that). An
    unbounded side is passed as ``seqlen_q + seqlen_k``, so the kernels' index arithmetic needs no
    case for it and stays in int32. HAS_WINDOW is off when neither side binds: the kernels are
    then the plain ones.
    """
    unbounded = seqlen_q + seqlen_k
    causal = causal or right == 0
    left = unbounded if left < 0 or left >= seqlen_k - 1 else left
    right = unbounded if causal or right < 0 or right >= seqlen_q - 1 else right
    return causal, left < unbounded or right < unbounded, left, right


def effective_window(
    causal: bool, window: tuple[int, int], seqlen_q: int, seqlen_k: int
) -> tuple[bool, tuple[int, int]]:
    """``(causal, window)`` with the window's sides that hide no key as -1 and a right side of 0
    as ``causal`` (``window_bounds``): the same problem in the form the launchers choose tiers,
    splits and plans by, so a window that binds nothing costs nothing."""
    causal, _, left, right = window_bounds(causal, *window, seqlen_q, seqlen_k)
    unbounded = seqlen_q + seqlen_k
    return causal, (-1 if left >= unbounded else left, -1 if right >= unbounded else right)


def type_flags(
    dtype: torch.dtype, head_dim: int, interpreted: bool, head_dim_v: int | None = None
) -> dict:
    """Constexprs every kernel takes from the input dtype and head dim; with ``head_dim_v``
    also the value head dim (kernels that read V: it may differ from the query/key one)."""
    value = {}
    if head_dim_v is not None:
        value = dict(HEAD_DIM_V=head_dim_v, BLOCK_DV=head_block(head_dim_v))
    return dict(
        HEAD_DIM=head_dim,
        BLOCK_D=head_block(head_dim),
        **value,
        # Triton 3.6's interpreter computes bf16 on the raw bit patterns: compute in fp32.
        UPCAST=interpreted and dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


def uses_exp_e(dtype: torch.dtype, interpreted: bool) -> int:
    """The kernels' EXP_E: fp32 takes the exact-exp path in natural units (``common.softmax_exp``):
    1 on the GPU (libdevice's ``exp``), 2 in the interpreter (numpy's: it has no libdevice); 0,
    base 2, for 16-bit inputs."""
    if dtype != torch.float32:
        return 0
    return 2 if interpreted else 1


def alibi_arg(slopes: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, int]:
    """ALiBi slopes as the kernels read them: ``(pointer, batch stride)``, unit stride over heads.

    ``(H,)`` slopes get a batch stride of 0. Without slopes, ``dummy`` stands in for the pointer
    (never read: HAS_ALIBI is off).
    """
    if slopes is None:
        return dummy, 0
    slopes = slopes.contiguous()
    return slopes, (slopes.stride(0) if slopes.dim() == 2 else 0)


def tma_compatible(t: torch.Tensor) -> bool:
    """Whether the bulk-copy engine can address ``t``: 16-byte aligned base and strides."""
    size = t.element_size()
    return (
        t.data_ptr() % 16 == 0
        and t.stride(-1) == 1
        and all(st * size % 16 == 0 for st in t.stride()[:-1])
    )


def descriptor(t: torch.Tensor, rows: int, block_d: int) -> Descriptor:
    """A 4-D tensor descriptor over ``(B, heads, S, D)`` moving ``(1, 1, rows, block_d)`` tiles
    (``t`` passed ``tma_compatible``)."""
    return Descriptor(t, [1, 1, rows, block_d])


def empty_rows_like(t: torch.Tensor, last: int) -> torch.Tensor:
    """``torch.empty_like(t)`` with a last dim of ``last``: the other dims in ``t``'s memory order
    (a dense ``(B, S, H, D)`` view in gives the same view of an ``Dv`` wide result), unit
    stride along the last."""
    if last == t.shape[-1]:
        return torch.empty_like(t)
    order = sorted(range(t.dim() - 1), key=lambda d: -t.stride(d))
    base = t.new_empty([t.shape[d] for d in order] + [last])
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    return base.permute(*inverse, t.dim() - 1)


def unit_stride_last_dim(t: torch.Tensor) -> torch.Tensor:
    """The kernels address the head dim with unit stride, and the int32 offsets, lengths and
    block-table rows as ``base + i``; copy only a tensor that lacks it."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def used_as_given(given: tuple, used: tuple) -> bool:
    """Whether a launcher ran on the caller's tensors themselves (``unit_stride_last_dim`` copied
    none): what a launch kept for the caller's signature (``ops.express``) needs."""
    return all(a is b for a, b in zip(given, used, strict=True))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
