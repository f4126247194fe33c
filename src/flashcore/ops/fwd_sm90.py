"""Host launcher of the Hopper forward tier (``kernels/hopper/fwd.py``, Gluon, sm_90a).

The forward dispatch calls ``supports`` and, when it says yes, ``attn_fwd_sm90`` with the
problem already folded into kernel units (the same ``qk_scale``/``softcap``/window arguments as
the portable forward's launch). Triton and the kernel module are imported at the first launch.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import NamedTuple

import torch

from flashcore.ops import fwd_sm90_configs as configs
from flashcore.ops import runtime, work_list
from flashcore.ops.launch import Descriptor, Launcher
from flashcore.ops.problem import Varlen, packed_totals

DTYPES = (torch.float16, torch.bfloat16)
# (Q/K head dim, V head dim) pairs both Hopper tiers run (this forward, ops/bwd_sm90.py).
DENSE_HEAD_DIMS = ((64, 64), (128, 128))
# MLA training shapes: Q and K at head dim 192, V and O at 128 (Q and K in three 64-column
# panels, ``qk_panel``: a TMA box is a power of two wide). Compiled for sm_90a (spill-free, 213 KB
# of shared memory, tests/test_compile_hopper.py); on the H100
# tests/test_value_dim.py::test_value_dim_gpu_sm90_forward_kernel passed (10 cases, fp16 and
# bf16) and it ran 1.11-1.17x SDPA (docs/hopper_fwd_configs.md, "MLA head dims").
MLA_HEAD_DIMS = (192, 128)
MLA_VERIFIED = True
# Head dim 256: BLOCK_N = 64, flat, 197 KB of shared memory, compiled spill-free for sm_90a
# (tests/test_compile_hopper.py); on the H100
# tests/test_forward_sm90.py::test_forward_gpu_sm90_kernel_d256 passed (10 cases, fp16 and bf16:
# causal with Sq > Sk, GQA/MQA, window + softcap, ALiBi, sinks, (B, S, H, D) views).
WIDE_HEAD_DIMS = (256, 256)
WIDE_VERIFIED = True


# Head dims between 64 and 128 (rows of 16-byte multiples: 72, 80, ..., 120; V's equal) run the
# D = 128 kernels of both Hopper tiers: every tile's box is 128 columns wide over the narrower
# tensors, so the copy engine fills the columns past D with zeros on loads (they add nothing to
# Q K^T, and P V's extra output columns are zero) and drops them on stores and reduce-adds
# (``kernel_head_dim``). The portable kernels pad these head dims to 128 as well (``BLOCK_D``).
# On the H100 tests/test_backward_sm90.py::test_sm90_padded_head_dims passed (10 cases, fp16 and
# bf16: head dims 72-112, forward and backward through both Hopper tiers) and the tiers ran
# 1.09-1.36x (forward) and 1.24-1.54x (backward) the portable ones at 80, 96 and 112
# (docs/hopper_fwd_configs.md, "Head dims between 64 and 128").
PADDED_HEAD_DIMS = tuple((d, d) for d in range(72, 128, 8))
PADDED_VERIFIED = True
# Head dims 48 and 56 the same way on the D = 64 kernels. On the H100 the same test passed at 48
# and 56 (and at 32 and 40), and at 48 and 56 the tiers ran 1.01-1.2x (forward) and 1.18-2.5x
# (backward) the portable ones; at 32 the forward lost causal (0.83-0.95x: half of its work is
# padding) and the backward at (16, 32, 1024) non-causal (0.94x), so 32 and 40 stay portable
# (docs/hopper_fwd_configs.md, "Head dims between 64 and 128").
NARROW_HEAD_DIMS = ((48, 48), (56, 56))
NARROW_VERIFIED = True
# Head dims between 128 and 256 (136, 144, ..., 248; V's equal, so not MLA's (192, 128)) run the
# D = 256 forward the same way, over 256-column boxes; the portable kernels pad them to 256 as
# well. Their backward runs the head-dim-256 Gluon kernels the same way (ops/bwd256.py).
# On the H100 tests/test_forward_sm90.py::test_forward_gpu_sm90_wide_padded passed (10 cases, fp16
# and bf16: head dims 136-248) and the forward ran 1.28-1.54x the portable one at 160, 192 and 224
# (docs/hopper_fwd_configs.md, "Head dims between 128 and 256").
WIDE_PADDED_HEAD_DIMS = tuple((d, d) for d in range(136, 256, 8))
WIDE_PADDED_VERIFIED = True
# The ping-pong's turns (configs with ``pingpong``) through named hardware barriers, ``bar.sync``
# and ``bar.arrive`` (kernel PINGPONG = 2, ``kernels/hopper/fwd_steps.py: turn_take``), or
# through mbarriers in shared memory (PINGPONG = 1). Named with two consumers, where the H200
# measured them about 2% faster at D = 128 non-causal from 2048 keys on; mbarriers with three
# (no gain: docs/hopper_fwd_configs.md, "Turns by named barriers"). Read when a plan is built.
NAMED_TURNS = True


def pingpong_mode(pingpong: bool, num_consumers: int) -> int:
    """The kernel's PINGPONG for a config: 0 (no turns), 1 (mbarriers), 2 (named barriers)."""
    if not pingpong:
        return 0
    return 2 if NAMED_TURNS and num_consumers == 2 else 1


