"""FlashAttention-3-style forward for Hopper (sm_90a) in Gluon: warp-specialised, TMA, async wgmma.

Algorithm. The same online softmax as ``kernels/fwd.py`` (same flags, same LSE): ``S = Q K^T`` on
the tensor cores with fp32 accumulation, scores in log2 units (``qk_scale = scale * log2(e)``),
running max ``m`` and sum ``l`` in fp32, ``P`` cast to the input dtype for ``O += P V``; at the end
``out = O / l`` and ``lse = (m + log2(l)) * ln(2)``. Nothing Sq x Sk reaches memory.

Grid. 1-D, ``cdiv(Sq, BLOCK_M) * B * H`` programs of ``BLOCK_M = 64 * NUM_CONSUMERS`` query rows
(``program_tile``: the query tiles of one head are consecutive; causal hands them out last-first,
heaviest first); with PERSISTENT one program per SM walking the same tiles (below). Query head h
reads kv head ``h // kv_group``.

Schedule (one CTA, ``gl.warp_specialize``):
- Producer (``fwd_load.producer``): one warp, 24 registers (``setmaxnreg.dec``). It issues, by
  TMA, each consumer's Q tile (``(1, 1, 64, D)`` block of the 4-D ``(B, H, Sq, D)`` descriptor)
  onto ``q_ready[c]``, then the
  K and V tiles of the key loop into a ring of NUM_STAGES shared-memory slots: for tile t in
  ``slot = t % NUM_STAGES`` it waits ``kv_empty[slot]`` (the K that slot held has been read;
  phase ``(t // NUM_STAGES) & 1 ^ 1``, so the first pass through the ring does not block) and
  loads K onto ``k_ready[slot]``, then waits ``kv_empty[NUM_STAGES + slot]`` (its V read) and
  loads V onto ``v_ready[slot]`` (each barrier armed with ``expect`` of the tile's bytes). K and
  V are released separately because a consumer is done with K_t after ``Q K_t^T``, a step before
  it is done with V_t: with one release for both, two slots held K_t and V_{t-1} at every step,
  so K_{t+1} could be loaded only after the step that needs it had begun (at D=128, 2 slots, the
  consumers waited ~1800 of ~4300 clocks per step for K). The K/V descriptors
  are 4-D ``(B, Hkv, Sk, D)``: their extent ends at Sk, so rows past Sk arrive as zeros.
- Consumers: NUM_CONSUMERS warpgroups (the default partition and NUM_CONSUMERS - 1 workers; 240
  registers each with two, 160 with three), each owning 64 query rows and the same key tiles
  (``fwd_steps.attend``). With P in
  registers (the A operand of the second wgmma), tile t's step is::

      wait k_ready[t]                     # K_t landed
      S_t  = wgmma(Q, K_t^T)   async      # group 1
      wait v_ready[t-1]
      O   += wgmma(P_{t-1}, V_{t-1}) async  # group 2, P from registers
      wgmma.wait_group 1                   # S_t done; P V still running
      arrive kv_empty[slot t]              # K_t free for the producer
      mask / softcap / ALiBi, row max, exp2, row sum of tile t   <- overlaps P_{t-1} V_{t-1}
      wgmma.wait_group 0                   # P_{t-1} V_{t-1} done
      arrive kv_empty[NUM_STAGES + slot t-1]   # V_{t-1} free

  where ``O *= alpha_{t-1}`` and the conversion of ``P_{t-1}`` to the A-operand layout sit between
  the two issues, under ``Q K_t^T`` (with PINGPONG the turn wait and arrive bracket the issues).
  As written, each warpgroup's exponentials would run while its own second product is on
  the tensor cores. ptxas (Triton 3.6's) hoists ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` above them in
  SASS, so in the assembled code a warpgroup's softmax waits for its own ``P V``; the overlap
  that remains is between warpgroups (``tests/test_compile_hopper.py`` holds both facts,
  ``docs/hopper_fwd.md``), except in the three-consumer causal flat build (``OWN_PV``), where a
  second wait on ``k_ready[t]`` before ``wait_group 0`` keeps the exponentials ahead of it (the
  only build where that measured faster). A row's sum is carried as each thread's share of it
  (``common.sums_start``), joined across the row's four threads once, after the last tile.
  With PINGPONG, consumer c waits for its turn before issuing its two products and passes
  the turn to consumer c + 1 after (consumer 0 holds the first turn), so the warpgroups take
  the tensor cores in turn: two consumers through named barriers (PINGPONG = 2, ``bar.sync``
  on their own, ``bar.arrive`` on the other's: ``fwd_steps.turn_take``), three through the
  mbarriers ``turn[c]`` (PINGPONG = 1). The loop is entered with tile 0's softmax done
  (prologue) and left with the last tile's ``P V`` issued in the epilogue. Each ``kv_empty``
  barrier counts NUM_CONSUMERS arrivals per phase.
- Three consumers (D=64): a step's exponentials keep the multi-function unit busy about as
  long as its two products keep the tensor cores, so with two warpgroups one softmax cannot
  hide behind the other's products; with three each has two products' time. Each consumer then
  computes only the key tiles its own 64 rows see (``BLOCK_M = 192`` against 128-key tiles
  leaves whole tiles masked for some rows at the causal diagonal, and rows past Sq see none);
  for a tile it sits out it waits until K and V have landed, frees both, and takes and passes
  its turn, so that every consumer still arrives once per ring entry and takes ``n + 1`` turns.
  P goes to its 16-bit operand form right after the ``wait_group 0`` that frees the previous
  one, so that the fp32 P is not live while the next ``Q K^T`` fills its accumulator (160
  registers).
- One consumer (``ops/fwd_sm90_configs.py: ONE``): the default partition alone, 64-row work tiles,
  no ping-pong (PINGPONG off), and a register cap at entry low enough (128 over the 8 warps Gluon
  makes of one warpgroup and the producer warp padded to a warpgroup) and shared memory small enough
  for two CTAs an SM. The two CTAs' consumers share the tensor cores with no turns between them, so
  one CTA's tile boundary (its last ``P V``, epilogue and next Q) runs while the other's products
  do; the persistent grid has two programs an SM.
- Epilogue, per consumer: ``O / l`` cast to the output dtype, written into this consumer's Q
  slot (its last reader, the final ``Q K^T``, has completed), ``fence.proxy.async``, one TMA
  store of the ``(1, 1, 64, D)`` block (the copy engine drops rows past Sq); the LSE row by row
  with masked stores.

Persistent schedule (PERSISTENT; the code above is the tile body of both). The grid is
``min(#SMs, n_work)`` programs, ``n_work = cdiv(Sq, BLOCK_M) * B * H``; program ``pid`` takes one
work item per wave, ``w = wave * grid + pid`` on even waves and ``wave * grid + grid - 1 - pid``
on odd ones, mapped to a tile by the same ``work`` as the flat grid (a head's tiles consecutive,
causal last-first). The snake matters for causal: with ``grid % n_m == 0`` (132 SMs, S = 512)
a plain stride gives every program the same query tile in each wave, its longest tile or its
shortest; the snake pairs them (a list-scheduling model of 32k tokens puts the plain stride's
makespan at 1.5x the snake's at S = 512, equal from 16k). Shared memory holds Q_BUFS = 3 Q
buffers (``q_smem[b * NUM_CONSUMERS + c]``, ``b = wave % 3``: the next tile's Q lands during the
current tile, and a slot is reused only three tiles later; one where three do not fit, below),
the K/V ring, and per Q slot a
``q_empty`` barrier (count 1). Each tile's work item is decoded with multiply-high divisions
(``common.fast_div``, constants from the launcher's plan). Phase bookkeeping, per program:

- ``wave`` counts the program's tiles (every wave but the last gives it one). Q slot
  ``(wave % 3, c)``: the producer waits ``q_empty`` with parity ``(wave // 3) & 1 ^ 1`` (the first
  use of each buffer passes), then completes ``q_ready`` (a TMA load with ``expect``; for a tile
  that sees no key a plain arrive, so that every tile takes exactly one phase); consumer c waits
  ``q_ready`` with parity ``(wave // 3) & 1`` for every tile, key or not, and at the end of tile
  i arrives on the ``q_empty`` of tile i - 1's slot (the one tile i + 2 takes). Neither barrier
  can run two phases ahead of its waiter: each completion needs the other side's previous one.
- ``kv`` counts the K/V tiles the program has loaded, over all its tiles (a tile with no key adds
  0); tile ``g = kv0 + t`` uses slot ``g % NUM_STAGES`` with parity ``(g // NUM_STAGES) & 1`` on
  ``k_ready``/``v_ready`` and ``^ 1`` on ``kv_empty``, exactly as the flat kernel's ``t`` does, so
  the ring runs on across tiles without a drain (the producer walks the same items and adds the
  same counts).
- ``turns`` counts each consumer's turns: ``n + 1`` per tile with ``n >= 1`` key tiles (prologue,
  ``n - 1`` steps, the last ``P V``), 0 for a tile with none. Both consumers walk the same tiles,
  so they take the same number of turns per tile and the alternation carries over.
- No deadlock: the producer's waits (``kv_empty``, ``q_empty``) need consumer progress made
  before the consumers wait for what that load brings (the ring as in the flat kernel; the Q
  of tile i + 1 needs only tile i - 2's slot, freed at the end of tile i - 1). A consumer's
  waits need the producer's loads, issued in tile order, and the other consumer's turn, at most
  one turn behind.
- O store: O goes into the consumer's own Q slot and leaves by TMA as in the flat kernel, then
  ``tma.store_wait(1)`` (``cp.async.bulk.wait_group.read`` of all but the store just issued: the
  copy engine has read tile i - 1's O; Gluon puts a warpgroup barrier between it and the
  single-thread arrive) before that slot's ``q_empty``, so no tile waits for its own store's read
  (about 650 clocks a tile with two buffers); the last store is waited for after the loop. A
  plain ``gl.store`` from the accumulator layout would drop the copy engine's clipping at Sq and
  need O's pointer and strides.
- One Q buffer a consumer (``Q_BUFS == 1``: head dims 192 and 256, whose two Q slots, K/V ring
  and a 16 or 32 KB O tile take 224 KB): O leaves through one O tile of the CTA (``o_smem``), not
  the Q slot,
  and the Q slot is freed as soon as the consumer's last ``Q K^T`` of the tile has completed
  (``fwd_steps._steps``, FREE_Q), so the
  producer loads the next tile's Q while the last softmax, ``P V`` and the epilogue run (a
  consumer that computes no key tile frees it after its epilogue). The consumers take the O tile
  in turn: use ``u = wave * NUM_CONSUMERS + c`` waits ``o_free`` with parity ``u & 1`` (one
  arrive at the start completes phase 0), writes O, stores it, waits for the copy engine's read
  (``wait_group.read 0``) and arrives; the last consumer (O_LATE) waits and arrives at its next
  tile instead, right after its first ``Q K^T`` issue (before anything else where it computes
  no key tile there), since the next use, the first consumer's, needs that tile's turns from
  it. Uses alternate between the consumers, each tile's in consumer order, so no use can pass
  a phase its predecessor has not completed. The producer's
  ``q_empty`` waits are the three-buffer ones with ``Q_BUFS`` for 3. The consumers walk their
  items in a while loop that stops at the first past the work count (a program's items rise wave
  by wave; the producer's for loop visits the same ones), and read the grid size and
  ``qk_scale`` through side-effecting ``mov``s: otherwise the wave count, ``%nctaid.x`` and two
  constants of the lazy rescale were spilled at head dim 256.

Dynamic deal (DYNAMIC, persistent causal dense problems of the configs that measured faster with
it: ``ops/fwd_sm90_configs.py: DYNAMIC_DEAL``). Program ``pid``'s first item is ``pid``; every
later one is drawn by its producer from a counter in global memory (WORK, int32, zero at launch):
``grid + atomic_add(WORK, 1)`` (``common.dealt_item``), drawn once the producer has issued the
current tile's last K/V load, so the program that frees up first takes the next heaviest tile (the
items are in the flat grid's order). A launch draws exactly ``n_work`` tickets (``n_work - grid``
items and one past the end per program); the draw that gets ticket ``n_work - 1`` is the last, and
puts the counter back to zero for the next launch on the stream. The consumers learn each item
from the producer: one int32 cell per Q slot (``items``), written by the producer after the slot's
``q_empty`` wait and before its ``q_ready`` arrive (the arrive's release, the consumer's wait's
acquire), read by consumer c after it waits ``q_ready`` of its next tile; past the last item the
producer writes an item ``>= n_work`` with a plain arrive, which ends the consumers' while loop.
The cell is not rewritten before its consumer has read it: the producer's next write to it waits
for that slot's ``q_empty``, which the consumer arrives on only after the tile that read it. The
ring, turns and Q phases count tiles as on the fixed deal (``wave``, ``kv``, ``turns``), so the
schedule above is unchanged; only the items differ, and each is computed as the fixed deal
computes it (bit for bit the same outputs).

Key tiles. ``kv_tile_range`` (the same split as ``kernels/common.py``) gives the tiles the CTA's
rows can see, ``[lo, hi)``, and the ones every row sees entirely, ``[full_lo, full_hi)``; all
consumers walk ``[lo, hi)`` (the producer loads each tile once), and a tile outside the full range
takes the masked path (a runtime branch on the score tile; no mask work on full tiles); the flat
causal D = 128 build instead walks the tiles below ``full_hi`` in a loop built without the masked
path and the rest in a masked loop (``fwd_steps._steps``, SPLIT). A CTA with no visible key
writes zeros and -inf without touching K or V.

Flags (``gl.constexpr``, compiled away when off):
- IS_CAUSAL: bottom-right aligned causal mask (row i sees key j iff ``j <= i + Sk - Sq``).
- HAS_WINDOW: row i sees key j iff ``i + d - window_left <= j`` and (unless IS_CAUSAL)
  ``j <= i + d + window_right``, ``d = Sk - Sq``; an unbounded side arrives as ``Sq + Sk``.
- SOFTCAP: ``qk_scale`` is ``scale / c`` (natural units) and scores become ``tanh(s) * softcap``,
  ``softcap = c * log2(e)``: ``c * tanh(scale q.k / c)`` in log2 units.
- HAS_ALIBI: adds ``-slope * log2(e) * |i + d - j|``; slope read from ``ALIBI + b * stride_ab + h``.
- HAS_SINKS: one learnable logit per query head (SINKS, fp32 ``(H,)``, natural units) joins
  every row's softmax as a key with no value: the running max starts at it and the sum at 1, as
  in the portable forward (``kernels/common.py: softmax_start``), so ``out`` and the LSE include
  it and a row that sees no key gives 0 and the sink.
- RAW_MAX: no softcap or ALiBi and ``qk_scale > 0``: the row max is taken on the raw products
  and ``p = exp2(s * qk_scale - m * qk_scale)`` is one FMA and one ex2 per score.
- EVEN_N: Sk is a multiple of BLOCK_N, so tail tiles need no ``j < Sk`` mask.
- VARLEN: packed sequences (FlashAttention-2's varlen). The descriptors are ``(1, heads, total,
  D)`` views of the ``(total, heads, D)`` tensors; ``batch`` counts sequences and ``seqlen_q``/
  ``seqlen_k`` are the longest (they size the grid); each work item reads its sequence's first
  rows and lengths from CU_Q/CU_K (``common.sequence``, clamped to ``total_q``/``total_k``) and
  runs as a problem of those lengths from those rows; a query tile past its sequence's end sees
  no key and writes nothing. Rows past a sequence's end are the next sequence's (or rows past
  the last offset), not zeros, so: Q rows there only make rows that are never stored; K rows
  there give scores the ``j < Sk`` mask replaces with -inf (a select: a NaN there never
  reaches the softmax); V rows there would meet P's zeros in ``P V``, where ``0 * inf`` is NaN,
  so the producer loads a sequence's last V tile onto its own barrier, zeroes the foreign rows
  (``fwd_load._load_v_bounded``: 8 x 64 pieces, read, masked, written back), fences them for
  the async proxy and then completes ``v_ready`` with a plain arrive; and a consumer whose 64
  rows pass the sequence's end writes O through its shared-memory tile, read back in 16-byte
  row pieces and stored with a row mask into O (``store_rows``), instead of the TMA store
  (persistent: it then waits for every earlier store's read before freeing a Q slot). The LSE
  is ``(H, total_q)`` (``stride_lb`` 0). Off, the kernel is the same instructions as without
  these lines. ``VARLEN == 2`` (a work list, ``ops/work_list.py``): work item ``w`` is pair
  ``w`` of WORK, ``(b, r)``, program ``r`` of a grid over sequence b alone
  (``common.work_item``); the list, built on the device by ``kernels/varlen.py:
  work_list_kernel``, holds every sequence's programs and no program past a sequence's end,
  the sequences costliest first, and its length in ``WORK[0]``; the flat grid's programs past
  the list's end read -1 and return before anything else (the persistent grid takes no list:
  dealt in its fixed order, a list of whole sequences took 0.86-1.43x the time of its own
  order, 1.37-1.43x at equal lengths causal; docs/hopper_fwd_configs.md, "Work lists").
- PAGED (with VARLEN): K and V are paged caches ``(num_blocks, Hkv, block_size, D)`` (k_desc and
  v_desc over them as they are), sequence b's keys in pages ``BLOCK_TABLE[b * stride_btb + j]``
  in order, its key count ``CU_K[b + 1] - CU_K[b]`` clamped to its row (``total_k`` = the
  row's pages times ``block_size``; ``common.sequence``). Only the producer's K/V copies change
  (``fwd_load._load_pages``): a tile from one page where ``block_size`` is a multiple of BLOCK_N
  (the descriptors' box is the tile), else one box of ``block_size`` rows a page (a power of two
  of 8 to BLOCK_N / 2: the box's rows) into that page's row slice of the slot; the sequence's last
  V tile is bounded as VARLEN's is (its page's rows past the keys are unset). The slots are
  BLOCK_N rows whatever the box.

MLA head dims (D = 192 for Q and K, Dv = 128 for V and O; ``ops/fwd_sm90.py: MLA_HEAD_DIMS``). A
TMA box is a power of two wide, so Q and K arrive in PANELS = 3 column panels of 64 (the q/k
descriptors' box is 64 wide; slot s's panel i is buffer ``s * PANELS + i``) and ``Q K^T`` is
one async wgmma per panel into the same accumulator (``fwd_steps._scores``; the wait that
leaves ``P V`` running still leaves exactly that group). V, O and the accumulator take Dv from
v_desc/o_desc; O goes out through the Q slot in O's own layout: the whole Q buffer (Q_SLOTS *
PANELS panels of 64 columns) is viewed as O tiles of Dv columns and slot s's O is the first of
them inside the slot, tile ceil(s * PANELS * 64 / Dv) (slot 1's at its panels 4-5). A view of
the whole buffer keeps the storage size, as triton 3.7 on requires of ``_reinterpret``. With
one panel and Dv = D (every other config) the code is the same instructions as without these
lines.

Invariants. The head dim is contiguous and every descriptor stride is 16-byte aligned (launcher).
Masked scores are -inf; a row whose keys are all hidden so far keeps ``m = -inf`` with ``p = 0``
(the max is replaced by 0 before the exp2), so it ends with ``l = 0``: out 0, LSE -inf, never NaN.
LSE is natural-log, fp32, ``(B, H, Sq)`` with unit stride along Sq. Offsets that can pass 2**31
(the LSE's batch/head offsets) are int64.
"""

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)

