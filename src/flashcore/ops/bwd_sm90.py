"""Host launcher of the Hopper backward (``kernels/hopper/bwd.py``, Gluon, sm_90a).

``ops.bwd.launch`` calls it (``supports``, then ``attn_bwd_sm90``) on an sm_90 GPU where the
tier is chosen (``runtime.backward_tier``, ``tuning.sm90_backward``) and ``deterministic`` is
off; ``scripts/hopper_bwd.py`` calls it directly.

One call: ``bwd_prep_kernel`` (delta with the portable tier's ``tile_delta``, lse2) into padded
fp32 row buffers, and the fp32 dQ accumulator zeroed (all three in one allocation);
``attn_bwd_sm90_kernel`` (dK, dV written, dQ reduce-added); ``bwd_dq_kernel`` (dQ scaled and
cast into ``dq``). With ``PDL`` the last two are launched with programmatic dependent launch
(``launch_pdl``): each may start while the kernel before it runs, and waits for that grid in-kernel
(``griddepcontrol.wait``) before reading what it wrote (kernels/hopper/bwd.py, "Dependent
launch").
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from flashcore.ops import problem as pb
from flashcore.ops import runtime

# The forward tier's checks and descriptors, so that both tiers accept the same problems.
from flashcore.ops.fwd_sm90 import (
    DENSE_HEAD_DIMS,
    box_layout,
    dense_problem,
    kernel_head_dim,
    num_sms,
    packed_problem,
    packed_view,
    padded_head_dims,
    tma_ok,
)
from flashcore.ops.fwd_sm90_configs import lpt_group
from flashcore.ops.launch import Bound, Descriptor, Launcher, cached, current_stream, remember

ROWS = 64  # query rows per step and keys per consumer warpgroup (kernels/hopper/bwd.py)
BLOCK_N = 128  # keys per program
DQ_ROWS = 64  # rows a program of the dQ conversion (bwd_dq_kernel)
# Programmatic dependent launch of the main kernel after the prep kernel and of the dQ conversion
# after the main kernel (``launch_pdl``; each waits with ``griddepcontrol.wait`` before reading
# what the grid before it writes): the main kernel's first programs set up and load K and V while
# the prep kernel's last ones run, and the launch gaps between the three close. Under CUDA graphs
# 2.4-7.4 us less a backward (H200; docs/performance_backward.md, "Programmatic dependent launch").
PDL = True
# The consumers' fixed tiles' (K_c, V_c, the dQ products' K columns) wgmma descriptors formed in
# the step loop through a zero LLVM cannot see, instead of every k-step's descriptor before the
# loop (``kernels/hopper/bwd.py``, FRESH_DESC; not with K and V in registers). sm_90a: D = 128
# spills 0 B (120), causal long 8 (172), 2-3 ``R2UR`` a step (18-27). Taken in the builds with
# the dQ products beside dK (``dq_beside_dk``): H200, bf16, scripts/bwd_switch_ab.py FRESH_DESC,
# two runs: there 1.01-1.03x (non-causal, causal from 4096), in the causal builds without it
# 0.95-0.97x at 1024-3000 (docs/performance_backward.md). FRESH_DESC_ALWAYS (tests): in every
# build without K and V in registers.
FRESH_DESC = True
FRESH_DESC_ALWAYS = False
# FRESH_DESC_CAUSAL_OPTIONS: also in the causal builds with a window, softcap, ALiBi or packed rows
# (sm_90a, D = 128: spills window 96 -> 0 B dense, 528 -> 96 B packed; packed 404 -> 40 B, ALiBi
# 196 -> 8, softcap 192 -> 96; the plain causal build, which measured 0.95-0.97x with it, spills
# none without it). H200, bf16, two runs each, scripts/bwd_switch_ab.py (FRESH_DESC_ALWAYS, then
# this switch, then this switch over the other options): packed causal (127, 0) 1.09x, dense
# (127, 0) 1.01-1.03x, (4095, 0) at 16k 0.99-1.00x; packed causal 1.05-1.07x; softcap and ALiBi
# causal at 2048 1.03-1.04x; dK and dV bit for bit (docs/performance_backward.md).
FRESH_DESC_CAUSAL_OPTIONS = True
# Causal: consumer 1 skips the products of a step none of whose rows sees its keys (a program's
# first step) and writes a zero dS^T tile (``kernels/hopper/bwd.py``, SKIP_MASKED). H200, bf16,
# scripts/bwd_switch_ab.py SKIP_MASKED: D = 128 causal 1.04-1.06 at 512, 1.03-1.05 at 1024,
# 0.99-1.03 at 2048, window 1.06; D = 64 1.01-1.02 at 512-2048; from 4096 and non-causal level.
SKIP_MASKED = True
# With a window: consumer 0 skips the products of the last step when its rows see none of its
# keys (the window's left edge), and without causal consumer 1 those of the first step at the
# right edge (``kernels/hopper/bwd.py``, SKIP_WINDOW). H200, bf16, scripts/bwd_switch_ab.py
# SKIP_MASKED_WINDOW --cases window: causal (256, 0) D = 128 1.01-1.02, causal (128, 0) D = 64
# 1.01-1.02, non-causal (256, 256) D = 128 1.09-1.10; dK and dV bit for bit.
SKIP_MASKED_WINDOW = True
# Causal with a window: the diagonal's and the window's masks as one unsigned comparison of
# ``row + diag - key`` against the window's left size, on every step (``kernels/hopper/bwd.py``,
# BAND_MASK). sm_90a: D = 128 step loops 718 / 708 -> 669 / 653 instructions, with softcap 200 ->
# 120 B of spills and 17 / 4 -> 2 / 4 local accesses a step, packed 96 -> 40 B; D = 64 610 / 593 ->
# 529 / 512. H200, bf16, scripts/bwd_switch_ab.py BAND_MASK --cases window (two runs): D = 64
# causal (128, 0) 1.030-1.033x, D = 128 causal (256, 0) 1.00-1.02x; packed (127, 0) 1.004x (one).
BAND_MASK = True
# Softcap or ALiBi at D = 128: each step's dQ a step late as in the other builds (the kernel's
# DQ_LAG; it was off there because ptxas spilled 20-80% more, before FRESH_DESC took those causal
# builds), and with it SKIP_MASKED, SKIP_WINDOW and the dQ products beside dK. sm_90a: causal
# softcap 96 -> 24 B of spills, causal window softcap 120 -> 36 B, softcap window 136 -> 68 B;
# non-causal softcap 16 -> 88 B (none in the step loops). H200, bf16, scripts/bwd_switch_ab.py
# DQ_LAG_OPTIONS (two runs each): softcap causal 1.04-1.05x, non-causal 1.04-1.07x, (256, 256)
# window 1.10-1.12x, causal (4095, 0) window 1.04-1.05x; ALiBi causal (256, 0) window 1.06x,
# causal 0.99-1.05x, non-causal 0.97-0.99x, so non-causal ALiBi stays as it was (``lag_options``).
DQ_LAG_OPTIONS = True


def fresh_desc(beside: bool, kv_regs: bool, causal_options: bool = False) -> bool:
    """Whether a build forms its fixed tiles' descriptors in the step loop (``FRESH_DESC``), given
    its ``DQ_BESIDE_DK``, ``KV_REGS`` and whether it is causal with a window, softcap, ALiBi or
    packed rows."""
    wanted = beside or FRESH_DESC_ALWAYS or (FRESH_DESC_CAUSAL_OPTIONS and causal_options)
    return FRESH_DESC and wanted and not kv_regs


def lag_options(causal: bool, softcap: bool, alibi: bool) -> bool:
    """Whether a build with softcap or ALiBi takes each step's dQ a step late at D = 128 (the
    kernel's ``LAG_OPTIONS``; ``DQ_LAG_OPTIONS``): with softcap, or with ALiBi when causal."""
    return DQ_LAG_OPTIONS and (softcap or (alibi and causal))


