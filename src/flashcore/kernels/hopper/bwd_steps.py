"""The Hopper backward's consumer warpgroups (``kernels/hopper/bwd.py``, whose docstring holds the
schedule, the flags and the order of the waits): ``consumer``, a step's five products over its 64
keys, its softmax and masks, dQ reduce-added a step late (or beside dK: DQ_BESIDE_DK), and dK and
dV stored through the K and V slots at the end; ``dq_warpgroup``, every step's dQ on a warpgroup
of its own (DQ_WARPGROUP).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashcore.kernels.hopper.bwd_dq import (
    dq_finish,
    dq_issue,
    dq_row,
    dq_rows,
    dq_step,
    reduce_dq,
    rows_of_sequence,
    stage_dq,
)
from flashcore.kernels.hopper.bwd_load import ROWS, key_block, q_blocks
from flashcore.kernels.hopper.common import LOG2E, opaque, store_rows, tanh, tma_store


@gluon.jit
def _store_dk_dv(dk_desc, dv_desc, k_tile, v_tile, dk, dv, off_b, off_hk, key):
    """dK and dV (scaled) of a consumer's 64 keys from key ``key`` on, through its K and V slots
    (their last readers are complete), by TMA stores (rows past the tensor's end dropped)."""
    k_tile.reshape([dk.shape[0], dk.shape[1]]).store(dk.to(dk_desc.dtype))
    v_tile.reshape([dv.shape[0], dv.shape[1]]).store(dv.to(dv_desc.dtype))
    fence_async_shared()
    tma_store(dk_desc, [off_b, off_hk, key, 0], k_tile)
    tma_store(dv_desc, [off_b, off_hk, key, 0], v_tile)


@gluon.jit
def _dq_k_cols(k_smem, i, CONSUMER: gl.constexpr):
    """The columns of K tile ``i`` that this consumer's half of dQ reads (``D / 2`` of them)."""
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    DQ_COLS: gl.constexpr = HEAD_DIM // 2
    return k_smem.index(i).reshape([ROWS, HEAD_DIM]).slice(CONSUMER * DQ_COLS, DQ_COLS, dim=1)


@gluon.jit
def _empty_step(qd_ready, ds_free, ds_smem, t, CONSUMER: gl.constexpr, NUM_STAGES: gl.constexpr,
                DQ_WARPGROUP: gl.constexpr, s_layout: gl.constexpr):  # fmt: skip
    """The front of a consumer's step ``t`` whose rows see none of its keys (SKIP_MASKED,
    SKIP_WINDOW; P = dS = 0), without its products: the waits the step's loop makes, in order
    (its Q/dO slot loaded, so that every phase of ``qd_ready`` is waited in turn; its dS^T tile
    released, with the loop's parity for runs with each dQ a step late), then a zero dS^T tile,
    fenced. Returns the step's ``(slot, buf)``; the caller makes the step's arrives."""
    slot = t % NUM_STAGES
    buf = t % 2
    mbarrier.wait(qd_ready.index(slot), (t // NUM_STAGES) & 1)
    if DQ_WARPGROUP:
        mbarrier.wait(ds_free.index(buf), ((t // 2) & 1) ^ 1)
    else:
        mbarrier.wait(ds_free.index(buf), ((t // 2) + 1 + buf) & 1)
    ds_smem.index(2 * buf + CONSUMER).store(gl.zeros([ROWS, ROWS], ds_smem.dtype, layout=s_layout))
    fence_async_shared()
    return slot, buf


@gluon.jit
def consumer(
    q_smem,
    k_smem,
    v_smem,
    do_smem,
    lse_smem,
    delta_smem,
    ds_smem,
    dq_smem,
    kv_ready,
    qd_ready,
    qd_empty,
    ds_ready,
    ds_free,
    dq_done,
    dq_desc,
    dk_desc,
    dv_desc,
    CU_Q,
    CU_K,
    DK,
    DV,
    kv_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    lpt_heads,
    seqlen_pad,
    qk_scale,
    scale,
    window_left,
    window_right,
    softcap,
    ALIBI,
    stride_ab,
    total_q,
    total_k,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    CONSUMER: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    EVEN_N: gl.constexpr,
    DQ_WARPGROUP: gl.constexpr,
    ABLATE: gl.constexpr,
    KV_REGS: gl.constexpr = False,
    VARLEN: gl.constexpr = False,
    DQ_BESIDE_DK: gl.constexpr = False,
    FRESH_DESC: gl.constexpr = False,
    SKIP_MASKED: gl.constexpr = False,
    SKIP_WINDOW: gl.constexpr = False,
    BAND_MASK: gl.constexpr = False,
    LAG_OPTIONS: gl.constexpr = False,
):
    dtype: gl.constexpr = k_smem.dtype
    # Each step's dQ a step late (docstring, "Schedule"), except at D=128 with softcap or ALiBi:
    # there the carried head and query block tipped ptxas into 20-80% more spills, and those
    # variants measured 2-15% slower with it.
    # LAG_OPTIONS (``ops/bwd_sm90.DQ_LAG_OPTIONS``): lagged there too. With FRESH_DESC in those
    # builds ptxas keeps the carried indices: sm_90a causal softcap 96 -> 24 B, causal window
    # softcap 120 -> 36 B, non-causal softcap window 136 -> 68 B (non-causal softcap 16 -> 88 B,
    # outside the loops).
    DQ_LAG: gl.constexpr = HEAD_DIM == 64 or not (SOFTCAP or HAS_ALIBI) or LAG_OPTIONS
    # S^T, dP^T: (64 keys, 64 query rows); dK, dV: (64 keys, D); dQ: (64 query rows, D).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    start_n, off_b, off_hk, q_start, k_start, seqlen_q, seqlen_k, desc_b = key_block(
        CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, VARLEN
    )
    key0 = start_n + CONSUMER * ROWS
    keys = gl.expand_dims(key0 + gl.arange(0, ROWS, layout=row_layout), 1)
    offs_m = gl.arange(0, ROWS, layout=col_layout)
    lo, n_m = q_blocks(
        start_n, seqlen_q, seqlen_k, window_left, window_right, IS_CAUSAL, HAS_WINDOW
    )
    diag = seqlen_k - seqlen_q
    # Query blocks starting at or past this row see every key of this consumer: no causal mask.
    full_m = key0 + ROWS - 1 - (seqlen_k - seqlen_q)

    k_tile = k_smem.index(CONSUMER)
    v_tile = v_smem.index(CONSUMER)
    k_c = k_tile.reshape([ROWS, HEAD_DIM])
    v_c = v_tile.reshape([ROWS, HEAD_DIM])
    # dQ of a step: this consumer computes its half of the columns (DQ_COLS = D / 2), over both
    # consumers' keys (K_0 and K_1 with both dS^T tiles), and reduce-adds it.
    DQ_COLS: gl.constexpr = HEAD_DIM // 2
    k0_cols = _dq_k_cols(k_smem, 0, CONSUMER)
    k1_cols = _dq_k_cols(k_smem, 1, CONSUMER)
    dq_tile = dq_smem.index(CONSUMER)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_COLS, 16]
    )
    zero_s = gl.zeros([ROWS, ROWS], gl.float32, layout=s_layout)
    zero_dq = gl.zeros([ROWS, DQ_COLS], gl.float32, layout=dq_layout)
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)

    mbarrier.wait(kv_ready, 0)
    if KV_REGS:
        ka_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        # racecheck hand-over: zeroed rows
        k_a = k_c.load(ka_layout)
        # racecheck hand-over: zeroed rows
        v_a = v_c.load(ka_layout)
    else:
        k_a = k_c
        v_a = v_c
    n_steps = n_m * kv_group
    # The dQ of step t is computed in step t + 1 (and the last one after the loop): its wait for
    # the other consumer's dS^T then has a step of slack, so the consumers need not run in
    # lockstep, and one's elementwise work can run under the other's products.
    # The dQ rows' coordinates: the descriptor's row of this program's first head's row 0, and
    # the rows between heads (both 0 unless the staging rows are permuted: ``dq_rows``).
    dq_base, dq_per_head = dq_rows(
        dq_desc, desc_b, off_hk * kv_group, kv_heads * kv_group, seqlen_pad
    )
    prev_h = off_hk * kv_group
    prev_m = dq_base + q_start + lo
    t_first = 0
    # Causal (SKIP_MASKED), or a window's right edge when not causal (SKIP_WINDOW): row i
    # sees keys up to i + diag + right (right 0 when causal).
    SKIP_FIRST: gl.constexpr = (SKIP_MASKED and IS_CAUSAL) or (SKIP_WINDOW and HAS_WINDOW)
    if SKIP_FIRST and DQ_LAG and CONSUMER == 1:
        # The first step's rows see none of this consumer's keys (the block's diagonal step,
        # when its rows start at or below the diagonal of the block's first key: P = dS = 0).
        # Its products are skipped: a zero dS^T tile for both consumers' dQ products and the
        # step's barrier operations, in the loop's order, without the products (a run-time
        # branch around wgmmas crashes ptxas 12.8, so the step is peeled off the loop). The
        # loop's lagged dQ of "step -1" at t = 0 only arrives on ds_free[1] here. The dQ of
        # step 0 (prev_h, prev_m: already its head and rows) runs in step 1 as usual.
        right = 0
        if not IS_CAUSAL:
            right = window_right
        if n_steps > 0 and lo + ROWS - 1 + diag + right < key0:
            t_first = 1
            # Step 0's qd_ready wait too: skipped, the parity wait of step NUM_STAGES could pass
            # on the slot's first phase before that phase completed.
            _empty_step(qd_ready, ds_free, ds_smem, 0, CONSUMER, NUM_STAGES, DQ_WARPGROUP, s_layout)
            mbarrier.arrive(qd_empty.index(0), count=1)
            mbarrier.arrive(ds_ready.index(0), count=1)
            if not DQ_WARPGROUP:
                mbarrier.arrive(ds_free.index(1), count=1)
    t_last = n_steps
    if SKIP_WINDOW and HAS_WINDOW and DQ_LAG and CONSUMER == 0:  # noqa: SIM102 (constexpr)
        # A window's left edge: the last step's rows (its last head's last query block) see
        # none of this consumer's keys when the block's last key lies before the first row's
        # window (P = dS = 0). That step runs after the loop without its products (below).
        if n_steps > 0 and key0 + ROWS - 1 < lo + (n_m - 1) * ROWS + diag - window_left:
            t_last = n_steps - 1
    for t in range(t_first, t_last):
        off_h = off_hk * kv_group + t // n_m
        start_m = lo + (t % n_m) * ROWS
        slot = t % NUM_STAGES
        mbarrier.wait(qd_ready.index(slot), (t // NUM_STAGES) & 1)
        q = q_smem.index(slot).reshape([ROWS, HEAD_DIM])
        do = do_smem.index(slot).reshape([ROWS, HEAD_DIM])
        if FRESH_DESC and not KV_REGS:
            # The fixed tiles' views through a zero LLVM cannot see: their wgmma descriptors are
            # formed here each step, not before the loop (kernels/hopper/bwd_mla.py, FRESH_DESC).
            z = opaque(0)
            k_op = k_smem.index(CONSUMER + z).reshape([ROWS, HEAD_DIM])
            v_op = v_smem.index(CONSUMER + z).reshape([ROWS, HEAD_DIM])
            k0_step = _dq_k_cols(k_smem, z, CONSUMER)
            k1_step = _dq_k_cols(k_smem, 1 + z, CONSUMER)
        else:
            k_op = k_a
            v_op = v_a
            k0_step = k0_cols
            k1_step = k1_cols
        s_tok = warpgroup_mma(k_op, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(v_op, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_tok])
        # lse2 and delta are read from shared memory where they are used: in the score layout a
        # row vector takes 16 registers a thread, and loaded early they overlapped S^T, dP^T, dK
        # and dV (spills at D=128).
        # racecheck hand-over: row stats
        lse2 = lse_smem.index(slot).load(col_layout)
        # Scores in log2 units as the forward forms them (ops/problem.py folds the units):
        # softcap (tanh of scale q.k / c, times c log2(e)), then ALiBi, then the masks.
        s = s * qk_scale
        if SOFTCAP:
            t_cap = tanh(s)
            s = t_cap * softcap
        if HAS_ALIBI:
            slope = gl.load(ALIBI + off_b.to(gl.int64) * stride_ab + off_h) * LOG2E
            rows = gl.expand_dims(start_m + offs_m, 0)
            s = s - slope * gl.abs(rows + diag - keys).to(gl.float32)
        if IS_CAUSAL and HAS_WINDOW and BAND_MASK:
            # Causal with a window: key j is seen from row i when 0 <= i + diag - j <= left, one
            # unsigned comparison (a key past the diagonal wraps to a large lag), on every step.
            rows = gl.expand_dims(start_m + offs_m, 0)
            lag = (rows + diag - keys).to(gl.uint32, bitcast=True)
            s = gl.where(lag <= window_left.to(gl.uint32, bitcast=True), s, float("-inf"))
        elif IS_CAUSAL:
            # Only the steps the diagonal crosses, except with softcap at D=128: on every step
            # there (behind the run-time branch ptxas 12.8 kept tanh's values and the scores
            # apart on both paths and spilled 700 B, 62-64 local accesses a step; 192 B and 4-7
            # this way, 1.08x). D=64 spills 16 B either way and keeps the branch.
            if (SOFTCAP and HEAD_DIM == 128) or start_m < full_m:
                rows = gl.expand_dims(start_m + offs_m, 0)
                s = gl.where(keys <= rows + diag, s, float("-inf"))
        elif not EVEN_N:  # noqa: SIM102 (a constexpr branch around a runtime one)
            # Keys past Sk (zeros) would get P = exp2(-lse2), which overflows fp16 for a row
            # whose LSE is below about -11, and then dQ = inf * 0 = NaN. Causal masks them above.
            if key0 + ROWS > seqlen_k:
                s = gl.where(keys < seqlen_k, s, float("-inf"))
        if HAS_WINDOW and not (IS_CAUSAL and BAND_MASK):
            # Every step (the band's edges cross query blocks at any offset; masking only the
            # steps that cross an edge, a run-time branch, made ptxas spill more).
            rows = gl.expand_dims(start_m + offs_m, 0)
            s = gl.where(keys >= rows + (diag - window_left), s, float("-inf"))
            if not IS_CAUSAL:
                s = gl.where(keys <= rows + (diag + window_right), s, float("-inf"))
        p = gl.exp2(s - gl.expand_dims(lse2, 0))
        dp = warpgroup_mma_wait(0, deps=[dp_tok])
        # racecheck hand-over: row stats
        delta = delta_smem.index(slot).load(col_layout)
        # dS^T before the dV issue: P^T's fp32 and register-operand copies are never live
        # together (16 registers less at the peak).
        ds = p * (dp - gl.expand_dims(delta, 0))
        if SOFTCAP:
            # d(c tanh(x / c)) / dx = 1 - tanh^2: dS with respect to the uncapped scores.
            ds = ds * (1.0 - t_cap * t_cap)
        ds = ds.to(dtype)
        p_op = gl.convert_layout(p.to(dtype), a_layout)
        dv_tok = warpgroup_mma(p_op, do, dv, is_async=True)
        # dS^T double-buffered over steps: tile [t % 2, c] was last read by both consumers' dQ
        # products of step t - 2 (ds_free; see the docstring for the phases).
        buf = t % 2
        if DQ_WARPGROUP:
            # Freed by the dQ warpgroup's products of step t - 2 (the first two pass).
            mbarrier.wait(ds_free.index(buf), ((t // 2) & 1) ^ 1)
        else:
            mbarrier.wait(ds_free.index(buf), ((t // 2) + 1 + DQ_LAG * buf) & 1)
        ds_smem.index(2 * buf + CONSUMER).store(ds)
        ds_op = gl.convert_layout(ds, a_layout)
        if DQ_BESIDE_DK and DQ_LAG and not DQ_WARPGROUP:
            # This consumer's dS^T of step t is in shared memory: fenced and announced at once.
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            # The dQ products of step t - 1 go in beside dV, and dK beside them; the dQ staging
            # then runs under dK. (At most two accumulators in flight at a time.)
            dq_tok = dq_issue(ds_smem, ds_ready, k0_step, k1_step, zero_dq, t - 1, ABLATE)
            dv, p_op = warpgroup_mma_wait(2, deps=[dv_tok, p_op])
            dk_tok = warpgroup_mma(ds_op, q, dk, is_async=True)
            if ABLATE < 2:
                dq_tok = warpgroup_mma_wait(1, deps=[dq_tok])
            dq_finish(
                ds_free, dq_tile, dq_desc, dq_tok, t - 1, t > 0, desc_b, prev_h, prev_m,
                CONSUMER, ABLATE, q_start + seqlen_q, VARLEN,
            )  # fmt: skip
            dk, ds_op = warpgroup_mma_wait(0, deps=[dk_tok, ds_op])
            # Every reader of the slot is complete: S^T, dP^T, dV, dK and the lse2/delta loads.
            mbarrier.arrive(qd_empty.index(slot), count=1)
        else:
            dk_tok = warpgroup_mma(ds_op, q, dk, is_async=True)
            fence_async_shared()
            # dV and dK complete before dQ is issued: with all three in flight (192 accumulator
            # registers plus P^T and dS^T held for the running products) ptxas serialised the
            # wgmmas (C7512) and spilled 240-328 B at D=128.
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_op, ds_op])
            # Every reader of the slot is complete: S^T, dP^T, dV, dK and the lse2/delta loads
            # (Gluon syncs the warpgroup before the single-thread arrive).
            mbarrier.arrive(qd_empty.index(slot), count=1)
            # This consumer's dS^T of step t is in shared memory (written and fenced before the
            # wait above).
            mbarrier.arrive(ds_ready.index(buf), count=1)
            if DQ_WARPGROUP:
                # A wait for no bulk copy (this consumer has none outstanding): without an
                # instruction here ptxas 12.8 (Triton 3.6's) crashes (SIGSEGV) on the step with
                # no dQ phase; ptxas 13.0 compiles it either way.
                tma.store_wait(0)
            elif DQ_LAG:
                # The dQ of step t - 1 (at t = 0 of no step: computed from whatever the tiles
                # hold, as a run-time branch around the products crashes ptxas, and not reduced).
                dq_step(
                    ds_smem, ds_ready, ds_free, k0_step, k1_step, dq_tile, dq_desc, zero_dq,
                    t - 1, t > 0, desc_b, prev_h, prev_m, CONSUMER, ABLATE, q_start + seqlen_q,
                    VARLEN,
                )  # fmt: skip
            else:
                dq_step(
                    ds_smem, ds_ready, ds_free, k0_step, k1_step, dq_tile, dq_desc, zero_dq, t,
                    True, desc_b, off_h,
                    dq_row(dq_base, dq_per_head, t // n_m, q_start + start_m), CONSUMER, ABLATE,
                    q_start + seqlen_q, VARLEN,
                )  # fmt: skip
        if DQ_LAG and not DQ_WARPGROUP:
            # This step's dQ runs in the next one (or after the loop): its head and rows.
            prev_h = off_h
            prev_m = dq_row(dq_base, dq_per_head, t // n_m, q_start + start_m)
    # SKIP_WINDOW: the last step when its rows see none of this consumer's keys (none otherwise):
    # its waits, a zero dS^T tile and its arrives in the loop's order, and the previous step's
    # dQ, without the step's own products. (A loop of at most one step, not a run-time branch:
    # such a branch around products crashed ptxas 12.8 in this kernel.)
    if SKIP_WINDOW and HAS_WINDOW and DQ_LAG and CONSUMER == 0:
        for t in range(t_last, n_steps):
            off_h = off_hk * kv_group + t // n_m
            start_m = lo + (t % n_m) * ROWS
            slot, buf = _empty_step(
                qd_ready, ds_free, ds_smem, t, CONSUMER, NUM_STAGES, DQ_WARPGROUP, s_layout
            )
            # The arrives in the order of the step's path: with the dQ products beside dK the
            # slot is freed after the previous step's dQ, otherwise before it.
            beside: gl.constexpr = DQ_BESIDE_DK and not DQ_WARPGROUP
            if not beside:
                mbarrier.arrive(qd_empty.index(slot), count=1)
            mbarrier.arrive(ds_ready.index(buf), count=1)
            if DQ_WARPGROUP:
                tma.store_wait(0)
            else:
                dq_step(
                    ds_smem, ds_ready, ds_free, k0_cols, k1_cols, dq_tile, dq_desc, zero_dq,
                    t - 1, t > 0, desc_b, prev_h, prev_m, CONSUMER, ABLATE, q_start + seqlen_q,
                    VARLEN,
                )  # fmt: skip
            if beside:
                mbarrier.arrive(qd_empty.index(slot), count=1)
            if not DQ_WARPGROUP:
                prev_h = off_h
                prev_m = dq_row(dq_base, dq_per_head, t // n_m, q_start + start_m)

    # Until the other consumer's last dQ products, which read this consumer's K tile, have
    # completed: the epilogue overwrites it. With DQ_LAG the last step's dQ (none without steps)
    # comes first. (Phases: the docstring.)
    if DQ_WARPGROUP:
        # The dQ warpgroup's last products (which read both K tiles) have completed.
        mbarrier.wait(dq_done, 0)
    elif DQ_LAG:
        dq_step(
            ds_smem, ds_ready, ds_free, k0_cols, k1_cols, dq_tile, dq_desc, zero_dq,
            n_steps - 1, n_steps > 0, desc_b, prev_h, prev_m, CONSUMER, ABLATE,
            q_start + seqlen_q, VARLEN,
        )  # fmt: skip
        mbarrier.wait(ds_free.index((n_steps + 1) % 2), (n_steps // 2) & 1)
    else:
        mbarrier.wait(ds_free.index((n_steps + 1) % 2), ((n_steps + 1) // 2 + 1) & 1)
    # Epilogue: dK, dV through this consumer's K and V slots (their last readers are complete).
    # VARLEN: keys that cross the sequence's end are stored with a row mask (the rows after its
    # last key are the next sequence's).
    key = k_start + key0
    if VARLEN:
        if key0 + ROWS > seqlen_k:
            n_keys = seqlen_k - key0
            store_rows(DK, dk_desc, k_tile, dk * scale, key, n_keys, off_hk, stride_dkt, stride_dkh)
            store_rows(DV, dv_desc, v_tile, dv, key, n_keys, off_hk, stride_dvt, stride_dvh)
        else:
            _store_dk_dv(dk_desc, dv_desc, k_tile, v_tile, dk * scale, dv, desc_b, off_hk, key)
    else:
        _store_dk_dv(dk_desc, dv_desc, k_tile, v_tile, dk * scale, dv, desc_b, off_hk, key)
    tma.store_wait(0)


@gluon.jit
def dq_warpgroup(
    ds_smem,
    k_smem,
    dq_smem,
    kv_ready,
    ds_ready,
    ds_free,
    dq_done,
    dq_desc,
    CU_Q,
    CU_K,
    kv_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    lpt_heads,
    seqlen_pad,
    window_left,
    window_right,
    total_q,
    total_k,
    HEAD_DIM: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    ABLATE: gl.constexpr,
    VARLEN: gl.constexpr,
):
    """DQ_WARPGROUP: every step's dQ (all D columns, over both consumers' keys) on a warpgroup
    of its own, reduce-added from two staging tiles in turn, so that the consumers' steps hold
    no dQ phase (docstring, "Schedule")."""
    start_n, _, off_hk, q_start, _, seqlen_q, seqlen_k, desc_b = key_block(
        CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, VARLEN
    )
    lo, n_m = q_blocks(
        start_n, seqlen_q, seqlen_k, window_left, window_right, IS_CAUSAL, HAS_WINDOW
    )
    # All D columns of a step in one 64 x D fp32 accumulator (D=64 only: the launcher's config;
    # at D=128 the consumers need 240 registers, docstring), through two staging tiles in turn.
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    zero_dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=dq_layout)
    k0 = k_smem.index(0).reshape([ROWS, HEAD_DIM])
    k1 = k_smem.index(1).reshape([ROWS, HEAD_DIM])
    dq_base, dq_per_head = dq_rows(
        dq_desc, desc_b, off_hk * kv_group, kv_heads * kv_group, seqlen_pad
    )
    mbarrier.wait(kv_ready, 0)
    for t in range(n_m * kv_group):
        off_h = off_hk * kv_group + t // n_m
        start_m = lo + (t % n_m) * ROWS
        buf = t % 2
        # Both consumers' dS^T tiles of step t are written (the k-th completion is step 2k + buf).
        mbarrier.wait(ds_ready.index(buf), (t // 2) & 1)
        ds0 = ds_smem.index(2 * buf).permute((1, 0))
        ds1 = ds_smem.index(2 * buf + 1).permute((1, 0))
        dq_tok = warpgroup_mma(ds0, k0, zero_dq, use_acc=False, is_async=True)
        dq_tok = warpgroup_mma(ds1, k1, dq_tok, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq_tok])
        mbarrier.arrive(ds_free.index(buf), count=1)
        # Staging tile t % 2 was last read by step t - 2's reduce: at most one reduce (step
        # t - 1's) may still be reading shared memory.
        stage = dq_smem.index(t % 2)
        tma.store_wait(1)
        if VARLEN:
            dq = rows_of_sequence(dq, seqlen_q - start_m)
        stage_dq(stage, dq)
        fence_async_shared()
        if ABLATE == 0:
            row = dq_row(dq_base, dq_per_head, t // n_m, q_start + start_m)
            reduce_dq(dq_desc, desc_b, off_h, row, 0, stage)
    # Nothing reads K any more: the consumers may overwrite it with dK, dV.
    mbarrier.arrive(dq_done, count=1)
    tma.store_wait(0)
