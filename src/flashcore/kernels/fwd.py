"""FlashAttention-2 forward: one program per (query block, batch x head).

Algorithm. A program keeps its (BLOCK_M, BLOCK_D) query tile on chip and streams the key/value
tiles of its (batch, kv head) through it: ``S = Q @ K^T`` on the tensor cores with fp32
accumulation, scaled by ``scale * log2(e)`` so the softmax runs on ``exp2``; an online softmax keeps
the running row max ``m`` and row sum ``l`` in fp32 and rescales the output accumulator when the max
grows; ``P`` is cast to the value dtype for the second product ``acc += P @ V``. Nothing of size
Sq x Sk ever reaches memory. At the end ``out = acc / l`` and ``lse = (m + log2(l)) * ln(2)``.

Grid. 1-D, ``cdiv(Sq, BLOCK_M) * B * H`` programs, Sq the longest query sequence with IS_VARLEN
(``common.program_tile``: the query tiles of one head are consecutive; causal hands them out
last-first, heaviest first). Query head h reads kv head ``h // (H // Hkv)`` (GQA/MQA without
repeating K/V in memory).

Key loop. ``kv_tile_range`` splits the keys a block may see into full tiles (every row sees every
key: no mask work at all) and a tail that needs masking (the causal diagonal band or the window's
right edge, the ragged end of Sk); with a sliding window also a masked head band across the
window's left edge, after skipping the keys left of it. Tiles outside every row's reach are never
visited, so causal costs about half and a window ``(left, right)`` about
``(left + right + BLOCK_M + BLOCK_N) / Sk``.

Flags (``tl.constexpr``, compiled away when off):
- IS_CAUSAL: bottom-right aligned causal mask (row i sees key j iff ``j <= i + Sk - Sq``).
- HAS_WINDOW: sliding window, row i sees key j iff ``i + d - window_left <= j`` and (unless
  IS_CAUSAL, which sets the right side to 0) ``j <= i + d + window_right``, ``d = Sk - Sq``. The
  launcher passes an unbounded side as ``Sq + Sk`` and turns the flag off when no side binds.
- SOFTCAP: ``qk_scale`` is ``scale / c`` in natural units and the scores become
  ``tanh(s) * softcap`` (``softcap`` = c, times log2(e) unless EXP_E): ``c * tanh(scale q.k / c)``.
  The host folds the units once for every kernel (``ops/problem.py``).
- HAS_ALIBI: adds ``-slope * |i + d - j|`` to every score, with the slope of this (batch, head)
  loaded from ALIBI (``stride_ab`` = 0 for per-head slopes). Softcap and ALiBi apply to full and
  masked tiles alike (``common.transform_scores``); only the window changes which tiles are masked.
- EVEN_M / EVEN_N: Sq / Sk are multiples of the block sizes, so loads skip row masks.
- HEAD_DIM < BLOCK_D: head dims that are not powers of two (80, 96, 192) are padded to BLOCK_D
  with masked loads; the padding reads 0 and contributes nothing. HEAD_DIM_V / BLOCK_DV: the same
  for the value head dim (V and O), which may differ from the query/key one (MLA: 192 and 128).
- UPCAST: compute in fp32 from fp32 copies of the tiles. Needed only by Triton 3.6's interpreter,
  which does bf16 arithmetic on the raw bit patterns; always off on the GPU.
- DOT_PRECISION: "ieee" for fp32 inputs (full fp32 products, matching PyTorch's default matmul),
  ignored for fp16/bf16.
- USE_TMA: Q, K, V and O arrive as 4-D tensor descriptors (B, heads, S, D) with blocks of
  (1, 1, rows, BLOCK_D): tiles move through Hopper's bulk-copy engine, which also zero-fills
  out-of-range rows and columns, so the masked loads disappear. The launcher takes it whenever
  the tensors meet the engine's alignment rules (16-byte base and strides); otherwise plain
  pointers with masked loads.
- EXP_E: fp32 inputs: scores in natural units and an exact exp (libdevice's on the GPU, 1;
  numpy's in the interpreter, 2) instead of the folded log2(e) and exp2 (see
  ``common.softmax_exp``); ``qk_scale`` is then just ``scale``.
- HAS_SINKS: one learnable logit per query head (SINKS, fp32 ``(H,)``) joins every row's softmax
  as a key with no value (gpt-oss): the running max and sum start from it
  (``common.softmax_start``), so the normalisation and the LSE include it and nothing else
  changes. The backward needs no flag: its probabilities come from this LSE.
- PAGED (with IS_VARLEN; 0 is off): K and V are paged caches ``(num_blocks, Hkv, block_size,
  D)``; key j of sequence b is row ``j % block_size`` of page ``BLOCK_TABLE[b, j // block_size]``,
  and ``CU_K`` gives only each sequence's number of keys (FlashAttention-2's paged varlen). 1:
  each key row finds its page (any block_size); 2: block_size is a multiple of BLOCK_N, so a tile
  is consecutive rows of one page, one lookup per tile; 3: as 1 for a power-of-two block_size
  (shifts, not divisions) with int32 row offsets (the launcher checks that the caches allow
  them). The base pointers stay at page 0. Pages are looked up a tile ahead of the loads that
  use them (``_fwd_kv_loop``).
- IS_VARLEN: packed variable-length batches (FlashAttention-2's varlen). Q and O are
  ``(total_q, H, D)``, K and V ``(total_k, Hkv, D)``, passed with batch stride 0; sequence b is
  rows ``[CU_Q[b], CU_Q[b+1])`` against rows ``[CU_K[b], CU_K[b+1])`` (int32 offsets). The
  prologue reads them, moves the base pointers to the sequence's first row and replaces
  ``seqlen_q``/``seqlen_k`` (the launcher's maxima, which only size the grid) by the sequence's
  own lengths; query blocks past its end return at once. Everything after the prologue (tile
  ranges, masks, softmax) sees one ordinary (Sq, Sk) problem, so later masks compose unchanged.
  EVEN_M/EVEN_N are False (lengths differ per sequence) and USE_TMA is False: descriptors
  zero-fill only at the end of the packed tensor, so a tile crossing a sequence end would read
  the next sequence's rows; masked pointer loads stop at the sequence end. The LSE is
  ``(H, total_q)``: batch stride 0, unit stride along the packed rows.
Later features join as more flags on the same kernel where they change only how base pointers
and lengths are found, as varlen does. Decoding from a (paged) KV cache divides the work
differently (few queries, split keys) and is its own kernel, ``kernels/decode.py``, built from the
same helpers.

Invariants. The head dim is contiguous (unit stride, guaranteed by the launcher): Triton 3.6 no
longer specialises integer arguments equal to 1, so a runtime last-dim stride would turn every tile
load into scalar 2-byte loads with no cp.async pipelining (measured: 3x slower on the H100).
Masked scores are -inf. A row that sees no key finishes with ``l = 0``: its output is
written as 0 and its LSE as -inf (never NaN); with HAS_SINKS as 0 and its sink. LSE is stored in
natural-log units, fp32, ``(B, H, Sq)`` with unit stride along Sq. Batch/head offsets are int64;
in-tile offsets are int32.
"""

