"""The dQ kernel of the backward at head dim 256 (and MLA's 192 / 128 where its dQ is not fused) on
Hopper (sm_90a) in Gluon. The design, VARLEN and the scores are the dK/dV kernel's
(``bwd256.py``, whose docstring this one completes); the helpers are ``bwd256_common.py``'s.

dQ (``attn_bwd_dq_sm90_d256_kernel``): the same split with rows and keys swapped, and dQ split by
head-dim halves (one accumulator, 64 x 256, is a single consumer's whole budget, and the other would
have only dP to compute). A program owns 64 query rows of query head h (Q and dO loaded once) and
walks the key blocks of 64 they see (``common.kv_tile_range``; causal programs last block first), K
and V through a two-slot ring (``kv_ready`` / ``kv_empty``, count 2). Consumer 0: ``S = Q K^T``, the
scores (``bwd256_common.capped``), the masks (only on the key blocks outside ``[full_lo,
full_hi)``), ``P = exp2(S - lse2)``, times ``1 - tanh^2`` with a softcap, into a shared tile (fp16),
then ``dQ[:, :128] += dS K[:, :128]`` with dS from shared memory; consumer 1: ``dP = dO V^T``, ``dS
= tile * (dP - delta)`` into a shared tile (input dtype), ``dQ[:, 128:] += dS K[:, 128:]`` with dS
in registers. The P and dS tiles, each with a ready and a free barrier as the dK/dV kernel's P tile,
by key step: consumer 0 at step t needs consumer 1's dS of step t, which needs only consumer 0's P
of step t (written before consumer 0 waits) and its release of tile b at step t - 2, so no cycle.
Each consumer holds half of dQ (64 registers) and a score tile; shared memory: Q and dO (32 KB
each), two K/V slots (64 KB each), the P and dS tiles: 229,840 B. dQ (scaled) leaves from registers
with a row and column mask."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashcore.kernels.hopper.bwd256_common import (
    ROWS,
    capped,
    handoff_state,
    load_fixed,
    load_tiles,
    program,
    qk_tiles,
    store_rows,
    tile_barriers,
)
from flashcore.kernels.hopper.common import (
    kv_tile_range,
)


@gluon.jit
def _dq_producer(q_desc, k_desc, v_desc, do_desc, qa_smem, qb_smem, ka_smem, kb_smem, v_smem,
                 do_smem, q_ready, kv_ready, kv_empty, fix_bar, CU_Q, CU_K, heads, kv_group,
                 seqlen_q, seqlen_k, lpt_heads, window_left, window_right, total_q, total_k,
                 QK_B: gl.constexpr, NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                 HAS_WINDOW: gl.constexpr, VARLEN: gl.constexpr):  # fmt: skip
    start_m, _, off_h, q_start, k_start, seqlen_q, seqlen_k, desc_b = program(
        CU_Q, CU_K, heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, False, IS_CAUSAL, VARLEN
    )
    # Q and dO: their rows past a packed sequence's end reach only dQ rows that are not stored.
    load_tiles(q_desc, do_desc, desc_b, off_h, q_start + start_m, q_ready, qa_smem, qb_smem,
                do_smem, QK_B)  # fmt: skip
    lo, _, _, hi = kv_tile_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, ROWS, ROWS, IS_CAUSAL, HAS_WINDOW
    )
    off_hk = off_h // kv_group
    n_fix = gl.to_tensor(0)
    for t in range(gl.cdiv(hi - lo, ROWS)):
        slot = t % NUM_STAGES
        mbarrier.wait(kv_empty.index(slot), ((t // NUM_STAGES) & 1) ^ 1)
        bar = kv_ready.index(slot)
        key = lo + t * ROWS
        ka = ka_smem.index(slot)
        kb = kb_smem.index(slot)
        v_dest = v_smem.index(slot)
        if VARLEN:
            if key + ROWS > seqlen_k:
                # K and V rows past the sequence's end would reach dQ through dS K (a sum over
                # keys) and dP = dO V^T.
                n_fix = load_fixed(k_desc, v_desc, off_hk, k_start + key, seqlen_k - key, bar,
                                    fix_bar, n_fix, ka, kb, v_dest, QK_B)  # fmt: skip
            else:
                load_tiles(k_desc, v_desc, desc_b, off_hk, k_start + key, bar, ka, kb, v_dest,
                            QK_B)  # fmt: skip
        else:
            load_tiles(k_desc, v_desc, desc_b, off_hk, k_start + key, bar, ka, kb, v_dest, QK_B)


@gluon.jit
def _dq_consumer(qa_smem, qb_smem, ka_smem, kb_smem, v_smem, do_smem, p_smem, ds_smem, q_ready,
                 kv_ready, kv_empty, p_ready, p_free, ds_ready, ds_free, LSE2, DELTA, DQ, ALIBI,
                 CU_Q, CU_K, stride_ab, stride_lb, stride_lh, stride_qb, stride_qh, stride_qm,
                 heads, seqlen_q, seqlen_k, lpt_heads, qk_scale, scale, softcap, window_left,
                 window_right, head_dim, total_q, total_k, CONSUMER: gl.constexpr,
                 QK_B: gl.constexpr, NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                 HAS_WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                 VARLEN: gl.constexpr):  # fmt: skip
    dtype: gl.constexpr = qa_smem.dtype
    QK_A: gl.constexpr = qa_smem.shape[3]
    V_DIM: gl.constexpr = do_smem.shape[3]
    # dQ's columns [COL0, COL0 + WIDTH) of this consumer: head-dim halves, or with QK_B (MLA)
    # consumer 0 the last QK_B (beside S, K = 192) and consumer 1 the first QK_A (beside dP, K =
    # 128): the same tensor work each (module docstring, "dQ").
    if QK_B > 0:
        WIDTH: gl.constexpr = QK_B if CONSUMER == 0 else QK_A
        COL0: gl.constexpr = QK_A if CONSUMER == 0 else 0
    else:
        WIDTH: gl.constexpr = QK_A // 2
        COL0: gl.constexpr = CONSUMER * (QK_A // 2)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WIDTH, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    start_m, off_b, off_h, q_start, _, seqlen_q, seqlen_k, _ = program(
        CU_Q, CU_K, heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, False, IS_CAUSAL, VARLEN
    )
    lo, full_lo, full_hi, hi = kv_tile_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, ROWS, ROWS, IS_CAUSAL, HAS_WINDOW
    )
    diag = seqlen_k - seqlen_q
    rows = gl.expand_dims(start_m + gl.arange(0, ROWS, layout=row_layout), 1)
    offs_n = gl.arange(0, ROWS, layout=col_layout)
    qat = qa_smem.reshape([ROWS, QK_A])
    qbt = qb_smem.reshape([ROWS, QK_B if QK_B > 0 else QK_A])
    dot = do_smem.reshape([ROWS, V_DIM])
    zero_s = gl.zeros([ROWS, ROWS], gl.float32, layout=s_layout)
    dq = gl.zeros([ROWS, WIDTH], gl.float32, layout=acc_layout)
    # The prep kernel's row stats (rows past Sq: lse2 +inf, delta 0; Sq_pad covers the block;
    # VARLEN: those of one sequence of all rows, stride_lb 0, the rows past this sequence's end
    # the next one's: masked).
    stats = off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + q_start + start_m
    stat_rows = gl.arange(0, ROWS, layout=row_layout)
    in_seq = start_m + stat_rows < seqlen_q
    if CONSUMER == 0:
        if VARLEN:
            row_stat = gl.load(LSE2 + stats + stat_rows, mask=in_seq, other=float("inf"))
        else:
            row_stat = gl.load(LSE2 + stats + stat_rows)
    elif VARLEN:
        row_stat = gl.load(DELTA + stats + stat_rows, mask=in_seq, other=0.0)
    else:
        row_stat = gl.load(DELTA + stats + stat_rows)
    mbarrier.wait(q_ready, 0)
    for t in range(gl.cdiv(hi - lo, ROWS)):
        start_n = lo + t * ROWS
        slot = t % NUM_STAGES
        buf = t % 2
        mbarrier.wait(kv_ready.index(slot), (t // NUM_STAGES) & 1)
        ka = ka_smem.index(slot).reshape([ROWS, QK_A])
        # The B operand of this consumer's dQ columns.
        if QK_B > 0:
            if CONSUMER == 0:
                k_dq = kb_smem.index(slot).reshape([ROWS, QK_B])
            else:
                k_dq = ka
        else:
            k_dq = ka.slice(COL0, WIDTH, dim=1)
        if CONSUMER == 0:
            s_tok = warpgroup_mma(qat, ka.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            if QK_B > 0:
                kb = kb_smem.index(slot).reshape([ROWS, QK_B])
                s_tok = warpgroup_mma(qbt, kb.permute((1, 0)), s_tok, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s_tok])
            keys = gl.expand_dims(start_n + offs_n, 0)
            s, t_cap = capped(s, rows, keys, diag, qk_scale, softcap, ALIBI,
                               off_b.to(gl.int64) * stride_ab + off_h, SOFTCAP,
                               HAS_ALIBI)  # fmt: skip
            # Key tiles outside [full_lo, full_hi) cross a mask's edge (or Sk).
            if (start_n < full_lo) | (start_n >= full_hi):
                seen = keys < seqlen_k
                if IS_CAUSAL:
                    seen = seen & (keys <= rows + diag)
                if HAS_WINDOW:
                    seen = seen & (keys >= rows + (diag - window_left))
                    if not IS_CAUSAL:
                        seen = seen & (keys <= rows + (diag + window_right))
                s = gl.where(seen, s, float("-inf"))
            p = gl.exp2(s - gl.expand_dims(row_stat, 1))
            mbarrier.wait(p_free.index(buf), ((t // 2) & 1) ^ 1)
            # Consumer 1 reads the tile for dS alone: with a softcap, P (1 - tanh^2) (the
            # gradient with respect to scale q.k).
            if SOFTCAP:
                p = p * (1.0 - t_cap * t_cap)
            p_smem.index(buf).store(p.to(gl.float16))
            fence_async_shared()
            mbarrier.arrive(p_ready.index(buf), count=1)
            mbarrier.wait(ds_ready.index(buf), (t // 2) & 1)
            ds_t = ds_smem.index(buf)
            dq_tok = warpgroup_mma(ds_t, k_dq, dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=[dq_tok])
            mbarrier.arrive(ds_free.index(buf), count=1)
        else:
            v = v_smem.index(slot).reshape([ROWS, V_DIM])
            dp_tok = warpgroup_mma(dot, v.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp = warpgroup_mma_wait(0, deps=[dp_tok])
            mbarrier.wait(p_ready.index(buf), (t // 2) & 1)
            p = p_smem.index(buf).load(s_layout).to(gl.float32)
            mbarrier.arrive(p_free.index(buf), count=1)
            ds = (p * (dp - gl.expand_dims(row_stat, 1))).to(dtype)
            mbarrier.wait(ds_free.index(buf), ((t // 2) & 1) ^ 1)
            ds_smem.index(buf).store(ds)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            ds_op = gl.convert_layout(ds, a_layout)
            dq_tok = warpgroup_mma(ds_op, k_dq, dq, is_async=True)
            dq, ds_op = warpgroup_mma_wait(0, deps=[dq_tok, ds_op])
        # Every reader of the slot is complete (S or dP, and this consumer's dQ products).
        mbarrier.arrive(kv_empty.index(slot), count=1)
    ptr = DQ + off_b.to(gl.int64) * stride_qb + off_h.to(gl.int64) * stride_qh
    ptr += q_start.to(gl.int64) * stride_qm
    store_rows(ptr, dq * scale, start_m, seqlen_q, stride_qm, COL0, head_dim, acc_layout)


@gluon.jit
def attn_bwd_dq_sm90_d256_kernel(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    LSE2,
    DELTA,
    DQ,
    ALIBI,
    CU_Q,
    CU_K,
    stride_ab,
    stride_lb,
    stride_lh,
    stride_qb,
    stride_qh,
    stride_qm,
    heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    lpt_heads,
    qk_scale,
    scale,
    softcap,
    window_left,
    window_right,
    head_dim,
    total_q,
    total_k,
    QK_A: gl.constexpr,
    QK_B: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    VARLEN: gl.constexpr,
):
    """dQ of one block of 64 query rows (module docstring, "dQ"): the dK/dV kernel's split with
    rows and keys swapped. The arguments as that kernel takes them; dQ scaled by ``scale`` and
    stored from registers with a row mask (and a column mask past ``head_dim``)."""
    if VARLEN:
        # The grid is sized by the longest sequence: a query block past its own has nothing to
        # do.
        start_m, _, _, _, _, n_rows, _, _ = program(
            CU_Q, CU_K, heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, False, IS_CAUSAL,
            VARLEN,
        )  # fmt: skip
        if start_m >= n_rows:
            return
    dtype: gl.constexpr = q_desc.dtype
    qa_smem, qb_smem = qk_tiles(q_desc, [1, 1, ROWS], QK_A, QK_B)
    ka_smem, kb_smem = qk_tiles(k_desc, [NUM_STAGES, 1, 1, ROWS], QK_A, QK_B)
    v_shape: gl.constexpr = [NUM_STAGES] + v_desc.block_type.shape  # noqa: RUF005
    do_smem = gl.allocate_shared_memory(dtype, do_desc.block_type.shape, do_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_shape, v_desc.layout)
    p_smem, q_ready, kv_ready, kv_empty, p_ready, p_free, fix_bar = handoff_state(
        NUM_STAGES, VARLEN
    )
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, ROWS, ROWS], ds_layout)
    ds_ready, ds_free = tile_barriers()
    gl.warp_specialize(
        [
            (_dq_consumer, (
                qa_smem, qb_smem, ka_smem, kb_smem, v_smem, do_smem, p_smem, ds_smem, q_ready,
                kv_ready, kv_empty, p_ready, p_free, ds_ready, ds_free, LSE2, DELTA, DQ, ALIBI,
                CU_Q, CU_K, stride_ab, stride_lb, stride_lh, stride_qb, stride_qh, stride_qm,
                heads, seqlen_q, seqlen_k, lpt_heads, qk_scale, scale, softcap, window_left,
                window_right, head_dim, total_q, total_k, 0, QK_B, NUM_STAGES, IS_CAUSAL,
                HAS_WINDOW, SOFTCAP, HAS_ALIBI, VARLEN,
            )),
            (_dq_consumer, (
                qa_smem, qb_smem, ka_smem, kb_smem, v_smem, do_smem, p_smem, ds_smem, q_ready,
                kv_ready, kv_empty, p_ready, p_free, ds_ready, ds_free, LSE2, DELTA, DQ, ALIBI,
                CU_Q, CU_K, stride_ab, stride_lb, stride_lh, stride_qb, stride_qh, stride_qm,
                heads, seqlen_q, seqlen_k, lpt_heads, qk_scale, scale, softcap, window_left,
                window_right, head_dim, total_q, total_k, 1, QK_B, NUM_STAGES, IS_CAUSAL,
                HAS_WINDOW, SOFTCAP, HAS_ALIBI, VARLEN,
            )),
            (_dq_producer, (
                q_desc, k_desc, v_desc, do_desc, qa_smem, qb_smem, ka_smem, kb_smem, v_smem,
                do_smem, q_ready, kv_ready, kv_empty, fix_bar, CU_Q, CU_K, heads, kv_group,
                seqlen_q, seqlen_k, lpt_heads, window_left, window_right, total_q, total_k, QK_B,
                NUM_STAGES, IS_CAUSAL, HAS_WINDOW, VARLEN,
            )),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )  # fmt: skip
