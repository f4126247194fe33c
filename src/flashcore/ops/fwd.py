"""Forward launcher: allocates ``out`` and ``lse``, picks the config, launches the kernel."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import NamedTuple

import torch

from flashcore import tuning
from flashcore.ops.launch import Descriptor, Launcher, cached
from flashcore.tuning import FwdConfig, fwd_config, head_block

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


def row_strides(t: torch.Tensor, varlen: Varlen | None) -> tuple[int, int, int]:
    """(batch, head, row) strides of a ``(B, heads, S, D)`` tensor; of a packed ``(total, heads,
    D)`` one with batch stride 0 (its kernels find each sequence's first row in cu_seqlens)."""
    return t.stride()[:3] if varlen is None else (0, t.stride(1), t.stride(0))


def stats_strides(t: torch.Tensor, varlen: Varlen | None) -> tuple[int, ...]:
    """(batch, head) strides of row stats ``(B, H, Sq)``, or of packed ones ``(H, total_q)``."""
    return t.stride()[:-1] if varlen is None else (0, *t.stride()[:-1])


@functools.cache
def kernels() -> ModuleType:
    """The kernel module, imported (with triton) at the first launch.

    Importing flashcore does not import triton, so TRITON_INTERPRET=1 may be set any time before
    the first attention call (triton reads it when its own modules are defined).
    """
    from flashcore.kernels import fwd

    return fwd


@functools.cache
def launcher() -> Launcher:
    """The forward kernel's launcher (``ops.launch``): Q, K, V, O, LSE, CU_Q, CU_K, ALIBI first."""
    return Launcher(kernels().attn_fwd_kernel, num_pointers=8)


@functools.cache
def is_interpreted() -> bool:
    """True when the kernels were defined under Triton's interpreter (TRITON_INTERPRET=1); fixed
    for the process once they are."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernels().attn_fwd_kernel, InterpretedFunction)


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    config: FwdConfig | None = None,
    varlen: Varlen | None = None,
    *,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel on validated inputs; returns ``(out, lse)``.

    ``out`` keeps q's memory layout when q is dense (so a ``(B, S, H, D)`` view in gives one out);
    ``lse`` is fp32 ``(B, H, Sq)``, contiguous. ``config`` overrides the tuned launch config
    (for tuning scripts). With ``varlen`` the inputs are packed, ``(total, heads, D)``, and
    ``lse`` is ``(H, total_q)``. ``window``, ``softcap`` and ``alibi_slopes`` as in
    ``flashcore.attention`` (validated; ``(-1, -1)``, 0.0 and None are off).
    """
    q, k, v = (unit_stride_last_dim(t) for t in (q, k, v))
    dims = problem_dims(q, k, varlen)
    lse_shape = (
        (dims.batch, dims.heads, dims.seqlen_q) if varlen is None else (dims.heads, q.shape[0])
    )
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if out.numel() == 0 or dims.seqlen_q == 0:
        return out, lse
    if k.numel() == 0:
        # Every row sees no key. Filled here rather than launched: k and v have no storage.
        return out.zero_(), lse.fill_(float("-inf"))
    alibi, stride_ab = alibi_arg(alibi_slopes, lse)
    # Everything but the pointers follows from this key (out's strides from q's shape and
    # strides, descriptor eligibility from strides and 16-byte alignment): the config, scalars
    # and constexprs are built once per problem signature.
    key = (
        q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, causal, scale,
        window, softcap, None if alibi_slopes is None else stride_ab,
        None if varlen is None else dims, config,
        all(t.data_ptr() % 16 == 0 for t in (q, k, v, out)), tuning.TMA_MIN_FLOPS,
    )  # fmt: skip
    grid, tail, meta, tiles = cached(_PLANS, key, lambda: _plan(
        q, k, v, out, lse, causal, scale, config, varlen, window, softcap, alibi_slopes,
        stride_ab, dims,
    ))  # fmt: skip
    if tiles is None:
        pointers = (q, k, v, out)
    else:
        rows_q, rows_k, block_d = tiles
        pointers = (
            descriptor(q, rows_q, block_d), descriptor(k, rows_k, block_d),
            descriptor(v, rows_k, block_d), descriptor(out, rows_q, block_d),
        )  # fmt: skip
    cu = (None, None) if varlen is None else varlen[:2]
    # Triton launches on the current CUDA device, not on the tensors' (a no-op on the CPU).
    with torch.cuda.device_of(q):
        launcher()(grid, (*pointers, lse, *cu, alibi, *tail), meta)
    return out, lse


# Launch plans by problem signature (see attn_fwd; bounded by ops.launch.cached).
_PLANS: dict[tuple, tuple] = {}


def _plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    config: FwdConfig | None,
    varlen: Varlen | None,
    window: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    stride_ab: int,
    dims: Dims,
) -> tuple:
    """``(grid, arguments after the pointers, constexprs, descriptor tiles or None)`` of the
    forward launch of ``attn_fwd``."""
    batch, heads, kv_heads, seqlen_q, seqlen_k = dims
    head_dim = q.shape[-1]
    interpreted = is_interpreted()
    # fp32 on the GPU takes the exact-exp path (kernels/common.py: softmax_exp).
    exp_e = q.dtype == torch.float32 and not interpreted
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim / (2 if causal else 1)
    cfg = config or fwd_config(
        head_dim,
        q.element_size(),
        interpreted=interpreted,
        seqlen_q=seqlen_q,
        causal=causal,
        flops=flops,
    )
    block_d = head_block(head_dim)
    is_causal, has_window, window_left, window_right = window_bounds(
        causal, *window, seqlen_q, seqlen_k
    )
    qk_scale = scale if exp_e else scale * LOG2E
    if softcap > 0:
        # The kernel takes tanh of scale * q.k / c in natural units and scales it back by c.
        qk_scale, softcap = scale / softcap, softcap if exp_e else softcap * LOG2E
    use_tma = (
        cfg.use_tma
        and varlen is None
        and (interpreted or has_tma(q.device))
        and all(tma_compatible(t) for t in (q, k, v, out))
    )
    tiles = (cfg.block_m, cfg.block_n, block_d) if use_tma else None
    tail = (
        *row_strides(q, varlen), *row_strides(k, varlen), *row_strides(v, varlen),
        *row_strides(out, varlen), *stats_strides(lse, varlen), stride_ab,
        heads, heads // kv_heads, seqlen_q, seqlen_k, float(qk_scale),
        window_left, window_right, float(softcap),
    )  # fmt: skip
    meta = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        IS_CAUSAL=is_causal,
        HAS_WINDOW=has_window,
        SOFTCAP=softcap > 0,
        HAS_ALIBI=alibi_slopes is not None,
        EVEN_M=varlen is None and seqlen_q % cfg.block_m == 0,
        EVEN_N=varlen is None and seqlen_k % cfg.block_n == 0,
        UPCAST=interpreted and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        EXP_E=exp_e,
        USE_TMA=use_tma,
        IS_VARLEN=varlen is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return (cdiv(seqlen_q, cfg.block_m) * batch * heads,), tail, meta, tiles