def forward_head_dims() -> tuple[tuple[int, int], ...]:
    """The (Q/K, V) head dim pairs this forward takes: the dense ones, and each wider or padded
    pair once it has been verified on a GPU (read per call: benchmarks may set the flags)."""
    return (
        DENSE_HEAD_DIMS
        + ((MLA_HEAD_DIMS,) if MLA_VERIFIED else ())
        + ((WIDE_HEAD_DIMS,) if WIDE_VERIFIED else ())
        + padded_head_dims()
        + (WIDE_PADDED_HEAD_DIMS if WIDE_PADDED_VERIFIED and WIDE_VERIFIED else ())
    )


def padded_head_dims() -> tuple[tuple[int, int], ...]:
    """The padded pairs both Hopper tiers take (``PADDED_HEAD_DIMS``, ``NARROW_HEAD_DIMS``), each
    once verified (read per call, as ``forward_head_dims``)."""
    return (PADDED_HEAD_DIMS if PADDED_VERIFIED else ()) + (
        NARROW_HEAD_DIMS if NARROW_VERIFIED else ()
    )


# Head dims 72 to 96 (``PADDED_HEAD_DIMS``) with the two-consumer D = 128 config: Q and K at
# their own width rounded up to 16 (``narrow_qk_dim``: 80 or 96), in column panels of 16 or 32
# (``qk_panel``; a TMA box is a power of two wide), so that ``Q K^T`` does 80 or 96 / 128 of the
# padded build's products; V and O stay 128 wide (an accumulator is a power of two wide), through
# the persistent grid's one-Q-buffer build (an O tile of its own: O is wider than Q's slot).
# Dense problems without softcap or ALiBi; the rest run the padded D = 128 build. H200, bf16,
# scripts/fwd_switch_ab.py NARROW_QK, five rounds, off / on time (outputs bit for bit equal):
# 96 non-causal 1.001 (4096 keys) and 1.012 (16384), causal 1.043 (4096); 80 1.031 (4096),
# causal 1.044 (8192); 72 causal 1.005 (2048); 112 (seven panels of 16) 0.960 and 0.953, so 104
# and 112 keep the padded build. The products shrink by a quarter or more and the time by 0-4%:
# the step is paced by the softmax, not the tensor cores (docs/hopper_fwd_configs.md, "Q and K
# at their own width"). Read per plan.
NARROW_QK = True
NARROW_QK_MAX = 96


# The same at head dims 136-192 of ``WIDE_PADDED_HEAD_DIMS``: Q and K at 192 (MLA's three
# 64-column panels) against V and O at 256, 64-key tiles (``NARROW_QK_WIDE``; ``CONFIGS[256]``
# has one Q buffer already; persistent at every length). H200, bf16, the same script, off / on
# time: 160 1.116 (1024 keys), 1.066 (4096), causal 1.086 (4096); 192 causal 1.088 (2048), 1.049
# (8192); 136 1.083 (4096); 176 causal 1.111 (16384). A 64-key step's products weigh more
# against its softmax here than at D = 128.
NARROW_QK_WIDE = True
NARROW_QK_WIDE_MAX = 192