import triton
import triton.language as tl

from flashcore.kernels.common import (
    alibi_slope,
    aligned,
    dot_nt,
    kv_tile_range,
    load_tile,
    mask_scores,
    online_softmax_step,
    page_lookup,
    page_row,
    program_tile,
    pv_finish,
    pv_start,
    softmax_start,
    store_tile,
    sum_dot,
    transform_scores,
)
from flashcore.kernels.varlen import seq_bounds


@triton.jit
def _fwd_kv_loop(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    tma_b,
    tma_h,
    offs_m,
    offs_n,
    offs_d,
    offs_dv,
    start_n,
    end_n,
    stride_kn,
    stride_vn,
    bt_row,
    block_size,
    num_blocks,
    stride_kb,
    stride_vb,
    seqlen_q,
    seqlen_k,
    qk_scale,
    window_left,
    window_right,
    softcap,
    slope,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EXP_E: tl.constexpr,
    USE_TMA: tl.constexpr,
    PAGED: tl.constexpr,
):
    """Visit key tiles ``[start_n, end_n)``; MASKED selects the masked-tail variant.

    ``k_base``/``v_base`` are scalar pointers at row ``start_n`` of this (batch, kv head); they
    advance by one tile per step and come back advanced, so the next range chains on. Tile pointers
    are rebuilt each step from them: carrying two (BLOCK_N, BLOCK_D) pointer tensors through the
    loop instead cost 128 registers per thread at 128x64x128 and made the kernel spill
    (docs/performance.md). With USE_TMA they are 4-D tensor descriptors instead, indexed by
    ``(tma_b, tma_h, tile_n, 0)``; the copy engine zero-fills rows past Sk and columns past D.
    """
    tile_k = offs_n[:, None] * stride_kn + offs_d[None, :]
    tile_v = offs_n[:, None] * stride_vn + offs_dv[None, :]
    if PAGED:
        # The first tile's pages, masked: an empty range may start past Sk. Later lookups stay
        # in the range, at most at its last tile (last_n).
        pages = page_lookup(
            bt_row, start_n, start_n + offs_n, seqlen_k, block_size, num_blocks, True, PAGED
        )
        last_n = start_n + tl.maximum(end_n - start_n - 1, 0) // BLOCK_N * BLOCK_N
    for tile_n in range(start_n, end_n, BLOCK_N):
        cols = tile_n + offs_n
        if USE_TMA:
            k = k_base.load([tma_b, tma_h, tile_n, 0]).reshape(BLOCK_N, BLOCK_D)
            v = v_base.load([tma_b, tma_h, tile_n, 0]).reshape(BLOCK_N, BLOCK_DV)
        elif PAGED:
            # Key j of the sequence is row j % block_size of page bt_row[j // block_size]; the
            # bases stay at this kv head of page 0. Full tiles lie inside Sk. The pages are
            # looked up a step ahead (the last step looks its own tile up again, never past the
            # range): no tile address waits on a load of its own step, and Triton pipelines
            # the tiles as the dense ones (three buffers at num_stages=3, a tile's copies in
            # flight across steps); with the lookup in the step it kept two buffers and waited
            # for every copy at the top of each step (TTGIR for sm_90).
            page = pages
            ahead = tl.minimum(tile_n + BLOCK_N, last_n)
            pages = page_lookup(
                bt_row, ahead, ahead + offs_n, seqlen_k, block_size, num_blocks, MASKED, PAGED
            )
            if PAGED != 3:
                # PAGED 3 offsets fit in int32 (the launcher checks the caches' extent).
                page = page.to(tl.int64)
            row = page_row(tile_n, cols, block_size, PAGED)
            k_ptrs = k_base + (page * stride_kb + row * stride_kn)[:, None] + offs_d[None, :]
            v_ptrs = v_base + (page * stride_vb + row * stride_vn)[:, None] + offs_dv[None, :]
            rows_even = EVEN_N or not MASKED
            k = load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, rows_even, EVEN_D)
            v = load_tile(v_ptrs, cols, seqlen_k, offs_dv, HEAD_DIM_V, rows_even, EVEN_DV)
        else:
            # Full tiles lie inside Sk by construction; only the masked tail can run past it.
            rows_even = EVEN_N or not MASKED
            k = load_tile(k_base + tile_k, cols, seqlen_k, offs_d, HEAD_DIM, rows_even, EVEN_D)
            v = load_tile(v_base + tile_v, cols, seqlen_k, offs_dv, HEAD_DIM_V, rows_even, EVEN_DV)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = dot_nt(q, k, DOT_PRECISION) * qk_scale
        s, _t = transform_scores(
            s, offs_m[:, None], cols[None, :], seqlen_q, seqlen_k, softcap, slope,
            SOFTCAP, HAS_ALIBI, k.dtype != tl.float32,
        )  # fmt: skip
        if MASKED:
            s = mask_scores(
                s, offs_m, cols, seqlen_q, seqlen_k, window_left, window_right,
                IS_CAUSAL, HAS_WINDOW, not EVEN_N,
            )  # fmt: skip
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i, MASKED, EXP_E)
        acc = sum_dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
        if not USE_TMA and not PAGED:
            k_base += BLOCK_N * stride_kn
            v_base += BLOCK_N * stride_vn
    return acc, m_i, l_i, k_base, v_base