from flashcore.kernels.hopper.common import (
    LN2,
    LOG2E,
    ROWS,
    item_read,
    kv_tile_range,
    opaque,
    programs,
    reinterpret,
    row_total,
    sequence,
    snake,
    store_rows,
    sums_start,
    tma_store,
    work_item,
)
from flashcore.kernels.hopper.fwd_load import producer
from flashcore.kernels.hopper.fwd_steps import attend, skips, turn_pass

# OWN_PV (``_consumer_tile``) only where it measured faster: with triton 3.8 its builds spill
# 304-308 B (3.6's none) and the D = 64 causal forward at 4096 keys ran 7% slower than 3.6's
# (H200); without it 3.8 spills none there (docs/maintainers.md, "Other Tritons").
OWN_PV_TRITON = gl.constexpr(triton.__version__.startswith("3.6."))


@gluon.jit
def _store_o(o_desc, o_tile, acc, off_b, off_h, row):
    """O out through its shared-memory tile (a Q slot) by one TMA store of rows ``row ..``."""
    o_tile.reshape([o_tile.shape[2], o_tile.shape[3]]).store(acc.to(o_desc.dtype))
    fence_async_shared()
    tma_store(o_desc, [off_b, off_h, row, 0], o_tile)


@gluon.jit
def _consumer_tile(
    o_desc,
    q_smem,
    k_smem,
    v_smem,
    o_smem,
    q_ready,
    q_empty,
    k_ready,
    v_ready,
    kv_empty,
    turn,
    o_free,
    LSE,
    ALIBI,
    SINKS,
    O,
    CU_Q,
    CU_K,
    WORK,
    w,
    it,
    kv0,
    turn0,
    stride_lb,
    stride_lh,
    stride_ab,
    stride_ot,
    stride_oh,
    num_heads,
    seqlen_q,
    seqlen_k,
    lpt_heads,
    divisors,
    qk_scale,
    window_left,
    window_right,
    softcap,
    total_q,
    total_k,
    CONSUMER: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    PINGPONG: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    RAW_MAX: gl.constexpr,
    EVEN_N: gl.constexpr,
    PERSISTENT: gl.constexpr,
    VARLEN: gl.constexpr,
    PAGED: gl.constexpr,
    Q_BUFS: gl.constexpr,
):
    """This consumer's 64 rows of work item ``w`` (the program's tile number ``it``), from ring
    entry ``kv0`` and turn ``turn0`` on; returns the number of key tiles it took."""
    dtype: gl.constexpr = o_desc.dtype
    HEAD_DIM_V: gl.constexpr = o_desc.block_type.shape[3]  # O's and V's; HEAD_DIM is Q's and K's
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM_V, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    if PERSISTENT:
        # Per tile, so that nothing derived from the lengths or the LSE strides (the key
        # loop's bounds, the strides' sign extension) is kept live across tiles.
        seqlen_q = opaque(seqlen_q)
        seqlen_k = opaque(seqlen_k)
        stride_lb = opaque(stride_lb)
        stride_lh = opaque(stride_lh)
    if VARLEN:
        # Flat too: the sign extensions of O's strides and the query tiles' count were hoisted
        # into the entry block and spilled (16-36 B at head dims 192 and 256).
        seqlen_q = opaque(seqlen_q)
        stride_ot = opaque(stride_ot)
        stride_oh = opaque(stride_oh)
    tile_m, off_b, off_h = work_item(
        WORK, CU_Q, w, seqlen_q, total_q, lpt_heads, num_heads, divisors, BLOCK_M, IS_CAUSAL,
        PERSISTENT, VARLEN,
    )  # fmt: skip
    start_m = tile_m * BLOCK_M
    row0 = start_m + CONSUMER * ROWS
    rows = gl.expand_dims(row0 + gl.arange(0, ROWS, layout=row_layout), 1)
    q_start, _, seqlen_q, seqlen_k, desc_b = sequence(
        CU_Q, CU_K, off_b, seqlen_q, seqlen_k, total_q, total_k, VARLEN, PAGED
    )
    lo, full_lo, full_hi, hi = kv_tile_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
        IS_CAUSAL, HAS_WINDOW, VARLEN,
    )  # fmt: skip
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)  # hi >= lo: 0 for a tile that sees no key
    t0 = 0
    t1 = n_tiles
    if skips(NUM_CONSUMERS, BLOCK_N, IS_CAUSAL):
        # The tiles this consumer's rows see, [t0, t1) of the CTA's (none past Sq).
        own_lo, _, _, own_hi = kv_tile_range(
            row0, seqlen_q, seqlen_k, window_left, window_right, ROWS, BLOCK_N, IS_CAUSAL,
            HAS_WINDOW,
        )  # fmt: skip
        t0 = gl.minimum(gl.maximum(own_lo - lo, 0) // BLOCK_N, n_tiles)
        t1 = gl.maximum(gl.minimum(gl.cdiv(own_hi - lo, BLOCK_N), n_tiles), t0)
        if row0 >= seqlen_q:
            t1 = t0
    if HAS_ALIBI:
        slope = gl.load(ALIBI + off_b.to(gl.int64) * stride_ab + off_h) * LOG2E
    else:
        slope = 0.0

    # One Q buffer a consumer (persistent, Q_BUFS == 1): O leaves through the CTA's one O tile,
    # taken in turn, and the Q slot is freed once the last Q K^T has completed (attend).
    SHARED_O: gl.constexpr = PERSISTENT and (Q_BUFS == 1)
    if PERSISTENT:
        qi = (it % Q_BUFS) * NUM_CONSUMERS + CONSUMER
        # Every tile completes one q_ready phase, a tile with no key included (without a load).
        mbarrier.wait(q_ready.index(qi), (it // Q_BUFS) & 1)
    else:
        qi = CONSUMER
    PANELS: gl.constexpr = HEAD_DIM // q_smem.shape[4]  # Q's column panels (the kernel's note)
    if HAS_SINKS:
        # The sink is a key already seen, with weight exp2(sink - m) = 1 and no value
        # (``kernels/common.py: softmax_start``), in the units of the running max.
        sink = gl.load(SINKS + off_h) * LOG2E
        if RAW_MAX:
            sink = sink / qk_scale  # raw q.k units (RAW_MAX has qk_scale > 0)
        m_i = gl.full([ROWS], 0.0, gl.float32, layout=row_layout) + sink
        l_i = sums_start(1.0, BLOCK_N)
    else:
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
        l_i = sums_start(0.0, BLOCK_N)
    acc = gl.zeros([ROWS, HEAD_DIM_V], gl.float32, layout=o_layout)
    # Three consumers, causal, on the flat grid (D = 64 from 4096 keys, on grids of four rounds
    # and more: ops/fwd_sm90_configs.py, three_consumers_fill): each softmax kept under its own P V
    # (fwd_steps._steps, OWN_PV): 1.5-2% faster there; the other builds with three consumers
    # gained less or spilled with it (docs/hopper_fwd_configs.md, "Row sums per thread").
    OWN_PV: gl.constexpr = (
        OWN_PV_TRITON and (NUM_CONSUMERS > 2) and IS_CAUSAL and RAW_MAX
        and not (PERSISTENT or HAS_SINKS or VARLEN or HAS_WINDOW)
    )  # fmt: skip
    # The causal D = 128 flat build (from 4096 keys) walks the tiles below the diagonal in a loop
    # without the masks' code (fwd_steps._steps, SPLIT): 1.8-2.1% faster at 8192-16384 keys,
    # but 1-3% slower on the persistent grid (docs/hopper_fwd_configs.md, "The causal key loop
    # split at the diagonal").
    SPLIT: gl.constexpr = (
        IS_CAUSAL and EVEN_N and (HEAD_DIM == 128) and (NUM_CONSUMERS == 2)
        and not (PERSISTENT or HAS_WINDOW or SOFTCAP or HAS_ALIBI or PANELS > 1)
    )  # fmt: skip
    # The last consumer of the CTA's O tile (SHARED_O) frees it late: its previous tile's store
    # is waited for under its next first Q K^T (attend), not before that tile begins, since the
    # O tile's next use (the first consumer's, a tile later) is far off.
    O_LATE: gl.constexpr = SHARED_O and (CONSUMER == NUM_CONSUMERS - 1)
    if O_LATE:  # noqa: SIM102
        if (it > 0) and (t1 <= t0):
            tma.store_wait(0)
            mbarrier.arrive(o_free.index(0), count=1)
    if hi > lo:
        if not PERSISTENT:
            mbarrier.wait(q_ready.index(qi), 0)
        m_i, l_i, acc = attend(
            q_smem, qi, k_smem, v_smem, k_ready, v_ready, kv_empty, turn, kv0, turn0, n_tiles,
            t0, t1, lo, full_lo, full_hi, rows, seqlen_q, seqlen_k, qk_scale, window_left,
            window_right, softcap, slope, m_i, l_i, CONSUMER, NUM_CONSUMERS, PINGPONG, HEAD_DIM,
            BLOCK_N, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, RAW_MAX, EVEN_N,
            OWN_PV, q_empty.index(qi), SHARED_O, SPLIT, o_free.index(0), O_LATE, it > 0,
        )  # fmt: skip

    l_i = row_total(l_i, m_i)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    acc = acc / gl.expand_dims(gl.convert_layout(l_safe, orow_layout), 1)
    if RAW_MAX:
        m_out = m_i * qk_scale
    else:
        m_out = m_i
    lse = gl.where(empty, float("-inf"), (m_out + gl.log2(l_safe)) * LN2)

    if SHARED_O:
        # The CTA's O tile, its uses in turn: this consumer's use of tile it is use
        # ``it * NUM_CONSUMERS + CONSUMER``, after the previous use's store has been read.
        mbarrier.wait(o_free.index(0), (it * NUM_CONSUMERS + CONSUMER) & 1)
        o_tile = o_smem.index(0)
    elif (HEAD_DIM_V == HEAD_DIM) and (PANELS == 1):
        # Q's slot is free: its last reader, the final Q K^T, completed above.
        o_tile = q_smem.index(qi * PANELS)
    else:
        # O (Dv <= D: the launcher's MLA shapes) in the slot's panels, in O's own layout: it
        # is written and read (by the copy engine) through that layout alone. The Q buffer
        # viewed whole as O tiles (the kernel's note: the first tile inside slot qi).
        O_PANELS: gl.constexpr = HEAD_DIM_V // q_smem.shape[4]
        O_TILES: gl.constexpr = q_smem.shape[0] // O_PANELS
        gl.static_assert(q_smem.shape[0] == O_TILES * O_PANELS, "O tiles must cover Q's panels")
        o_shape: gl.constexpr = [O_TILES] + o_desc.block_type.shape  # noqa: RUF005
        o_tiles = reinterpret(q_smem, dtype, o_shape, o_desc.layout)
        o_tile = o_tiles.index((qi * PANELS + O_PANELS - 1) // O_PANELS)
    if VARLEN:
        # Rows past the sequence's end are the next sequence's: a tile that reaches them is
        # written from registers with a row mask (and, for the padded head dims, a column
        # mask: the copy engine's clipping at O's real width).
        clipped = row0 + ROWS > seqlen_q
        if clipped:
            store_rows(
                O, o_desc, o_tile, acc, q_start + row0, seqlen_q - row0, off_h, stride_ot,
                stride_oh,
            )  # fmt: skip
        else:
            _store_o(o_desc, o_tile, acc, desc_b, off_h, q_start + row0)
    else:
        _store_o(o_desc, o_tile, acc, off_b, off_h, row0)
    offs_m = row0 + gl.arange(0, ROWS, layout=row_layout)
    lse_ptrs = (
        LSE + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + q_start + offs_m
    )
    gl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)
    if SHARED_O:
        # The copy engine has read this tile's O: the next use of the O tile may write it
        # (O_LATE: at this consumer's next tile). A consumer that computed no key tile frees its
        # Q slot here (attend did otherwise).
        if not O_LATE:
            tma.store_wait(0)
            mbarrier.arrive(o_free.index(0), count=1)
        if t1 <= t0:
            mbarrier.arrive(q_empty.index(qi), count=1)
    elif PERSISTENT:
        # The copy engine has read the previous tile's O out of its slot (``wait_group.read``
        # of all but the store just issued; Gluon puts a warpgroup barrier after it, before the
        # arrive): the producer may land tile it + 2's Q there. Waiting for this tile's own
        # store instead cost about 650 clocks a tile (the copy engine's read of the O tile).
        # A tile written from registers issued no store: all of them, the previous tile's
        # included, must have been read.
        if VARLEN:
            if clipped:
                tma.store_wait(0)
            else:
                tma.store_wait(1)
        else:
            tma.store_wait(1)
        if it > 0:
            prev = ((it + Q_BUFS - 1) % Q_BUFS) * NUM_CONSUMERS + CONSUMER
            mbarrier.arrive(q_empty.index(prev), count=1)
    else:
        tma.store_wait(0)
    return n_tiles


@gluon.jit
def _consumer(
    run,
    CONSUMER: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    PINGPONG: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    RAW_MAX: gl.constexpr,
    EVEN_N: gl.constexpr,
    PERSISTENT: gl.constexpr,
    VARLEN: gl.constexpr,
    PAGED: gl.constexpr = False,
    Q_BUFS: gl.constexpr = 3,
    DYNAMIC: gl.constexpr = False,
):
    """Consumer ``CONSUMER``'s partition: its tiles one after another (persistent), or its
    program's one tile; ``run`` holds the kernel's runtime values (``attn_fwd_sm90_kernel``)."""
    (
        o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
        turn, o_free, items, LSE, ALIBI, SINKS, O, CU_Q, CU_K, WORK, stride_lb, stride_lh,
        stride_ab, stride_ot, stride_oh, num_heads, batch, seqlen_q, seqlen_k, lpt_heads,
        divisors, qk_scale, window_left, window_right, softcap, total_q, total_k,
    ) = run  # fmt: skip
    if (PINGPONG == 2) and (CONSUMER == 0):
        # Consumer 0 holds the first turn: its own half of the barrier's first phase.
        turn_pass(turn, 0, 0, PINGPONG)
    if PERSISTENT and (Q_BUFS == 1):
        # Out of the entry block (``common.opaque``); so is the grid size (``programs``).
        qk_scale = opaque(qk_scale)
    if PERSISTENT:
        pid = gl.program_id(0)
        grid = programs(pid, VARLEN or (Q_BUFS == 1))
        seqlen_q = opaque(seqlen_q)
        seqlen_k = opaque(seqlen_k)
        num_heads = opaque(num_heads)
        lpt_heads = opaque(lpt_heads)
        stride_lh = opaque(stride_lh)
        stride_lb = opaque(stride_lb)
        n_work = gl.cdiv(seqlen_q, BLOCK_M) * opaque(batch) * num_heads
        kv = 0
        turns = 0
        if (Q_BUFS == 1) or DYNAMIC:
            # A while loop over the program's work items (each wave's item is past the
            # previous one's, so the first past n_work ends it): the for loop's wave count,
            # live beside n_work across the tiles, spilled at head dim 256. DYNAMIC: the
            # producer posts each item past the first beside its Q (an item >= n_work past
            # the last), read once q_ready completes.
            wave = 0
            w = pid
            while w < n_work:
                n = _consumer_tile(
                    o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready,
                    kv_empty, turn, o_free, LSE, ALIBI, SINKS, O, CU_Q, CU_K, WORK, w, wave, kv,
                    turns, stride_lb, stride_lh, stride_ab, stride_ot, stride_oh, num_heads,
                    seqlen_q, seqlen_k, lpt_heads, divisors, qk_scale, window_left, window_right,
                    softcap, total_q, total_k, CONSUMER, NUM_CONSUMERS, PINGPONG, HEAD_DIM,
                    BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI,
                    HAS_SINKS, RAW_MAX, EVEN_N, PERSISTENT, VARLEN, PAGED, Q_BUFS,
                )  # fmt: skip
                kv += n
                if n > 0:
                    turns += n + 1
                wave += 1
                if DYNAMIC:
                    qi = (wave % Q_BUFS) * NUM_CONSUMERS + CONSUMER
                    mbarrier.wait(q_ready.index(qi), (wave // Q_BUFS) & 1)
                    w = item_read(items, qi, 4)
                else:
                    w = snake(wave, pid, grid)
        else:
            for wave in range(gl.cdiv(n_work, grid)):
                w = snake(wave, pid, grid)
                if w < n_work:
                    n = _consumer_tile(
                        o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready,
                        v_ready, kv_empty, turn, o_free, LSE, ALIBI, SINKS, O, CU_Q, CU_K, WORK,
                        w, wave, kv, turns, stride_lb, stride_lh, stride_ab, stride_ot, stride_oh,
                        num_heads, seqlen_q, seqlen_k, lpt_heads, divisors, qk_scale, window_left,
                        window_right, softcap, total_q, total_k, CONSUMER, NUM_CONSUMERS,
                        PINGPONG, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, HAS_WINDOW,
                        SOFTCAP, HAS_ALIBI, HAS_SINKS, RAW_MAX, EVEN_N, PERSISTENT, VARLEN, PAGED,
                        Q_BUFS,
                    )  # fmt: skip
                    kv += n
                    if n > 0:
                        turns += n + 1
        tma.store_wait(0)  # the last tile's O read out of shared memory before the CTA ends
    else:
        _consumer_tile(
            o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
            turn, o_free, LSE, ALIBI, SINKS, O, CU_Q, CU_K, WORK, gl.program_id(0), 0, 0, 0,
            stride_lb, stride_lh, stride_ab, stride_ot, stride_oh, num_heads, seqlen_q, seqlen_k,
            lpt_heads, divisors, qk_scale, window_left, window_right, softcap, total_q, total_k,
            CONSUMER, NUM_CONSUMERS, PINGPONG, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL,
            HAS_WINDOW, SOFTCAP, HAS_ALIBI, HAS_SINKS, RAW_MAX, EVEN_N, PERSISTENT, VARLEN,
            PAGED, Q_BUFS,
        )  # fmt: skip


@gluon.jit
def attn_fwd_sm90_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    LSE,
    ALIBI,
    SINKS,
    O,
    CU_Q,
    CU_K,
    WORK,
    BLOCK_TABLE,
    stride_lb,
    stride_lh,
    stride_ab,
    stride_ot,
    stride_oh,
    stride_btb,
    block_size,
    num_heads,
    kv_group,
    batch,
    seqlen_q,
    seqlen_k,
    total_q,
    total_k,
    lpt_heads,
    div_group_m,
    div_group_s,
    div_lpt_m,
    div_lpt_s,
    div_heads_m,
    div_heads_s,
    qk_scale,
    window_left,
    window_right,
    softcap,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PINGPONG: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    RAW_MAX: gl.constexpr,
    EVEN_N: gl.constexpr,
    PERSISTENT: gl.constexpr = False,
    VARLEN: gl.constexpr = False,
    PAGED: gl.constexpr = False,
    Q_BUFS: gl.constexpr = 3,
    DYNAMIC: gl.constexpr = False,
):
    BLOCK_M: gl.constexpr = ROWS * NUM_CONSUMERS
    if VARLEN == 2:  # noqa: SIM102 (one condition would load WORK in every build)
        # The grid is sized for the most tiles the packed rows can make; past the list's end
        # (-1) there is nothing to do.
        if gl.load(WORK + 2 + 2 * gl.program_id(0)) < 0:
            return
    # Persistent: Q_BUFS per consumer, so that the next tile's Q lands during this one.
    Q_SLOTS: gl.constexpr = NUM_CONSUMERS * (Q_BUFS if PERSISTENT else 1)
    dtype: gl.constexpr = q_desc.dtype
    # Buffers are [slots, 1, 1, rows, D]: one 4-D TMA block per slot (Gluon 3.6 has no starred
    # list in a kernel, hence the concatenation).
    # Q and K come in PANELS column panels each (head dim 192: three of 64; a TMA box is a power
    # of two wide), slot s's panel i at s * PANELS + i; one panel otherwise. V and O have their
    # own head dim (v_desc, o_desc: 128 at head dim 192, the MLA shapes; HEAD_DIM otherwise).
    PANELS: gl.constexpr = HEAD_DIM // q_desc.block_type.shape[3]
    q_shape: gl.constexpr = [Q_SLOTS * PANELS] + q_desc.block_type.shape  # noqa: RUF005
    # A K/V slot holds BLOCK_N rows; a paged cache's box may be one page of fewer (PAGED).
    k_shape: gl.constexpr = [NUM_STAGES * PANELS, 1, 1, BLOCK_N, k_desc.block_type.shape[3]]
    v_shape: gl.constexpr = [NUM_STAGES, 1, 1, BLOCK_N, v_desc.block_type.shape[3]]
    q_smem = gl.allocate_shared_memory(dtype, q_shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, k_shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_shape, v_desc.layout)
    q_bars: gl.constexpr = [Q_SLOTS, 1]
    q_ready = gl.allocate_shared_memory(gl.int64, q_bars, mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    # kv_empty[slot]: the slot's K has been read by every consumer; kv_empty[NUM_STAGES + slot]:
    # its V. K is released after Q K^T and V after P V, a step apart, so that the next K
    # loads while V is still in use.
    kv_empty = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(Q_SLOTS):
        mbarrier.init(q_ready.index(c), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=NUM_CONSUMERS)
        mbarrier.init(kv_empty.index(NUM_STAGES + i), count=NUM_CONSUMERS)
    if PERSISTENT:
        # q_empty[b * NUM_CONSUMERS + c]: consumer c has stored its O out of Q buffer b.
        q_empty = gl.allocate_shared_memory(gl.int64, q_bars, mbarrier.MBarrierLayout())
        for c in gl.static_range(Q_SLOTS):
            mbarrier.init(q_empty.index(c), count=1)
    else:
        q_empty = q_ready  # never touched
    if PERSISTENT and (Q_BUFS == 1):
        # One Q buffer a consumer: O leaves through one O tile of the CTA instead of the Q
        # slot, the consumers' uses in turn (o_free completes once per use; the first passes).
        o_shape: gl.constexpr = [1] + o_desc.block_type.shape  # noqa: RUF005
        o_smem = gl.allocate_shared_memory(dtype, o_shape, o_desc.layout)
        o_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(o_free.index(0), count=1)
        mbarrier.arrive(o_free.index(0), count=1)
    else:
        o_smem = q_smem  # never touched
        o_free = q_ready
    if VARLEN:
        # The producer's own barrier for bounded V loads (fwd_load._load_v_bounded).
        fix_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(fix_bar.index(0), count=1)
    else:
        fix_bar = q_ready  # never touched
    if PINGPONG == 1:
        # Ping-pong through mbarriers: consumer c issues its products after waiting turn[c] and
        # passes the turn on to c + 1 once they are issued; consumer 0 holds the first turn.
        # (PINGPONG == 2 takes the turns by named barriers: fwd_steps.turn_take.)
        turn = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(NUM_CONSUMERS):
            mbarrier.init(turn.index(c), count=1)
        mbarrier.arrive(turn.index(0), count=1)
    else:
        turn = q_ready  # never touched

    if DYNAMIC:
        # The dynamic deal's work items, one cell per Q slot (written by the producer before
        # the slot's q_ready, read by its consumer after it).
        items = gl.allocate_shared_memory(
            gl.int32, [Q_SLOTS, 1], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
    else:
        items = q_ready  # never touched
    divisors = (div_group_m, div_group_s, div_lpt_m, div_lpt_s, div_heads_m, div_heads_s)
    # Each partition kind's runtime values in one tuple, built once; the constexprs are spelled
    # out inline in each partition's argument tuple, because a tuple that holds constexprs in a
    # variable inside the kernel turns them into tensors (Triton 3.6).
    run = (
        o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
        turn, o_free, items, LSE, ALIBI, SINKS, O, CU_Q, CU_K, WORK, stride_lb, stride_lh,
        stride_ab, stride_ot, stride_oh, num_heads, batch, seqlen_q, seqlen_k, lpt_heads,
        divisors, qk_scale, window_left, window_right, softcap, total_q, total_k,
    )  # fmt: skip
    loads = (
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
        kv_empty, fix_bar.index(0), items, CU_Q, CU_K, WORK, num_heads, kv_group, batch, seqlen_q,
        seqlen_k,
        lpt_heads, divisors, window_left, window_right, total_q, total_k, BLOCK_TABLE,
        stride_btb, block_size,
    )  # fmt: skip
    gl.static_assert((NUM_CONSUMERS >= 1) & (NUM_CONSUMERS <= 3), "one to three consumers")
    if NUM_CONSUMERS == 1:
        gl.warp_specialize(
            [
                (_consumer, (run, 0, NUM_CONSUMERS, PINGPONG, HEAD_DIM, BLOCK_M, BLOCK_N,
                             NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, HAS_SINKS,
                             RAW_MAX, EVEN_N, PERSISTENT, VARLEN, PAGED, Q_BUFS, DYNAMIC)),
                (producer, (loads, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL,
                            HAS_WINDOW, PERSISTENT, VARLEN, PAGED, Q_BUFS, DYNAMIC)),
            ],
            [1],
            [24],
        )  # fmt: skip
    elif NUM_CONSUMERS == 2:
        gl.warp_specialize(
            [
                (_consumer, (run, 0, NUM_CONSUMERS, PINGPONG, HEAD_DIM, BLOCK_M, BLOCK_N,
                             NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, HAS_SINKS,
                             RAW_MAX, EVEN_N, PERSISTENT, VARLEN, PAGED, Q_BUFS, DYNAMIC)),
                (_consumer, (run, 1, NUM_CONSUMERS, PINGPONG, HEAD_DIM, BLOCK_M, BLOCK_N,
                             NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, HAS_SINKS,
                             RAW_MAX, EVEN_N, PERSISTENT, VARLEN, PAGED, Q_BUFS, DYNAMIC)),
                (producer, (loads, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL,
                            HAS_WINDOW, PERSISTENT, VARLEN, PAGED, Q_BUFS, DYNAMIC)),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_consumer, (run, 0, NUM_CONSUMERS, PINGPONG, HEAD_DIM, BLOCK_M, BLOCK_N,
                             NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, HAS_SINKS,
                             RAW_MAX, EVEN_N, PERSISTENT, VARLEN, PAGED, Q_BUFS, DYNAMIC)),
                (_consumer, (run, 1, NUM_CONSUMERS, PINGPONG, HEAD_DIM, BLOCK_M, BLOCK_N,
                             NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, HAS_SINKS,
                             RAW_MAX, EVEN_N, PERSISTENT, VARLEN, PAGED, Q_BUFS, DYNAMIC)),
                (_consumer, (run, 2, NUM_CONSUMERS, PINGPONG, HEAD_DIM, BLOCK_M, BLOCK_N,
                             NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, HAS_SINKS,
                             RAW_MAX, EVEN_N, PERSISTENT, VARLEN, PAGED, Q_BUFS, DYNAMIC)),
                (producer, (loads, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL,
                            HAS_WINDOW, PERSISTENT, VARLEN, PAGED, Q_BUFS, DYNAMIC)),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, 24],
        )  # fmt: skip
