"""The Hopper backward's producer warp and each program's work (``kernels/hopper/bwd.py``, whose
docstring holds the schedule): the key block a program owns and the query blocks that see it
(``key_block``, ``q_blocks``; ``bwd256.py`` and ``bwd_mla.py`` walk the same), K and V loaded
once, and each step's Q, dO and row stats loaded into the ring, a packed batch's rows past a
sequence's end zeroed before their hand-over (``bwd.py``, "VARLEN").
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.language.extra.cuda import gdc_wait

from flashcore.kernels.hopper.common import interleave, sequence, tma_load, zero_rows

ROWS = gl.constexpr(64)  # query rows per step, and keys per consumer warpgroup (one m64 wgmma)
BLOCK_N = gl.constexpr(128)  # keys per program: two consumers x 64


@gluon.jit
def q_blocks(
    start_n,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    KEYS: gl.constexpr = BLOCK_N,
):
    """``(lo, n_m)``: the query blocks of ROWS rows that see any key of ``[start_n, start_n +
    KEYS)`` start at ``lo`` (a multiple of ROWS), ``n_m`` of them (0 when none). Row i sees key
    j iff ``j - d - right <= i <= j - d + left`` (``d = Sk - Sq``; right = 0 when causal, a side
    without a bound arrives as ``Sq + Sk``). ``KEYS``: the program's keys (``bwd256.py``: 64)."""
    diag = seqlen_k - seqlen_q
    if IS_CAUSAL:
        # The block's first key is seen from row start_n - diag on.
        lo = (gl.maximum(start_n - diag, 0) // ROWS) * ROWS
    elif HAS_WINDOW:
        lo = (gl.maximum(start_n - diag - window_right, 0) // ROWS) * ROWS
    else:
        lo = start_n * 0
    if HAS_WINDOW:
        # The block's last key is seen up to row start_n + BLOCK_N - 1 - diag + window_left.
        hi = gl.minimum(gl.maximum(start_n + KEYS - diag + window_left, 0), seqlen_q)
    else:
        hi = seqlen_q
    n_m = gl.maximum(gl.cdiv(hi - lo, ROWS), 0)
    return lo, n_m


@gluon.jit
def key_block(
    CU_Q,
    CU_K,
    kv_heads,
    seqlen_q,
    seqlen_k,
    lpt_heads,
    total_q,
    total_k,
    VARLEN: gl.constexpr,
):
    """``(start_n, off_b, off_hk, q_start, k_start, seqlen_q, seqlen_k, desc_b)`` of this program:
    its key block's first key, batch (VARLEN: sequence) and kv head (``interleave``, heaviest key
    blocks first when causal), and its sequence's first rows, lengths and batch coordinate in the
    descriptors (``common.sequence``: VARLEN's ``(1, heads, total, D)`` views take 0). With VARLEN
    the grid is sized by the longest sequence (``seqlen_k``): a block may start past its own."""
    n_blocks = gl.cdiv(seqlen_k, BLOCK_N)
    block, off_bh = interleave(gl.program_id(0), n_blocks, lpt_heads)
    off_b = off_bh // kv_heads
    q_start, k_start, seqlen_q, seqlen_k, desc_b = sequence(
        CU_Q, CU_K, off_b, seqlen_q, seqlen_k, total_q, total_k, VARLEN
    )
    return block * BLOCK_N, off_b, off_bh % kv_heads, q_start, k_start, seqlen_q, seqlen_k, desc_b


@gluon.jit
def _load_kv(k_desc, v_desc, off_b, kv_head, key, bar, k_smem, v_smem):
    """K and V of the block's two 64-key halves from key ``key`` on, by TMA onto ``bar``."""
    mbarrier.expect(bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for c in gl.static_range(2):
        tma_load(k_desc, [off_b, kv_head, key + c * ROWS, 0], bar, k_smem.index(c))
        tma_load(v_desc, [off_b, kv_head, key + c * ROWS, 0], bar, v_smem.index(c))


@gluon.jit
def _load_step(
    q_desc,
    do_desc,
    lse_desc,
    delta_desc,
    off_b,
    off_h,
    q_row,
    row,
    bar,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    slot,
    STATS: gl.constexpr = True,
):
    """A step's Q and dO (query rows from ``q_row`` on) and, with STATS, its lse2 and delta (from
    flat index ``row``) into ring slot ``slot``, by TMA onto ``bar``."""
    if STATS:
        mbarrier.expect(
            bar,
            q_desc.block_type.nbytes
            + do_desc.block_type.nbytes
            + lse_desc.block_type.nbytes
            + delta_desc.block_type.nbytes,
        )
    else:
        mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma_load(q_desc, [off_b, off_h, q_row, 0], bar, q_smem.index(slot))
    tma_load(do_desc, [off_b, off_h, q_row, 0], bar, do_smem.index(slot))
    if STATS:
        tma_load(lse_desc, [row], bar, lse_smem.index(slot))
        tma_load(delta_desc, [row], bar, delta_smem.index(slot))


@gluon.jit
def producer(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    lse_desc,
    delta_desc,
    q_smem,
    k_smem,
    v_smem,
    do_smem,
    lse_smem,
    delta_smem,
    kv_ready,
    qd_ready,
    qd_empty,
    fix_bar,
    CU_Q,
    CU_K,
    LSE2,
    DELTA,
    kv_heads,
    kv_group,
    kv_share,
    seqlen_q,
    seqlen_k,
    lpt_heads,
    seqlen_pad,
    window_left,
    window_right,
    total_q,
    total_k,
    NUM_STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    VARLEN: gl.constexpr,
    PDL: gl.constexpr = False,
):
    start_n, _, off_hk, q_start, k_start, seqlen_q, seqlen_k, desc_b = key_block(
        CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, VARLEN
    )
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    if VARLEN:
        r_stat = gl.arange(0, ROWS, layout=gl.BlockedLayout([2], [32], [1], [0]))
    # K and V of the block, once (also for a block no query sees: the consumers wait for it),
    # from the kv head the program's heads share (itself unless the group is split).
    kv_head = off_hk // kv_share
    # VARLEN: a block that crosses its sequence's end lands on the producer's own fix_bar; the
    # rows past the end (the next sequence's, or unset memory: a NaN or inf there would reach dQ
    # through dS K and dP^T = V dO^T) are zeroed before kv_ready completes (a plain arrive).
    key = k_start + start_n
    n_fix = 0
    if VARLEN:
        n_fix = gl.to_tensor(0)
        if start_n + BLOCK_N > seqlen_k:
            _load_kv(k_desc, v_desc, desc_b, kv_head, key, fix_bar, k_smem, v_smem)
            mbarrier.wait(fix_bar, 0)
            for c in gl.static_range(2):
                keep = seqlen_k - start_n - c * ROWS
                zero_rows(k_smem.index(c).reshape([ROWS, HEAD_DIM]), keep)
                zero_rows(v_smem.index(c).reshape([ROWS, HEAD_DIM]), keep)
            fence_async_shared()
            mbarrier.arrive(kv_ready, count=1)
            n_fix = n_fix + 1
        else:
            _load_kv(k_desc, v_desc, desc_b, kv_head, key, kv_ready, k_smem, v_smem)
    else:
        _load_kv(k_desc, v_desc, desc_b, kv_head, key, kv_ready, k_smem, v_smem)
    if PDL:
        # Launched while bwd_prep_kernel may still run: K and V are inputs, but the row stats
        # and the zeroed dQ accumulator are its output (the consumers reduce into the latter
        # only after this warp's first step loads, so after this wait).
        gdc_wait()
    lo, n_m = q_blocks(
        start_n, seqlen_q, seqlen_k, window_left, window_right, IS_CAUSAL, HAS_WINDOW
    )
    for t in range(n_m * kv_group):
        off_h = off_hk * kv_group + t // n_m
        start_m = lo + (t % n_m) * ROWS
        slot = t % NUM_STAGES
        q_row = q_start + start_m
        row = (desc_b * kv_heads * kv_group + off_h) * seqlen_pad + q_row
        if VARLEN:
            # The row stats by this warp's loads: a sequence's rows start anywhere, and a copy
            # engine box of fp32 must start 16-byte aligned (an unaligned one faulted with an
            # illegal instruction on the H100). Rows past the sequence's end (the next one's,
            # or past the buffers) get lse2 = +inf (P = 0) and delta = 0 (dS = 0).
            keep = seqlen_q - start_m
            lse2 = gl.load(LSE2 + row + r_stat, mask=r_stat < keep, other=float("inf"))
            delta = gl.load(DELTA + row + r_stat, mask=r_stat < keep, other=0.0)
            mbarrier.wait(qd_empty.index(slot), ((t // NUM_STAGES) & 1) ^ 1)
            if keep < ROWS:
                # Q and dO land on fix_bar; their rows past the end are zeroed (a NaN or inf
                # there would reach dV and dK through P^T dO and dS^T Q, even with P = 0).
                _load_step(
                    q_desc, do_desc, lse_desc, delta_desc, desc_b, off_h, q_row, row, fix_bar,
                    q_smem, do_smem, lse_smem, delta_smem, slot, False,
                )  # fmt: skip
                mbarrier.wait(fix_bar, n_fix & 1)
                zero_rows(q_smem.index(slot).reshape([ROWS, HEAD_DIM]), keep)
                zero_rows(do_smem.index(slot).reshape([ROWS, HEAD_DIM]), keep)
                fence_async_shared()
                n_fix = n_fix + 1
                # qd_ready's arrival for the data (the copies' expect on the other steps).
                mbarrier.arrive(qd_ready.index(slot), count=1)
            else:
                _load_step(
                    q_desc, do_desc, lse_desc, delta_desc, desc_b, off_h, q_row, row,
                    qd_ready.index(slot), q_smem, do_smem, lse_smem, delta_smem, slot, False,
                )  # fmt: skip
            # racecheck hand-over: row stats
            lse_smem.index(slot).store(lse2)
            # racecheck hand-over: row stats
            delta_smem.index(slot).store(delta)
            # qd_ready's second arrival (count 2): the row stats.
            mbarrier.arrive(qd_ready.index(slot), count=1)
        else:
            mbarrier.wait(qd_empty.index(slot), ((t // NUM_STAGES) & 1) ^ 1)
            _load_step(
                q_desc, do_desc, lse_desc, delta_desc, desc_b, off_h, q_row, row,
                qd_ready.index(slot), q_smem, do_smem, lse_smem, delta_smem, slot,
            )  # fmt: skip