# dQ leaves in (64, D / 2) fp32 tiles: each consumer reduce-adds half the columns of a step's dQ.


@functools.cache
def dq_layout(head_dim: int, permuted_rows: bool = False):
    """The shared layout of the fp32 dQ staging tile (64 rows x D/2 columns, or D with the dQ
    warpgroup) and of its reduce-add descriptor.

    ``permuted_rows`` (``Sm90BwdConfig.permuted_rows``, dense problems): the 128-byte swizzle
    over a box ``(8, 4, 2, cols)`` of the accumulator viewed as ``(B H Sp / 8, 4, 2, D)`` with
    strides ``(8 D, D, 4 D, 1)`` (``dq_view``): the copy engine takes each 8-row group's
    rows in the order 0, 4, 1, 5, 2, 6, 3, 7, and the kernel stores them there
    (``kernels/hopper/bwd_dq.py: permuted_rows_layout``), which puts a half-warp's four rows on
    distinct banks, with the 128-byte swizzle's full-width copies.

    Otherwise (``rows_permuted`` false: packed batches, whose query blocks start anywhere, and
    the D=128 builds where the permutation measured slower), rows in order. The consumers
    store the tile straight from the wgmma accumulator,
    each 64-bit store covering 8 rows x 32 bytes, which the hardware serves as two half-warps of
    4 rows. With a 128-byte swizzle each half-warp's 4 rows share 16 banks: four wavefronts a
    store where two would do (ncu, D=128: bank conflicts on 33% of the kernel's shared-store
    wavefronts). A 32-byte swizzle gives each half-warp 32 distinct banks, but the copy engine
    then sends the tile as 8-column (32-byte) slabs, four times the L2 requests: at D=128
    (H100, ncu at its fixed 1.44 GHz) the kernel took 9.5% fewer cycles and the L2 ran at 87%
    of its throughput (52% before), and at the boost clock (do_bench) it lost 2-10%. D=64 sends
    half the dQ bytes a step, and there the 32-byte swizzle measured 3-4% faster
    (docs/performance_backward.md, "dQ a step late")."""
    from triton.experimental.gluon import language as gl

    swizzle = 32 if head_dim == 64 and not permuted_rows else 128
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=32, rank=4)


def dq_box(head_dim: int, cfg: Sm90BwdConfig, permuted_rows: bool) -> list[int]:
    """The reduce-add box of a staging tile: all D columns with the dQ warpgroup, else each
    consumer's half; ``(1, 1, 64, cols)`` or, with ``permuted_rows``, ``(8, 4, 2, cols)``
    (``dq_layout``)."""
    cols = head_dim if cfg.dq_warpgroup else head_dim // 2
    return [8, 4, 2, cols] if permuted_rows else [1, 1, ROWS, cols]