@triton.jit
def attn_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    CU_Q,
    CU_K,
    ALIBI,
    SINKS,
    BLOCK_TABLE,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    stride_lb,
    stride_lh,
    stride_ab,
    stride_btb,
    block_size,
    num_blocks,
    num_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    total_q,
    total_k,
    qk_scale,
    window_left,
    window_right,
    softcap,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EXP_E: tl.constexpr,
    USE_TMA: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PAGED: tl.constexpr,
    ALIGN: tl.constexpr = 1,
):
    # Row strides of 16-byte multiples (common.aligned; a paged cache's are page, head, row).
    stride_qb, stride_qh, stride_qm = aligned(stride_qb, stride_qh, stride_qm, ALIGN)
    stride_kb, stride_kh, stride_kn = aligned(stride_kb, stride_kh, stride_kn, ALIGN)
    stride_vb, stride_vh, stride_vn = aligned(stride_vb, stride_vh, stride_vn, ALIGN)
    stride_ob, stride_oh, stride_om = aligned(stride_ob, stride_oh, stride_om, ALIGN)
    tile_m, off_bh = program_tile(tl.cdiv(seqlen_q, BLOCK_M), IS_CAUSAL)
    start_m = tile_m * BLOCK_M
    tma_b = off_bh // num_heads
    tma_h = off_bh % num_heads
    tma_hk = tma_h // kv_group
    off_b = tma_b.to(tl.int64)
    off_h = tma_h.to(tl.int64)
    off_hk = tma_hk.to(tl.int64)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    EVEN_DV: tl.constexpr = HEAD_DIM_V == BLOCK_DV
    if IS_VARLEN:
        # Packed sequences: batch b is rows [CU_Q[b], CU_Q[b+1]) of Q and O (and of the LSE's
        # last dim) and rows [CU_K[b], CU_K[b+1]) of K and V. Moving the bases to the first row
        # makes the rest of the kernel see one (Sq, Sk) problem; the batch strides are 0.
        tl.static_assert(not USE_TMA, "varlen reads through masked pointers, not descriptors")
        row_q, seqlen_q = seq_bounds(CU_Q, off_b, total_q)
        if PAGED:
            # Only the length counts (the keys are in pages), at most the row's capacity.
            _, seqlen_k = seq_bounds(CU_K, off_b, 2147483647)
            seqlen_k = tl.minimum(seqlen_k, total_k)
        else:
            row_k, seqlen_k = seq_bounds(CU_K, off_b, total_k)
        if start_m >= seqlen_q:
            return
        Q += row_q * stride_qm
        O += row_q * stride_om
        LSE += row_q
        if not PAGED:
            K += row_k * stride_kn
            V += row_k * stride_vn

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_tm = tl.arange(0, BLOCK_M)

    if USE_TMA:
        q = Q.load([tma_b, tma_h, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
        k_base = K
        v_base = V
    else:
        q_ptrs = (
            Q
            + off_b * stride_qb
            + off_h * stride_qh
            + start_m.to(tl.int64) * stride_qm
            + (offs_tm[:, None] * stride_qm + offs_d[None, :])
        )
        q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
        if PAGED:
            # Paged K/V (num_blocks, Hkv, block_size, D): the bases at this kv head of page 0.
            tl.static_assert(IS_VARLEN, "a paged cache comes with packed queries")
            k_base = K + off_hk * stride_kh
            v_base = V + off_hk * stride_vh
        else:
            k_base = K + off_b * stride_kb + off_hk * stride_kh
            v_base = V + off_b * stride_vb + off_hk * stride_vh
    bt_row = BLOCK_TABLE + off_b * stride_btb
    if UPCAST:
        q = q.to(tl.float32)

    m_i, l_i = softmax_start(SINKS, off_h, BLOCK_M, HAS_SINKS, EXP_E)
    acc, l_i = pv_start(l_i, BLOCK_M, BLOCK_DV, DOT_PRECISION)

    slope = alibi_slope(ALIBI, off_b, off_h, stride_ab, HAS_ALIBI, EXP_E)

    lo, full_lo, full_hi, hi = kv_tile_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
        IS_CAUSAL, HAS_WINDOW,
    )  # fmt: skip
    if HAS_WINDOW:
        # The window's left edge: skip the keys before it, mask the band that crosses it.
        if not USE_TMA and not PAGED:
            k_base += lo.to(tl.int64) * stride_kn
            v_base += lo.to(tl.int64) * stride_vn
        acc, m_i, l_i, k_base, v_base = _fwd_kv_loop(
            acc, m_i, l_i, q, k_base, v_base, tma_b, tma_hk, offs_m, offs_n, offs_d, offs_dv,
            lo, full_lo,
            stride_kn, stride_vn, bt_row, block_size, num_blocks, stride_kb, stride_vb, seqlen_q,
            seqlen_k,
            qk_scale, window_left, window_right,
            softcap, slope,
            HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, EVEN_D, EVEN_DV, IS_CAUSAL,
            HAS_WINDOW, SOFTCAP, HAS_ALIBI, True,
            EVEN_N, UPCAST, DOT_PRECISION, EXP_E, USE_TMA, PAGED,
        )  # fmt: skip
    acc, m_i, l_i, k_base, v_base = _fwd_kv_loop(
        acc, m_i, l_i, q, k_base, v_base, tma_b, tma_hk, offs_m, offs_n, offs_d, offs_dv,
        full_lo, full_hi,
        stride_kn, stride_vn, bt_row, block_size, num_blocks, stride_kb, stride_vb, seqlen_q,
        seqlen_k,
        qk_scale, window_left, window_right,
        softcap, slope,
        HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, EVEN_D, EVEN_DV, IS_CAUSAL, HAS_WINDOW,
        SOFTCAP, HAS_ALIBI, False,
        EVEN_N, UPCAST, DOT_PRECISION, EXP_E, USE_TMA, PAGED,
    )  # fmt: skip
    acc, m_i, l_i, k_base, v_base = _fwd_kv_loop(
        acc, m_i, l_i, q, k_base, v_base, tma_b, tma_hk, offs_m, offs_n, offs_d, offs_dv,
        full_hi, hi,
        stride_kn, stride_vn, bt_row, block_size, num_blocks, stride_kb, stride_vb, seqlen_q,
        seqlen_k,
        qk_scale, window_left, window_right,
        softcap, slope,
        HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, EVEN_D, EVEN_DV, IS_CAUSAL, HAS_WINDOW,
        SOFTCAP, HAS_ALIBI, True,
        EVEN_N, UPCAST, DOT_PRECISION, EXP_E, USE_TMA, PAGED,
    )  # fmt: skip

    acc, lse = pv_finish(acc, m_i, l_i, EXP_E)

    if USE_TMA:
        # The copy engine drops rows past Sq and columns past D.
        O.store([tma_b, tma_h, start_m, 0], acc.to(O.dtype).reshape(1, 1, BLOCK_M, BLOCK_DV))
    else:
        o_ptrs = (
            O
            + off_b * stride_ob
            + off_h * stride_oh
            + start_m.to(tl.int64) * stride_om
            + (offs_tm[:, None] * stride_om + offs_dv[None, :])
        )
        o = acc.to(O.dtype.element_ty)
        store_tile(o_ptrs, o, offs_m, seqlen_q, offs_dv, HEAD_DIM_V, EVEN_M, EVEN_DV)
    lse_ptrs = LSE + off_b * stride_lb + off_h * stride_lh + offs_m
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)
