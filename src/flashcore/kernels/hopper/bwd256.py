"""The backward at head dim 256 (and MLA's 192 / 128) on Hopper (sm_90a) in Gluon: a dK/dV kernel
and a dQ kernel.

Why a kernel of its own. At head dim 256 the Hopper backward's design (``bwd.py``: each consumer
warpgroup owns 64 keys and holds their dK and dV, 64 x 256 fp32 each) needs 256 accumulator
registers a thread before any score tile, over the 240 a consumer gets; its shared memory (K, V
and a two-slot Q/dO ring, 32 KB a tile, plus dS^T tiles and the fp32 dQ staging) is over the 227
KB of a block too. The portable dK/dV kernel at this head dim runs 32 x 32 tiles (the largest that
hold both accumulators in registers) at about 220 TFLOP/s on an H100.

Both kernels here split one block's work between two consumer warpgroups by product, and each
writes its gradient once per program (no atomics: deterministic). Launch order
(``ops/bwd256.py``): ``bwd.bwd_prep_kernel`` (delta and lse2 into padded row buffers), the dQ
kernel, the dK/dV kernel.

dK and dV (``attn_bwd_dkdv_sm90_d256_kernel``).

Design. The two consumer warpgroups of a program share one block of 64 keys and split the work by
product instead of by keys:

- consumer 0: ``S^T = K Q^T`` (K = 256), the scores as the forward forms them, the masks, ``P^T
  = exp2(S^T - lse2)``; ``P^T (1 - tanh^2)`` (softcap) or P^T into a shared tile for consumer 1;
  ``dV += P^T dO`` (P^T in registers, N = 256);
- consumer 1: ``dP^T = V dO^T``; the tile; ``dS^T = tile * (dP^T - delta)``; ``dK += dS^T Q``
  (dS^T in registers, N = 256).

Each consumer holds one whole accumulator (64 x 256 fp32: 128 registers) and one 64 x 64 score
tile (32), and the tensor work is balanced (8 units of 64^3 each a step). One tile crosses, one
way: consumer 1 needs P only for dS (an earlier build split dK and dV by head-dim halves instead,
each consumer needing both P^T and dS^T, two tiles crossing both ways; this one is 1-7% faster
and frees 16 KB). dQ is not computed here (a fused dQ would need a third accumulator or
atomics): the dQ kernel below recomputes S and dP (three products of 4 units a step against this
kernel's four). The tile is fp16 whatever the input dtype (P and P (1 - tanh^2) are in [0, 1]:
11 significant bits where bf16 has 8; bf16 P measured dK errors up to 2x the portable kernel's
against float64).

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

Scores (SOFTCAP, HAS_ALIBI, ``_capped``): as ``bwd.py`` forms them, ``ops/problem.py:scores``
folding the units (softcap: ``c log2(e) tanh(scale q.k / c)``, then ALiBi, then the masks); with
a softcap dS is taken with respect to ``scale q.k``, the factor ``1 - tanh^2`` applied by
consumer 0 to the tile it hands over. Masks as ``bwd.py``'s: causal bottom-right, a window on
every step, keys past Sk (without causal, on a block that crosses Sk; K and V arrive as zeros
there); rows past Sq have Q = dO = 0 and lse2 = +inf (P = 0). dK and dV leave from registers by
plain stores with a row mask, and a column mask past ``head_dim`` (head dims 136-248 run these
kernels over the same 256-column boxes: the copy engine fills the columns past the tensors'
with zeros, which add nothing to any product), or with TMA_EPILOGUE (``ops/bwd256.py:
DKDV_TMA_EPILOGUE``, on: 1.02-1.08x at 1024-8192 keys, H200): once both consumers' last products
are complete (``epi_bar``, count 2: consumer 0's S^T and dQ read K, consumer 1's dP^T reads V),
consumer 0 writes dV into V's tile and consumer 1 dK into K's (MLA: its two), and each stores
its tile by TMA (rows past Sk and columns past the head dim clipped by the copy engine; VARLEN:
a block that crosses its sequence's end keeps the register stores), as ``bwd.py`` does; the
register stores cost the 128-key MLA kernel 43-64 us at 1024 programs on an H200.

dQ (``attn_bwd_dq_sm90_d256_kernel``): the same split with rows and keys swapped, and dQ split by
head-dim halves (one accumulator, 64 x 256, is a single consumer's whole budget, and the other
would have only dP to compute). A program owns 64 query rows of query head h (Q and dO loaded
once) and walks the key blocks of 64 they see (``common.kv_tile_range``; causal programs last
block first), K and V through a two-slot ring (``kv_ready`` / ``kv_empty``, count 2). Consumer
0: ``S = Q K^T``, the scores (``_capped``), the masks (only on the key blocks outside
``[full_lo, full_hi)``), ``P = exp2(S - lse2)``, times ``1 - tanh^2`` with a softcap, into a
shared tile (fp16), then ``dQ[:, :128] += dS K[:, :128]`` with dS from shared memory; consumer 1:
``dP = dO V^T``, ``dS = tile * (dP - delta)`` into a shared tile (input dtype), ``dQ[:, 128:] +=
dS K[:, 128:]`` with dS in registers. The P and dS tiles, each with a ready and a free barrier as
above, by key step: consumer 0 at step t needs consumer 1's dS of step t, which needs only
consumer 0's P of step t (written before consumer 0 waits) and its release of tile b at step t -
2, so no cycle. Each consumer holds half of dQ (64 registers) and a score tile; shared memory: Q
and dO (32 KB each), two K/V slots (64 KB each), the P and dS tiles: 229,840 B. dQ (scaled)
leaves from registers with a row and column mask.

VARLEN (packed batches, FlashAttention-2's varlen): the descriptors are ``(1, heads, total, D)``
views of the packed tensors (batch coordinate 0), the grids are sized by the longest sequence (a
program whose block starts past its own sequence returns at entry), and each program reads its
sequence's first rows and lengths from ``CU_Q``, ``CU_K`` (``common.sequence``). The row stats are
those of one sequence of all ``total_q`` rows (the prep kernel runs as for a dense batch of one),
read with a row mask (lse2 +inf and delta 0 past the sequence's end). A tile that crosses the
sequence's end holds the next sequence's rows (or, past the tensors, the copy engine's zeros);
where a product sums over those rows a NaN or inf there would reach this sequence's gradients
even times P = 0, so the producer lands such a tile on its own barrier, zeroes the rows past the
end (``common.zero_rows``) and then arrives on the slot's ready barrier (``_load_fixed``): Q and
dO in the dK/dV kernel (dV and dK sum over query rows), K and V in the dQ kernel (dQ sums over
keys). The resident tiles (K and V of the dK/dV kernel, Q and dO of the dQ kernel) reach only
gradient rows past the end, which the row-masked stores drop.

MLA's head dims (QK_B = 64: q and k 192, v 128). A shared-memory tile is a power of two wide, so
Q and K live in two tiles, columns ``[0, QK_A)`` (128) and ``[QK_A, QK_A + QK_B)`` (64), each
filled by 64-column copy boxes (``_load_tiles``); V, dO and dV are 128 wide. ``S^T = K Q^T`` (and
the dQ kernel's S) is two chained wgmmas over the tiles, consumer 1's dK two accumulators (128
and 64 columns) from the same dS^T operand; the dQ kernel gives consumer 0 (beside S, K = 192)
the last 64 columns of dQ and consumer 1 (beside dP, K = 128) the first 128, 4 units of 64^3 a
step each. Three ring slots (``ops/bwd256.py``): 180,688 B (dK/dV), 197,152 B (dQ). Without
QK_B, QK_A is the tile's whole width (256) and the second tile is never allocated.

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

from flashcore.kernels.hopper.bwd_dq import stage_and_reduce
from flashcore.kernels.hopper.bwd_load import q_blocks
from flashcore.kernels.hopper.common import (
    LOG2E,
    interleave,
    kv_tile_range,
    sequence,
    tanh,
    tma_load,
    tma_store,
    zero_rows,
)

ROWS = gl.constexpr(64)  # query rows a step, and keys a program (one m64 wgmma)


@gluon.jit
def _program(CU_Q, CU_K, heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k,
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
def _load_tiles(qk_desc, v_desc, off_b, off_h, row, bar, a_dest, b_dest, v_dest,
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
def _load_fixed(qk_desc, v_desc, off_h, row, keep, bar, fix_bar, n_fix, a_dest, b_dest, v_dest,
                QK_B: gl.constexpr):  # fmt: skip
    """``_load_tiles`` for a packed sequence's tiles whose rows from ``keep`` on are past the
    sequence's end (the next sequence's, or past the tensors): landed on this warp's own
    ``fix_bar`` (its ``n_fix``-th use), those rows zeroed (a NaN or inf there would reach this
    sequence's gradients through a product over rows, even times P = 0), then ``bar`` arrived
    on (the arrival the copies' expect makes otherwise). Returns ``n_fix + 1``."""
    _load_tiles(qk_desc, v_desc, 0, off_h, row, fix_bar, a_dest, b_dest, v_dest, QK_B)
    mbarrier.wait(fix_bar, n_fix & 1)
    zero_rows(a_dest.reshape([a_dest.shape[2], a_dest.shape[3]]), keep)
    if QK_B > 0:
        zero_rows(b_dest.reshape([b_dest.shape[2], b_dest.shape[3]]), keep)
    zero_rows(v_dest.reshape([v_dest.shape[2], v_dest.shape[3]]), keep)
    fence_async_shared()
    mbarrier.arrive(bar, count=1)
    return n_fix + 1


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, qa_smem, qb_smem, ka_smem, kb_smem, v_smem,
              do_smem, kv_ready, qd_ready, qd_empty, fix_bar, CU_Q, CU_K, kv_heads, kv_group,
              seqlen_q, seqlen_k, lpt_heads, window_left, window_right, total_q, total_k,
              QK_B: gl.constexpr, NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
              HAS_WINDOW: gl.constexpr, VARLEN: gl.constexpr,
              FUSED_DQ: gl.constexpr):  # fmt: skip
    start_n, _, off_hk, q_start, k_start, seqlen_q, seqlen_k, desc_b = _program(
        CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, True, False, VARLEN
    )
    n_fix = gl.to_tensor(0)
    # K and V: without FUSED_DQ their rows past a packed sequence's end reach only dK and dV
    # rows that are not stored (nothing sums over keys), so they are not zeroed; with it, dQ =
    # dS K sums over keys (and dS takes dP^T = V dO^T): zeroed.
    if VARLEN and FUSED_DQ:
        if start_n + ROWS > seqlen_k:
            n_fix = _load_fixed(k_desc, v_desc, off_hk, k_start + start_n, seqlen_k - start_n,
                                kv_ready, fix_bar, n_fix, ka_smem, kb_smem, v_smem,
                                QK_B)  # fmt: skip
        else:
            _load_tiles(k_desc, v_desc, desc_b, off_hk, k_start + start_n, kv_ready, ka_smem,
                        kb_smem, v_smem, QK_B)  # fmt: skip
    else:
        _load_tiles(k_desc, v_desc, desc_b, off_hk, k_start + start_n, kv_ready, ka_smem,
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
                n_fix = _load_fixed(q_desc, do_desc, off_h, row, seqlen_q - start_m, bar,
                                    fix_bar, n_fix, qa, qb, do_dest, QK_B)  # fmt: skip
            else:
                _load_tiles(q_desc, do_desc, desc_b, off_h, row, bar, qa, qb, do_dest, QK_B)
        else:
            _load_tiles(q_desc, do_desc, desc_b, off_h, row, bar, qa, qb, do_dest, QK_B)


@gluon.jit
def _store_rows(ptr, acc, start, seqlen, stride, col0, head_dim, layout: gl.constexpr):
    """``acc`` into rows ``[start, start + ROWS)`` and columns from ``col0`` on of dQ, dK or dV
    (``ptr`` at its batch and head, ``stride`` its row stride): rows past ``seqlen`` and columns
    past ``head_dim`` (the tensors' own, 256 or less) dropped."""
    rows = start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    offs = gl.expand_dims(rows.to(gl.int64) * stride, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(rows < seqlen, 1) & gl.expand_dims(cols < head_dim, 0)
    gl.store(ptr + offs, acc.to(ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _capped(s, rows, keys, diag, qk_scale, softcap, ALIBI, slope_off, SOFTCAP: gl.constexpr,
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

    start_n, off_b, off_hk, q_start, k_start, seqlen_q, seqlen_k, desc_b = _program(
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
            s, t_cap = _capped(s, r, keys, diag, qk_scale, softcap, ALIBI,
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
    _store_acc(DK, DV, dka_desc, dkb_desc, dv_desc, ka_smem, kb_smem, v_smem, acc, acc, acc_b,
               off_b, off_hk, desc_b, k_start, start_n, seqlen_k, stride_dkb, stride_dkh,
               stride_dkn, stride_dvb, stride_dvh, stride_dvn, scale, head_dim, CONSUMER == 0,
               CONSUMER == 1, QK_B, TMA_EPILOGUE, VARLEN)  # fmt: skip
    if TMA_EPILOGUE:
        # No TMA store may still read the tile when the block exits.
        tma.store_wait(0)


@gluon.jit
def _store_acc(DK, DV, dka_desc, dkb_desc, dv_desc, ka_tile, kb_tile, v_tile, dv, dk_a, dk_b,
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
    """``_store_acc`` from registers, dV first, rows past ``seqlen_k`` and columns past
    ``head_dim`` dropped (VARLEN: strides (0, head, row), the sequence's rows from ``k_start``
    on)."""
    if HAS_DV:
        dv_layout: gl.constexpr = dv.type.layout
        ptr = DV + off_b.to(gl.int64) * stride_dvb + off_hk.to(gl.int64) * stride_dvh
        ptr += k_start.to(gl.int64) * stride_dvn
        _store_rows(ptr, dv, start_n, seqlen_k, stride_dvn, 0, head_dim, dv_layout)
    if HAS_DK:
        a_layout: gl.constexpr = dk_a.type.layout
        ptr = DK + off_b.to(gl.int64) * stride_dkb + off_hk.to(gl.int64) * stride_dkh
        ptr += k_start.to(gl.int64) * stride_dkn
        _store_rows(ptr, dk_a * scale, start_n, seqlen_k, stride_dkn, 0, head_dim, a_layout)
        if QK_B > 0:
            b_layout: gl.constexpr = dk_b.type.layout
            _store_rows(ptr, dk_b * scale, start_n, seqlen_k, stride_dkn, dk_a.shape[1],
                        head_dim, b_layout)  # fmt: skip


@gluon.jit
def _store_acc_tma(dka_desc, dkb_desc, dv_desc, ka_tile, kb_tile, v_tile, dv, dk_a, dk_b, scale,
                   desc_b, off_hk, key, HAS_DV: gl.constexpr, HAS_DK: gl.constexpr,
                   QK_B: gl.constexpr):  # fmt: skip
    """``_store_acc`` through the tiles they match (dK, scaled, into K's one or two, in boxes of
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
def _qk_tiles(desc, lead: gl.constexpr, QK_A: gl.constexpr, QK_B: gl.constexpr):
    """Shared memory for Q or K tiles (``lead`` the shape before the columns): QK_A columns
    and, with QK_B (MLA's 192 = 128 + 64; a shared-memory tile is a power of two wide), a second
    buffer of QK_B; without, the first stands in for the second (never touched)."""
    a = gl.allocate_shared_memory(desc.dtype, lead + [QK_A], desc.layout)  # noqa: RUF005
    b = a
    if QK_B > 0:
        b = gl.allocate_shared_memory(desc.dtype, lead + [QK_B], desc.layout)  # noqa: RUF005
    return a, b


@gluon.jit
def _handoff_state(NUM_STAGES: gl.constexpr, VARLEN: gl.constexpr):
    """Both kernels' shared state beside their tiles, allocated and initialised (module
    docstring): two P tiles (fp16); the resident pair's barrier (count 1); the ring's ready
    (count 1) and empty (count 2: both consumers) barriers; the P tiles' ready and free barriers
    (count 1); with VARLEN the producer's own barrier for the tiles it zeroes past a sequence's
    end (``_load_fixed``; without, the resident pair's stands in, never touched). Returns
    ``(p_smem, resident_ready, ring_ready, ring_empty, p_ready, p_free, fix_bar)``."""
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], gl.float16)
    p_smem = gl.allocate_shared_memory(gl.float16, [2, ROWS, ROWS], p_layout)
    resident_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    resident_ready = resident_bar.index(0)
    ring_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ring_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    p_ready, p_free = _tile_barriers()
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
def _tile_barriers():
    """A double-buffered tile's ready and free barriers (two each, count 1), initialised."""
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    return ready, free


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
        start_n, _, _, _, _, _, n_keys, _ = _program(
            CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, True, False,
            VARLEN,
        )  # fmt: skip
        if start_n >= n_keys:
            return
    dtype: gl.constexpr = q_desc.dtype
    qa_smem, qb_smem = _qk_tiles(q_desc, [NUM_STAGES, 1, 1, ROWS], QK_A, QK_B)
    ka_smem, kb_smem = _qk_tiles(k_desc, [1, 1, ROWS], QK_A, QK_B)
    do_shape: gl.constexpr = [NUM_STAGES] + do_desc.block_type.shape  # noqa: RUF005
    do_smem = gl.allocate_shared_memory(dtype, do_shape, do_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    p_smem, kv_ready, qd_ready, qd_empty, p_ready, p_free, fix_bar = _handoff_state(
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


@gluon.jit
def _dq_producer(q_desc, k_desc, v_desc, do_desc, qa_smem, qb_smem, ka_smem, kb_smem, v_smem,
                 do_smem, q_ready, kv_ready, kv_empty, fix_bar, CU_Q, CU_K, heads, kv_group,
                 seqlen_q, seqlen_k, lpt_heads, window_left, window_right, total_q, total_k,
                 QK_B: gl.constexpr, NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                 HAS_WINDOW: gl.constexpr, VARLEN: gl.constexpr):  # fmt: skip
    start_m, _, off_h, q_start, k_start, seqlen_q, seqlen_k, desc_b = _program(
        CU_Q, CU_K, heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, False, IS_CAUSAL, VARLEN
    )
    # Q and dO: their rows past a packed sequence's end reach only dQ rows that are not stored.
    _load_tiles(q_desc, do_desc, desc_b, off_h, q_start + start_m, q_ready, qa_smem, qb_smem,
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
                n_fix = _load_fixed(k_desc, v_desc, off_hk, k_start + key, seqlen_k - key, bar,
                                    fix_bar, n_fix, ka, kb, v_dest, QK_B)  # fmt: skip
            else:
                _load_tiles(k_desc, v_desc, desc_b, off_hk, k_start + key, bar, ka, kb, v_dest,
                            QK_B)  # fmt: skip
        else:
            _load_tiles(k_desc, v_desc, desc_b, off_hk, k_start + key, bar, ka, kb, v_dest, QK_B)


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

    start_m, off_b, off_h, q_start, _, seqlen_q, seqlen_k, _ = _program(
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
            s, t_cap = _capped(s, rows, keys, diag, qk_scale, softcap, ALIBI,
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
    _store_rows(ptr, dq * scale, start_m, seqlen_q, stride_qm, COL0, head_dim, acc_layout)


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
        start_m, _, _, _, _, n_rows, _, _ = _program(
            CU_Q, CU_K, heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, False, IS_CAUSAL,
            VARLEN,
        )  # fmt: skip
        if start_m >= n_rows:
            return
    dtype: gl.constexpr = q_desc.dtype
    qa_smem, qb_smem = _qk_tiles(q_desc, [1, 1, ROWS], QK_A, QK_B)
    ka_smem, kb_smem = _qk_tiles(k_desc, [NUM_STAGES, 1, 1, ROWS], QK_A, QK_B)
    v_shape: gl.constexpr = [NUM_STAGES] + v_desc.block_type.shape  # noqa: RUF005
    do_smem = gl.allocate_shared_memory(dtype, do_desc.block_type.shape, do_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_shape, v_desc.layout)
    p_smem, q_ready, kv_ready, kv_empty, p_ready, p_free, fix_bar = _handoff_state(
        NUM_STAGES, VARLEN
    )
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, ROWS, ROWS], ds_layout)
    ds_ready, ds_free = _tile_barriers()
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
