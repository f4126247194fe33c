"""MLA's backward (q and k head dim 192, v 128) on Hopper (sm_90a) in Gluon, 128 keys a program.

Why a kernel of its own. ``bwd256.py``'s dK/dV kernel with FUSED_DQ takes 64 keys a program and
splits their work between its two consumers by product. Each of its steps (64 keys by 64 query
rows) loads 40 KB of Q and dO from L2 and reduce-adds 48 KB of fp32 dQ into it; under ncu (H200,
(2, 16, 4096) bf16 non-causal) the reduce-adds came to 10.3 of the kernel's 15.3 GB of L2
traffic, which ran at 87% of L2's throughput: L2 set the pace, and its bytes alone needed more
time than FlashAttention-4's whole kernel (96 keys a program: 10.0 GB). Both kinds of traffic are
per key block, so the lever is more keys a program (docs/performance_backward.md, "MLA's backward
at 128 keys a program").

Design: ``bwd.py``'s (the D = 128 backward) at MLA's head dims. A program owns 128 keys of a kv
head; consumer c (worker 0 and the default partition) owns keys ``[64 c, 64 c + 64)``: its K_c
(a 128- and a 64-column tile) and V_c in shared memory, loaded once, and its dV_c (64 x 128 fp32:
64 registers a thread) and dK_c (64 x 192: 96) in registers. Per step (query head g, 64 query
rows; the producer warp lands Q, dO and the rows' lse2 and delta in a ring slot), consumer c::

    S^T  = K_c Q^T        (K = 192: two wgmmas); wait
    P^T = exp2(S^T qk_scale - lse2) (masked; lse2 from the slot)
    dV_c += P^T dO        (P^T in registers); wait
    dP^T = V_c dO^T       (K = 128); wait
    dS^T = P^T (dP^T - delta)   (P^T kept in fp16; delta from the slot)
    dS^T -> shared (tile c), once both consumers' dQ of the previous step has read it
    dK_c += dS^T Q        (dS^T in registers, two wgmmas); wait; release the slot
    wait for both dS^T tiles; for each 64-column panel i of this consumer's dQ columns:
        dQ_i = dS_0 K_0[:, panel i] + dS_1 K_1[:, panel i]; wait
        stage dQ_i in fp32 (``bwd_dq.stage_dq``), fence, reduce-add it into the accumulator

with consumer 0's columns ``[0, 128)`` (two panels) and consumer 1's ``[128, 192)`` (one). The
step sends its 64 x 192 fp32 dQ to L2 once for 128 keys, half of ``bwd256.py``'s bytes a key,
and Q and dO likewise. Registers: a consumer's dK and dV are 160 a thread through the loop, and
one tile of 32 beside them at a time (S^T, dP^T or a dQ panel), a step's products one after
another: with S^T and dP^T in flight together, or both of consumer 0's panels (ptxas issued the
second panel's products before the first's staging stores), ptxas spilled the accumulators and
serialised every wgmma (C7512); the fence between a panel's staging and the next panel's
products keeps them apart. The row stats come from shared memory where they are used (as
vectors in registers, loaded from global memory, they held 32 a thread over the step). The two
consumers' steps interleave on the tensor cores.

SKIP_MASKED (``ops/bwd256.py: WIDE_SKIP_MASKED``, on), causal: a step none of whose rows sees
a key of consumer 1's (a block's first step: its rows start at or below the block's first key's
diagonal) has P = dS = 0 there, so consumer 1 issues none of its products (10 of the step's 26
units of 64^3), writes a zero dS^T tile for both consumers' dQ panels and keeps the barriers'
order (``ds_free`` wait, ``ds_ready`` and ``qd_empty`` arrivals); 1.02-1.04x at 512-2048 keys.

TMA_EPILOGUE (``ops/bwd256.py: WIDE_TMA_EPILOGUE``, on; 1.05-1.11x non-causal, level causal): dK
and dV leave through shared memory and TMA stores, as ``bwd.py``'s, instead of 4-byte stores
from registers in the wgmma layout (43-64 us a backward at 1024 programs on an H200, whatever
their length: docs/performance_backward.md). Consumer c waits for ``ds_free``'s completion of
the last step (both consumers' last dQ products, the other's of which read K_c), then writes
dK_c into its K tiles (the 128- and 64-column ones: dK's boxes are a 128-wide one like V's
and a 64-wide one, so no store reads a sub-view of a tile) and dV_c into V_c, and stores them
(rows past Sk clipped by the copy engine). VARLEN: a block that crosses the sequence's end
keeps the row-masked register stores.

MASK_EXPONENT (``ops/bwd256.py: WIDE_MASK_EXPONENT``, on): the exponent ``S^T qk_scale - lse2``
formed before the masks' run-time branches (``_step``). Without it the causal build's branch
splits an FMUL from an FADD on every step and consumer 1 spills nine registers a step beside it;
with the exponent first, each consumer's softmax is 32 FFMAs and the exponentials as in the
non-causal build (sm_90a SASS), 564 B of spills against 608; causal 1.01-1.02x (H200).

FRESH_DESC (``ops/bwd256.py: WIDE_FRESH_DESC``, on): the views
of the tiles that stay put (K_c, V_c, both consumers' K columns for dQ) are taken each step
through a zero that LLVM cannot see (``common.opaque``). Without it LLVM forms every k-step's
64-bit wgmma descriptor of those tiles once before the loop (dozens of values live across it),
ptxas spills them, and each step reloads them (``LDL``) right before the ``R2UR`` that hands them
to an ``HGMMA`` (docs/performance_backward.md, "MLA's backward: the diagonal's steps in a loop
of their own"); with it, sm_90a: no local accesses in the non-causal step loops (11 / 26 a step
without), 549 / 477 instructions (608 / 540), 36 B of spills (488); causal 635 / 613 (707 /
651), 0 / 3 local accesses (16 / 28), 132 B (564). H200: non-causal 1.04-1.05x, causal
1.09-1.10x at 2048-8192 keys.

SPLIT_DIAG (``ops/bwd256.py: WIDE_SPLIT_DIAG``, on), causal: a block's steps that the diagonal
crosses for either consumer (``diagonal_steps``: those starting before consumer 1's ``full_m``),
every head's of its kv group, run in one loop with the masks, then the others in a second loop
built as the non-causal step (no mask, EVEN_N: below the diagonal every key of the block is in
[0, Sk) and seen by every row); the producer loads them in that order. sm_90a: the second loops
565 / 516 instructions a step against the one loop's 635 / 613; the spills grow outside the loops
(344 B against 132). Before FRESH_DESC the same split was 0.88-0.91x (it doubled the descriptors'
reloads); with it, H200: 1.02-1.07x kernel time at 512-4096 keys.

Consumer 0 does 14 units of 64^3 a step to consumer 1's 12, and the ``ds_free`` wait keeps
them in step. The middle dQ panel alternating between them by step (13 units each, its staging
tile handed over on an mbarrier) was built, ran exact and was not faster (0.90-1.04x, H200:
docs/performance_backward.md, "MLA's backward: packed batches, every length, ..."); removed.

Shared memory (two ring slots): Q 2 x 24 KB, dO 2 x 16 KB, the row stats 2 x 512 B, K 2 x 24 KB,
V 2 x 16 KB, the dS^T tiles 2 x 8 KB (one step's; FlashAttention-4's MLA backward keeps one
too), the fp32 staging 3 x 16 KB: 230,920 B with the barriers, of the 232,448 a block may use.

Barriers: ``kv_ready`` (count 2: each consumer's K and V by their own expect); ``qd_ready[s]``
(count 2: the copies' expect and the producer's arrival after it stored the row stats),
``qd_empty[s]`` (count 2) as ``bwd.py``'s ring; ``ds_ready`` (count 2: both consumers
wrote their step's dS^T tile) completes once a step, waited with parity ``t & 1``; ``ds_free``
(count 2: both consumers' dQ products of the step read both tiles) once a step, waited before
step t's dS^T store with parity ``(t & 1) ^ 1`` (step 0's passes on the initial phase). Neither
runs two phases ahead of a waiter: a consumer arrives on ``ds_ready`` for step t + 1 only after
``ds_free`` of step t, which needs the other consumer's dQ of step t, after its ``ds_ready``
wait of step t; ``ds_free`` of step t + 1 needs both consumers' ``ds_ready`` arrivals of step t
+ 1, after their ``ds_free`` waits of step t. No cycle: a consumer's dS^T of step t needs only
its own products and the previous step's dQ of both.

Covered: fp16 and bf16, causal (bottom-right) or not, ragged Sq and Sk (TMA zero fill: rows past Sq
have Q = dO = 0 and lse2 = +inf; keys past Sk are masked, their K and V rows zeros), GQA/MQA (a
program walks its group's query heads). VARLEN (packed batches, ``bwd256.py``'s way: the grid sized
by the longest sequence, a block past its own returns at entry; the producer zeroes the rows of a
Q/dO tile or of a consumer's K/V tile past the sequence's end (``bwd256_common.load_fixed``, its own
``fix_bar``) and loads the row stats with lse2 +inf and delta 0 there; the dQ rows past the end
reduce-add exact zeros; dK and dV rows past it are not stored; ``ops/bwd256.py: WIDE_MLA_VARLEN``,
on). Not covered (``ops/bwd256.py: wide`` says no; the 64-key kernel runs them): window, softcap,
ALiBi.

The row stats' stores (the producer's) and loads (the consumers') are hand-overs ordered by
mbarriers alone, which compute-sanitizer's racecheck reports; they are marked for
``scripts/racecheck_triage.py`` (docs/maintainers.md, "What racecheck reports in the Gluon
kernels"). Loading them by the copy engine instead (two (64,) boxes a step, as ``bwd.py``'s dense
build) ran 1-3% slower non-causal (H200; docs/performance_backward.md, "MLA's row statistics by
the copy engine"): not kept.

dQ's last bits depend on the order of the reduce-adds (``deterministic`` keeps ``bwd256.py``'s
dQ kernel).
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

from flashcore.kernels.hopper.bwd256_common import load_fixed, load_tiles, qk_tiles, store_acc
from flashcore.kernels.hopper.bwd_dq import stage_and_reduce
from flashcore.kernels.hopper.bwd_load import BLOCK_N, key_block, q_blocks
from flashcore.kernels.hopper.common import opaque

ROWS = gl.constexpr(64)  # query rows a step, and keys a consumer (one m64 wgmma)
KEYS = BLOCK_N  # keys a program: two consumers x 64 (bwd.py's key_block walks them)
# Registers a thread of consumer 0 (worker 0: two dQ panels a step); consumer 1, the default
# partition, gets what the producer and it leave of 512: 232.
HEAVY_REGS = gl.constexpr(248)


@gluon.jit
def diagonal_steps(start_n, lo, n_m, diag, SPLIT: gl.constexpr):
    """SPLIT_DIAG: how many of a head's ``n_m`` steps (from row ``lo``) the causal diagonal
    crosses for either consumer of the block from key ``start_n`` (``diag = Sk - Sq``): those
    whose rows start before ``start_n + KEYS - 1 - diag``, consumer 1's ``full_m``; 0 without
    SPLIT. The steps of a block run in this order: every head's diagonal steps (head by head),
    then every head's others; without SPLIT, head by head."""
    if SPLIT:
        n = gl.minimum(gl.cdiv(gl.maximum(start_n + KEYS - 1 - diag - lo, 0), ROWS), n_m)
    else:
        n = n_m * 0
    return n


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, qa_smem, qb_smem, ka_smem, kb_smem, v_smem,
              do_smem, stats_smem, kv_ready, qd_ready, qd_empty, fix_bar, LSE2, DELTA, CU_Q,
              CU_K, stride_lb, stride_lh, kv_heads, kv_group, seqlen_q, seqlen_k, lpt_heads,
              total_q, total_k, QK_B: gl.constexpr, NUM_STAGES: gl.constexpr,
              IS_CAUSAL: gl.constexpr, VARLEN: gl.constexpr,
              SPLIT_DIAG: gl.constexpr):  # fmt: skip
    start_n, off_b, off_hk, q_start, k_start, seqlen_q, seqlen_k, desc_b = key_block(
        CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, VARLEN
    )
    n_fix = gl.to_tensor(0)
    for c in gl.static_range(2):
        # Each consumer's K and V on kv_ready (count 2: one arrival each). VARLEN: rows past
        # the sequence's end zeroed first (dQ sums over keys; ``bwd256_common.load_fixed``).
        key = start_n + c * ROWS
        if VARLEN:
            if key + ROWS > seqlen_k:
                n_fix = load_fixed(k_desc, v_desc, off_hk, k_start + key, seqlen_k - key,
                                    kv_ready, fix_bar, n_fix, ka_smem.index(c), kb_smem.index(c),
                                    v_smem.index(c), QK_B)  # fmt: skip
            else:
                load_tiles(k_desc, v_desc, desc_b, off_hk, k_start + key, kv_ready,
                            ka_smem.index(c), kb_smem.index(c), v_smem.index(c),
                            QK_B)  # fmt: skip
        else:
            load_tiles(k_desc, v_desc, desc_b, off_hk, key, kv_ready, ka_smem.index(c),
                        kb_smem.index(c), v_smem.index(c), QK_B)  # fmt: skip
    lo, n_m = q_blocks(start_n, seqlen_q, seqlen_k, 0, 0, IS_CAUSAL, False, KEYS)
    offs = gl.arange(0, ROWS, layout=gl.BlockedLayout([2], [32], [1], [0]))
    n_diag = diagonal_steps(start_n, lo, n_m, seqlen_k - seqlen_q, IS_CAUSAL and SPLIT_DIAG)
    n_a = n_diag * kv_group
    for t in range(n_m * kv_group):
        # The steps in the consumers' order (``diagonal_steps``).
        if t < n_a:
            off_h = off_hk * kv_group + t // n_diag
            start_m = lo + (t % n_diag) * ROWS
        else:
            u = t - n_a
            off_h = off_hk * kv_group + u // (n_m - n_diag)
            start_m = lo + (n_diag + u % (n_m - n_diag)) * ROWS
        slot = t % NUM_STAGES
        mbarrier.wait(qd_empty.index(slot), ((t // NUM_STAGES) & 1) ^ 1)
        bar = qd_ready.index(slot)
        row = q_start + start_m
        if VARLEN:
            if start_m + ROWS > seqlen_q:
                # Q and dO rows past the sequence's end (dV and dK sum over query rows).
                n_fix = load_fixed(q_desc, do_desc, off_h, row, seqlen_q - start_m, bar,
                                    fix_bar, n_fix, qa_smem.index(slot), qb_smem.index(slot),
                                    do_smem.index(slot), QK_B)  # fmt: skip
            else:
                load_tiles(q_desc, do_desc, desc_b, off_h, row, bar, qa_smem.index(slot),
                            qb_smem.index(slot), do_smem.index(slot), QK_B)  # fmt: skip
        else:
            load_tiles(q_desc, do_desc, desc_b, off_h, row, bar, qa_smem.index(slot),
                        qb_smem.index(slot), do_smem.index(slot), QK_B)  # fmt: skip
        # The step's row stats (lse2, delta) into the slot, read by the consumers from shared
        # memory where they use them (as row vectors in registers they held 32 a thread over
        # the step); qd_ready's second arrival. VARLEN (the stats of one sequence of all rows):
        # lse2 +inf and delta 0 past the sequence's end (P = 0, dS = 0 there).
        base = off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + row
        if VARLEN:
            inside = start_m + offs < seqlen_q
            lse2 = gl.load(LSE2 + base + offs, mask=inside, other=float("inf"))
            delta = gl.load(DELTA + base + offs, mask=inside, other=0.0)
        else:
            lse2 = gl.load(LSE2 + base + offs)
            delta = gl.load(DELTA + base + offs)
        # racecheck hand-over: row stats
        stats_smem.index(2 * slot).store(lse2)
        # racecheck hand-over: row stats
        stats_smem.index(2 * slot + 1).store(delta)
        mbarrier.arrive(bar, count=1)


@gluon.jit
def _dq_panel(ds_smem, k0, k1, zero_dq, tile, dq_desc, desc_b, off_h, row, col, n_rows, ds_free,
              RELEASE: gl.constexpr, VARLEN: gl.constexpr):  # fmt: skip
    """One 64-column panel of a step's dQ over both consumers' keys (``k0``, ``k1``: the panel's
    columns of K_0 and K_1): the products, ``ds_free`` arrived on with RELEASE (this consumer's
    last reader of the dS^T tiles), the staging and the reduce-add at ``(desc_b, off_h, row,
    col)`` (``bwd_dq.stage_and_reduce``; VARLEN: rows from ``n_rows`` on, the next sequence's, as
    exact zeros)."""
    dq_tok = warpgroup_mma(ds_smem.index(0).permute((1, 0)), k0, zero_dq, use_acc=False,
                           is_async=True)  # fmt: skip
    dq_tok = warpgroup_mma(ds_smem.index(1).permute((1, 0)), k1, dq_tok, is_async=True)
    dq = warpgroup_mma_wait(0, deps=[dq_tok])
    if RELEASE:
        mbarrier.arrive(ds_free, count=1)
    # The step's one wait for the staging tiles' previous reads is the caller's.
    stage_and_reduce(dq, tile, dq_desc, desc_b, off_h, row, col, n_rows, True, VARLEN, False)


@gluon.jit
def _step(ka, kb, vt, qa, qb, do, stats_smem, ds_smem, qd_empty, ds_ready, ds_free, dv, dk_a,
          dk_b, zero_s, t, slot, start_m, key0, diag, full_m, seqlen_k, qk_scale,
          CONSUMER: gl.constexpr, IS_CAUSAL: gl.constexpr, EVEN_N: gl.constexpr,
          MASK_EXPONENT: gl.constexpr):  # fmt: skip
    """One step's products of a consumer up to its dS^T tile and dK (module docstring), the
    slot released; returns ``(dv, dk_a, dk_b)``. MASK_EXPONENT: the exponent ``S^T qk_scale -
    lse2`` formed whole before the masks' run-time branches (one FFMA an element on the steps
    they skip; ``exp2(-inf) = 0`` whatever lse2 is), instead of the scaled scores, whose
    subtraction after the branch ptxas cannot fuse."""
    dtype: gl.constexpr = ka.dtype
    s_layout: gl.constexpr = zero_s.type.layout
    acc_layout: gl.constexpr = dv.type.layout
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_tok = warpgroup_mma(ka, qa.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s_tok = warpgroup_mma(kb, qb.permute((1, 0)), s_tok, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    if MASK_EXPONENT:
        # racecheck hand-over: row stats
        s = s * qk_scale - gl.expand_dims(stats_smem.index(2 * slot).load(col_layout), 0)
    else:
        s = s * qk_scale
    if IS_CAUSAL:
        if start_m < full_m:
            keys = gl.expand_dims(key0 + gl.arange(0, ROWS, layout=row_layout), 1)
            r = gl.expand_dims(start_m + gl.arange(0, ROWS, layout=col_layout), 0)
            s = gl.where(keys <= r + diag, s, float("-inf"))
    elif not EVEN_N:  # noqa: SIM102 (a constexpr branch around a runtime one)
        # Keys past Sk (zeros): their P = exp2(-lse2) could overflow (bwd.py, EVEN_N).
        if key0 + ROWS > seqlen_k:
            keys = gl.expand_dims(key0 + gl.arange(0, ROWS, layout=row_layout), 1)
            s = gl.where(keys < seqlen_k, s, float("-inf"))
    if MASK_EXPONENT:
        p = gl.exp2(s)
    else:
        # racecheck hand-over: row stats
        p = gl.exp2(s - gl.expand_dims(stats_smem.index(2 * slot).load(col_layout), 0))
    # One score tile at a time beside dK and dV (160 registers): dV += P^T dO, retired,
    # then dP^T = V dO^T, with P^T kept in fp16 for dS.
    p_op = gl.convert_layout(p.to(dtype), a_layout)
    p = p.to(gl.float16)
    dv_tok = warpgroup_mma(p_op, do, dv, is_async=True)
    dv, p_op = warpgroup_mma_wait(0, deps=[dv_tok, p_op])
    dp_tok = warpgroup_mma(vt, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp = warpgroup_mma_wait(0, deps=[dp_tok])
    # racecheck hand-over: row stats
    delta = gl.expand_dims(stats_smem.index(2 * slot + 1).load(col_layout), 0)
    ds = (p.to(gl.float32) * (dp - delta)).to(dtype)
    # dS^T for both consumers' dQ, once both have read the previous step's tiles.
    mbarrier.wait(ds_free, (t & 1) ^ 1)
    ds_smem.index(CONSUMER).store(ds)
    fence_async_shared()
    mbarrier.arrive(ds_ready, count=1)
    ds_op = gl.convert_layout(ds, a_layout)
    dka_tok = warpgroup_mma(ds_op, qa, dk_a, is_async=True)
    dkb_tok = warpgroup_mma(ds_op, qb, dk_b, is_async=True)
    dk_a, dk_b, ds_op = warpgroup_mma_wait(0, deps=[dka_tok, dkb_tok, ds_op])
    # Every reader of the slot is complete (both score products, dV and dK).
    mbarrier.arrive(qd_empty.index(slot), count=1)
    return dv, dk_a, dk_b


@gluon.jit
def _fixed_tiles(ka_smem, kb_smem, v_smem, z, CONSUMER: gl.constexpr):
    """``(ka, kb, vt, k0_dq, k1_dq)``: this consumer's K (its 128- and 64-column tiles) and V,
    and both consumers' K columns its dQ panels read (consumer 0: the 128-column tiles, 1: the
    64-column ones), each through index ``z + i`` (``z`` is 0: FRESH_DESC passes an opaque 0)."""
    QK_A: gl.constexpr = ka_smem.shape[4]
    QK_B: gl.constexpr = kb_smem.shape[4]
    ka = ka_smem.index(CONSUMER + z).reshape([ROWS, QK_A])
    kb = kb_smem.index(CONSUMER + z).reshape([ROWS, QK_B])
    vt = v_smem.index(CONSUMER + z).reshape([ROWS, v_smem.shape[4]])
    if CONSUMER == 0:
        k0_dq = ka_smem.index(z).reshape([ROWS, QK_A])
        k1_dq = ka_smem.index(1 + z).reshape([ROWS, QK_A])
    else:
        k0_dq = kb_smem.index(z).reshape([ROWS, QK_B])
        k1_dq = kb_smem.index(1 + z).reshape([ROWS, QK_B])
    return ka, kb, vt, k0_dq, k1_dq


@gluon.jit
def _full_step(ka_smem, kb_smem, v_smem, ka, kb, vt, qa_smem, qb_smem, do_smem, stats_smem,
               ds_smem, qd_ready, qd_empty, ds_ready, ds_free, dv, dk_a, dk_b, zero_s, zero_dq,
               k0_dq, k1_dq, dq_tiles, dq_desc, desc_b, t, off_h, start_m, q_start, key0, diag,
               full_m, seqlen_q, seqlen_k, qk_scale, dq_col, CONSUMER: gl.constexpr,
               NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, EVEN_N: gl.constexpr,
               VARLEN: gl.constexpr, SKIP_MASKED: gl.constexpr, MASK_EXPONENT: gl.constexpr,
               N_PANELS: gl.constexpr, PANEL: gl.constexpr,
               FRESH_DESC: gl.constexpr):  # fmt: skip
    """Step ``t`` of a consumer (query head ``off_h``, rows from ``start_m``): its products, its
    dS^T tile and its dQ panels (module docstring); returns ``(dv, dk_a, dk_b)``."""
    QK_A: gl.constexpr = qa_smem.shape[4]
    QK_B: gl.constexpr = qb_smem.shape[4]
    V_DIM: gl.constexpr = do_smem.shape[4]
    dtype: gl.constexpr = qa_smem.dtype
    s_layout: gl.constexpr = zero_s.type.layout
    slot = t % NUM_STAGES
    if FRESH_DESC:
        # The fixed tiles' views through a zero LLVM cannot see (a side-effecting mov), so
        # that their wgmma descriptors are formed here each step (module docstring).
        ka, kb, vt, k0_dq, k1_dq = _fixed_tiles(ka_smem, kb_smem, v_smem, opaque(0), CONSUMER)
    mbarrier.wait(qd_ready.index(slot), (t // NUM_STAGES) & 1)
    qa = qa_smem.index(slot).reshape([ROWS, QK_A])
    qb = qb_smem.index(slot).reshape([ROWS, QK_B])
    do = do_smem.index(slot).reshape([ROWS, V_DIM])
    masked = False
    if SKIP_MASKED and IS_CAUSAL and CONSUMER == 1:
        # Causal: no row of the step sees a key of this consumer's (a 128-key block's first
        # step): P = dS = 0, so no products, a zero dS^T tile for the dQ panels.
        masked = start_m + ROWS - 1 + diag < key0
    if masked:
        mbarrier.wait(ds_free, (t & 1) ^ 1)
        ds_smem.index(CONSUMER).store(gl.zeros([ROWS, ROWS], dtype, layout=s_layout))
        fence_async_shared()
        mbarrier.arrive(ds_ready, count=1)
        mbarrier.arrive(qd_empty.index(slot), count=1)
    else:
        dv, dk_a, dk_b = _step(ka, kb, vt, qa, qb, do, stats_smem, ds_smem, qd_empty, ds_ready,
                               ds_free, dv, dk_a, dk_b, zero_s, t, slot, start_m, key0, diag,
                               full_m, seqlen_k, qk_scale, CONSUMER, IS_CAUSAL, EVEN_N,
                               MASK_EXPONENT)  # fmt: skip
    mbarrier.wait(ds_ready, t & 1)
    # The staging tiles' previous reduce-adds (step t - 1's) have read them.
    tma.store_wait(0)
    row = q_start + start_m
    for i in gl.static_range(N_PANELS):
        # Each panel reduced as soon as it is staged: the fence keeps ptxas from issuing the
        # next panel's products beside this one's registers (two panels at once serialised
        # the consumer's products for lack of registers, C7512).
        _dq_panel(ds_smem, k0_dq.slice(i * PANEL, PANEL, dim=1),
                  k1_dq.slice(i * PANEL, PANEL, dim=1), zero_dq, dq_tiles.index(i), dq_desc,
                  desc_b, off_h, row, dq_col + i * PANEL, seqlen_q - start_m, ds_free,
                  i == N_PANELS - 1, VARLEN)  # fmt: skip
    return dv, dk_a, dk_b


@gluon.jit
def _consumer(qa_smem, qb_smem, ka_smem, kb_smem, v_smem, do_smem, stats_smem, ds_smem,
              dq_tiles, dq_desc, kv_ready, qd_ready, qd_empty, ds_ready, ds_free, DK, DV, CU_Q,
              CU_K, dka_desc, dkb_desc, dv_desc, stride_dkb, stride_dkh, stride_dkn, stride_dvb,
              stride_dvh, stride_dvn, kv_heads, kv_group, seqlen_q, seqlen_k, lpt_heads,
              qk_scale, scale, head_dim, total_q, total_k, CONSUMER: gl.constexpr,
              QK_B: gl.constexpr, NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
              EVEN_N: gl.constexpr, VARLEN: gl.constexpr, SKIP_MASKED: gl.constexpr,
              TMA_EPILOGUE: gl.constexpr, MASK_EXPONENT: gl.constexpr,
              FRESH_DESC: gl.constexpr, SPLIT_DIAG: gl.constexpr):  # fmt: skip
    QK_A: gl.constexpr = ka_smem.shape[4]
    V_DIM: gl.constexpr = v_smem.shape[4]
    gl.static_assert(QK_A == V_DIM)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, QK_A, 16]
    )
    b_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, QK_B, 16]
    )

    start_n, off_b, off_hk, q_start, k_start, seqlen_q, seqlen_k, desc_b = key_block(
        CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, VARLEN
    )
    lo, n_m = q_blocks(start_n, seqlen_q, seqlen_k, 0, 0, IS_CAUSAL, False, KEYS)
    key0 = start_n + CONSUMER * ROWS
    diag = seqlen_k - seqlen_q
    # Query blocks starting at or past this row see every key of this consumer's: no mask.
    full_m = key0 + ROWS - 1 - diag
    ka, kb, vt, k0_dq, k1_dq = _fixed_tiles(ka_smem, kb_smem, v_smem, 0, CONSUMER)
    # This consumer's dQ columns over both consumers' keys, in 64-column panels (consumer 0
    # the two of [0, QK_A), consumer 1 the one of [QK_A, QK_A + QK_B)): one panel's 32
    # registers at a time beside dK and dV.
    PANEL: gl.constexpr = QK_B
    if CONSUMER == 0:
        N_PANELS: gl.constexpr = QK_A // PANEL
        dq_col = 0
    else:
        N_PANELS: gl.constexpr = 1
        dq_col = QK_A
    zero_dq = gl.zeros([ROWS, PANEL], gl.float32, layout=b_layout)
    zero_s = gl.zeros([ROWS, ROWS], gl.float32, layout=s_layout)
    dv = gl.zeros([ROWS, V_DIM], gl.float32, layout=acc_layout)
    dk_a = gl.zeros([ROWS, QK_A], gl.float32, layout=acc_layout)
    dk_b = gl.zeros([ROWS, QK_B], gl.float32, layout=b_layout)
    mbarrier.wait(kv_ready, 0)
    if SPLIT_DIAG and IS_CAUSAL:
        # The steps the diagonal crosses, every head's, in a loop of their own, then the others
        # in a loop without the mask's code, as the non-causal build's (``diagonal_steps``; the
        # producer's order is the same).
        n_diag = diagonal_steps(start_n, lo, n_m, diag, True)
        n_rest = n_m - n_diag
        for g in range(kv_group):
            for i in range(n_diag):
                dv, dk_a, dk_b = _full_step(
                    ka_smem, kb_smem, v_smem, ka, kb, vt, qa_smem, qb_smem, do_smem,
                    stats_smem, ds_smem, qd_ready, qd_empty, ds_ready, ds_free, dv, dk_a, dk_b,
                    zero_s, zero_dq, k0_dq, k1_dq, dq_tiles, dq_desc, desc_b, g * n_diag + i,
                    off_hk * kv_group + g, lo + i * ROWS, q_start, key0, diag, full_m,
                    seqlen_q, seqlen_k, qk_scale, dq_col, CONSUMER, NUM_STAGES, True, EVEN_N,
                    VARLEN, SKIP_MASKED, MASK_EXPONENT, N_PANELS, PANEL, FRESH_DESC,
                )  # fmt: skip
        t0 = n_diag * kv_group - n_diag
        for g in range(kv_group):
            for i in range(n_diag, n_m):
                # Below the diagonal every key of the block is in [0, Sk) and seen by every row
                # (a block that crosses Sk has only diagonal steps): no mask, EVEN_N.
                dv, dk_a, dk_b = _full_step(
                    ka_smem, kb_smem, v_smem, ka, kb, vt, qa_smem, qb_smem, do_smem,
                    stats_smem, ds_smem, qd_ready, qd_empty, ds_ready, ds_free, dv, dk_a, dk_b,
                    zero_s, zero_dq, k0_dq, k1_dq, dq_tiles, dq_desc, desc_b,
                    t0 + g * n_rest + i, off_hk * kv_group + g, lo + i * ROWS, q_start, key0,
                    diag, full_m, seqlen_q, seqlen_k, qk_scale, dq_col, CONSUMER, NUM_STAGES,
                    False, True, VARLEN, False, MASK_EXPONENT, N_PANELS, PANEL, FRESH_DESC,
                )  # fmt: skip
    else:
        for t in range(n_m * kv_group):
            dv, dk_a, dk_b = _full_step(
                ka_smem, kb_smem, v_smem, ka, kb, vt, qa_smem, qb_smem, do_smem, stats_smem,
                ds_smem, qd_ready, qd_empty, ds_ready, ds_free, dv, dk_a, dk_b, zero_s, zero_dq,
                k0_dq, k1_dq, dq_tiles, dq_desc, desc_b, t, off_hk * kv_group + t // n_m,
                lo + (t % n_m) * ROWS, q_start, key0, diag, full_m, seqlen_q, seqlen_k,
                qk_scale, dq_col, CONSUMER, NUM_STAGES, IS_CAUSAL, EVEN_N, VARLEN, SKIP_MASKED,
                MASK_EXPONENT, N_PANELS, PANEL, FRESH_DESC,
            )  # fmt: skip
    # No bulk reduce may still read this consumer's staging tile when the block exits.
    tma.store_wait(0)
    if TMA_EPILOGUE:
        # Both consumers' last dQ products (the other's read this consumer's K tile) have
        # completed: ds_free's completion of the last step (none without steps).
        n_steps = n_m * kv_group
        mbarrier.wait(ds_free, (n_steps - 1) & 1, pred=n_steps > 0)
    # dK and dV (``bwd256_common.store_acc``: by TMA through this consumer's own tiles, or from
    # registers).
    store_acc(DK, DV, dka_desc, dkb_desc, dv_desc, ka_smem.index(CONSUMER),
               kb_smem.index(CONSUMER), v_smem.index(CONSUMER), dv, dk_a, dk_b, off_b, off_hk,
               desc_b, k_start, key0, seqlen_k, stride_dkb, stride_dkh, stride_dkn, stride_dvb,
               stride_dvh, stride_dvn, scale, head_dim, True, True, QK_B, TMA_EPILOGUE,
               VARLEN)  # fmt: skip
    if TMA_EPILOGUE:
        tma.store_wait(0)


@gluon.jit
def attn_bwd_mla_sm90_kernel(
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
    FUSED_DQ: gl.constexpr = True,
    SKIP_MASKED: gl.constexpr = False,
    TMA_EPILOGUE: gl.constexpr = False,
    MASK_EXPONENT: gl.constexpr = False,
    FRESH_DESC: gl.constexpr = False,
    SPLIT_DIAG: gl.constexpr = False,
):
    """dK, dV and the reduce-adds of dQ of one 128-key block (module docstring), with the
    arguments of ``bwd256.attn_bwd_dkdv_sm90_d256_kernel`` (FUSED_DQ; the ones for the options
    this kernel does not cover are not read). ``EVEN_N``: Sk a multiple of 128."""
    gl.static_assert(QK_B > 0 and FUSED_DQ)
    gl.static_assert(not (HAS_WINDOW or SOFTCAP or HAS_ALIBI))
    if VARLEN:
        # The grid is sized by the longest sequence: a key block past its own has nothing to do.
        start_n, _, _, _, _, _, n_keys, _ = key_block(
            CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, VARLEN
        )
        if start_n >= n_keys:
            return
    dtype: gl.constexpr = q_desc.dtype
    qa_smem, qb_smem = qk_tiles(q_desc, [NUM_STAGES, 1, 1, ROWS], QK_A, QK_B)
    ka_smem, kb_smem = qk_tiles(k_desc, [2, 1, 1, ROWS], QK_A, QK_B)
    do_shape: gl.constexpr = [NUM_STAGES] + do_desc.block_type.shape  # noqa: RUF005
    do_smem = gl.allocate_shared_memory(dtype, do_shape, do_desc.layout)
    v_shape: gl.constexpr = [2] + v_desc.block_type.shape  # noqa: RUF005
    v_smem = gl.allocate_shared_memory(dtype, v_shape, v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, ROWS, ROWS], ds_layout)
    # fp32 dQ staging, 64-column panels: consumer 0's two, consumer 1's one (reduce-added with
    # dqb_desc's 64-column box; dqa_desc is not read).
    dq_box: gl.constexpr = dqb_desc.block_type.shape
    dq_tiles0 = gl.allocate_shared_memory(gl.float32, [2] + dq_box, dqb_desc.layout)  # noqa: RUF005
    dq_tiles1 = gl.allocate_shared_memory(gl.float32, [1] + dq_box, dqb_desc.layout)  # noqa: RUF005
    # The ring's row stats: lse2 and delta of each slot's 64 rows.
    stats_smem = gl.allocate_shared_memory(
        gl.float32, [2 * NUM_STAGES, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0])
    )
    bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    kv_ready = bars.index(0)
    ds_ready = bars.index(1)
    ds_free = bars.index(2)
    qd_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qd_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(bars.index(i), count=2)
    # VARLEN: the producer's own barrier for the tiles it zeroes (``bwd256_common.load_fixed``);
    # without, kv_ready stands in (never touched).
    fix_bar = kv_ready
    if VARLEN:
        fix = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        fix_bar = fix.index(0)
        mbarrier.init(fix_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(qd_ready.index(i), count=2)
        mbarrier.init(qd_empty.index(i), count=2)
    # Consumer 1 (one dQ panel a step) is the default partition, consumer 0 worker 0 with 16
    # registers more (fewer spills: 268-380 B against 360-400 with 240 each; 0.97-1.09x the
    # time of the even split, geomean about 1.02, H200). The two argument tuples differ only in
    # CONSUMER and the staging tiles (Triton 3.6's frontend has no starred tuples).
    gl.warp_specialize(
        [
            (_consumer, (
                qa_smem, qb_smem, ka_smem, kb_smem, v_smem, do_smem, stats_smem, ds_smem,
                dq_tiles1, dqb_desc, kv_ready, qd_ready, qd_empty, ds_ready, ds_free, DK, DV,
                CU_Q, CU_K, dka_desc, dkb_desc, dv_desc, stride_dkb, stride_dkh, stride_dkn,
                stride_dvb, stride_dvh, stride_dvn, kv_heads, kv_group, seqlen_q, seqlen_k,
                lpt_heads, qk_scale, scale, head_dim, total_q, total_k, 1, QK_B, NUM_STAGES,
                IS_CAUSAL, EVEN_N, VARLEN, SKIP_MASKED, TMA_EPILOGUE, MASK_EXPONENT, FRESH_DESC,
                SPLIT_DIAG,
            )),
            (_consumer, (
                qa_smem, qb_smem, ka_smem, kb_smem, v_smem, do_smem, stats_smem, ds_smem,
                dq_tiles0, dqb_desc, kv_ready, qd_ready, qd_empty, ds_ready, ds_free, DK, DV,
                CU_Q, CU_K, dka_desc, dkb_desc, dv_desc, stride_dkb, stride_dkh, stride_dkn,
                stride_dvb, stride_dvh, stride_dvn, kv_heads, kv_group, seqlen_q, seqlen_k,
                lpt_heads, qk_scale, scale, head_dim, total_q, total_k, 0, QK_B, NUM_STAGES,
                IS_CAUSAL, EVEN_N, VARLEN, SKIP_MASKED, TMA_EPILOGUE, MASK_EXPONENT, FRESH_DESC,
                SPLIT_DIAG,
            )),
            (_producer, (
                q_desc, k_desc, v_desc, do_desc, qa_smem, qb_smem, ka_smem, kb_smem, v_smem,
                do_smem, stats_smem, kv_ready, qd_ready, qd_empty, fix_bar, LSE2, DELTA, CU_Q,
                CU_K, stride_lb, stride_lh, kv_heads, kv_group, seqlen_q, seqlen_k, lpt_heads,
                total_q, total_k, QK_B, NUM_STAGES, IS_CAUSAL, VARLEN, SPLIT_DIAG,
            )),
        ],
        [4, 1],
        [HEAVY_REGS, 24],
    )  # fmt: skip
