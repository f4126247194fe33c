"""The backward at head dim 256 (and MLA's 192 / 128) on Hopper (sm_90a) in Gluon: a dK/dV kernel
(here) and a dQ kernel (``bwd256_dq.py``).

Why a kernel of its own. At head dim 256 the Hopper backward's design (``bwd.py``: each consumer
warpgroup owns 64 keys and holds their dK and dV, 64 x 256 fp32 each) needs 256 accumulator
registers a thread before any score tile, over the 240 a consumer gets; its shared memory (K, V
and a two-slot Q/dO ring, 32 KB a tile, plus dS^T tiles and the fp32 dQ staging) is over the 227
KB of a block too. The portable dK/dV kernel at this head dim runs 32 x 32 tiles (the largest that
hold both accumulators in registers) at about 220 TFLOP/s on an H100.

Both kernels here split one block's work between two consumer warpgroups by product, and each
writes its gradient once per program (no atomics: deterministic). Launch order
(``ops/bwd256.py``): ``bwd_rows.bwd_prep_kernel`` (delta and lse2 into padded row buffers), the dQ
kernel, the dK/dV kernel.

dK and dV (``attn_bwd_dkdv_sm90_d256_kernel``).

Design. The two consumer warpgroups of a program share one block of 64 keys and split the work by
product instead of by keys:

- consumer 0: ``S^T = K Q^T`` (K = 256), the scores as the forward forms them, the masks, ``P^T
  = exp2(S^T - lse2)``; ``P^T (1 - tanh^2)`` (softcap) or P^T into a shared tile for consumer 1;
  ``dV += P^T dO`` (P^T in registers, N = 256);
- consumer 1: ``dP^T = V dO^T``; the tile; ``dS^T = tile * (dP^T - delta)``; ``dK += dS^T Q``
  (dS^T in registers, N = 256).

Each consumer holds one whole accumulator (64 x 256 fp32: 128 registers) and one 64 x 64 score tile
(32), and the tensor work is balanced (8 units of 64^3 each a step). One tile crosses, one way:
consumer 1 needs P only for dS (an earlier build split dK and dV by head-dim halves instead, each
consumer needing both P^T and dS^T, two tiles crossing both ways; this one is 1-7% faster and frees
16 KB). dQ is not computed here (a fused dQ would need a third accumulator or atomics): the dQ
kernel (``bwd256_dq.py``) recomputes S and dP (three products of 4 units a step against this
kernel's four). The tile is fp16 whatever the input dtype (P and P (1 - tanh^2) are in [0, 1]: 11
significant bits where bf16 has 8; bf16 P measured dK errors up to 2x the portable kernel's against
float64).

Grid: ``cdiv(Sk, 64) * B * Hkv`` programs, program ``(n, b, hk)`` (``interleave`` with
``lpt_heads``) owning keys ``[64 n, 64 n + 64)`` of kv head hk, walking the query blocks of 64
rows of each query head of its group that see them (causal: from the diagonal; window: its band).

Schedule (``gl.warp_specialize``): consumer 0 is the default partition, consumer 1 worker 0, the
producer (one warp, 24 registers) worker 1. Shared memory: K and V (32 KB each), a ring of
NUM_STAGES Q/dO slots (64 KB a slot), the P tile double-buffered by step (8 KB each): 213,376 B
with two slots. Barriers (all single-phase-per-use, parities from the step index):

- ``kv_ready``: K and V landed (count 1, the producer's expect);
- ``qd_ready[s]``, ``qd_empty[s]``: slot s landed / released by both consumers (count 2);
- ``p_ready[b]``, ``p_free[b]``: tile b written (consumer 0) / read (consumer 1).

Step t uses slot ``t % NUM_STAGES`` (parity ``(t // NUM_STAGES) & 1``) and tile ``b = t % 2``
(parity ``(t // 2) & 1``); consumer 0 writes tile b after consumer 1's read of step t - 2
(parity ``((t // 2) & 1) ^ 1``, the first two pass on the barrier's initial phase). Consumer 0
never waits for consumer 1 otherwise, and runs up to two steps ahead of it.

Scores (SOFTCAP, HAS_ALIBI, ``bwd256_common.capped``): as ``bwd.py`` forms them,
``ops/problem.py:scores`` folding the units (softcap: ``c log2(e) tanh(scale q.k / c)``, then ALiBi,
then the masks); with a softcap dS is taken with respect to ``scale q.k``, the factor ``1 - tanh^2``
applied by consumer 0 to the tile it hands over. Masks as ``bwd.py``'s: causal bottom-right, a
window on every step, keys past Sk (without causal, on a block that crosses Sk; K and V arrive as
zeros there); rows past Sq have Q = dO = 0 and lse2 = +inf (P = 0). dK and dV leave from registers
by plain stores with a row mask, and a column mask past ``head_dim`` (head dims 136-248 run these
kernels over the same 256-column boxes: the copy engine fills the columns past the tensors' with
zeros, which add nothing to any product), or with TMA_EPILOGUE (``ops/bwd256.py:
DKDV_TMA_EPILOGUE``, on: 1.02-1.08x at 1024-8192 keys, H200): once both consumers' last products are
complete (``epi_bar``, count 2: consumer 0's S^T and dQ read K, consumer 1's dP^T reads V), consumer
0 writes dV into V's tile and consumer 1 dK into K's (MLA: its two), and each stores its tile by TMA
(rows past Sk and columns past the head dim clipped by the copy engine; VARLEN: a block that crosses
its sequence's end keeps the register stores), as ``bwd.py`` does; the register stores cost the
128-key MLA kernel 43-64 us at 1024 programs on an H200.

dQ: ``bwd256_dq.py`` (the same split with rows and keys swapped). The helpers the two kernels
and MLA's 128-key kernel (``bwd_mla.py``) share (the program's work, the tile loads with a packed
batch's rows zeroed, the scores, the stores, the barriers) are in ``bwd256_common.py``.

VARLEN (packed batches, FlashAttention-2's varlen): the descriptors are ``(1, heads, total, D)``
views of the packed tensors (batch coordinate 0), the grids are sized by the longest sequence (a
program whose block starts past its own sequence returns at entry), and each program reads its
sequence's first rows and lengths from ``CU_Q``, ``CU_K`` (``common.sequence``). The row stats are
those of one sequence of all ``total_q`` rows (the prep kernel runs as for a dense batch of one),
read with a row mask (lse2 +inf and delta 0 past the sequence's end). A tile that crosses the
sequence's end holds the next sequence's rows (or, past the tensors, the copy engine's zeros); where
a product sums over those rows a NaN or inf there would reach this sequence's gradients even times P
= 0, so the producer lands such a tile on its own barrier, zeroes the rows past the end
(``common.zero_rows``) and then arrives on the slot's ready barrier (``bwd256_common.load_fixed``):
Q and dO in the dK/dV kernel (dV and dK sum over query rows), K and V in the dQ kernel (dQ sums over
keys). The resident tiles (K and V of the dK/dV kernel, Q and dO of the dQ kernel) reach only
gradient rows past the end, which the row-masked stores drop.

MLA's head dims (QK_B = 64: q and k 192, v 128). A shared-memory tile is a power of two wide, so Q
and K live in two tiles, columns ``[0, QK_A)`` (128) and ``[QK_A, QK_A + QK_B)`` (64), each filled
by 64-column copy boxes (``bwd256_common.load_tiles``); V, dO and dV are 128 wide. ``S^T = K Q^T``
(and the dQ kernel's S) is two chained wgmmas over the tiles, consumer 1's dK two accumulators (128
and 64 columns) from the same dS^T operand; the dQ kernel gives consumer 0 (beside S, K = 192) the
last 64 columns of dQ and consumer 1 (beside dP, K = 128) the first 128, 4 units of 64^3 a step
each. Three ring slots (``ops/bwd256.py``): 180,688 B (dK/dV), 197,152 B (dQ). Without QK_B, QK_A is
the tile's whole width (256) and the second tile is never allocated.

MLA's dQ in the dK/dV kernel (FUSED_DQ, ``ops/bwd256.py: FUSED_MLA``; the dQ kernel is not
launched): five products a step instead of the two kernels' seven (13 units of 64^3 against 18).
Consumer 1 stores dS^T (input dtype) into a double-buffered tile (``ds_ready`` count 1,
``ds_free`` count 2: both consumers read it); ``dQ = dS K`` (dS from that tile, transposed, as
the A operand) is split by columns, consumer 0 the first QK_A (beside dV's layout), consumer 1
the last QK_B (beside dK's second tile): 7 and 6 units a step. Each stages its fp32 columns in a
tile of its own and reduce-adds them into an fp32 accumulator (zeroed by the launcher; the Hopper
backward's conversion kernel scales and casts it afterwards) by ``cp.reduce.async.bulk``, waiting
for the previous step's reduce to have read the tile first. Two pipelining moves keep the tensor
cores fed: consumer 0 runs step t - 1's dQ beside step t's S^T (so it never waits on consumer 1's
step t), and consumer 1 issues step t + 1's dP^T before it retires step t's dK and dQ (wgmma
groups retire in order: ``warpgroup_mma_wait(2)`` then ``(1)``); consumer 0 stages and reduces
step t - 1's dQ while step t's dV runs. The products past either end
(consumer 0's at step 0, consumer 1's after the last step) run on whatever their tiles hold and
are never used or reduced; their waits pass on the barriers' initial phase or are predicated
off. With VARLEN the producer zeroes the resident K and V rows past the sequence's end too (dQ
sums over keys) and the reduced rows past it are zeros. Two ring slots: 205,344 B. dQ's last
bits then depend on the order of the reduce-adds: ``deterministic`` keeps the dQ kernel.
Without a window, softcap, ALiBi or packed batch, MLA's fused backward runs ``bwd_mla.py``'s
kernel instead (128 keys a program: half the L2 traffic a key of this one's, which its
reduce-adds held at 87% of L2's throughput).

Not covered (the launcher's ``takes`` says no): a value head dim unlike the query's other than
MLA's, head dims outside 136-256.
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

from flashcore.kernels.hopper.bwd256_common import (
    ROWS,
    capped,
    handoff_state,
    load_fixed,
    load_tiles,
    program,
    qk_tiles,
    store_acc,
)
from flashcore.kernels.hopper.bwd_dq import stage_and_reduce
from flashcore.kernels.hopper.bwd_load import q_blocks


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, qa_smem, qb_smem, ka_smem, kb_smem, v_smem,
              do_smem, kv_ready, qd_ready, qd_empty, fix_bar, CU_Q, CU_K, kv_heads, kv_group,
              seqlen_q, seqlen_k, lpt_heads, window_left, window_right, total_q, total_k,
              QK_B: gl.constexpr, NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
              HAS_WINDOW: gl.constexpr, VARLEN: gl.constexpr,
              FUSED_DQ: gl.constexpr):  # fmt: skip
    start_n, _, off_hk, q_start, k_start, seqlen_q, seqlen_k, desc_b = program(
        CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, True, False, VARLEN
    )
    n_fix = gl.to_tensor(0)
    # K and V: without FUSED_DQ their rows past a packed sequence's end reach only dK and dV
    # rows that are not stored (nothing sums over keys), so they are not zeroed; with it, dQ =
    # dS K sums over keys (and dS takes dP^T = V dO^T): zeroed.
    if VARLEN and FUSED_DQ:
        if start_n + ROWS > seqlen_k:
            n_fix = load_fixed(k_desc, v_desc, off_hk, k_start + start_n, seqlen_k - start_n,
                                kv_ready, fix_bar, n_fix, ka_smem, kb_smem, v_smem,
                                QK_B)  # fmt: skip
        else:
            load_tiles(k_desc, v_desc, desc_b, off_hk, k_start + start_n, kv_ready, ka_smem,
                        kb_smem, v_smem, QK_B)  # fmt: skip
    else:
        load_tiles(k_desc, v_desc, desc_b, off_hk, k_start + start_n, kv_ready, ka_smem,
                    kb_smem, v_smem, QK_B)  # fmt: skip
    lo, n_m = q_blocks(start_n, seqlen_q, seqlen_k, window_left, window_right, IS_CAUSAL,
                      HAS_WINDOW, ROWS)  # fmt: skip
    for t in range(n_m * kv_group):
        off_h = off_hk * kv_group + t // n_m
        start_m = lo + (t % n_m) * ROWS
        slot = t % NUM_STAGES
        mbarrier.wait(qd_empty.index(slot), ((t // NUM_STAGES) & 1) ^ 1)
        bar = qd_ready.index(slot)
        row = q_start + start_m
        qa = qa_smem.index(slot)
        qb = qb_smem.index(slot)
        do_dest = do_smem.index(slot)
        if VARLEN:
            if start_m + ROWS > seqlen_q:
                # Q and dO rows past the sequence's end would reach dV and dK through P^T dO
                # and dS^T Q (sums over query rows).
                n_fix = load_fixed(q_desc, do_desc, off_h, row, seqlen_q - start_m, bar,
                                    fix_bar, n_fix, qa, qb, do_dest, QK_B)  # fmt: skip
            else:
                load_tiles(q_desc, do_desc, desc_b, off_h, row, bar, qa, qb, do_dest, QK_B)
        else:
            load_tiles(q_desc, do_desc, desc_b, off_h, row, bar, qa, qb, do_dest, QK_B)


@gluon.jit
def _consumer(qa_smem, qb_smem, ka_smem, kb_smem, v_smem, do_smem, p_smem, ds_smem, dq_tile,
              dq_desc, kv_ready, qd_ready, qd_empty, p_ready, p_free, ds_ready, ds_free, LSE2,
              DELTA, DK, DV, ALIBI, CU_Q, CU_K, dka_desc, dkb_desc, dv_desc, epi_bar, stride_ab,
              stride_lb, stride_lh, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
              stride_dvn, kv_heads, kv_group, seqlen_q, seqlen_k, lpt_heads, qk_scale, scale,
              softcap, window_left, window_right, head_dim, total_q, total_k,
              CONSUMER: gl.constexpr, QK_B: gl.constexpr, NUM_STAGES: gl.constexpr,
              IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, EVEN_N: gl.constexpr,
              SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, VARLEN: gl.constexpr,
              FUSED_DQ: gl.constexpr, TMA_EPILOGUE: gl.constexpr):  # fmt: skip
    dtype: gl.constexpr = ka_smem.dtype
    QK_A: gl.constexpr = ka_smem.shape[3]
    V_DIM: gl.constexpr = v_smem.shape[3]
    # Consumer 0 holds dV, consumer 1 dK (module docstring; MLA's dK as columns [0, QK_A) and
    # [QK_A, QK_A + QK_B)).
    ACC_DIM: gl.constexpr = V_DIM if CONSUMER == 0 else QK_A
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ACC_DIM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    start_n, off_b, off_hk, q_start, k_start, seqlen_q, seqlen_k, desc_b = program(
        CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, True, False, VARLEN
    )
    lo, n_m = q_blocks(start_n, seqlen_q, seqlen_k, window_left, window_right, IS_CAUSAL,
                      HAS_WINDOW, ROWS)  # fmt: skip
    diag = seqlen_k - seqlen_q
    keys = gl.expand_dims(start_n + gl.arange(0, ROWS, layout=row_layout), 1)
    offs_m = gl.arange(0, ROWS, layout=col_layout)
    # Query blocks starting at or past this row see every key of the block: no causal mask.
    full_m = start_n + ROWS - 1 - diag
    kat = ka_smem.reshape([ROWS, QK_A])
    vt = v_smem.reshape([ROWS, V_DIM])
    zero_s = gl.zeros([ROWS, ROWS], gl.float32, layout=s_layout)
    acc = gl.zeros([ROWS, ACC_DIM], gl.float32, layout=acc_layout)
    if QK_B > 0:
        kbt = kb_smem.reshape([ROWS, QK_B])
        if CONSUMER == 1:
            b_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, QK_B, 16]
            )
            acc_b = gl.zeros([ROWS, QK_B], gl.float32, layout=b_layout)
    if FUSED_DQ:
        # This consumer's columns of a step's dQ = dS K (consumer 0 the first QK_A, beside dV's
        # layout; consumer 1 the last QK_B, beside dK's second tile), from the dS^T tile.
        if CONSUMER == 0:
            zero_dq = gl.zeros([ROWS, QK_A], gl.float32, layout=acc_layout)
            k_dq = kat
            dq_col = 0
        else:
            zero_dq = gl.zeros([ROWS, QK_B], gl.float32, layout=b_layout)
            k_dq = kbt
            dq_col = QK_A
        # Consumer 0 runs step t - 1's dQ beside step t's S^T (its dS^T tile is written by then:
        # no wait on consumer 1's step t), and reduces it at that step's row of that head.
        prev_h = off_hk * kv_group
        prev_m = lo
    mbarrier.wait(kv_ready, 0)
    if FUSED_DQ and CONSUMER == 1:
        # Consumer 1 issues step t + 1's dP^T before it retires step t's dK and dQ (the tensor
        # cores keep its products while it waits for consumer 0's P): step 0's here.
        dp_tok = _dp_product(vt, do_smem, qd_ready, zero_s, 0, n_m * kv_group, NUM_STAGES)
    for t in range(n_m * kv_group):
        off_h = off_hk * kv_group + t // n_m
        start_m = lo + (t % n_m) * ROWS
        slot = t % NUM_STAGES
        buf = t % 2
        mbarrier.wait(qd_ready.index(slot), (t // NUM_STAGES) & 1)
        qa = qa_smem.index(slot).reshape([ROWS, QK_A])
        do = do_smem.index(slot).reshape([ROWS, V_DIM])
        rows = start_m + offs_m
        # The prep kernel's row stats (VARLEN: of one sequence of all rows; stride_lb is 0).
        stats = off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + q_start + rows
        if CONSUMER == 0:
            s_tok = warpgroup_mma(kat, qa.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            if QK_B > 0:
                qb = qb_smem.index(slot).reshape([ROWS, QK_B])
                s_tok = warpgroup_mma(kbt, qb.permute((1, 0)), s_tok, is_async=True)
            if FUSED_DQ:
                # Step t - 1's dQ (tile (t + 1) % 2; at t = 0 the barrier's initial phase passes
                # and the product runs on whatever the tile holds, not reduced: a run-time branch
                # around a product would not do, bwd.py).
                dq_tok = _dq_product(ds_smem, ds_ready, k_dq, zero_dq, t - 1)
            # lse2 = +inf for a row with no key and past Sq (P = 0); VARLEN, the rows past the
            # sequence's end are the next one's: masked.
            if VARLEN:
                lse2 = gl.load(LSE2 + stats, mask=rows < seqlen_q, other=float("inf"))
            else:
                lse2 = gl.load(LSE2 + stats)
            if FUSED_DQ:
                s = warpgroup_mma_wait(1, deps=[s_tok])
            else:
                s = warpgroup_mma_wait(0, deps=[s_tok])
            r = gl.expand_dims(rows, 0)
            s, t_cap = capped(s, r, keys, diag, qk_scale, softcap, ALIBI,
                               off_b.to(gl.int64) * stride_ab + off_h, SOFTCAP,
                               HAS_ALIBI)  # fmt: skip
            if IS_CAUSAL:
                if start_m < full_m:
                    s = gl.where(keys <= r + diag, s, float("-inf"))
            elif not EVEN_N:  # noqa: SIM102 (a constexpr branch around a runtime one)
                # Keys past Sk (zeros): their P = exp2(-lse2) could overflow (bwd.py, EVEN_N).
                if start_n + ROWS > seqlen_k:
                    s = gl.where(keys < seqlen_k, s, float("-inf"))
            if HAS_WINDOW:
                s = gl.where(keys >= r + (diag - window_left), s, float("-inf"))
                if not IS_CAUSAL:
                    s = gl.where(keys <= r + (diag + window_right), s, float("-inf"))
            p = gl.exp2(s - gl.expand_dims(lse2, 0))
            # For consumer 1's dS^T, in fp16 (module docstring), once it has read tile buf of
            # step t - 2: P^T, times 1 - tanh^2 with a softcap (the gradient with respect to
            # scale q.k: dS^T = P^T (1 - t^2) (dP^T - delta)).
            mbarrier.wait(p_free.index(buf), ((t // 2) & 1) ^ 1)
            if SOFTCAP:
                p_smem.index(buf).store((p * (1.0 - t_cap * t_cap)).to(gl.float16))
            else:
                p_smem.index(buf).store(p.to(gl.float16))
            fence_async_shared()
            mbarrier.arrive(p_ready.index(buf), count=1)
            p_op = gl.convert_layout(p.to(dtype), a_layout)
            tok = warpgroup_mma(p_op, do, acc, is_async=True)
            if FUSED_DQ:
                # Step t - 1's dQ first (older than dV): its staging and reduce run under dV.
                dq = warpgroup_mma_wait(1, deps=[dq_tok])
                mbarrier.arrive(ds_free.index((t + 1) % 2), count=1, pred=t > 0)
                if t > 0:
                    stage_and_reduce(dq, dq_tile, dq_desc, desc_b, prev_h, q_start + prev_m,
                                     dq_col, seqlen_q - prev_m, True, VARLEN)  # fmt: skip
                acc, p_op = warpgroup_mma_wait(0, deps=[tok, p_op])
                mbarrier.arrive(qd_empty.index(slot), count=1)
                prev_h = off_h
                prev_m = start_m
            else:
                acc, p_op = warpgroup_mma_wait(0, deps=[tok, p_op])
        else:
            if not FUSED_DQ:
                dp_tok = warpgroup_mma(vt, do.permute((1, 0)), zero_s, use_acc=False,
                                       is_async=True)  # fmt: skip
            if VARLEN:
                delta = gl.load(DELTA + stats, mask=rows < seqlen_q, other=0.0)
            else:
                delta = gl.load(DELTA + stats)
            dp = warpgroup_mma_wait(0, deps=[dp_tok])
            mbarrier.wait(p_ready.index(buf), (t // 2) & 1)
            p = p_smem.index(buf).load(s_layout).to(gl.float32)
            mbarrier.arrive(p_free.index(buf), count=1)
            ds = (p * (dp - gl.expand_dims(delta, 0))).to(dtype)
            if FUSED_DQ:
                # dS^T for both consumers' dQ products, once both have read step t - 2's.
                mbarrier.wait(ds_free.index(buf), ((t // 2) & 1) ^ 1)
                ds_smem.index(buf).store(ds)
                fence_async_shared()
                mbarrier.arrive(ds_ready.index(buf), count=1)
            ds_op = gl.convert_layout(ds, a_layout)
            tok = warpgroup_mma(ds_op, qa, acc, is_async=True)
            if QK_B > 0:
                qb = qb_smem.index(slot).reshape([ROWS, QK_B])
                tok_b = warpgroup_mma(ds_op, qb, acc_b, is_async=True)
                if FUSED_DQ:
                    dq_tok = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), k_dq, zero_dq,
                                           use_acc=False, is_async=True)  # fmt: skip
                    # Step t + 1's dP^T (past the last step: on whatever its slot holds, never
                    # read); then dK's two products (the slot's last readers), then dQ.
                    dp_tok = _dp_product(vt, do_smem, qd_ready, zero_s, t + 1, n_m * kv_group,
                                         NUM_STAGES)  # fmt: skip
                    acc, acc_b, ds_op = warpgroup_mma_wait(2, deps=[tok, tok_b, ds_op])
                    mbarrier.arrive(qd_empty.index(slot), count=1)
                    dq = warpgroup_mma_wait(1, deps=[dq_tok])
                    mbarrier.arrive(ds_free.index(buf), count=1)
                    stage_and_reduce(dq, dq_tile, dq_desc, desc_b, off_h, q_start + start_m,
                                     dq_col, seqlen_q - start_m, True, VARLEN)  # fmt: skip
                else:
                    acc, acc_b, ds_op = warpgroup_mma_wait(0, deps=[tok, tok_b, ds_op])
            else:
                acc, ds_op = warpgroup_mma_wait(0, deps=[tok, ds_op])
        if not FUSED_DQ:
            # Every reader of the slot is complete (S^T or dP^T, and this consumer's dV or dK).
            mbarrier.arrive(qd_empty.index(slot), count=1)
    if FUSED_DQ:
        if CONSUMER == 0:
            # The last step's dQ.
            n_steps = n_m * kv_group
            dq_tok = _dq_product(ds_smem, ds_ready, k_dq, zero_dq, n_steps - 1)
            dq = warpgroup_mma_wait(0, deps=[dq_tok])
            if n_steps > 0:
                stage_and_reduce(dq, dq_tile, dq_desc, desc_b, prev_h, q_start + prev_m, dq_col,
                                 seqlen_q - prev_m, True, VARLEN)  # fmt: skip
        else:
            # The dP^T issued past the last step.
            warpgroup_mma_wait(0, deps=[dp_tok])
        # No bulk reduce may still read this consumer's staging tile when the block exits.
        tma.store_wait(0)
    if QK_B == 0 or CONSUMER == 0:
        acc_b = acc  # a stand-in: only consumer 1 holds MLA's second dK tile
    if TMA_EPILOGUE:
        # Both consumers' last products have completed (consumer 0's S^T and dQ read K,
        # consumer 1's dP^T reads V): each overwrites the tile of its own accumulator.
        mbarrier.arrive(epi_bar, count=1)
        mbarrier.wait(epi_bar, 0)
    # Consumer 0 holds dV, consumer 1 dK (and MLA's second tile).
    store_acc(DK, DV, dka_desc, dkb_desc, dv_desc, ka_smem, kb_smem, v_smem, acc, acc, acc_b,
               off_b, off_hk, desc_b, k_start, start_n, seqlen_k, stride_dkb, stride_dkh,
               stride_dkn, stride_dvb, stride_dvh, stride_dvn, scale, head_dim, CONSUMER == 0,
               CONSUMER == 1, QK_B, TMA_EPILOGUE, VARLEN)  # fmt: skip
    if TMA_EPILOGUE:
        # No TMA store may still read the tile when the block exits.
        tma.store_wait(0)


@gluon.jit
def _dp_product(vt, do_smem, qd_ready, zero_s, step, n_steps, NUM_STAGES: gl.constexpr):
    """FUSED_DQ: issue consumer 1's ``dP^T = V dO^T`` of step ``step`` once its ring slot has
    landed (at ``step == n_steps`` nothing is waited for: the product reads whatever the slot
    holds and is never used); returns the accumulator's token."""
    slot = step % NUM_STAGES
    mbarrier.wait(qd_ready.index(slot), (step // NUM_STAGES) & 1, pred=step < n_steps)
    do = do_smem.index(slot).reshape([vt.shape[0], vt.shape[1]])
    return warpgroup_mma(vt, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)


@gluon.jit
def _dq_product(ds_smem, ds_ready, k_dq, zero_dq, step):
    """FUSED_DQ: issue consumer 0's columns of step ``step``'s dQ (``dS K``, ``k_dq`` K's
    columns) once consumer 1 has written the step's dS^T tile (``step + 2``: step -1 is the
    barrier's initial phase, which passes); returns the accumulator's token."""
    buf = (step + 2) % 2
    mbarrier.wait(ds_ready.index(buf), (((step + 2) // 2) & 1) ^ 1)
    ds = ds_smem.index(buf).permute((1, 0))
    return warpgroup_mma(ds, k_dq, zero_dq, use_acc=False, is_async=True)


@gluon.jit
def attn_bwd_dkdv_sm90_d256_kernel(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    dqa_desc,
    dqb_desc,
    LSE2,
    DELTA,
    DK,
    DV,
    ALIBI,
    CU_Q,
    CU_K,
    dka_desc,
    dkb_desc,
    dv_desc,
    stride_ab,
    stride_lb,
    stride_lh,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    kv_heads,
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
    EVEN_N: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    VARLEN: gl.constexpr,
    FUSED_DQ: gl.constexpr = False,
    TMA_EPILOGUE: gl.constexpr = False,
):
    """dK and dV of one 64-key block (module docstring). ``LSE2`` and ``DELTA``: the row stats
    of ``bwd.bwd_prep_kernel``, fp32 ``(B, H, Sq_pad)`` with strides ``(stride_lb, stride_lh,
    1)``, ``Sq_pad`` a multiple of 64 (lse2 +inf and delta 0 past Sq); ``qk_scale`` is ``scale *
    log2(e)`` (``scale / c`` with softcap c, then ``softcap`` is ``c log2(e)``); ``ALIBI`` fp32
    slopes at ``b * stride_ab + h`` (HAS_ALIBI); ``head_dim`` the tensors' (the boxes are 256
    wide: columns past it load as zeros and are not stored); dK is scaled by ``scale`` here.
    VARLEN: packed sequences (``CU_Q``, ``CU_K`` int32 offsets, at most ``total_q`` /
    ``total_k`` rows; ``seqlen_q`` / ``seqlen_k`` the longest sequence's), the descriptors over
    ``(1, heads, total, D)`` views, the row stats those of one sequence of all rows, the strides
    of dK and dV ``(0, head, row)``."""
    if VARLEN:
        # The grid is sized by the longest sequence: a key block past its own has nothing to do.
        start_n, _, _, _, _, _, n_keys, _ = program(
            CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, True, False,
            VARLEN,
        )  # fmt: skip
        if start_n >= n_keys:
            return
    dtype: gl.constexpr = q_desc.dtype
    qa_smem, qb_smem = qk_tiles(q_desc, [NUM_STAGES, 1, 1, ROWS], QK_A, QK_B)
    ka_smem, kb_smem = qk_tiles(k_desc, [1, 1, ROWS], QK_A, QK_B)
    do_shape: gl.constexpr = [NUM_STAGES] + do_desc.block_type.shape  # noqa: RUF005
    do_smem = gl.allocate_shared_memory(dtype, do_shape, do_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    p_smem, kv_ready, qd_ready, qd_empty, p_ready, p_free, fix_bar = handoff_state(
        NUM_STAGES, VARLEN
    )
    # FUSED_DQ: the dS^T tiles (ready count 1, free count 2: both consumers read them) and each
    # consumer's fp32 staging tile; without, the P tiles, their barriers and V stand in (never
    # touched).
    ds_smem = p_smem
    ds_ready = p_ready
    ds_free = p_free
    dqa_tile = v_smem
    dqb_tile = v_smem
    if FUSED_DQ:
        gl.static_assert(QK_B > 0)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2, ROWS, ROWS], ds_layout)
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=1)
            mbarrier.init(ds_free.index(i), count=2)
        dqa_tile = gl.allocate_shared_memory(gl.float32, dqa_desc.block_type.shape, dqa_desc.layout)
        dqb_tile = gl.allocate_shared_memory(gl.float32, dqb_desc.block_type.shape, dqb_desc.layout)
    # TMA_EPILOGUE: both consumers' last products are complete (count 2, one phase); without,
    # kv_ready stands in (never touched).
    epi_bar = kv_ready
    if TMA_EPILOGUE:
        epi = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        epi_bar = epi.index(0)
        mbarrier.init(epi_bar, count=2)
    # The consumers' argument tuples differ only in CONSUMER and the dQ staging (Triton 3.6's
    # frontend has no starred tuples).
    gl.warp_specialize(
        [
            (_consumer, (
                qa_smem, qb_smem, ka_smem, kb_smem, v_smem, do_smem, p_smem, ds_smem, dqa_tile,
                dqa_desc, kv_ready, qd_ready, qd_empty, p_ready, p_free, ds_ready, ds_free, LSE2,
                DELTA, DK, DV, ALIBI, CU_Q, CU_K, dka_desc, dkb_desc, dv_desc, epi_bar, stride_ab,
                stride_lb, stride_lh, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
                stride_dvn, kv_heads, kv_group, seqlen_q, seqlen_k, lpt_heads, qk_scale, scale,
                softcap, window_left, window_right, head_dim, total_q, total_k, 0, QK_B,
                NUM_STAGES, IS_CAUSAL, HAS_WINDOW, EVEN_N, SOFTCAP, HAS_ALIBI, VARLEN, FUSED_DQ,
                TMA_EPILOGUE,
            )),
            (_consumer, (
                qa_smem, qb_smem, ka_smem, kb_smem, v_smem, do_smem, p_smem, ds_smem, dqb_tile,
                dqb_desc, kv_ready, qd_ready, qd_empty, p_ready, p_free, ds_ready, ds_free, LSE2,
                DELTA, DK, DV, ALIBI, CU_Q, CU_K, dka_desc, dkb_desc, dv_desc, epi_bar, stride_ab,
                stride_lb, stride_lh, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
                stride_dvn, kv_heads, kv_group, seqlen_q, seqlen_k, lpt_heads, qk_scale, scale,
                softcap, window_left, window_right, head_dim, total_q, total_k, 1, QK_B,
                NUM_STAGES, IS_CAUSAL, HAS_WINDOW, EVEN_N, SOFTCAP, HAS_ALIBI, VARLEN, FUSED_DQ,
                TMA_EPILOGUE,
            )),
            (_producer, (
                q_desc, k_desc, v_desc, do_desc, qa_smem, qb_smem, ka_smem, kb_smem, v_smem,
                do_smem, kv_ready, qd_ready, qd_empty, fix_bar, CU_Q, CU_K, kv_heads, kv_group,
                seqlen_q, seqlen_k, lpt_heads, window_left, window_right, total_q, total_k, QK_B,
                NUM_STAGES, IS_CAUSAL, HAS_WINDOW, VARLEN, FUSED_DQ,
            )),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )  # fmt: skip