def dq_view(acc: torch.Tensor) -> torch.Tensor:
    """The dense fp32 accumulator ``(B, H, Sp, D)`` (``Sp`` = ``seqlen_pad``, Sq to a multiple of
    64) as the 4-D tensor that ``dq_layout(..., permuted_rows=True)``'s descriptor walks: ``(B H Sp
    / 8, 4, 2, D)``, element ``[g, b, a, d]`` being row ``8 g + 4 a + b`` of the flattened ``(B H
    Sp, D)``."""
    b, h, rows, d = acc.shape
    return acc.view(b * h * rows // 8, 2, 4, d).transpose(1, 2)


class Sm90BwdConfig(NamedTuple):
    """``num_stages`` slots of the Q/dO ring; ``consumer_regs`` per consumer thread after
    ``setmaxnreg`` (the producer warp keeps 24); ``maxnreg`` the cap at entry (9 warps, 13 with
    the dQ warpgroup: at most 65536 registers in all)."""

    num_stages: int = 2
    consumer_regs: int = 240
    maxnreg: int = 168
    dq_warpgroup: bool = False
    """dQ on a warpgroup of its own (``dq_regs`` registers a thread) instead of in the consumers'
    steps (``kernels/hopper/bwd.py``, "DQ_WARPGROUP"); head dim 64 only."""
    dq_regs: int = 96
    kv_regs: bool = False
    """K and V of each consumer's keys held in registers as the A operands of ``S^T`` and
    ``dP^T`` (``kernels/hopper/bwd.py``, "KV_REGS"), where ``kv_in_registers`` allows it."""
    ablate: int = 0
    """Measurement only (wrong dQ): 1 computes dQ but never reduces it into memory, 2 skips dQ
    (``scripts/hopper_bwd.py bench --ablate``)."""
    permuted_rows: bool = True
    """Dense problems: the dQ staging tile's rows permuted for conflict-free stores and the
    128-byte swizzle (``dq_layout``); packed ones always keep them in order."""
    dq_beside_dk: bool = True
    """The dQ products beside dV's and dK's where ``dq_beside_dk`` takes them (measurement: False
    keeps them after dK everywhere)."""


# Shared memory (the kernel's docstring, "Invariants"): 198 KB at D=128, 133 KB at D=64. At D=64
# dQ runs on its own warpgroup (4-10% faster, H100; docs/performance_backward.md, "dQ on a
# warpgroup of its own"): 128 x (192 + 200 + 96 + 24) registers after setmaxnreg (consumer 0,
# the default partition, gets what the others leave), and the consumers hold K and V in
# registers (2-13% faster; "K and V as register operands at D = 64"). At D=128 the consumers
# need 240 each and neither fits.
CONFIGS = {
    128: Sm90BwdConfig(),
    64: Sm90BwdConfig(consumer_regs=200, maxnreg=128, dq_warpgroup=True, dq_regs=96, kv_regs=True),
}

# The ptxas Triton compiles sm_90 with is CUDA 12's up to 3.8 (12.8 in 3.6 and 3.7, 12.9 in
# 3.8) and CUDA 13's from 3.9 on (the wheel's ptxas-blackwell, 13.4 in 3.9.0), which spilled
# consumer 0 of the D=64 builds at 192 registers: 280-308 B, about 50 local accesses in each step
# of its loop (causal, causal varlen; 64 B ragged), where 12.9 spills none from the same PTX
# (3.8's or 3.9's). With 16 registers fewer for the dQ warpgroup (80) consumer 0 gets 208 and
# 13.4's step loops hold 0-2 local accesses (8-44 B in all, about 50 before), 6-16% faster on an
# H200; 12.8 measured no faster with that split (docs/performance_backward.md, "K and V as
# register operands at D = 64"), so CUDA 12's keeps 96 (docs/maintainers.md, "Other Tritons").
DQ_REGS_PTXAS13 = 80


@functools.cache
def ptxas_major() -> int:
    """The CUDA major version of the ptxas this Triton compiles sm_90 with."""
    from triton.backends.nvidia.compiler import get_ptxas

    return int(get_ptxas(90).version.split(".")[0])


@functools.cache
def dq_regs(cfg: Sm90BwdConfig) -> int:
    """The dQ warpgroup's registers a thread (``DQ_REGS``) for the ptxas that compiles it."""
    if cfg.dq_warpgroup and ptxas_major() >= 13:
        return min(cfg.dq_regs, DQ_REGS_PTXAS13)
    return cfg.dq_regs


# Causal D=128 problems take the permuted dQ staging rows from this many query rows on (H100,
# bf16, rows permuted / in order: 0.974 at 2048, 1.071 at 8192, 1.017 at 16384;
# docs/performance_backward.md, "The dQ rows' head stride from seqlen_pad").
PERMUTED_ROWS_MIN_SEQLEN_CAUSAL = 4096


def rows_permuted(
    cfg: Sm90BwdConfig,
    head_dim: int,
    varlen: bool,
    causal: bool,
    window: bool,
    softcap: bool,
    alibi: bool,
    seqlen_q: int,
) -> bool:
    """Whether the dQ staging rows are permuted (``dq_layout``): dense problems, as the config
    says; at D=128 not with a window (0.985x of rows in order), always with ALiBi, with softcap
    only when not causal, and causal otherwise only from ``PERMUTED_ROWS_MIN_SEQLEN_CAUSAL``
    query rows on (H100, bf16, rows permuted / in order: non-causal 1.01-1.04, softcap 1.04-1.09,
    causal softcap 0.993-0.995 (2048, 8192), ALiBi causal 1.07-1.09, causal 0.97 at 2048 and 3072,
    1.03 at 4096 and 6144, 1.02-1.07 from 8192; docs/performance_backward.md, "The dQ rows' head
    stride from seqlen_pad")."""
    if not cfg.permuted_rows or varlen:
        return False
    if head_dim == 64:
        return True
    if window:
        return False
    if alibi:
        return True
    if softcap:
        return not causal
    return not causal or seqlen_q >= PERMUTED_ROWS_MIN_SEQLEN_CAUSAL


# Causal dense problems take the dQ products beside dK from this many query rows on (H200, bf16,
# in-process A/B, two runs, beside dK / after it: causal 0.95-0.99 at 1024-3000, 1.00-1.02 from
# 4096; non-causal 1.01-1.05 at every length; docs/performance_backward.md, "dQ beside dK").
DQ_BESIDE_DK_MIN_SEQLEN_CAUSAL = 4096


def dq_beside_dk(cfg: Sm90BwdConfig, causal: bool, varlen: bool, seqlen_q: int) -> bool:
    """Whether the consumers issue a step's dQ products beside its dV and dK products and stage
    dQ under dK (``DQ_BESIDE_DK``; the kernel takes it where it runs each dQ a step late, in the
    consumers): without causal, and causal dense problems from
    ``DQ_BESIDE_DK_MIN_SEQLEN_CAUSAL`` query rows on."""
    if cfg.dq_warpgroup or not cfg.dq_beside_dk:
        return False
    return not causal or (not varlen and seqlen_q >= DQ_BESIDE_DK_MIN_SEQLEN_CAUSAL)


def kv_in_registers(cfg: Sm90BwdConfig, window: bool, softcap: bool, alibi: bool) -> bool:
    """Whether the kernel takes K and V as register operands (``KV_REGS``): as the config says,
    without score options. With softcap or ALiBi ptxas 12.8 (Triton 3.6's) spilled 268-1156 B at
    D=64 or crashed; with a window it compiled (32 B of spills) but measured 1-4% slower (H100,
    bf16, (256, 0) causal at 2048 and 8192; docs/performance_backward.md, "K and V as register
    operands at D = 64")."""
    return cfg.kv_regs and not (window or softcap or alibi)


@functools.cache
def kernels() -> tuple[Launcher, Launcher]:
    """Launchers of the row-stats kernel and the backward kernel (imported with triton at the
    first launch). ``Launcher`` skips Triton's per-call argument binding once a signature has
    been compiled: the compiled kernel's own launcher reads only each descriptor's base, shape,
    strides and padding (its swizzle and block come from the compiled metadata)."""
    from flashcore.kernels.hopper import bwd, bwd_rows

    return Launcher(bwd_rows.bwd_prep_kernel, 7), Launcher(bwd.attn_bwd_sm90_kernel, 16)


@functools.cache
def dq_kernel() -> Launcher:
    """Launcher of the dQ conversion (``bwd_dq_kernel``: the fp32 accumulator scaled and cast
    into dq)."""
    from flashcore.kernels.hopper import bwd_rows

    return Launcher(bwd_rows.bwd_dq_kernel, 2)


def dq_strides(dq: torch.Tensor, packed: bool) -> tuple[int, ...]:
    """``dq``'s batch, head, row and column strides as ``bwd_dq_kernel`` takes them: a dense
    ``(B, H, Sq, D)``'s own; a packed batch's ``(total_q, H, D)`` as one sequence (batch stride
    0)."""
    if not packed:
        return dq.stride()
    return (0, dq.stride(1), dq.stride(0), dq.stride(2))


def supports(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    *,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    varlen: bool = False,
) -> bool:
    """Whether this kernel computes the problem's gradients into ``dq``, ``dk``, ``dv`` (when
    given: shaped like q, k, v; dk and dv with strides the copy engine accepts): an sm_90 device,
    fp16/bf16, head dim 64 or 128, or one of ``fwd_sm90.padded_head_dims`` (72-120 run by the
    D = 128 kernel, 48 and 56 by the D = 64 one) (V's equal to Q/K's), dense ``(B, H, Sq, D)`` /
    ``(B, Hkv, Sk, D)`` tensors with ``H % Hkv == 0``, non-empty sequences, strides the copy
    engine accepts, with any of causal, window, softcap, ALiBi and sinks; with ``varlen`` packed
    ``(total, heads, D)`` ones (``fwd_sm90.packed_problem``)."""
    # Sinks need nothing of the kernel: P comes from the LSE, which includes them, and their
    # gradient from the LSE and delta (the caller's ``bwd.sink_grad``). Window, softcap and ALiBi
    # are flags of the kernel.
    del sinks, window, softcap
    if alibi is not None and alibi.dtype != torch.float32:
        return False
    head_dims = DENSE_HEAD_DIMS + padded_head_dims()
    if not (packed_problem if varlen else dense_problem)(q, k, v, head_dims):
        return False
    if dq is not None and dq.shape != q.shape:
        return False
    view = packed_view if varlen else (lambda t: t)
    return all(g is None or (g.shape == t.shape and tma_ok(view(g))) for g, t in ((dk, k), (dv, v)))


# The split's extra memory (dK and dV per query head: two (B, H, Sk, D) tensors) at most this
# many bytes; past it the grouped grid runs. With fewer than two programs per SM it is about
# G x 17 MB at D = 128 in 16-bit (G the group size), so this binds only for large groups (MQA
# with many heads).
SPLIT_MAX_BYTES = 512 * 2**20


def split_group(
    groups: int,
    programs: int,
    sms: int,
    causal: bool,
    window: tuple[int, int],
    extra_bytes: int = 0,
) -> bool:
    """Whether to run a GQA/MQA backward with one program per query head instead of per kv head
    (each program reading its kv head's K and V, dK and dV written per query head and summed
    over each group afterwards).

    A program walks the query blocks of all ``groups`` query heads of its kv head, so with few
    programs (``programs`` = key blocks x batch x kv heads) the longest one sets the time:
    non-causal, ``groups`` steps' worth against ``ceil(programs * groups / sms)`` waves of the
    split ones; causal, the first key block sees every query and the last almost none, so below
    two programs per SM (``sms``) the grouped grid leaves SMs idle for up to half the time.
    ``extra_bytes``: what the split would allocate; never more than ``SPLIT_MAX_BYTES``.
    """
    if groups <= 1 or extra_bytes > SPLIT_MAX_BYTES:
        return False
    if causal and window == (-1, -1):
        return programs < 2 * sms
    return math.ceil(programs * groups / sms) < groups


def _group_sum(part: torch.Tensor, out: torch.Tensor | None, groups: int) -> torch.Tensor:
    """The per-query-head gradients ``part`` ``(B, H, Sk, D)`` summed over each group of
    ``groups`` heads into ``out`` ``(B, H / groups, Sk, D)`` (new when None), in one reduction
    kernel (PyTorch accumulates fp16/bf16 sums in fp32)."""
    grouped = part.unflatten(1, (-1, groups))
    if out is None:
        return grouped.sum(2)
    return torch.sum(grouped, 2, out=out)


def attn_bwd_sm90(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    dlse: torch.Tensor | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    config: Sm90BwdConfig | None = None,
    *,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi: torch.Tensor | None = None,
    varlen: pb.Varlen | None = None,
    quick: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, delta)`` of ``out, lse = attention(q, k, v, causal, scale)`` for inputs that
    passed ``supports`` (with the same ``dq``, ``dk``, ``dv``; not checked again here, the caller
    has); ``delta`` is ``rowsum(dout * out) - dlse``, fp32, shaped like ``lse`` (a view into a
    padded buffer; for the sinks' gradient).

    ``q``, ``out``, ``dout``: ``(B, H, Sq, D)``; ``k``, ``v``: ``(B, Hkv, Sk, D)`` (any strides the
    copy engine accepts; ``(B, S, H, D)`` storage passed as ``.transpose(1, 2)`` works; ``dout``
    and ``out`` with others are copied); ``lse``: the forward's natural-log fp32 ``(B, H, Sq)``;
    ``dlse``: its gradient or None. Causal is bottom-right aligned; ``window``, ``softcap`` and
    ``alibi`` (float32 ``(H,)`` or ``(B, H)`` slopes) as ``flashcore.attention`` takes them. The
    gradients are written into ``dq``, ``dk``, ``dv`` when given (tests pass NaN-filled ones to see
    every element written), else into new contiguous tensors, in the input dtype. ``config``
    overrides the tiles. Extra memory: the fp32 dQ accumulator (``B H Sq D`` x 4 bytes, Sq to a
    multiple of 64 where the staging rows are permuted: ``rows_permuted``) and two
    fp32 ``(B, H, Sq_pad)`` row buffers (``Sq_pad = cdiv(Sq, 64) * 64``); where ``split_group``
    says so (GQA/MQA with few programs), dK and dV per query head (``2 B H Sk D`` x the element
    size, at most ``SPLIT_MAX_BYTES``), summed over each group (in fp32) at the end.

    ``varlen``: a packed batch (``supports(..., varlen=True)``): q, out, dout ``(total_q, H, D)``,
    k, v ``(total_k, Hkv, D)``, lse and dlse ``(H, total_q)``; the kernels see ``(1, heads,
    total, D)`` views (``fwd_sm90.packed_view``), the row stats and the dQ accumulator are those
    of one sequence of ``total_q`` rows, and each program finds its sequence in the offsets.

    ``quick``: a list, to which the call appends the ``Quick`` run of its launches (None where
    the problem has options or copies that a quick run does not make: ``ops.bwd``'s "Quick
    backwards").
    """
    # Everything but the tensors per problem signature (the split, grids, scalars, constexprs,
    # descriptor layouts, whether out and dout need a copy the copy engine can address): tens of
    # microseconds of Python a call otherwise (docs/performance_host.md).
    aligned = (out.data_ptr() | dout.data_ptr()) % 16 == 0
    key = (
        q.shape, k.shape, q.dtype, out.stride(), dout.stride(), aligned,
        None if dlse is None else dlse.stride(), lse.stride(), q.device, causal, scale, window,
        softcap, None if alibi is None else (alibi.shape, alibi.stride()), config,
        None if varlen is None else pb.problem_dims(q, k, varlen),
    )  # fmt: skip
    p = _PLANS.get(key)
    if p is None:
        p = cached(_PLANS, key, lambda: _plan(
            q, k, out, dout, lse, dlse, causal, scale, config, window, softcap, alibi, varlen,
        ))  # fmt: skip
    if p.copy_out:
        out = out.contiguous()
    if p.copy_dout:
        dout = dout.contiguous()
    lse = lse.contiguous()
    if p.split:
        dk_out, dv_out = dk, dv
        dk = dv = None
    # delta, lse2 and the dQ accumulator (zeroed by the prep kernel) in one fp32 allocation, cut
    # in one call; the accumulator starts at a multiple of 64 floats (16-byte aligned for the copy
    # engine).
    rows = p.rows
    acc_numel = math.prod(p.acc_shape)
    fp32 = torch.empty(2 * rows + acc_numel, device=q.device, dtype=torch.float32)
    delta, lse2, dq_acc = fp32.split_with_sizes((rows, rows, acc_numel))
    # (B, H, Sq, D), with permuted rows (B, H, seqlen_pad, D); packed, (1, H, total_q, D): one
    # sequence of all rows (the prep's view).
    dq_acc = dq_acc.view(p.acc_shape)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty(p.grad_shape, device=k.device, dtype=k.dtype) if dk is None else dk
    dv = torch.empty(p.grad_shape, device=v.device, dtype=v.dtype) if dv is None else dv
    alibi_ptr = pb.alibi_arg(alibi, lse)[0]  # contiguous slopes (the plan's batch stride)
    dlse_arg = lse if dlse is None else dlse
    prep, main = kernels()
    tile, rows_1d, dq_tile = p.layouts
    if varlen is None:
        cu_q = cu_k = lse  # never read
        tensors = (q, k, v, dout, dk, dv)
        # The masked dK/dV stores of a sequence's last key block (VARLEN only): never read.
        grad_strides = (0, 0, 0, 0)
    else:
        cu_q, cu_k = varlen[:2]
        tensors = tuple(packed_view(t) for t in (q, k, v, dout, dk, dv))
        grad_strides = (dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1))
    with runtime.launch_on(q):
        prep(p.prep_grid, (out, dout, dlse_arg, lse, delta, lse2, dq_acc, *p.prep_scalars),
             p.prep_meta, planned=True)  # fmt: skip
        box, dq_box = p.boxes
        q_t, k_t, v_t, dout_t, dk_t, dv_t = tensors
        descs = (
            Descriptor(q_t, box, tile),
            Descriptor(k_t, box, tile),
            Descriptor(v_t, box, tile),
            Descriptor(dout_t, box, tile),
            Descriptor(lse2, [ROWS], rows_1d),
            Descriptor(delta, [ROWS], rows_1d),
            Descriptor(dq_view(dq_acc) if p.permuted_rows else dq_acc, dq_box, dq_tile),
            Descriptor(dk_t, box, tile),
            Descriptor(dv_t, box, tile),
        )
        main(
            p.main_grid,
            (*descs, alibi_ptr, cu_q, cu_k, dk, dv, lse2, delta, *p.main_scalars, *grad_strides),
            p.main_meta,
            planned=True,
        )
        # The main kernel accumulates dQ unscaled; one more kernel scales and casts it.
        strides = dq_strides(dq, varlen is not None)
        dq_kernel()(
            p.dq_grid, (dq_acc, dq, scale, *strides, *p.dq_scalars), p.dq_meta, planned=True
        )
    if p.split:
        groups = q.shape[1] // k.shape[1]
        dk, dv = _group_sum(dk, dk_out, groups), _group_sum(dv, dv_out, groups)
    elif quick is not None:
        quick.append(
            None if varlen is not None or alibi is not None or dlse is not None
            or p.copy_out or p.copy_dout else Quick.of(p, q.get_device())
        )  # fmt: skip
    return dq, dk, dv, delta.view(p.delta_shape)[..., : lse.shape[-1]]


class Quick:
    """``attn_bwd_sm90`` of one dense problem signature without a LSE gradient, ALiBi, the split
    or copies, below ``Launcher`` (``ops.bwd``, "Quick backwards"): the three launches of its
    plan bound (``ops.launch.Bound``), the main kernel's tensor maps kept per set of addresses
    (the shapes and strides are the signature's). ``run(dout, q, k, v, out, lse)`` returns
    ``(dq, dk, dv, None)``, or None where an address is not 16-byte aligned."""

    __slots__ = ("convert", "device", "fronts", "main", "numel", "plan", "prep")

    # Sets of addresses whose main-kernel arguments are kept, per signature; past these many the
    # map starts over (single descriptors' expansions: ``Bound.part``).
    MAX_FRONTS = 64

    def __init__(self, plan: Plan, device: int, prep: Bound, main: Bound, convert: Bound):
        self.plan = plan
        # delta, lse2 and the dQ accumulator: one fp32 buffer, as attn_bwd_sm90 allocates it.
        self.numel = 2 * plan.rows + math.prod(plan.acc_shape)
        self.device = device
        self.prep = prep
        self.main = main
        self.convert = convert
        self.fronts: dict[tuple, list] = {}

    @classmethod
    def of(cls, plan: Plan, device: int) -> Quick | None:
        prep, main = kernels()
        launches = (
            Bound.of(prep, plan.prep_grid, plan.prep_meta),
            Bound.of(main, plan.main_grid, plan.main_meta),
            Bound.of(dq_kernel(), plan.dq_grid, plan.dq_meta),
        )
        if None in launches:
            return None
        return cls(plan, device, *launches)

    def __call__(self, dout, q, k, v, out, lse) -> tuple | None:
        a_q, a_k, a_v, a_out, a_dout, a_lse = (
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(),
            lse.data_ptr(),
        )  # fmt: skip
        if (a_q | a_k | a_v | a_out | a_dout | a_lse) % 16:
            return None
        rows = self.plan.rows
        fp32 = lse.new_empty((self.numel,))
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        delta = fp32.data_ptr()
        lse2 = delta + 4 * rows
        acc = lse2 + 4 * rows
        stream = current_stream(self.device)
        # The LSE stands in for dlse (never read without HAS_DLSE).
        self.prep(stream, (a_out, a_dout, a_lse, a_lse, delta, lse2, acc))
        a_dk, a_dv = dk.data_ptr(), dv.data_ptr()
        addresses = (a_q, a_k, a_v, a_dout, delta, a_dk, a_dv, a_lse)
        front = self.fronts.get(addresses)
        if front is None:
            front = self._front(addresses, q, k, v, dout, fp32, dk, dv)
        self.main(stream, front)
        self.convert(stream, (acc, dq.data_ptr()))
        return dq, dk, dv, None

    def _front(self, addresses: tuple, q, k, v, dout, fp32, dk, dv) -> list:
        """The main kernel's pointer arguments for these tensors, as ``attn_bwd_sm90`` passes
        them (nine descriptors expanded, then the plain pointers), kept under ``addresses``;
        each descriptor's expansion kept under its own address too (``Bound.part``), so that a
        new combination of addresses seen before encodes nothing."""
        p = self.plan
        box, dq_box = p.boxes
        tile, rows_1d, dq_tile = p.layouts
        a_q, a_k, a_v, a_dout, a_delta, a_dk, a_dv, a_lse = addresses
        tensors = {0: q, 1: k, 2: v, 3: dout, 7: dk, 8: dv}

        def describe(i: int) -> Descriptor:
            t = tensors.get(i)
            if t is not None:
                return Descriptor(t, box, tile)
            # 4, 5, 6: lse2, delta and the dQ accumulator, views of the one fp32 buffer.
            delta, lse2, acc = fp32.split_with_sizes((p.rows, p.rows, math.prod(p.acc_shape)))
            if i < 6:
                return Descriptor(lse2 if i == 4 else delta, [ROWS], rows_1d)
            acc = acc.view(p.acc_shape)
            return Descriptor(dq_view(acc) if p.permuted_rows else acc, dq_box, dq_tile)

        front = []
        for i, address in enumerate((a_q, a_k, a_v, a_dout, a_delta, a_delta, a_delta, a_dk, a_dv)):
            front += self.main.part(i, address, functools.partial(describe, i))
        # ALiBi's pointer and both offsets: the LSE stands in (never read).
        front += (a_lse, a_lse, a_lse, a_dk, a_dv, a_delta + 4 * p.rows, a_delta)
        return remember(self.fronts, addresses, front, self.MAX_FRONTS)


class Plan(NamedTuple):
    """A backward launch but its tensors (``_plan``)."""

    split: bool
    grad_shape: tuple[int, ...]  # of the dK, dV the kernel writes (per query head when split)
    rows: int  # B * H * seqlen_pad: the length of each fp32 row-stat buffer
    delta_shape: tuple[int, ...]  # (B, H, seqlen_pad); packed (H, seqlen_pad) (the LSE's)
    acc_shape: tuple[int, ...]  # of the dQ accumulator: q's (rows seqlen_pad with permuted
    # rows), or packed (1, H, total_q, D)
    permuted_rows: bool  # the dQ staging rows permuted (dq_layout)
    copy_out: bool  # out and dout need a contiguous copy (strides the copy engine refuses)
    copy_dout: bool
    boxes: tuple[list[int], list[int]]  # of the (B, H, S, D) tiles and of the dQ accumulator's
    layouts: tuple  # their shared layouts: tiles, fp32 row stats, dQ accumulator
    prep_grid: tuple[int]
    prep_scalars: tuple
    prep_meta: dict
    main_grid: tuple[int]
    main_scalars: tuple
    main_meta: dict
    dq_grid: tuple[int]
    dq_scalars: tuple  # heads, rows a head (Sq; packed total_q), the accumulator's rows a head
    dq_meta: dict


# Plans by problem signature (bounded by ops.launch.cached).
_PLANS: dict[tuple, Plan] = {}


def _plan(
    q: torch.Tensor,
    k: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    config: Sm90BwdConfig | None,
    window: tuple[int, int],
    softcap: float,
    alibi: torch.Tensor | None,
    varlen: pb.Varlen | None,
) -> Plan:
    # The strides the launches will see: out and dout as given where the copy engine can address
    # them (else contiguous copies, as each call then makes), the LSE contiguous.
    view = (lambda t: t) if varlen is None else packed_view
    copy_out, copy_dout = not tma_ok(view(out)), not tma_ok(view(dout))
    out = out.contiguous() if copy_out else out
    dout = dout.contiguous() if copy_dout else dout
    lse = lse.contiguous()
    batch, heads, kv_heads, seqlen_q, seqlen_k = pb.problem_dims(q, k, varlen)
    real_head_dim = q.shape[-1]
    total_q, total_k = pb.packed_totals(q, k, varlen)
    # The prep kernel and the row stats see one sequence of total_q rows when packed.
    rows_b, rows_q = (batch, seqlen_q) if varlen is None else (1, total_q)
    # The tiles' width: 128 for fwd_sm90.PADDED_HEAD_DIMS (boxes wider than the tensors, whose
    # columns past the head dim the copy engine reads as zeros and drops on stores).
    head_dim = kernel_head_dim(real_head_dim)
    cfg = config or CONFIGS[head_dim]
    if cfg.dq_warpgroup and head_dim != 64:
        raise ValueError(f"config: dq_warpgroup takes head dim 64, not {head_dim}")
    groups = heads // kv_heads
    programs = math.ceil(seqlen_k / BLOCK_N) * batch * kv_heads
    extra = 2 * batch * heads * seqlen_k * real_head_dim * k.element_size()
    split = split_group(groups, programs, num_sms(q.device.index), causal, window, extra)
    # With the split, a program per query head (groups of one), each reading the K and V of kv
    # head h // groups; dK and dV land per query head.
    grad_heads = heads if split else kv_heads
    seqlen_pad = math.ceil(rows_q / ROWS) * ROWS
    sc = pb.scores(causal, window, softcap, scale, alibi is not None, seqlen_q, seqlen_k)
    permuted_rows = rows_permuted(
        cfg, head_dim, varlen is not None, sc.is_causal, sc.has_window, sc.has_softcap,
        sc.has_alibi, seqlen_q,
    )  # fmt: skip
    # The accumulator's rows a head: with permuted rows seqlen_pad, the row stats' (whole groups
    # of 8, as the copy engine's boxes see no row past them; the kernel's head stride is then an
    # argument it already has), the rows past Sq zeroed by the prep kernel and dropped by the
    # conversion.
    acc_rows = seqlen_pad if permuted_rows else rows_q
    stride_ab = 0 if alibi is None else pb.alibi_arg(alibi, lse)[1]
    # Batch and head strides of the row stats ((B, H, Sq); packed (H, total_q)) and row strides.
    dlse_strides = (0, 0) if dlse is None else pb.stats_strides(dlse, varlen)
    prep_scalars = (
        *pb.row_strides(out, varlen), *pb.row_strides(dout, varlen), *dlse_strides,
        *pb.stats_strides(lse, varlen), heads, rows_q, seqlen_pad, acc_rows,
    )  # fmt: skip
    prep_meta = {
        "HEAD_DIM": real_head_dim,
        "BLOCK_D": head_dim,
        "BLOCK_M": ROWS,
        "HAS_DLSE": dlse is not None,
        "PDL": PDL,
        "num_warps": 4,
    }
    lpt_heads = 1
    if sc.is_causal and not sc.has_window:
        # Heaviest key blocks first across heads: the flat grid is handed out in order as SMs
        # free up (the forward's ``causal_order``); a group's heads read their Q and dO at once.
        q_bytes = seqlen_q * 2 * real_head_dim * q.element_size()
        lpt_heads = lpt_group(batch * grad_heads, q_bytes)
    main_scalars = (
        grad_heads, heads // grad_heads, groups if split else 1, seqlen_q, seqlen_k, lpt_heads,
        seqlen_pad, sc.qk_scale, float(scale), sc.window_left, sc.window_right, sc.softcap,
        stride_ab, total_q, total_k,
    )  # fmt: skip
    beside = dq_beside_dk(cfg, sc.is_causal, varlen is not None, seqlen_q)
    kv_regs = kv_in_registers(cfg, sc.has_window, sc.has_softcap, sc.has_alibi)
    options = sc.has_window or sc.has_softcap or sc.has_alibi or varlen is not None
    causal_options = sc.is_causal and options
    main_meta = {
        "HEAD_DIM": head_dim,
        "NUM_STAGES": cfg.num_stages,
        "CONSUMER_REGS": cfg.consumer_regs,
        "IS_CAUSAL": sc.is_causal,
        "HAS_WINDOW": sc.has_window,
        "SOFTCAP": sc.has_softcap,
        "HAS_ALIBI": sc.has_alibi,
        "EVEN_N": varlen is None and seqlen_k % BLOCK_N == 0,
        "DQ_WARPGROUP": cfg.dq_warpgroup,
        "DQ_REGS": dq_regs(cfg),
        "ABLATE": cfg.ablate,
        "KV_REGS": kv_regs,
        "VARLEN": varlen is not None,
        "PERMUTED_ROWS": permuted_rows,
        "DQ_BESIDE_DK": beside,
        "PDL": PDL,
        "FRESH_DESC": fresh_desc(beside, kv_regs, causal_options),
        "SKIP_MASKED": SKIP_MASKED and sc.is_causal,
        "SKIP_WINDOW": SKIP_MASKED_WINDOW and sc.has_window,
        "BAND_MASK": BAND_MASK and sc.is_causal and sc.has_window,
        "LAG_OPTIONS": lag_options(sc.is_causal, sc.has_softcap, sc.has_alibi),
        "num_warps": 4,
        "maxnreg": cfg.maxnreg,
        "launch_pdl": PDL,
    }
    box = [1, 1, ROWS, head_dim]
    layouts = (
        box_layout(tuple(box), q.dtype),
        box_layout((ROWS,), torch.float32),
        dq_layout(head_dim, permuted_rows),
    )
    if varlen is None:
        grad_shape = (batch, grad_heads, seqlen_k, real_head_dim)
        delta_shape = (batch, heads, seqlen_pad)
        acc_shape = (batch, heads, acc_rows, real_head_dim)
    else:
        grad_shape = (total_k, grad_heads, real_head_dim)
        delta_shape, acc_shape = (heads, seqlen_pad), (1, heads, total_q, real_head_dim)
    return Plan(
        split, grad_shape, rows_b * heads * seqlen_pad, delta_shape, acc_shape, permuted_rows,
        copy_out, copy_dout, (box, dq_box(head_dim, cfg, permuted_rows)), layouts,
        (seqlen_pad // ROWS * rows_b * heads,), prep_scalars, prep_meta,
        (math.ceil(seqlen_k / BLOCK_N) * batch * grad_heads,), main_scalars, main_meta,
        (math.ceil(rows_q / DQ_ROWS) * rows_b * heads,), (heads, rows_q, acc_rows),
        {
            "HEAD_DIM": real_head_dim, "BLOCK_D": head_dim, "BLOCK_M": DQ_ROWS, "PDL": PDL,
            "num_warps": 4, "launch_pdl": PDL,
        },
    )  # fmt: skip
