"""FlashAttention-3-style forward for Hopper (sm_90a) in Gluon: warp-specialised, TMA, async wgmma.

Algorithm. The same online softmax as ``kernels/fwd.py`` (same flags, same LSE): ``S = Q K^T`` on
the tensor cores with fp32 accumulation, scores in log2 units (``qk_scale = scale * log2(e)``),
running max ``m`` and sum ``l`` in fp32, ``P`` cast to the input dtype for ``O += P V``; at the end
``out = O / l`` and ``lse = (m + log2(l)) * ln(2)``. Nothing Sq x Sk reaches memory.

Grid. 1-D, ``cdiv(Sq, BLOCK_M) * B * H`` programs of ``BLOCK_M = 64 * NUM_CONSUMERS`` query rows
(``program_tile``: the query tiles of one head are consecutive; causal hands them out last-first,
heaviest first). Query head h reads kv head ``h // kv_group``.

Schedule (one CTA, ``gl.warp_specialize``):
- Producer: one warp, 24 registers (``setmaxnreg.dec``). It issues, by TMA, each consumer's Q tile
  (``(1, 1, 64, D)`` block of the 4-D ``(B, H, Sq, D)`` descriptor) onto ``q_ready[c]``, then the
  K and V tiles of the key loop into a ring of NUM_STAGES shared-memory slots: for tile t it
  waits ``kv_empty[t % NUM_STAGES]`` (phase ``(t // NUM_STAGES) & 1 ^ 1``, so the first pass
  through the ring does not block), then loads K onto ``k_ready[slot]`` and V onto
  ``v_ready[slot]`` (each barrier armed with ``expect`` of the tile's bytes). The K/V descriptors
  are 4-D ``(B, Hkv, Sk, D)``: their extent ends at Sk, so rows past Sk arrive as zeros.
- Consumers: NUM_CONSUMERS warpgroups (the default partition and NUM_CONSUMERS - 1 workers, 240
  registers each with two consumers), each owning 64 query rows and the same key tiles. With P in
  registers (the A operand of the second wgmma), tile t's step is::

      wait k_ready[t]                     # K_t landed
      S_t  = wgmma(Q, K_t^T)   async      # group 1
      wait v_ready[t-1]
      O   += wgmma(P_{t-1}, V_{t-1}) async  # group 2, P from registers
      wgmma.wait_group 1                   # S_t done; P V still running
      mask / softcap / ALiBi, row max, exp2, row sum of tile t   <- overlaps P_{t-1} V_{t-1}
      wgmma.wait_group 0                   # P_{t-1} V_{t-1} done
      arrive kv_empty[t-1]                 # K_{t-1}, V_{t-1} free for the producer

  where ``O *= alpha_{t-1}`` and the conversion of ``P_{t-1}`` to the A-operand layout sit between
  the two issues, under ``Q K_t^T`` (with PINGPONG the turn wait and arrive bracket the issues).
  As written, each warpgroup's exponentials would run while its own second product is on
  the tensor cores. ptxas (Triton 3.6's) hoists ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` above them in
  SASS, so in the assembled code a warpgroup's softmax waits for its own ``P V``; the overlap
  that remains is between warpgroups (``tests/test_compile_hopper.py`` holds both facts,
  ``docs/hopper_fwd.md``). With PINGPONG, consumer c waits ``turn[c]`` before issuing its two
  products and arrives on ``turn[c + 1]`` after (consumer 0 holds the first turn), so the
  warpgroups take the tensor cores in turn. The loop is entered with tile 0's softmax done
  (prologue) and left with the last tile's ``P V`` issued in the epilogue. ``kv_empty`` counts
  NUM_CONSUMERS arrivals per phase.
- Epilogue, per consumer: ``O / l`` cast to the output dtype, written into this consumer's Q
  slot (its last reader, the final ``Q K^T``, has completed), ``fence.proxy.async``, one TMA
  store of the ``(1, 1, 64, D)`` block (the copy engine drops rows past Sq); the LSE row by row
  with masked stores.

Key tiles. ``kv_tile_range`` (the same split as ``kernels/common.py``) gives the tiles the CTA's
rows can see, ``[lo, hi)``, and the ones every row sees entirely, ``[full_lo, full_hi)``; all
consumers walk ``[lo, hi)`` (the producer loads each tile once), and a tile outside the full range
takes the masked path (a runtime branch on the score tile; no mask work on full tiles). A CTA with
no visible key writes zeros and -inf without touching K or V.

Flags (``gl.constexpr``, compiled away when off):
- IS_CAUSAL: bottom-right aligned causal mask (row i sees key j iff ``j <= i + Sk - Sq``).
- HAS_WINDOW: row i sees key j iff ``i + d - window_left <= j`` and (unless IS_CAUSAL)
  ``j <= i + d + window_right``, ``d = Sk - Sq``; an unbounded side arrives as ``Sq + Sk``.
- SOFTCAP: ``qk_scale`` is ``scale / c`` (natural units) and scores become ``tanh(s) * softcap``,
  ``softcap = c * log2(e)``: ``c * tanh(scale q.k / c)`` in log2 units.
- HAS_ALIBI: adds ``-slope * log2(e) * |i + d - j|``; slope read from ``ALIBI + b * stride_ab + h``.
- RAW_MAX: no softcap or ALiBi and ``qk_scale > 0``: the row max is taken on the raw products
  and ``p = exp2(s * qk_scale - m * qk_scale)`` is one FMA and one ex2 per score.
- EVEN_N: Sk is a multiple of BLOCK_N, so tail tiles need no ``j < Sk`` mask.

Invariants. The head dim is contiguous and every descriptor stride is 16-byte aligned (launcher).
Masked scores are -inf; a row whose keys are all hidden so far keeps ``m = -inf`` with ``p = 0``
(the max is replaced by 0 before the exp2), so it ends with ``l = 0``: out 0, LSE -inf, never NaN.
LSE is natural-log, fp32, ``(B, H, Sq)`` with unit stride along Sq. Offsets that can pass 2**31
(the LSE's batch/head offsets) are int64.
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

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one m64 wgmma)


@gluon.jit
def kv_tile_range(
    start_m,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
):
    """``(lo, full_lo, full_hi, hi)``: key tiles of rows ``[start_m, start_m + BLOCK_M)``, as
    ``kernels/common.py:kv_tile_range`` (tiles in ``[full_lo, full_hi)`` need no mask)."""
    diag = seqlen_k - seqlen_q
    if IS_CAUSAL:
        hi = gl.minimum(seqlen_k, gl.maximum(start_m + BLOCK_M + diag, 0))
        full_hi = (gl.maximum(start_m + diag + 1, 0) // BLOCK_N) * BLOCK_N
    elif HAS_WINDOW:
        hi = gl.minimum(seqlen_k, gl.maximum(start_m + BLOCK_M + diag + window_right, 0))
        edge = gl.minimum(gl.maximum(start_m + diag + window_right + 1, 0), seqlen_k)
        full_hi = (edge // BLOCK_N) * BLOCK_N
    else:
        hi = seqlen_k
        full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        lo = (gl.maximum(start_m + diag - window_left, 0) // BLOCK_N) * BLOCK_N
        last = gl.maximum(start_m + BLOCK_M - 1 + diag - window_left, 0)
        full_lo = gl.minimum(((last + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, hi)
        lo = gl.minimum(lo, full_lo)
        full_hi = gl.maximum(full_hi, full_lo)
    else:
        lo = 0
        full_lo = 0
    return lo, full_lo, full_hi, hi


@gluon.jit
def tanh(x):
    """fp32 tanh from exp2 alone, the formula of ``kernels/common.py:tanh`` (Cephes' tanhf: an odd
    polynomial below |x| = 0.625, ``1 - 2 / (exp(2|x|) + 1)`` above)."""
    ax = gl.abs(x)
    z = x * x
    poly = -5.70498872745e-3 * z + 2.06390887954e-2
    poly = poly * z - 5.37397155531e-2
    poly = poly * z + 1.33314422036e-1
    poly = poly * z - 3.33332819422e-1
    small = poly * z * x + x
    big = 1.0 - 2.0 / (gl.exp2(ax * (2.0 * LOG2E)) + 1.0)
    big = gl.where(x < 0, -big, big)
    return gl.where(ax < 0.625, small, big)


@gluon.jit
def _program(n_tiles, REVERSE: gl.constexpr):
    """``(tile, off_bh)`` on a 1-D grid of ``n_tiles * B * H`` programs, as
    ``common.program_tile``."""
    pid = gl.program_id(0)
    off_bh = pid // n_tiles
    tile = pid % n_tiles
    if REVERSE:
        tile = n_tiles - 1 - tile
    return tile, off_bh


@gluon.jit
def _producer(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    k_smem,
    v_smem,
    q_ready,
    k_ready,
    v_ready,
    kv_empty,
    num_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
):
    tile_m, off_bh = _program(gl.cdiv(seqlen_q, BLOCK_M), IS_CAUSAL)
    start_m = tile_m * BLOCK_M
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    off_hk = off_h // kv_group
    lo, _, _, hi = kv_tile_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
        IS_CAUSAL, HAS_WINDOW,
    )  # fmt: skip
    if hi > lo:
        for c in gl.static_range(NUM_CONSUMERS):
            bar = q_ready.index(c)
            mbarrier.expect(bar, q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                q_desc, [off_b, off_h, start_m + c * ROWS, 0], bar, q_smem.index(c)
            )
        n_tiles = gl.cdiv(hi - lo, BLOCK_N)
        for t in range(n_tiles):
            slot = t % NUM_STAGES
            phase = (t // NUM_STAGES) & 1
            mbarrier.wait(kv_empty.index(slot), phase ^ 1)
            start_n = lo + t * BLOCK_N
            kbar = k_ready.index(slot)
            mbarrier.expect(kbar, k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                k_desc, [off_b, off_hk, start_n, 0], kbar, k_smem.index(slot)
            )
            vbar = v_ready.index(slot)
            mbarrier.expect(vbar, v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                v_desc, [off_b, off_hk, start_n, 0], vbar, v_smem.index(slot)
            )


@gluon.jit
def _scores(
    s,
    rows,
    cols,
    seqlen_q,
    seqlen_k,
    qk_scale,
    window_left,
    window_right,
    softcap,
    slope,
    MASKED: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    RAW_MAX: gl.constexpr,
    CHECK_N: gl.constexpr,
):
    """Scores of one tile in the softmax's units: raw ``q.k`` with RAW_MAX (the scale is folded
    into the exp2), else ``qk_scale * q.k`` in log2 units after softcap and ALiBi; -inf where
    masked (MASKED: keys past Sk, causal future, outside the window)."""
    if not RAW_MAX:
        s = s * qk_scale
        if SOFTCAP:
            s = tanh(s) * softcap
        if HAS_ALIBI:
            dist = rows + (seqlen_k - seqlen_q) - cols
            s = s - slope * gl.abs(dist).to(gl.float32)
    if MASKED:
        if CHECK_N:
            s = gl.where(cols < seqlen_k, s, float("-inf"))
        if IS_CAUSAL:
            s = gl.where(cols <= rows + (seqlen_k - seqlen_q), s, float("-inf"))
        if HAS_WINDOW:
            s = gl.where(cols >= rows + (seqlen_k - seqlen_q - window_left), s, float("-inf"))
            if not IS_CAUSAL:
                s = gl.where(cols <= rows + (seqlen_k - seqlen_q + window_right), s, float("-inf"))
    return s


@gluon.jit
def _tile_scores(
    s,
    start_n,
    full_lo,
    full_hi,
    rows,
    offs_n,
    seqlen_q,
    seqlen_k,
    qk_scale,
    window_left,
    window_right,
    softcap,
    slope,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    RAW_MAX: gl.constexpr,
    CHECK_N: gl.constexpr,
):
    """``_scores`` of the tile at key ``start_n``: masked unless it lies in the full range."""
    cols = gl.expand_dims(start_n + offs_n, 0)
    if (start_n < full_lo) | (start_n >= full_hi):
        s = _scores(
            s, rows, cols, seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap,
            slope, True, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, RAW_MAX, CHECK_N,
        )  # fmt: skip
    else:
        s = _scores(
            s, rows, cols, seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap,
            slope, False, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, RAW_MAX, CHECK_N,
        )  # fmt: skip
    return s


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, RAW_MAX: gl.constexpr):
    """One online-softmax step on a score tile: ``(p, alpha, m, l)``. A row with every score
    -inf so far keeps ``m = -inf`` and gets ``p = 0``, ``alpha = 0`` (its max is replaced by 0)."""
    m_new = gl.maximum(m_i, gl.max(s, 1))
    if RAW_MAX:
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
        p = gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(m_ref, 1)))
        alpha = gl.exp2(m_i * qk_scale - m_ref)
    else:
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_ref, 1))
        alpha = gl.exp2(m_i - m_ref)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _consumer(
    o_desc,
    q_smem,
    k_smem,
    v_smem,
    q_ready,
    k_ready,
    v_ready,
    kv_empty,
    turn,
    LSE,
    ALIBI,
    stride_lb,
    stride_lh,
    stride_ab,
    num_heads,
    seqlen_q,
    seqlen_k,
    qk_scale,
    window_left,
    window_right,
    softcap,
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
    RAW_MAX: gl.constexpr,
    EVEN_N: gl.constexpr,
):
    dtype: gl.constexpr = o_desc.dtype
    NEXT: gl.constexpr = (CONSUMER + 1) % NUM_CONSUMERS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    tile_m, off_bh = _program(gl.cdiv(seqlen_q, BLOCK_M), IS_CAUSAL)
    start_m = tile_m * BLOCK_M
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    row0 = start_m + CONSUMER * ROWS
    rows = gl.expand_dims(row0 + gl.arange(0, ROWS, layout=row_layout), 1)
    offs_n = gl.arange(0, BLOCK_N, layout=col_layout)
    lo, full_lo, full_hi, hi = kv_tile_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
        IS_CAUSAL, HAS_WINDOW,
    )  # fmt: skip
    if HAS_ALIBI:
        slope = gl.load(ALIBI + off_b.to(gl.int64) * stride_ab + off_h) * LOG2E
    else:
        slope = 0.0

    q_tile = q_smem.index(CONSUMER)
    q = q_tile.reshape([ROWS, HEAD_DIM])
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    CHECK_N: gl.constexpr = not EVEN_N

    if hi > lo:
        n_tiles = gl.cdiv(hi - lo, BLOCK_N)
        mbarrier.wait(q_ready.index(CONSUMER), 0)
        # Prologue: tile 0's scores and softmax (one turn on the tensor cores).
        mbarrier.wait(k_ready.index(0), 0)
        if PINGPONG:
            mbarrier.wait(turn.index(CONSUMER), 0)
        k_t = k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
        s_tok = warpgroup_mma(q, k_t, zero_s, use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(NEXT), count=1)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        s = _tile_scores(
            s, lo, full_lo, full_hi, rows, offs_n, seqlen_q, seqlen_k, qk_scale, window_left,
            window_right, softcap, slope, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, RAW_MAX,
            CHECK_N,
        )  # fmt: skip
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, RAW_MAX)

        for t in range(1, n_tiles):
            slot = t % NUM_STAGES
            prev = (t - 1) % NUM_STAGES
            mbarrier.wait(k_ready.index(slot), (t // NUM_STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(CONSUMER), t & 1)
            k_t = k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
            s_tok = warpgroup_mma(q, k_t, zero_s, use_acc=False, is_async=True)
            # While Q K_t^T runs: rescale O by the previous step's alpha, P to the A operand.
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(v_ready.index(prev), ((t - 1) // NUM_STAGES) & 1)
            v_t = v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM])
            acc_tok = warpgroup_mma(p_op, v_t, acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(NEXT), count=1)
            s = warpgroup_mma_wait(1, deps=[s_tok])
            s = _tile_scores(
                s, lo + t * BLOCK_N, full_lo, full_hi, rows, offs_n, seqlen_q, seqlen_k,
                qk_scale, window_left, window_right, softcap, slope, IS_CAUSAL, HAS_WINDOW,
                SOFTCAP, HAS_ALIBI, RAW_MAX, CHECK_N,
            )  # fmt: skip
            # Tile t's softmax runs while P_{t-1} V_{t-1} is on the tensor cores.
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, RAW_MAX)
            acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])
            mbarrier.arrive(kv_empty.index(prev), count=1)

        # Epilogue: the last tile's P V.
        last = (n_tiles - 1) % NUM_STAGES
        mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // NUM_STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(CONSUMER), n_tiles & 1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        v_t = v_smem.index(last).reshape([BLOCK_N, HEAD_DIM])
        acc_tok = warpgroup_mma(p_op, v_t, acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(NEXT), count=1)
        acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])
        mbarrier.arrive(kv_empty.index(last), count=1)

    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    acc = acc / gl.expand_dims(gl.convert_layout(l_safe, orow_layout), 1)
    if RAW_MAX:
        m_out = m_i * qk_scale
    else:
        m_out = m_i
    lse = gl.where(empty, float("-inf"), (m_out + gl.log2(l_safe)) * LN2)

    # Q's slot is free: its last reader, the final Q K^T, completed above.
    q.store(acc.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [off_b, off_h, row0, 0], q_tile)
    offs_m = row0 + gl.arange(0, ROWS, layout=row_layout)
    lse_ptrs = LSE + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + offs_m
    gl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)
    tma.store_wait(0)


@gluon.jit
def attn_fwd_sm90_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    LSE,
    ALIBI,
    stride_lb,
    stride_lh,
    stride_ab,
    num_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
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
    RAW_MAX: gl.constexpr,
    EVEN_N: gl.constexpr,
):
    BLOCK_M: gl.constexpr = ROWS * NUM_CONSUMERS
    dtype: gl.constexpr = q_desc.dtype
    # Buffers are [slots, 1, 1, rows, D]: one 4-D TMA block per slot (Gluon 3.6 has no starred
    # list in a kernel, hence the concatenation).
    q_shape: gl.constexpr = [NUM_CONSUMERS] + q_desc.block_type.shape  # noqa: RUF005
    kv_shape: gl.constexpr = [NUM_STAGES] + k_desc.block_type.shape  # noqa: RUF005
    q_smem = gl.allocate_shared_memory(dtype, q_shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, kv_shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, kv_shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_ready.index(c), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=NUM_CONSUMERS)
    # Ping-pong: consumer c issues its products after waiting turn[c] and passes the turn on to
    # c + 1 once they are issued; consumer 0 holds the first turn.
    turn = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(turn.index(c), count=1)
    if PINGPONG:
        mbarrier.arrive(turn.index(0), count=1)

    # Argument tuples spelled out per partition: a tuple built by concatenation inside the kernel
    # turns its constexprs into tensors (Triton 3.6).
    gl.static_assert(NUM_CONSUMERS == 2, "two consumer warpgroups (three spilled at D=64)")
    gl.warp_specialize(
        [
            (_consumer, (
                o_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turn,
                LSE, ALIBI, stride_lb, stride_lh, stride_ab, num_heads, seqlen_q, seqlen_k,
                qk_scale, window_left, window_right, softcap, 0, NUM_CONSUMERS, PINGPONG,
                HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP,
                HAS_ALIBI, RAW_MAX, EVEN_N,
            )),
            (_consumer, (
                o_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turn,
                LSE, ALIBI, stride_lb, stride_lh, stride_ab, num_heads, seqlen_q, seqlen_k,
                qk_scale, window_left, window_right, softcap, 1, NUM_CONSUMERS, PINGPONG,
                HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP,
                HAS_ALIBI, RAW_MAX, EVEN_N,
            )),
            (_producer, (
                q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
                kv_empty, num_heads, kv_group, seqlen_q, seqlen_k, window_left, window_right,
                BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL, HAS_WINDOW,
            )),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )  # fmt: skip