def narrow_qk_dim(head_dim: int, head_dim_v: int) -> int | None:
    """Q's and K's kernel width under ``NARROW_QK`` for tensors of ``(head_dim, head_dim_v)``:
    ``head_dim`` rounded up to 16 (at most ``NARROW_QK_MAX``) beside V at 128, or 192 beside V
    at 256 (``NARROW_QK_WIDE``); None where the padded build runs."""
    pair = (head_dim, head_dim_v)
    if NARROW_QK and pair in PADDED_HEAD_DIMS:
        width = -(-head_dim // 16) * 16
        return width if width <= NARROW_QK_MAX else None
    if NARROW_QK_WIDE and pair in WIDE_PADDED_HEAD_DIMS and head_dim <= NARROW_QK_WIDE_MAX:
        return NARROW_QK_WIDE_MAX
    return None


def kernel_head_dim(head_dim: int) -> int:
    """The head dim the Hopper kernels are built for when the tensors' is ``head_dim``: 128 for
    ``PADDED_HEAD_DIMS``, 64 for ``NARROW_HEAD_DIMS``, ``head_dim`` itself otherwise."""
    if (head_dim, head_dim) in PADDED_HEAD_DIMS:
        return 128
    return 64 if (head_dim, head_dim) in NARROW_HEAD_DIMS else head_dim


def kernel_head_dims(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """The forward kernel's (Q/K, V) head dims for tensors of ``(head_dim, head_dim_v)``: (256,
    256) for ``WIDE_PADDED_HEAD_DIMS``, else ``kernel_head_dim`` of each."""
    if (head_dim, head_dim_v) in WIDE_PADDED_HEAD_DIMS:
        return 256, 256
    return kernel_head_dim(head_dim), kernel_head_dim(head_dim_v)


def qk_panel(head_dim: int) -> int:
    """Width of the column panels Q and K are loaded in: the largest power of two dividing the
    head dim (the whole of it at 64, 128, 256; 64 at 192, three panels)."""
    return head_dim & -head_dim


# Each stream's counter of the dynamic deal (device, stream) -> int32 (1,): zero between launches
# (the launch's last draw puts it back), so that launches on one stream, which run one after
# the other, share it. Launches on other streams may run at the same time: each its own.
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def work_counter(device: torch.device) -> torch.Tensor:
    """The dynamic deal's counter for a launch on ``device``'s current stream: the stream's own,
    or, while a CUDA graph is being captured, a new zero of the graph's (its replays may run
    beside launches on the capturing stream)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    index = torch.cuda.current_device() if device.index is None else device.index
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    counter = _COUNTERS.get(key)
    if counter is None:
        counter = _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (the persistent grid), cached per device."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def kernels() -> ModuleType:
    """The Gluon kernel module, imported (with triton) at the first launch."""
    from flashcore.kernels.hopper import fwd

    return fwd


@functools.cache
def launcher() -> Launcher:
    """The kernel's ``Launcher`` (its four descriptors, LSE, ALIBI, SINKS, O, the two offset
    tensors, the work list and the block table come first): Triton's per-call argument binding
    is skipped once a signature has been compiled."""
    return Launcher(kernels().attn_fwd_sm90_kernel, 12)


@functools.cache
def _gluon_available() -> bool:
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def tma_ok(t: torch.Tensor) -> bool:
    """A 4-D ``(B, heads, S, D)`` view the copy engine can address: unit stride on D, 16-byte
    aligned base and strides."""
    size = t.element_size()
    return (
        t.dim() == 4
        and t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(s * size % 16 == 0 for s in t.stride()[:-1])
    )


def _tier_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: int, kv_dims: int | None = None
) -> bool:
    """An sm_90 device with Gluon, and q, k, v all fp16 or all bf16, q of ``dims`` dims, k and
    v of ``kv_dims`` (default ``dims``)."""
    if not (q.is_cuda and _is_sm90(q.device) and _gluon_available()):
        return False
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    kv_dims = dims if kv_dims is None else kv_dims
    return q.dim() == dims and k.dim() == kv_dims and v.dim() == kv_dims


def dense_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_dims: tuple[tuple[int, int], ...] = DENSE_HEAD_DIMS,
) -> bool:
    """What both Hopper tiers (this forward, ``ops/bwd_sm90.py``) need of their inputs: an sm_90
    device with Gluon, fp16/bf16, a (Q/K, V) head dim pair in ``head_dims`` (64 or 128, V's equal
    to Q/K's, by default), dense ``(B, H, Sq, D)`` / ``(B, Hkv, Sk, D)`` tensors with
    ``H % Hkv == 0``, non-empty sequences, and strides the copy engine accepts."""
    if not _tier_inputs(q, k, v, 4):
        return False
    batch, heads, seqlen_q, head_dim = q.shape
    if k.shape[-1] != head_dim or v.shape[:-1] != k.shape[:-1]:
        return False
    if (head_dim, v.shape[-1]) not in head_dims:
        return False
    if k.shape[0] != batch or heads % k.shape[1] != 0 or seqlen_q == 0 or k.shape[2] == 0:
        return False
    return all(tma_ok(t) for t in (q, k, v))


def packed_view(t: torch.Tensor) -> torch.Tensor:
    """A packed ``(total, heads, D)`` tensor as the ``(1, heads, total, D)`` view the kernels'
    4-D descriptors take (VARLEN: batch coordinate 0, each sequence's rows from its offset)."""
    return t.transpose(0, 1).unsqueeze(0)


def packed_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_dims: tuple[tuple[int, int], ...],
    paged: bool = False,
) -> bool:
    """``dense_problem`` for packed (varlen) inputs: q ``(total_q, H, D)``, k and v ``(total_k,
    Hkv, D)`` with ``H % Hkv == 0`` and rows, whose ``packed_view`` the copy engine can address;
    with ``paged``, k and v are paged caches ``(num_blocks, Hkv, block_size, D)``, addressable as
    they are (pages, heads and rows 16-byte strided)."""
    if not _tier_inputs(q, k, v, 3, 4 if paged else 3):
        return False
    if k.shape[-1] != q.shape[-1] or v.shape[:-1] != k.shape[:-1]:
        return False
    if (q.shape[-1], v.shape[-1]) not in head_dims:
        return False
    if q.shape[1] % k.shape[1] != 0 or q.shape[0] == 0 or k.shape[0] == 0:
        return False
    kv = (k, v) if paged else (packed_view(k), packed_view(v))
    return tma_ok(packed_view(q)) and all(tma_ok(t) for t in kv)


def page_rows(block_size: int, block_n: int) -> int | None:
    """The rows of a paged cache's box for ``block_n``-key tiles (``kernels/hopper/fwd_load.py:
    _load_pages``): the whole tile where pages hold a multiple of it, one page where a page is a
    power of two of at least 8 rows (the NVMMA swizzle's atom) that divides the tile, else None
    (the tier does not take that page size)."""
    if block_size % block_n == 0:
        return block_n
    if 8 <= block_size < block_n and block_size & (block_size - 1) == 0:
        return block_size
    return None


def supports(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    window: tuple[int, int] | None,
    softcap: float,
    alibi: torch.Tensor | None,
    varlen: bool = False,
    block_table: torch.Tensor | None = None,
) -> bool:
    """Whether this tier runs the problem: an sm_90 device, fp16/bf16, head dim 64 or 128, dense
    ``(B, H, Sq, D)`` / ``(B, Hkv, Sk, D)`` tensors with ``H % Hkv == 0``, non-empty
    sequences, and strides the copy engine accepts, or with ``varlen`` packed ``(total, heads,
    D)`` ones (``packed_problem``), with a ``block_table`` against paged caches; or the wider
    and padded pairs of ``forward_head_dims``. Causal, the sliding window, softcap and ALiBi
    are all covered (flags of the one kernel), so ``causal``/``window``/``softcap``/``alibi``
    never reject; they are taken so that the dispatch can call every tier alike. (Whether a
    paged cache's page size suits the tiles is ``plan``'s to say: it depends on the config.)"""
    del causal, window, softcap
    if alibi is not None and alibi.dtype != torch.float32:
        return False
    if varlen or block_table is not None:
        return packed_problem(q, k, v, forward_head_dims(), paged=block_table is not None)
    return dense_problem(q, k, v, forward_head_dims())


def descriptor(t: torch.Tensor, block: list[int]) -> Descriptor:
    """A host tensor descriptor of ``t`` (fp16, bf16 or fp32) with box ``block`` for a Gluon
    kernel: the default NVMMA swizzle for tiles, none for a 1-D run of fp32 row stats. A light
    ``ops.launch.Descriptor`` (Gluon's own ``TensorDescriptor`` validates on every build; the
    callers have checked ``tma_ok``), made the real one on a launcher miss."""
    return Descriptor(t, block, box_layout(tuple(block), t.dtype))


@functools.cache
def box_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The shared layout of a descriptor's box, once per box and dtype (``get_default_for`` costs
    about 13 us of Python a call; a backward builds nine descriptors)."""
    from triton.experimental.gluon import language as gl

    if len(block) == 1:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    gl_dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype[dtype])


class Plan(NamedTuple):
    """Everything of a launch but the tensors (``plan``): the grid, the descriptors' boxes (q,
    k, v, out), the scalar arguments, the constexprs and a packed batch's work list."""

    grid: tuple[int]
    boxes: tuple[list[int], ...]
    scalars: tuple
    meta: dict
    work: work_list.WorkList | None = None  # a packed batch's work list (VARLEN 2)


