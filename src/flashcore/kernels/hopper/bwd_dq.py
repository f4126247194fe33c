"""The dQ part of the Hopper backward's step (``kernels/hopper/bwd.py``, whose docstring holds
the schedule and the barrier phases): a consumer's half of a step's dQ on the tensor cores and its
reduce-add into the fp32 accumulator by the copy engine."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashcore.kernels.hopper.common import reinterpret


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``cp.reduce.async.bulk.tensor`` with ``.add`` of the shared tile ``src`` into the
    descriptor's tensor at ``coord`` (rows past the extent dropped). Triton 3.6's Gluon exposes
    the builder call (``create_async_tma_reduce``) but no language function; this is that
    function, written as ``tma.async_copy_shared_to_global`` is."""
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


# The staging tile's rows in shared memory, permuted (``ops/bwd_sm90.py: dq_layout``). The
# consumers store dQ straight from the wgmma accumulator: a 64-bit store covers 8 rows x 32 bytes,
# served as two half-warps of 4 consecutive rows. In the copy engine's 128-byte swizzle a row's
# 32-byte column pieces sit at the same banks as those of the row after it (row pairs (0, 1) and
# (2, 3) share 16 banks), so every store takes twice the wavefronts it needs. Stored with the row
# bits of each group of 8 rotated (row ``4a + b`` at slot ``2b + a``), a half-warp's 4 rows fall on
# slots 0, 2, 4, 6 (or 1, 3, 5, 7), whose swizzles put their pieces on all 32 banks. The
# reduce-add descriptor walks the slots in the same order (dims ``(groups of 8 rows, b, a,
# columns)``, strides ``(8 D, D, 4 D, 1)``), so the rows land where they belong.
@gluon.constexpr_function
def permuted_rows_layout(cols):
    """The 128-byte swizzled fp32 layout of a ``(64, cols)`` tile (the copy engine's, boxes of 32
    columns side by side) with the row bits of each 8-row group rotated: offset bit -> (row,
    column). Unrotated, rows 1, 2, 4 sit at offset bits 5, 6, 7 (with the swizzle's column
    XOR); here slots 1, 2, 4 hold rows 4, 1, 2."""
    bases = [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [4, 4], [1, 8], [2, 16], [8, 0], [16, 0]]
    bases.append([32, 0])
    col = 32
    while col < cols:
        bases.append([0, col])
        col *= 2
    return gl.SharedLinearLayout(offset_bases=bases)


@gluon.constexpr_function
def permuted_box(shape):
    """Whether a staging tile or dQ descriptor block of this shape is the permuted rows' ``(8, 4,
    2, cols)`` (``ops/bwd_sm90.py: dq_box``) rather than rows in order, ``(1, 1, 64, cols)``."""
    return shape[1] == 4


@gluon.jit
def stage_dq(tile, dq):
    """Store the fp32 ``dq`` (64 x cols, the wgmma accumulator) into the staging ``tile``: a
    ``(1, 1, 64, cols)`` box in row order, or an ``(8, 4, 2, cols)`` one with each 8-row group's
    rows permuted (``permuted_rows_layout``, conflict-free)."""
    if permuted_box(tile.shape):
        flat = tile.reshape(dq.shape)
        reinterpret(flat, gl.float32, dq.shape, permuted_rows_layout(dq.shape[1])).store(dq)
    else:
        tile.reshape(dq.shape).store(dq)


@gluon.jit
def dq_rows(dq_desc, off_b, off_h, heads, seqlen_pad):
    """``(base, per_head)``: where the dQ rows of batch ``off_b``, head ``off_h`` (of ``heads``)
    start in the reduce-add descriptor's row coordinate, and how far apart consecutive heads'
    rows are. ``(0, 0)`` for the ``(B, H, Sq, D)`` descriptor (its row coordinate is the row
    itself: the head is a coordinate of its own); for the permuted rows' ``(B H Sp / 8, 4, 2,
    D)`` view (``Sp`` = ``seqlen_pad``, Sq to a multiple of 64: a kernel argument, so the stride
    comes from the constant bank) rows of the flattened ``(B H Sp, D)``."""
    if permuted_box(dq_desc.block_type.shape):
        return (off_b * heads + off_h) * seqlen_pad, seqlen_pad
    else:
        return 0, 0


@gluon.jit
def dq_row(base, per_head, head_in_group, row):
    """The reduce-add descriptor's row of a step's query block: ``row`` (``q_start + start_m``) of
    the program's ``head_in_group``-th head, from ``dq_rows``' ``(base, per_head)``."""
    return base + head_in_group * per_head + row


@gluon.jit
def reduce_dq(dq_desc, off_b, off_h, row, col, tile):
    """Reduce-add the staging ``tile`` into 64 dQ rows from ``row``, columns from ``col``: of
    batch ``off_b``, head ``off_h`` in the ``(B, H, Sq, D)`` descriptor, or from flattened row
    ``row`` (a multiple of 64: ``dq_rows``) in the permuted rows' view."""
    if permuted_box(dq_desc.block_type.shape):
        tma_reduce_add(dq_desc, [row >> 3, 0, 0, col], tile)
    else:
        tma_reduce_add(dq_desc, [off_b, off_h, row, col], tile)


