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


@gluon.jit
def rows_of_sequence(dq, n_rows):
    """VARLEN: ``dq`` with its rows from ``n_rows`` on set to 0. Those rows of a step's query
    block are the next sequence's (their dS is 0, but 0 times an inf or NaN key of this sequence
    is NaN), and the reduce-add would carry them into its dQ."""
    rows = gl.arange(0, dq.shape[0], layout=gl.SliceLayout(1, dq.type.layout))
    return gl.where(gl.expand_dims(rows < n_rows, 1), dq, 0.0)


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
    """This consumer's half of the columns of step ``step``'s dQ (``step`` >= -1; -1 is no step:
    the products run on whatever the tiles hold and ``live`` is false), over both consumers' keys,
    reduce-added into dQ at ``(off_b, off_h, start_m)`` when ``live``. Waits until both dS^T
    tiles of the step are written (``ds_ready``) and, after its products, frees them
    (``ds_free``). VARLEN: rows from ``q_end`` on (the next sequence's) are reduced as zeros
    (``rows_of_sequence``)."""
    buf = (step + 2) % 2
    # Phase of ds_ready[buf] for this step; for step -1 the barrier's initial phase (parity 1),
    # which counts as completed.
    mbarrier.wait(ds_ready.index(buf), (((step + 2) // 2) & 1) ^ 1)
    if ABLATE < 2:
        ds0 = ds_smem.index(2 * buf).permute((1, 0))
        ds1 = ds_smem.index(2 * buf + 1).permute((1, 0))
        dq_tok = warpgroup_mma(ds0, k0_cols, zero_dq, use_acc=False, is_async=True)
        dq_tok = warpgroup_mma(ds1, k1_cols, dq_tok, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq_tok])
    mbarrier.arrive(ds_free.index(buf), count=1)
    if ABLATE < 2:
        # The staging tile was last read by the previous step's reduce: wait until the copy
        # engine has read it (cp.async.bulk.wait_group.read).
        tma.store_wait(0)
        if VARLEN:
            dq = rows_of_sequence(dq, q_end - start_m)
        dq_tile.reshape(dq.shape).store(dq)
        fence_async_shared()
        if ABLATE == 0 and live:
            tma_reduce_add(dq_desc, [off_b, off_h, start_m, CONSUMER * dq.shape[1]], dq_tile)