def fast_divisor(d: int) -> tuple[int, int]:
    """``(magic, shift)`` for ``kernels/hopper/common.py: fast_div`` by ``d`` (1 <= d < 2**30):
    ``n // d == (umulhi(n, magic) + n) >> shift`` for ``0 <= n < 2**30``, with ``shift =
    ceil(log2 d)`` and the round-up multiplier ``magic = floor(2**32 (2**shift - d) / d) + 1``
    (below 2**32; passed as the int32 of the same bits, which ``umulhi`` reads unsigned)."""
    if not 1 <= d < 2**30:
        raise ValueError(f"fast_divisor: divisor {d} outside [1, 2**30)")
    shift = (d - 1).bit_length()
    magic = ((1 << 32) * ((1 << shift) - d)) // d + 1
    return (magic - (1 << 32) if magic >= 1 << 31 else magic), shift


def attn_fwd_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    alibi: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
    varlen: Varlen | None = None,
    block_table: torch.Tensor | None = None,
    **options,
) -> None:
    """Write ``out`` (like q) and ``lse`` (fp32 ``(B, H, Sq)``, contiguous; packed ``(H,
    total_q)`` with ``varlen``) for inputs that passed ``supports``: ``launch`` of ``plan``.
    ``alibi`` holds float32 slopes read at ``b * stride_ab + h``; ``sinks`` float32 ``(H,)``
    logits (natural units), contiguous; ``block_table`` (with ``varlen``) int32 ``(B,
    max_blocks)`` over paged k and v; ``options`` are ``plan``'s other keywords."""
    if not tma_ok(out if varlen is None else packed_view(out)):
        raise ValueError(f"out: strides {out.stride()} are not 16-byte aligned for TMA")
    p = plan(
        q, k, v, lse, alibi=alibi is not None, sinks=sinks is not None, varlen=varlen,
        out_strides=(0, 0) if varlen is None else out.stride()[:2], block_table=block_table,
        **options,
    )  # fmt: skip
    if p is None:
        raise ValueError(
            f"block_table: pages of {k.shape[2]} keys do not fit this tier's key tiles"
        )
    launch(p, q, k, v, out, lse, alibi, sinks, varlen, block_table)


def plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    qk_scale: float,
    window_left: int,
    window_right: int,
    has_window: bool,
    softcap: float,
    alibi: bool,
    sinks: bool,
    stride_ab: int,
    config: configs.Sm90Config | None = None,
    varlen: Varlen | None = None,
    out_strides: tuple[int, int] = (0, 0),
    use_work_list: bool = True,
    block_table: torch.Tensor | None = None,
) -> Plan | None:
    """The launch of ``attn_fwd_sm90`` for these shapes and options (a function of q's, k's and
    v's shapes, lse's strides, the device and the options only, so callers keep it per problem
    signature).

    ``qk_scale`` is ``scale * log2(e)``, or ``scale / c`` with softcap ``c`` > 0, when
    ``softcap`` is ``c * log2(e)``. ``causal`` is bottom-right aligned; the window sides are the
    portable launcher's (``ops.fwd.window_bounds``: unbounded as ``Sq + Sk``, HAS_WINDOW off when
    neither binds). ``alibi`` and ``sinks``: whether those tensors come. ``config`` overrides
    the tiles (for benchmarks). ``varlen``: q, k and v are packed (``packed_problem``; the
    lengths below are the longest sequence's), and ``out_strides`` are out's row and head
    strides, which the kernel stores a sequence's last query rows with. A packed batch on the
    flat grid takes its tiles from a work list (``ops/work_list.py``) unless ``use_work_list``
    is off (for benchmarks). ``block_table`` (with ``varlen``): k and v are paged caches
    ``(num_blocks, Hkv, block_size, D)`` read through it (PAGED); None where the page size
    does not suit the config's key tiles (``page_rows``).
    """
    if varlen is None:
        batch, heads, seqlen_q, head_dim = q.shape
        kv_heads, seqlen_k = k.shape[1], k.shape[2]
    else:
        batch, heads, head_dim = varlen.batch, q.shape[1], q.shape[2]
        kv_heads, seqlen_q, seqlen_k = k.shape[1], varlen.max_seqlen_q, varlen.max_seqlen_k
    # (0, 0) dense; a paged sequence's keys are bounded by its block-table row.
    totals = packed_totals(q, k, varlen, block_table)
    # The tiles' width (``PADDED_HEAD_DIMS``, ``WIDE_PADDED_HEAD_DIMS``: boxes wider than the
    # tensors).
    head_dim, head_dim_v = kernel_head_dims(head_dim, v.shape[-1])
    # A packed batch takes the config and schedule of its longest lengths. H100, bf16,
    # scripts/varlen_bench.py: by the mean lengths instead, 8192, 8192, 1000, 77 and 3 tokens
    # at D = 64 causal ran 0.88x (two consumers for three), and 16 sequences of 256-4096 the
    # same (docs/hopper_fwd_configs.md, "Packed batches").
    spread = configs.varlen_spread(batch, seqlen_q, totals[0])
    cfg = config or configs.pick_config(
        head_dim, seqlen_q, seqlen_k, causal, has_window or softcap > 0 or alibi,
        grid=(batch * heads, num_sms(q.device.index)), packed=spread,
        keys=configs.window_keys(causal, has_window, window_left, window_right),
    )  # fmt: skip
    # What the one-Q-buffer persistent builds take (below, and the narrow Q/K builds): without
    # softcap or ALiBi (their builds spilled 40-140 B, against 8 B flat), and dense problems only
    # (head dim 256 spilled 8 B with pages shorter than the key tile; packed batches of equal
    # lengths ran on the GPU only before the consumers' while loop).
    one_q = softcap <= 0 and not alibi and varlen is None
    narrow = narrow_qk_dim(q.shape[-1], v.shape[-1])
    if narrow and one_q and config is None and cfg == configs.CONFIGS.get(head_dim):
        # The padded build's own config (not one consumer a CTA or a short window's).
        head_dim, cfg = narrow, cfg._replace(q_buffers=1, persistent=True)
    rows = 64
    block_m = rows * cfg.num_consumers
    panel = qk_panel(head_dim)
    rows_k = cfg.block_n if block_table is None else page_rows(k.shape[2], cfg.block_n)
    if rows_k is None:
        return None
    boxes = (
        [1, 1, rows, panel], [1, 1, rows_k, panel], [1, 1, rows_k, head_dim_v],
        [1, 1, rows, head_dim_v],
    )  # fmt: skip
    raw_max = softcap <= 0 and not alibi and qk_scale > 0
    n_work = -(-seqlen_q // block_m) * batch * heads
    keys = configs.loop_keys(seqlen_k, block_m, causal, has_window, window_left, window_right)
    persistent = cfg.persistent
    if persistent is None and cfg.q_buffers == 1:
        # One Q buffer a consumer (head dims 192 and 256) where ``one_q`` allows: causal as
        # ``CONFIGS`` says, non-causal without a window up to ``ONE_Q_FULL_MAX_KEY_TILES`` key
        # tiles (``fwd_sm90_configs``).
        if causal:
            short = head_dim == 192 or configs.use_persistent(keys, head_dim, causal, cfg.block_n)
        else:
            short = not has_window and configs.use_persistent(
                keys, head_dim, causal, cfg.block_n, configs.ONE_Q_FULL_MAX_KEY_TILES
            )
        persistent = short and one_q
    elif persistent is None:
        persistent = configs.use_persistent(keys, head_dim, causal, cfg.block_n)
    if config is None and spread and cfg.num_consumers > 1:
        persistent = False
    slots = num_sms(q.device.index) * cfg.ctas_per_sm
    grid, lpt_heads = (min(slots, n_work) if persistent else n_work), 1
    dynamic = configs.dynamic_deal(cfg, persistent, causal, varlen, seqlen_k)
    work = None
    if varlen is not None and not persistent and use_work_list:
        # A paged sequence's keys are counted by its offsets' differences alone (the list
        # clamps offsets to the totals; the kernel clamps the count to the block-table row).
        list_totals = totals if block_table is None else (totals[0], 2**31 - 1)
        work = work_list.plan(
            batch, heads, *list_totals, seqlen_q, seqlen_k, block_m, cfg.block_n, causal=causal,
            window_left=window_left, window_right=window_right, has_window=has_window,
        )  # fmt: skip
    kv_bytes = seqlen_k * (k.shape[-1] + v.shape[-1]) * k.element_size()
    if work is not None:
        # Each sequence's programs in the dense flat grid's order over its own heads.
        grid, lpt_heads = work.size, configs.lpt_group(heads, kv_bytes) if causal else 1
    elif dynamic:
        # First come, first served: the flat grid's order (heaviest tiles first over the
        # widest head groups L2 allows), one program an SM slot.
        lpt_heads = configs.lpt_group(batch * heads, kv_bytes)
    elif causal:
        costs = configs.tile_costs(
            seqlen_q, seqlen_k, block_m, cfg.block_n, window_left, has_window
        )
        grid, lpt_heads = configs.causal_order(costs, batch * heads, slots, persistent, kv_bytes)
    n_tiles = -(-seqlen_q // block_m)
    # The LSE's batch and head strides: (B, H, Sq), or packed (H, total_q) with batch stride 0.
    lse_strides = lse.stride()[:2] if varlen is None else (0, lse.stride(0))
    # A paged cache's block-table row stride and page size (unused, 0 and 1, otherwise).
    pages = (0, 1) if block_table is None else (block_table.stride(0), k.shape[2])
    scalars = (
        *lse_strides, stride_ab, *out_strides, *pages, heads, heads // kv_heads, batch, seqlen_q,
        seqlen_k, *totals, lpt_heads, *fast_divisor(n_tiles * lpt_heads),
        *fast_divisor(lpt_heads), *fast_divisor(heads), float(qk_scale), window_left,
        window_right, float(softcap),
    )  # fmt: skip
    meta = {
        "HEAD_DIM": head_dim,
        "BLOCK_N": cfg.block_n,
        "NUM_STAGES": cfg.num_stages,
        "NUM_CONSUMERS": cfg.num_consumers,
        "CONSUMER_REGS": cfg.consumer_regs,
        "PINGPONG": pingpong_mode(cfg.pingpong, cfg.num_consumers),
        "IS_CAUSAL": causal,
        "HAS_WINDOW": has_window,
        "SOFTCAP": softcap > 0,
        "HAS_ALIBI": alibi,
        "HAS_SINKS": sinks,
        "RAW_MAX": raw_max,
        "EVEN_N": varlen is None and seqlen_k % cfg.block_n == 0,
        "PERSISTENT": persistent,
        "VARLEN": 0 if varlen is None else 2 if work is not None else 1,
        "PAGED": block_table is not None,
        "Q_BUFS": cfg.q_buffers,
        "DYNAMIC": dynamic,
        "num_warps": 4,
        "maxnreg": cfg.maxnreg,
    }
    return Plan((grid,), boxes, scalars, meta, work)


def launch(
    p: Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    alibi: torch.Tensor | None,
    sinks: torch.Tensor | None,
    varlen: Varlen | None = None,
    block_table: torch.Tensor | None = None,
) -> None:
    """Launch ``p`` on these tensors (which passed ``supports``, ``out`` ``tma_ok``; packed ones
    with their ``varlen`` offsets and paged caches with their ``block_table``, as ``p`` was
    planned)."""
    tensors = (q, k, v, out)
    if varlen is not None:
        # Paged caches are 4-D as they are: (pages, heads, rows, D).
        paged = block_table is not None
        tensors = tuple(
            t if paged and i in (1, 2) else packed_view(t) for i, t in enumerate(tensors)
        )
    descs = tuple(descriptor(t, box) for t, box in zip(tensors, p.boxes, strict=True))
    # The LSE stands in for an absent ALiBi, sinks, offsets, work list (or the dynamic deal's
    # counter) or block table pointer (never read: its flag is off), out for O (read only with
    # VARLEN).
    if p.meta.get("DYNAMIC"):
        work = work_counter(q.device)
    else:
        work = lse if p.work is None else work_list.build(p.work, *varlen[:2])
    extra = (
        lse, lse if alibi is None else alibi, lse if sinks is None else sinks, out,
        *((lse, lse) if varlen is None else varlen[:2]), work,
        lse if block_table is None else block_table,
    )  # fmt: skip
    with runtime.launch_on(q):
        launcher()(p.grid, (*descs, *extra, *p.scalars), p.meta, planned=True)