@gluon.jit
def rows_of_sequence(dq, n_rows):
    """VARLEN: ``dq`` with its rows from ``n_rows`` on set to 0. Those rows of a step's query
    block are the next sequence's (their dS is 0, but 0 times an inf or NaN key of this sequence
    is NaN), and the reduce-add would carry them into its dQ."""
    rows = gl.arange(0, dq.shape[0], layout=gl.SliceLayout(1, dq.type.layout))
    return gl.where(gl.expand_dims(rows < n_rows, 1), dq, 0.0)


@gluon.jit
def dq_issue(ds_smem, ds_ready, k0_cols, k1_cols, zero_dq, step, ABLATE: gl.constexpr):
    """Issue this consumer's dQ products of step ``step`` (>= -1; -1 is no step: the products
    run on whatever the tiles hold) over both consumers' keys, once both dS^T tiles of the step
    are written (``ds_ready``); returns the accumulator's token (two wgmma groups in flight)."""
    buf = (step + 2) % 2
    # Phase of ds_ready[buf] for this step; for step -1 the barrier's initial phase (parity 1),
    # which counts as completed.
    mbarrier.wait(ds_ready.index(buf), (((step + 2) // 2) & 1) ^ 1)
    dq = zero_dq
    if ABLATE < 2:
        ds0 = ds_smem.index(2 * buf).permute((1, 0))
        ds1 = ds_smem.index(2 * buf + 1).permute((1, 0))
        dq = warpgroup_mma(ds0, k0_cols, zero_dq, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds1, k1_cols, dq, is_async=True)
    return dq


@gluon.jit
def dq_finish(
    ds_free,
    dq_tile,
    dq_desc,
    dq,
    step,
    live,
    off_b,
    off_h,
    start_m,
    CONSUMER: gl.constexpr,
    ABLATE: gl.constexpr,
    q_end=0,
    VARLEN: gl.constexpr = False,
):
    """After step ``step``'s dQ products have completed (``dq``, their accumulator): free both
    dS^T tiles of the step (``ds_free``) and reduce-add ``dq`` into dQ at ``(off_b, off_h,
    start_m)`` when ``live``. VARLEN: rows from ``q_end`` on (the next sequence's) are reduced as
    zeros (``rows_of_sequence``); ``start_m`` is the descriptor's row (``reduce_dq``)."""
    mbarrier.arrive(ds_free.index((step + 2) % 2), count=1)
    if ABLATE < 2:
        stage_and_reduce(
            dq, dq_tile, dq_desc, off_b, off_h, start_m, CONSUMER * dq.shape[1], q_end - start_m,
            ABLATE == 0 and live, VARLEN,
        )  # fmt: skip


@gluon.jit
def stage_and_reduce(dq, tile, dq_desc, off_b, off_h, row, col, n_rows, live,
                     VARLEN: gl.constexpr, WAIT_READ: gl.constexpr = True):  # fmt: skip
    """A consumer's fp32 ``dq`` (64 rows x its columns) into its staging ``tile`` once the copy
    engine has read the tile's previous contents (``cp.async.bulk.wait_group.read``; without
    WAIT_READ the caller has waited), then, when ``live``, reduce-added into dQ at ``(off_b,
    off_h, row)``, columns from ``col`` (``reduce_dq``). VARLEN: rows from ``n_rows`` on (the
    next sequence's) as zeros (``rows_of_sequence``)."""
    if WAIT_READ:
        tma.store_wait(0)
    if VARLEN:
        dq = rows_of_sequence(dq, n_rows)
    stage_dq(tile, dq)
    fence_async_shared()
    if live:
        reduce_dq(dq_desc, off_b, off_h, row, col, tile)


@gluon.jit
def dq_step(
    ds_smem,
    ds_ready,
    ds_free,
    k0_cols,
    k1_cols,
    dq_tile,
    dq_desc,
    zero_dq,
    step,
    live,
    off_b,
    off_h,
    start_m,
    CONSUMER: gl.constexpr,
    ABLATE: gl.constexpr,
    q_end=0,
    VARLEN: gl.constexpr = False,
):
    """This consumer's half of the columns of step ``step``'s dQ, issued, waited and reduced
    (``dq_issue``, then ``dq_finish``)."""
    dq = dq_issue(ds_smem, ds_ready, k0_cols, k1_cols, zero_dq, step, ABLATE)
    if ABLATE < 2:
        dq = warpgroup_mma_wait(0, deps=[dq])
    dq_finish(
        ds_free, dq_tile, dq_desc, dq, step, live, off_b, off_h, start_m, CONSUMER, ABLATE, q_end,
        VARLEN,
    )  # fmt: skip
