"""Helpers of the Hopper backward at head dim 256 and MLA's head dims (``bwd256.py``, whose
docstring holds the design; ``bwd256_dq.py``; ``bwd_mla.py``): a program's key block and
sequence (``program``), Q/K tiles of two widths (``qk_tiles``, ``load_tiles``), a packed batch's
tile landed on the producer's own barrier with its rows past the sequence's end zeroed
(``load_fixed``), the scores' softcap and ALiBi (``capped``), dK and dV stored from registers or
by TMA (``store_acc``, ``store_rows``), and the barriers the kernels set up alike
(``handoff_state``, ``tile_barriers``).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
)

from flashcore.kernels.hopper.common import (
    LOG2E,
    interleave,
    sequence,
    tanh,
    tma_load,
    tma_store,
    zero_rows,
)

ROWS = gl.constexpr(64)  # query rows a step, and keys a program (one m64 wgmma)


@gluon.jit
def program(CU_Q, CU_K, heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k,
             BY_KEYS: gl.constexpr, LAST_FIRST: gl.constexpr, VARLEN: gl.constexpr):  # fmt: skip
    """``(start, off_b, off_h, q_start, k_start, seqlen_q, seqlen_k, desc_b)`` of a program: its
    block's first key (BY_KEYS, the dK/dV kernel; ``heads`` the kv heads) or first query row
    (the dQ kernel; ``heads`` the query heads), its batch (VARLEN: sequence) and head, and its
    sequence's first rows, lengths and batch coordinate in the descriptors
    (``common.sequence``). LAST_FIRST: the blocks in reverse (causal dQ: the later rows see more
    keys, so the heavy programs start first; VARLEN, counted from the longest sequence's last).
    With VARLEN the grid is sized by the longest sequence: a block may start past its own."""
    pid = gl.program_id(0)
    if BY_KEYS:
        n_blocks = gl.cdiv(seqlen_k, ROWS)
    else:
        n_blocks = gl.cdiv(seqlen_q, ROWS)
    block, off_bh = interleave(pid, n_blocks, lpt_heads)
    if LAST_FIRST:
        block = n_blocks - 1 - block
    off_b = off_bh // heads
    q_start, k_start, seqlen_q, seqlen_k, desc_b = sequence(
        CU_Q, CU_K, off_b, seqlen_q, seqlen_k, total_q, total_k, VARLEN
    )
    return block * ROWS, off_b, off_bh % heads, q_start, k_start, seqlen_q, seqlen_k, desc_b


@gluon.jit
def load_tiles(qk_desc, v_desc, off_b, off_h, row, bar, a_dest, b_dest, v_dest,
                QK_B: gl.constexpr):  # fmt: skip
    """A Q (or K) tile and a dO (or V) tile from row ``row`` on, by TMA onto ``bar``: the Q/K
    tile's first ``a_dest.shape[3]`` columns into ``a_dest`` and, with QK_B (MLA), the next QK_B
    into ``b_dest``, in boxes of ``qk_desc``'s width (a box is a power of two wide: MLA's 192
    columns come as three of 64); the other into ``v_dest``."""
    PANEL: gl.constexpr = qk_desc.block_type.shape[3]
    QK_A: gl.constexpr = a_dest.shape[3]
    A_PANELS: gl.constexpr = QK_A // PANEL
    B_PANELS: gl.constexpr = QK_B // PANEL
    mbarrier.expect(
        bar, (A_PANELS + B_PANELS) * qk_desc.block_type.nbytes + v_desc.block_type.nbytes
    )
    if A_PANELS == 1:
        tma_load(qk_desc, [off_b, off_h, row, 0], bar, a_dest)
    else:
        for i in gl.static_range(A_PANELS):
            tma_load(
                qk_desc, [off_b, off_h, row, i * PANEL], bar, a_dest.slice(i * PANEL, PANEL, dim=3)
            )
    if QK_B > 0:
        gl.static_assert(B_PANELS == 1)
        tma_load(qk_desc, [off_b, off_h, row, QK_A], bar, b_dest)
    tma_load(v_desc, [off_b, off_h, row, 0], bar, v_dest)


@gluon.jit
def load_fixed(qk_desc, v_desc, off_h, row, keep, bar, fix_bar, n_fix, a_dest, b_dest, v_dest,
                QK_B: gl.constexpr):  # fmt: skip
    """``load_tiles`` for a packed sequence's tiles whose rows from ``keep`` on are past the
    sequence's end (the next sequence's, or past the tensors): landed on this warp's own
    ``fix_bar`` (its ``n_fix``-th use), those rows zeroed (a NaN or inf there would reach this
    sequence's gradients through a product over rows, even times P = 0), then ``bar`` arrived
    on (the arrival the copies' expect makes otherwise). Returns ``n_fix + 1``."""
    load_tiles(qk_desc, v_desc, 0, off_h, row, fix_bar, a_dest, b_dest, v_dest, QK_B)
    mbarrier.wait(fix_bar, n_fix & 1)
    zero_rows(a_dest.reshape([a_dest.shape[2], a_dest.shape[3]]), keep)
    if QK_B > 0:
        zero_rows(b_dest.reshape([b_dest.shape[2], b_dest.shape[3]]), keep)
    zero_rows(v_dest.reshape([v_dest.shape[2], v_dest.shape[3]]), keep)
    fence_async_shared()
    mbarrier.arrive(bar, count=1)
    return n_fix + 1


@gluon.jit
def store_rows(ptr, acc, start, seqlen, stride, col0, head_dim, layout: gl.constexpr):
    """``acc`` into rows ``[start, start + ROWS)`` and columns from ``col0`` on of dQ, dK or dV
    (``ptr`` at its batch and head, ``stride`` its row stride): rows past ``seqlen`` and columns
    past ``head_dim`` (the tensors' own, 256 or less) dropped."""
    rows = start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    offs = gl.expand_dims(rows.to(gl.int64) * stride, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(rows < seqlen, 1) & gl.expand_dims(cols < head_dim, 0)
    gl.store(ptr + offs, acc.to(ptr.dtype.element_ty), mask=mask)


@gluon.jit
def capped(s, rows, keys, diag, qk_scale, softcap, ALIBI, slope_off, SOFTCAP: gl.constexpr,
            HAS_ALIBI: gl.constexpr):  # fmt: skip
    """Raw scores ``s`` (q.k) to the forward's log2 units (``ops/problem.py:scores`` folds the
    units): softcap (``c log2(e) tanh(scale q.k / c)``), then ALiBi (``- slope |i + Sk - Sq -
    j|``, the slope at ``ALIBI + slope_off``). ``rows`` and ``keys`` broadcast to ``s``'s shape.
    Returns ``(s, t)``: ``t`` the tanh (``s`` itself without SOFTCAP, unused)."""
    s = s * qk_scale
    t = s
    if SOFTCAP:
        t = tanh(s)
        s = t * softcap
    if HAS_ALIBI:
        slope = gl.load(ALIBI + slope_off) * LOG2E
        s = s - slope * gl.abs(rows + diag - keys).to(gl.float32)
    return s, t


@gluon.jit
def store_acc(DK, DV, dka_desc, dkb_desc, dv_desc, ka_tile, kb_tile, v_tile, dv, dk_a, dk_b,
               off_b, off_hk, desc_b, k_start, start_n, seqlen_k, stride_dkb, stride_dkh,
               stride_dkn, stride_dvb, stride_dvh, stride_dvn, scale, head_dim,
               HAS_DV: gl.constexpr, HAS_DK: gl.constexpr, QK_B: gl.constexpr,
               TMA_EPILOGUE: gl.constexpr, VARLEN: gl.constexpr):  # fmt: skip
    """dV (HAS_DV) and dK (HAS_DK: scaled; MLA's second tile ``dk_b``) of the ROWS keys from
    ``start_n``: with TMA_EPILOGUE through the tiles they match by TMA stores (the caller has
    seen the tiles' last readers complete, and waits for the stores' reads), where a packed
    block does not cross its sequence's end (a TMA store would overwrite the next sequence's
    rows); otherwise from registers. Shared by ``bwd_mla.py``'s consumers (both at once)."""
    if TMA_EPILOGUE:
        if VARLEN:
            if start_n + ROWS > seqlen_k:
                _store_acc_rows(DK, DV, dv, dk_a, dk_b, off_b, off_hk, k_start, start_n, seqlen_k,
                                stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
                                stride_dvn, scale, head_dim, HAS_DV, HAS_DK, QK_B)  # fmt: skip
            else:
                _store_acc_tma(dka_desc, dkb_desc, dv_desc, ka_tile, kb_tile, v_tile, dv, dk_a,
                               dk_b, scale, desc_b, off_hk, k_start + start_n, HAS_DV, HAS_DK,
                               QK_B)  # fmt: skip
        else:
            _store_acc_tma(dka_desc, dkb_desc, dv_desc, ka_tile, kb_tile, v_tile, dv, dk_a, dk_b,
                           scale, desc_b, off_hk, k_start + start_n, HAS_DV, HAS_DK,
                           QK_B)  # fmt: skip
    else:
        _store_acc_rows(DK, DV, dv, dk_a, dk_b, off_b, off_hk, k_start, start_n, seqlen_k,
                        stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                        scale, head_dim, HAS_DV, HAS_DK, QK_B)  # fmt: skip


@gluon.jit
def _store_acc_rows(DK, DV, dv, dk_a, dk_b, off_b, off_hk, k_start, start_n, seqlen_k,
                    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, scale,
                    head_dim, HAS_DV: gl.constexpr, HAS_DK: gl.constexpr,
                    QK_B: gl.constexpr):  # fmt: skip
    """``store_acc`` from registers, dV first, rows past ``seqlen_k`` and columns past
    ``head_dim`` dropped (VARLEN: strides (0, head, row), the sequence's rows from ``k_start``
    on)."""
    if HAS_DV:
        dv_layout: gl.constexpr = dv.type.layout
        ptr = DV + off_b.to(gl.int64) * stride_dvb + off_hk.to(gl.int64) * stride_dvh
        ptr += k_start.to(gl.int64) * stride_dvn
        store_rows(ptr, dv, start_n, seqlen_k, stride_dvn, 0, head_dim, dv_layout)
    if HAS_DK:
        a_layout: gl.constexpr = dk_a.type.layout
        ptr = DK + off_b.to(gl.int64) * stride_dkb + off_hk.to(gl.int64) * stride_dkh
        ptr += k_start.to(gl.int64) * stride_dkn
        store_rows(ptr, dk_a * scale, start_n, seqlen_k, stride_dkn, 0, head_dim, a_layout)
        if QK_B > 0:
            b_layout: gl.constexpr = dk_b.type.layout
            store_rows(ptr, dk_b * scale, start_n, seqlen_k, stride_dkn, dk_a.shape[1],
                        head_dim, b_layout)  # fmt: skip


@gluon.jit
def _store_acc_tma(dka_desc, dkb_desc, dv_desc, ka_tile, kb_tile, v_tile, dv, dk_a, dk_b, scale,
                   desc_b, off_hk, key, HAS_DV: gl.constexpr, HAS_DK: gl.constexpr,
                   QK_B: gl.constexpr):  # fmt: skip
    """``store_acc`` through the tiles they match (dK, scaled, into K's one or two, in boxes of
    their widths; dV into V's), one fence, then TMA stores from row ``key`` on (rows past the
    tensor's end dropped, columns past its head dim too)."""
    ROWS_T: gl.constexpr = ka_tile.shape[2]
    QK_A: gl.constexpr = ka_tile.shape[3]
    if HAS_DK:
        ka_tile.reshape([ROWS_T, QK_A]).store((dk_a * scale).to(dka_desc.dtype))
        if QK_B > 0:
            kb_tile.reshape([ROWS_T, QK_B]).store((dk_b * scale).to(dkb_desc.dtype))
    if HAS_DV:
        v_tile.reshape([ROWS_T, v_tile.shape[3]]).store(dv.to(dv_desc.dtype))
    fence_async_shared()
    if HAS_DK:
        tma_store(dka_desc, [desc_b, off_hk, key, 0], ka_tile)
        if QK_B > 0:
            tma_store(dkb_desc, [desc_b, off_hk, key, QK_A], kb_tile)
    if HAS_DV:
        tma_store(dv_desc, [desc_b, off_hk, key, 0], v_tile)


@gluon.jit
def qk_tiles(desc, lead: gl.constexpr, QK_A: gl.constexpr, QK_B: gl.constexpr):
    """Shared memory for Q or K tiles (``lead`` the shape before the columns): QK_A columns
    and, with QK_B (MLA's 192 = 128 + 64; a shared-memory tile is a power of two wide), a second
    buffer of QK_B; without, the first stands in for the second (never touched)."""
    a = gl.allocate_shared_memory(desc.dtype, lead + [QK_A], desc.layout)  # noqa: RUF005
    b = a
    if QK_B > 0:
        b = gl.allocate_shared_memory(desc.dtype, lead + [QK_B], desc.layout)  # noqa: RUF005
    return a, b


@gluon.jit
def handoff_state(NUM_STAGES: gl.constexpr, VARLEN: gl.constexpr):
    """Both kernels' shared state beside their tiles, allocated and initialised (module
    docstring): two P tiles (fp16); the resident pair's barrier (count 1); the ring's ready
    (count 1) and empty (count 2: both consumers) barriers; the P tiles' ready and free barriers
    (count 1); with VARLEN the producer's own barrier for the tiles it zeroes past a sequence's
    end (``load_fixed``; without, the resident pair's stands in, never touched). Returns
    ``(p_smem, resident_ready, ring_ready, ring_empty, p_ready, p_free, fix_bar)``."""
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], gl.float16)
    p_smem = gl.allocate_shared_memory(gl.float16, [2, ROWS, ROWS], p_layout)
    resident_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    resident_ready = resident_bar.index(0)
    ring_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ring_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    p_ready, p_free = tile_barriers()
    mbarrier.init(resident_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ring_ready.index(i), count=1)
        mbarrier.init(ring_empty.index(i), count=2)
    fix_bar = resident_ready
    if VARLEN:
        fix = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        fix_bar = fix.index(0)
        mbarrier.init(fix_bar, count=1)
    return p_smem, resident_ready, ring_ready, ring_empty, p_ready, p_free, fix_bar


@gluon.jit
def tile_barriers():
    """A double-buffered tile's ready and free barriers (two each, count 1), initialised."""
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    return ready, free
