"""The backward's first kernel: ``delta = rowsum(dO * O) - dlse`` per query row, in fp32.

``kernels/bwd.py`` (which re-exports it) has the algorithm; ``delta`` feeds ``dS = P * (dP -
delta)`` in both gradient kernels. Grid: ``cdiv(Sq, BLOCK_M) * B * H`` programs
(``common.program_tile``). Flags: HAS_DLSE subtracts the LSE's gradient (read by strides: it may be
a broadcast); EVEN_M skips row masks; IS_VARLEN reads packed rows as the forward does. fp32
inputs sum in fp64 and round once, like the fp64 ``dP`` of ``common.dot_nt``. Delta is written
with the LSE's strides.
"""

import triton
import triton.language as tl

from flashcore.kernels.common import load_tile, program_tile
from flashcore.kernels.varlen import seq_bounds


@triton.jit
def attn_bwd_preprocess_kernel(
    O,
    DO,
    DLSE,
    DELTA,
    CU_Q,
    stride_ob,
    stride_oh,
    stride_om,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dlb,
    stride_dlh,
    stride_dlm,
    stride_lb,
    stride_lh,
    num_heads,
    seqlen_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    EVEN_M: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """``delta = rowsum(dO * O) [- dlse]`` in fp32, written with the LSE's strides."""
    tile_m, off_bh = program_tile(tl.cdiv(seqlen_q, BLOCK_M), False)
    start_m = tile_m * BLOCK_M
    off_b = (off_bh // num_heads).to(tl.int64)
    off_h = (off_bh % num_heads).to(tl.int64)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    if IS_VARLEN:
        # Packed sequences (see the forward): move the bases to this sequence's first row.
        row_q, seqlen_q = seq_bounds(CU_Q, off_b)
        if start_m >= seqlen_q:
            return
        O += row_q * stride_om
        DO += row_q * stride_dom
        DLSE += row_q * stride_dlm
        DELTA += row_q

    offs_tm = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_tm
    offs_d = tl.arange(0, BLOCK_D)
    row0 = start_m.to(tl.int64)
    o_ptrs = (
        O
        + off_b * stride_ob
        + off_h * stride_oh
        + row0 * stride_om
        + (offs_tm[:, None] * stride_om + offs_d[None, :])
    )
    do_ptrs = (
        DO
        + off_b * stride_dob
        + off_h * stride_doh
        + row0 * stride_dom
        + (offs_tm[:, None] * stride_dom + offs_d[None, :])
    )
    o = load_tile(o_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    do = load_tile(do_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    if o.dtype == tl.float32:
        # fp32 inputs: dP comes from an fp64 product rounded once (common.dot_nt); delta must be
        # rounded the same way, or dP - delta keeps a rounding residue where the two are equal
        # (one visible key: dS must be exactly 0, and was ~1 ulp).
        delta = tl.sum(o.to(tl.float64) * do.to(tl.float64), 1).to(tl.float32)
    else:
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        # The LSE gradient may be a broadcast (stride 0) or any other view: read it by strides.
        dlse_ptrs = DLSE + off_b * stride_dlb + off_h * stride_dlh + row0 * stride_dlm
        dlse_ptrs += offs_tm * stride_dlm
        if EVEN_M:
            dlse = tl.load(dlse_ptrs)
        else:
            dlse = tl.load(dlse_ptrs, mask=offs_m < seqlen_q, other=0.0)
        delta -= dlse.to(tl.float32)
    delta_ptrs = DELTA + off_b * stride_lb + off_h * stride_lh + offs_m
    if EVEN_M:
        tl.store(delta_ptrs, delta)
    else:
        tl.store(delta_ptrs, delta, mask=offs_m < seqlen_q)