def window_bounds(
    causal: bool, left: int, right: int, seqlen_q: int, seqlen_k: int
) -> tuple[bool, bool, int, int]:
    """``(IS_CAUSAL, HAS_WINDOW, window_left, window_right)`` as the kernels take a window.

    ``left``/``right`` are ``flashcore.attention``'s (-1: unbounded). A right side of 0 is the
    causal mask, which has its own flag (and causal overrides any right side). A side that no row
    can reach (left >= Sk, right >= Sq) is unbounded, and an unbounded side is passed as
    ``seqlen_q + seqlen_k``, so the kernels' index arithmetic needs no case for it and stays in
    int32. HAS_WINDOW is off when neither side binds: the kernels are then the plain ones.
    """
    unbounded = seqlen_q + seqlen_k
    causal = causal or right == 0
    left = unbounded if left < 0 or left >= seqlen_k else left
    right = unbounded if causal or right < 0 or right >= seqlen_q else right
    return causal, left < unbounded or right < unbounded, left, right


def alibi_arg(slopes: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, int]:
    """ALiBi slopes as the kernels read them: ``(pointer, batch stride)``, unit stride over heads.

    ``(H,)`` slopes get a batch stride of 0. Without slopes, ``dummy`` stands in for the pointer
    (never read: HAS_ALIBI is off).
    """
    if slopes is None:
        return dummy, 0
    slopes = slopes.contiguous()
    return slopes, (slopes.stride(0) if slopes.dim() == 2 else 0)


@functools.cache
def has_tma(device: torch.device) -> bool:
    """Tensor descriptors need the bulk-copy engine of Hopper (sm_90) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


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


def unit_stride_last_dim(t: torch.Tensor) -> torch.Tensor:
    """The kernels address the head dim with unit stride; copy only a tensor that lacks it."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
