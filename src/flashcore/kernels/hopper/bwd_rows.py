"""The row kernels around the Hopper backward (``kernels/hopper/bwd.py``), in plain Triton:
``bwd_prep_kernel`` before the main kernel (the row stats delta and lse2, and the fp32 dQ
accumulator zeroed) and ``bwd_dq_kernel`` after it (dQ scaled and rounded out of that
accumulator); with PDL each overlaps the main kernel's launch (``bwd.py``, "Dependent
launch").
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashcore.kernels.bwd_delta import tile_delta
from flashcore.kernels.common import load_lse2


@triton.jit
def row_tile(rows_per_head, num_heads, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's tile of a kernel over ``(B, H, rows_per_head, D)`` rows, one (BLOCK_M,
    BLOCK_D) tile a program, grid ``cdiv(rows_per_head, BLOCK_M) * B * H``: ``(off_bh, off_b,
    off_h, offs_m, offs_d)``, the batch and head as int64."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(rows_per_head, BLOCK_M)
    off_bh = pid // n_tiles
    start_m = (pid % n_tiles) * BLOCK_M
    off_b = (off_bh // num_heads).to(tl.int64)
    off_h = (off_bh % num_heads).to(tl.int64)
    return off_bh, off_b, off_h, start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)


@triton.jit
def bwd_prep_kernel(
    O,
    DO,
    DLSE,
    LSE,
    DELTA,
    LSE2,
    DQ_ACC,
    stride_ob,
    stride_oh,
    stride_om,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dlb,
    stride_dlh,
    stride_lb,
    stride_lh,
    num_heads,
    seqlen_q,
    seqlen_pad,
    acc_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Row stats of the backward, one (BLOCK_M, D) tile a program: ``delta = rowsum(dO * O) -
    dlse`` (``tile_delta``, as the portable dQ kernel) and ``lse2`` (``load_lse2``: +inf for a row
    with no key and past Sq), written to ``(B, H, seqlen_pad)`` fp32 buffers (delta 0 past Sq);
    and the same rows of the fp32 dQ accumulator ``DQ_ACC`` (contiguous ``(B, H, acc_rows,
    D)``, ``acc_rows`` Sq or, with the dQ rows permuted, ``seqlen_pad``) zeroed, for the
    main kernel's reduce-adds (launched after it on the same stream; one kernel fewer than a
    separate fill). Grid ``cdiv(seqlen_pad, BLOCK_M) * B * H``. ``BLOCK_D``: the
    main kernel's head dim, a power of two of at least ``HEAD_DIM`` (the tensors')."""
    if PDL:
        # The main kernel may launch now; it waits for this grid before reading what it writes.
        gdc_launch_dependents()
    off_bh, off_b, off_h, offs_m, offs_d = row_tile(seqlen_pad, num_heads, BLOCK_M, BLOCK_D)
    rows = offs_m.to(tl.int64)[:, None]  # Sq x row stride may pass 2**31
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + rows * stride_om + offs_d
    do_ptrs = DO + off_b * stride_dob + off_h * stride_doh + rows * stride_dom + offs_d
    in_tile = offs_m[:, None] < seqlen_q
    if HEAD_DIM < BLOCK_D:
        in_tile = in_tile & (offs_d[None, :] < HEAD_DIM)
    do = tl.load(do_ptrs, mask=in_tile, other=0.0)
    dlse_ptrs = DLSE + off_b * stride_dlb + off_h * stride_dlh + offs_m
    delta = tile_delta(
        o_ptrs, do, dlse_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, False, HEAD_DIM == BLOCK_D,
        HAS_DLSE,
    )  # fmt: skip
    lse2 = load_lse2(LSE + off_b * stride_lb + off_h * stride_lh + offs_m, offs_m, seqlen_q, False)
    out = off_bh.to(tl.int64) * seqlen_pad + offs_m
    tl.store(DELTA + out, tl.where(offs_m < seqlen_q, delta, 0.0))
    tl.store(LSE2 + out, lse2)
    acc = DQ_ACC + (off_bh.to(tl.int64) * acc_rows + rows) * HEAD_DIM + offs_d
    in_acc = offs_m[:, None] < acc_rows
    if HEAD_DIM < BLOCK_D:
        in_acc = in_acc & (offs_d[None, :] < HEAD_DIM)
    tl.store(acc, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=in_acc)


@triton.jit
def bwd_dq_kernel(
    DQ_ACC,
    DQ,
    scale,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    num_heads,
    seqlen_q,
    acc_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """dQ out of the fp32 accumulator the main kernel reduce-added it into (unscaled):
    ``DQ = scale * DQ_ACC`` rounded to DQ's dtype, one (BLOCK_M, D) tile a program, grid
    ``cdiv(seqlen_q, BLOCK_M) * B * H``. ``DQ_ACC`` as ``bwd_prep_kernel`` takes it (contiguous
    ``(B, H, acc_rows, HEAD_DIM)``; a packed batch's ``(1, H, total_q, HEAD_DIM)``); ``DQ`` by its
    strides (a packed batch's ``(total_q, H, D)`` as batch stride 0, head and row strides). The
    product and the rounding are those of ``torch.mul(acc, scale, out=dq)``, which this replaced:
    PyTorch's mixed-dtype elementwise path moves one element at a time, this 16-byte pieces; 66.3
    against 49.0 us at 16k tokens, 16 heads, D = 128 (H200; docs/performance_backward.md, "The
    dQ conversion and the short floors")."""
    off_bh, off_b, off_h, offs_m, offs_d = row_tile(seqlen_q, num_heads, BLOCK_M, BLOCK_D)
    rows = offs_m.to(tl.int64)[:, None]
    if PDL:
        # Launched while the main kernel runs: its reduce-adds complete before DQ_ACC is read.
        gdc_wait()
    mask = offs_m[:, None] < seqlen_q
    if HEAD_DIM < BLOCK_D:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    acc = tl.load(DQ_ACC + (off_bh.to(tl.int64) * acc_rows + rows) * HEAD_DIM + offs_d, mask=mask)
    dq = DQ + off_b * stride_qb + off_h * stride_qh + rows * stride_qm + offs_d * stride_qd
    tl.store(dq, (acc * scale).to(DQ.dtype.element_ty), mask=mask)
