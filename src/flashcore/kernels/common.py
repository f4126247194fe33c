"""Small ``@triton.jit`` helpers shared by every portable kernel (forward, backward, decode) and
the debug probe.

Each helper owns one concern so that a bug shows in one place and the probe kernel
(``flashcore.debug``) can run the very same code on its own:

- ``load_tile``: a (rows, BLOCK_D) tile, masked only where constexpr flags say an edge is ragged.
- ``kv_tile_range``: which key tiles a block of query rows visits, split into a masked head (the
  sliding window's left edge), an unmasked middle and a masked tail (causal diagonal, window's
  right edge, ragged end of Sk); the decode kernel's rows are its queries' positions too.
- ``q_tile_range``: its mirror for the backward's dK/dV kernel: which query tiles see a key block.
- ``mask_by_index``: -inf where a key is out of range or hidden by the causal mask or the sliding
  window, for index tensors in either orientation (the decode kernel calls it directly);
  ``mask_scores`` / ``mask_scores_t`` apply it to a (queries, keys) tile or its transpose.
- ``transform_scores``: softcap (``c * tanh(s / c)``) and ALiBi (``-slope * |i + Sk - Sq - j|``),
  on every tile; ``tanh`` is a portable fp32 tanh, ``tanh_16bit`` the cheaper one fp16/bf16 tiles
  take.
- ``alibi_slope``: a head's ALiBi slope in the scores' units.
- ``page_lookup`` / ``page_row`` / ``paged_rows``: where a key tile lies in a paged cache (page
  and row of each key).
- ``softmax_start``: the running max and sum before the first key tile (a sink logit, if any).
- ``online_softmax_step``: one step of the streaming softmax in base 2 (base e with EXP_E).
- ``row_lse``: the natural-log logsumexp of a finished row, -inf for a row that saw no key.
- ``load_lse2`` / ``load_row_stats``: the backward's per-row LSE (converted to base 2) and delta.
- ``program_tile``: which (tile, batch x head) a program of a 1-D grid owns.
- ``dot_nt``: ``a @ b^T`` for the score-like products (Q K^T and dO V^T), widened for fp32 inputs.

Conventions: scores arrive in log2 units (``scale * log2(e)`` folded into one multiply by the host,
``ops/problem.py``; natural units with EXP_E), a masked
score is ``-inf`` (never a large finite number, so a row that sees no key ends with l = 0 exactly),
and all softmax state (m, l) is fp32.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

LN2 = tl.constexpr(0.6931471805599453)

# A tl.constexpr instance: Triton 3.6 compiles only module globals that are constexpr objects.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def aligned(b, h, m, ALIGN: tl.constexpr):
    """A tensor's batch, head and row strides, declared multiples of ``ALIGN`` elements when
    ALIGN > 1 (the launcher checked them: ``ops.problem.stride_align``). Triton specialises an
    integer argument only on divisibility by 16, so rows of a head dim such as 56 (a 112-byte row
    stride) would otherwise be read one element at a time. Written as ``x // ALIGN * ALIGN``
    (the same value), which the compiler's alignment analysis reads as a multiple of ALIGN:
    ``tl.multiple_of`` on a kernel argument is dropped (Triton 3.6)."""
    if ALIGN > 1:
        b = b // ALIGN * ALIGN
        h = h // ALIGN * ALIGN
        m = m // ALIGN * ALIGN
    return b, h, m


@triton.jit
def load_tile(
    ptrs,
    offs_r,
    n_rows,
    offs_d,
    HEAD_DIM: tl.constexpr,
    EVEN_R: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """Load a (R, BLOCK_D) tile; rows >= n_rows and columns >= HEAD_DIM read as 0."""
    if EVEN_R:
        if EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        if EVEN_D:
            tile = tl.load(ptrs, mask=offs_r[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(
                ptrs, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0
            )
    return tile


@triton.jit
def store_tile(
    ptrs,
    tile,
    offs_r,
    n_rows,
    offs_d,
    HEAD_DIM: tl.constexpr,
    EVEN_R: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """Store a (R, BLOCK_D) tile, skipping rows >= n_rows and columns >= HEAD_DIM."""
    if EVEN_R:
        if EVEN_D:
            tl.store(ptrs, tile)
        else:
            tl.store(ptrs, tile, mask=offs_d[None, :] < HEAD_DIM)
    else:
        if EVEN_D:
            tl.store(ptrs, tile, mask=offs_r[:, None] < n_rows)
        else:
            tl.store(ptrs, tile, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def kv_tile_range(
    start_m,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    block_m,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Key tiles that query rows ``[start_m, start_m + block_m)`` can see, in three parts.

    Returns ``(lo, full_lo, full_hi, hi)``, multiples of BLOCK_N except ``hi``: tiles starting in
    ``[lo, full_lo)`` cross the window's left edge and need ``mask_scores``; tiles in
    ``[full_lo, full_hi)`` are complete and visible to every row of the block (no mask work);
    tiles in ``[full_hi, hi)`` cross the causal diagonal or the window's right edge, or run past
    Sk, and need ``mask_scores``. Keys before ``lo`` and from ``hi`` on are seen by no row.

    Visibility is bottom-right aligned (``d = seqlen_k - seqlen_q``): causal, row i sees key j iff
    ``j <= i + d``; with HAS_WINDOW also iff ``i + d - window_left <= j`` and (unless causal)
    ``j <= i + d + window_right``. The launcher passes an unbounded side as a value of at least
    ``seqlen_q + seqlen_k``. Without HAS_WINDOW ``lo = full_lo = 0`` (compile-time), and the
    ranges are exactly the causal/full ones. ``block_m`` is the tile's BLOCK_M, or for the decode
    kernel (whose rows pack the query heads of a kv head) the number of queries in its tile.
    """
    diag = seqlen_k - seqlen_q
    if IS_CAUSAL:
        hi = tl.minimum(seqlen_k, tl.maximum(start_m + block_m + diag, 0))
        # The first row of the block sees keys [0, start_m + diag]; every later row sees more.
        full_hi = (tl.maximum(start_m + diag + 1, 0) // BLOCK_N) * BLOCK_N
    elif HAS_WINDOW:
        # The right edge as the causal diagonal, shifted by window_right (and capped by Sk).
        hi = tl.minimum(seqlen_k, tl.maximum(start_m + block_m + diag + window_right, 0))
        edge = tl.minimum(tl.maximum(start_m + diag + window_right + 1, 0), seqlen_k)
        full_hi = (edge // BLOCK_N) * BLOCK_N
    else:
        hi = seqlen_k
        full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        # The first row of the block sees keys from start_m + d - window_left on, the last row
        # (padding rows included: a little more masking than needed) from block_m - 1 later.
        lo = (tl.maximum(start_m + diag - window_left, 0) // BLOCK_N) * BLOCK_N
        last = tl.maximum(start_m + block_m - 1 + diag - window_left, 0)
        full_lo = tl.minimum(((last + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, hi)
        # Narrow windows: no full tile, the two masked parts meet. Keep the parts ordered, as the
        # loops chain their pointers from one part to the next.
        lo = tl.minimum(lo, full_lo)
        full_hi = tl.maximum(full_hi, full_lo)
    else:
        lo = 0
        full_lo = 0
    return lo, full_lo, full_hi, hi


@triton.jit
def q_tile_range(
    start_n,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Query rows that can see keys ``[start_n, start_n + BLOCK_N)``, in three parts.

    The mirror of ``kv_tile_range``, for programs that own a key block. Returns
    ``(lo, mid, full_hi, hi)``: query tiles starting in ``[lo, mid)`` cross the causal diagonal
    (or the window's right edge) and need ``mask_scores``; tiles in ``[mid, full_hi)`` see every
    key of the block (no mask work); tiles in ``[full_hi, hi)`` cross the window's left edge and
    need masking again; rows outside ``[lo, hi)`` see none of the block. ``lo``, ``mid`` and
    ``full_hi`` are multiples of BLOCK_M or equal to ``hi <= seqlen_q``. Row i sees key j iff
    ``j - d - right <= i <= j - d + window_left`` (``d = seqlen_k - seqlen_q``, right = 0 when
    causal), so later rows see more on the right edge and less on the left. Without HAS_WINDOW
    ``full_hi = hi = seqlen_q``. Neither rows past seqlen_q nor keys past seqlen_k are masked here:
    the caller makes padded rows contribute nothing (``load_row_stats``) and never stores the rows
    of padded keys.
    """
    diag = seqlen_k - seqlen_q
    if IS_CAUSAL:
        # The block's first key is seen from row start_n - diag on, its last from
        # start_n + BLOCK_N - 1 - diag on (a ragged last block is masked a little more than needed).
        lo = (tl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M
        full = (tl.maximum(start_n + BLOCK_N - 1 - diag + BLOCK_M - 1, 0) // BLOCK_M) * BLOCK_M
    elif HAS_WINDOW:
        lo = (tl.maximum(start_n - diag - window_right, 0) // BLOCK_M) * BLOCK_M
        last = start_n + BLOCK_N - 1 - diag - window_right
        full = (tl.maximum(last + BLOCK_M - 1, 0) // BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        # The block's last key is seen up to row start_n + BLOCK_N - 1 - diag + window_left, its
        # first up to start_n - diag + window_left.
        hi = tl.minimum(seqlen_q, tl.maximum(start_n + BLOCK_N - diag + window_left, 0))
    else:
        hi = seqlen_q
    if IS_CAUSAL or HAS_WINDOW:
        mid = tl.minimum(full, hi)
        lo = tl.minimum(lo, mid)
    else:
        # Compile-time zeros: the masked loop over [lo, mid) disappears.
        lo = 0
        mid = 0
    if HAS_WINDOW:
        full_hi = (tl.maximum(start_n - diag + window_left + 1, 0) // BLOCK_M) * BLOCK_M
        full_hi = tl.maximum(tl.minimum(full_hi, hi), mid)
    else:
        full_hi = hi
    return lo, mid, full_hi, hi


@triton.jit
def mask_by_index(
    s,
    rows,
    cols,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    CHECK_N: tl.constexpr,
):
    """-inf where query ``rows`` may not see key ``cols`` (keys past seqlen_k; causal future;
    outside the sliding window ``[i + d - window_left, i + d + window_right]``, d = Sk - Sq).

    ``rows`` and ``cols`` are index tensors that broadcast against ``s`` in either orientation
    (queries along dim 0 or dim 1): the one place that decides visibility, for every kernel.
    """
    if CHECK_N:
        s = tl.where(cols < seqlen_k, s, float("-inf"))
    if IS_CAUSAL:
        s = tl.where(cols <= rows + (seqlen_k - seqlen_q), s, float("-inf"))
    if HAS_WINDOW:
        s = tl.where(cols >= rows + (seqlen_k - seqlen_q - window_left), s, float("-inf"))
        if not IS_CAUSAL:
            s = tl.where(cols <= rows + (seqlen_k - seqlen_q + window_right), s, float("-inf"))
    return s


@triton.jit
def mask_scores(
    s,
    offs_m,
    offs_n,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    CHECK_N: tl.constexpr,
):
    """Set scores of keys a row may not see to -inf on a (BLOCK_M, BLOCK_N) tile (rows: queries)."""
    return mask_by_index(
        s, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left, window_right,
        IS_CAUSAL, HAS_WINDOW, CHECK_N,
    )  # fmt: skip


@triton.jit
def mask_scores_t(
    st,
    offs_n,
    offs_m,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    CHECK_N: tl.constexpr,
):
    """``mask_scores`` on a transposed (BLOCK_N, BLOCK_M) tile (rows: keys), as the dK/dV kernel
    computes ``S^T = K Q^T`` so that K, V stay the register operand of its products."""
    return mask_by_index(
        st, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, window_left, window_right,
        IS_CAUSAL, HAS_WINDOW, CHECK_N,
    )  # fmt: skip


@triton.jit
def tanh(x):
    """``tanh(x)`` in fp32 to a few ulp from ``exp2`` alone (the interpreter has no libdevice).

    Cephes' tanhf: an odd polynomial below |x| = 0.625, where ``1 - 2 / (exp(2|x|) + 1)`` would
    lose the low bits of small results to cancellation (10x PyTorch's fp32 error on softcapped
    scores with c = 50), and that formula above, which saturates to exactly +-1 when exp overflows.
    """
    ax = tl.abs(x)
    z = x * x
    poly = -5.70498872745e-3 * z + 2.06390887954e-2
    poly = poly * z - 5.37397155531e-2
    poly = poly * z + 1.33314422036e-1
    poly = poly * z - 3.33332819422e-1
    small = poly * z * x + x
    big = 1.0 - 2.0 / (tl.math.exp2(ax * (2.0 * LOG2E)) + 1.0)
    big = tl.where(x < 0, -big, big)
    return tl.where(ax < 0.625, small, big)


@triton.jit
def tanh_16bit(x):
    """``tanh(x)`` for the softcap of fp16/bf16 problems: ``1 - 2 / (2^(2 x log2 e) + 1)`` with an
    approximate division, about 1e-7 absolute error everywhere, which ``c * tanh`` needs where its
    exponential is relative to it (the relative error of small results, which ``tanh`` keeps to a
    few ulp for fp32 problems, is far below a 16-bit input's rounding). Five instructions against
    about twenty-five; as ``kernels/hopper/common.py: tanh``."""
    return 1.0 - tl.fdiv(2.0, tl.math.exp2(x * (2.0 * LOG2E)) + 1.0, ieee_rounding=False)


@triton.jit
def transform_scores(
    s,
    rows,
    cols,
    seqlen_q,
    seqlen_k,
    softcap,
    slope,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    TANH_16BIT: tl.constexpr = False,
):
    """Softcap, then ALiBi, on scores ``s`` in the kernel's units (log2, or natural with EXP_E).

    With SOFTCAP ``s`` arrives as ``scale * q.k / c`` (``1 / c`` is folded into the scale) and
    leaves as ``tanh(s) * softcap``, where ``softcap`` is ``c`` in the scores' units
    (``c * log2(e)`` for base 2). ALiBi adds ``-slope * |i + Sk - Sq - j|``, ``slope`` again in the
    scores' units. ``rows``/``cols`` broadcast as in ``mask_by_index``. Applied on every tile, full
    or masked, before the mask; the identity when both flags are off.

    Returns ``(s, t)``: the transformed scores and ``t = tanh(.)``, which the backward needs for
    the softcap's derivative ``1 - t^2`` (``t`` is unused, and compiled away, elsewhere).
    TANH_16BIT (the callers pass whether the tiles are fp16/bf16): ``tanh_16bit`` for ``tanh``.
    """
    t = s
    if SOFTCAP:
        if TANH_16BIT:
            t = tanh_16bit(s)
        else:
            t = tanh(s)
        s = t * softcap
    if HAS_ALIBI:
        # In fp32 from the row and column vectors (exact below 2^24 positions): a subtraction and
        # an FMA a score, where the integer distance took a conversion too.
        dist = (rows + (seqlen_k - seqlen_q)).to(tl.float32) - cols.to(tl.float32)
        s = s - slope * tl.abs(dist)
    return s, t


@triton.jit
def softmax_exp(x, EXP_E: tl.constexpr):
    """``exp2(x)`` on base-2 scores; with EXP_E, an exact (to an ulp) ``exp(x)`` on natural ones:
    libdevice's on the GPU (EXP_E 1), numpy's in the interpreter (EXP_E 2: ``tl.exp``, as the
    interpreter has no libdevice; compiled, ``tl.exp`` is ``ex2.approx`` of a scaled argument).

    EXP_E is the fp32 path: on the GPU ``ex2.approx`` (about 2 ulp) plus the rounding of the folded
    ``scale * log2(e)`` put fp32 outputs ~5x further from float64 than PyTorch's fp32 math (seen
    on the H100 at Sq=1, Sk=17, D=80), outside FlashAttention's error rule. In the interpreter
    base 2 was exact enough for the forward, but the backward's ``lse * log2(e)`` (the stored LSE
    is natural) put a row's exponent an ulp of its scores off the forward's: dV of one key seen
    by 1803 rows under ALiBi 6.5-14x outside the rule, and softcap's scores near their cap, 2 seeds
    in 40, just outside it. Half-precision inputs never see the difference.
    """
    if EXP_E == 2:
        return tl.exp(x)
    elif EXP_E:
        return libdevice.exp(x)
    else:
        return tl.math.exp2(x)


@triton.jit
def row_lse(m_i, l_i, EXP_E: tl.constexpr):
    """Natural-log logsumexp from the running max (in the scores' base) and sum; -inf if l = 0."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if EXP_E:
        lse = m_i + tl.log(l_safe)
    else:
        lse = (m_i + tl.math.log2(l_safe)) * LN2
    return tl.where(empty, float("-inf"), lse)


@triton.jit
def page_lookup(
    bt_row, tile_n, cols, seqlen, block_size, num_blocks, MASKED: tl.constexpr, PAGED: tl.constexpr
):
    """Pages of key tile ``cols`` (starting at ``tile_n``) in a paged cache, 32-bit: key j is row
    ``j % block_size`` (``page_row``) of page ``bt_row[j // block_size]``.

    PAGED 2 (block_size a multiple of the tile): one lookup for the tile, a scalar (``tile_n`` a
    multiple of the tile, as the key loops' starts are). PAGED 1: a lookup per key. PAGED 3
    (block_size a power of two): a lookup per key too, indexed by a shift where PAGED 1 divides
    (a signed division by the runtime block_size is ~15 instructions a key row on sm_90: 16-key
    pages in 64-key tiles took 790 instructions a step of the key loop with PAGED 1, 477 with
    PAGED 3, 400 dense; tests/sm90_compile.py). MASKED: keys from ``seqlen`` on (PAGED 2: a
    tile starting there) read page 0, not the table; unmasked, every key of the tile must be
    below ``seqlen``. Entries are clamped to
    ``[0, num_blocks)`` here, compared as unsigned numbers (a negative one becomes the last page):
    a bad one reads another page of the cache (wrong numbers for its own sequence), never memory
    outside it. (A signed clamp a key row, a maximum and a minimum, once made the paged decode
    variant spill on sm_90; the unsigned select compiles spill-free, tests/test_compile_sm90.py.)
    """
    if PAGED == 2:
        if MASKED:
            page = tl.load(bt_row + tile_n // block_size, mask=tile_n < seqlen, other=0)
        else:
            page = tl.load(bt_row + tile_n // block_size)
        page = tl.minimum(page.to(tl.uint32), num_blocks - 1)
    else:
        if PAGED == 3:
            # log2(block_size): the exponent of a power of two's float, exact.
            shift = (block_size.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
            idx = cols >> shift
        else:
            idx = cols // block_size
        if MASKED:
            page = tl.load(bt_row + idx, mask=cols < seqlen, other=0)
        else:
            page = tl.load(bt_row + idx)
        # The same clamp as a select: the minimum's form made ptxas of Triton 3.8 spill 8 bytes
        # in the plain fp16 decode build (tests/test_compile_sm90.py); this one compiles
        # spill-free with 3.6's and 3.8's.
        page = tl.where(page.to(tl.uint32) < num_blocks, page, num_blocks - 1)
    return page


@triton.jit
def page_row(tile_n, cols, block_size, PAGED: tl.constexpr):
    """Row of each key of tile ``cols`` within its page (``page_lookup``'s PAGED)."""
    if PAGED == 2:
        row = tile_n % block_size + (cols - tile_n)
    elif PAGED == 3:
        row = cols & (block_size - 1)  # a power of two (page_lookup)
    else:
        row = cols % block_size
    return row


@triton.jit
def paged_rows(
    bt_row, tile_n, cols, seqlen, block_size, num_blocks, MASKED: tl.constexpr, PAGED: tl.constexpr
):
    """``(page, row)`` of key tile ``cols`` (starting at ``tile_n``) in a paged cache, ``page``
    int64, so that a key row's offset is ``page * stride_page + row * stride_row``: the page
    (``page_lookup``; a scalar for PAGED 2, whose ``tile_n`` is below ``seqlen`` in every tile
    the kernels visit, so its lookup is never masked) and the row within it (``page_row``)."""
    page = page_lookup(
        bt_row, tile_n, cols, seqlen, block_size, num_blocks, MASKED and PAGED != 2, PAGED
    )
    return page.to(tl.int64), page_row(tile_n, cols, block_size, PAGED)


@triton.jit
def softmax_start(
    SINKS, heads, BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr, EXP_E: tl.constexpr
):
    """Running max and sum ``(m, l)`` of BLOCK_M rows before their first key tile.

    Without sinks ``(-inf, 0)``. With HAS_SINKS each row starts as if it had already seen one key,
    its head's sink logit ``SINKS[heads]`` (natural units, converted to the scores' base), with
    probability mass ``exp(sink - m) = 1`` and a value of zero (the accumulator starts at 0): the
    streaming softmax then rescales it like any key, the row's sum and LSE include it, and a row
    that sees no key ends with ``out = 0`` and ``lse = sink``. A sink of -inf is no sink (its
    weight 1 is scaled by ``exp(-inf) = 0`` at the first finite score; an empty row stays at
    ``lse = -inf``). ``heads`` is a scalar or a (BLOCK_M,) tensor of head indices.
    """
    if HAS_SINKS:
        sink = tl.load(SINKS + heads).to(tl.float32)
        if not EXP_E:
            sink = sink * LOG2E
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def alibi_slope(ALIBI, off_b, off_h, stride_ab, HAS_ALIBI: tl.constexpr, EXP_E: tl.constexpr):
    """The ALiBi slope of head(s) ``off_h`` of batch ``off_b`` in the scores' units (0.0 without
    ALiBi): slopes are (B, H) with unit stride along H, or (H,) with ``stride_ab = 0``; base-2
    scores take ``slope * log2(e)`` (``ops/problem.py`` folds every other unit on the host)."""
    if HAS_ALIBI:
        slope = tl.load(ALIBI + off_b * stride_ab + off_h)
        if not EXP_E:
            slope = slope * LOG2E
        return slope
    else:
        return 0.0


@triton.jit
def online_softmax_step(s, m_i, l_i, MAY_BE_EMPTY: tl.constexpr, EXP_E: tl.constexpr):
    """One streaming-softmax step on a tile of base-2 scores ``s`` (BLOCK_M, BLOCK_N).

    With EXP_E the scores are in natural units and ``softmax_exp`` is base e.
    Returns ``(p, alpha, m_new, l_new)``: unnormalised probabilities ``exp2(s - m_new)``, the factor
    that rescales the previous accumulator, and the updated running max and sum. With
    MAY_BE_EMPTY, a row whose scores so far are all -inf keeps m = -inf, p = 0 and alpha = 0 instead
    of computing ``-inf - -inf = NaN``; without it the caller guarantees a finite max (unmasked
    tiles), and the guard compiles away.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = softmax_exp(s - m_ref[:, None], EXP_E)
    alpha = softmax_exp(m_i - m_ref, EXP_E)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def sum_zeros(ROWS: tl.constexpr, COLS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A zero accumulator for ``sum_dot``: fp64 for fp32 inputs (``"ieee"``), else fp32."""
    if DOT_PRECISION == "ieee":
        return tl.zeros([ROWS, COLS], dtype=tl.float64)
    else:
        return tl.zeros([ROWS, COLS], dtype=tl.float32)


@triton.jit
def sum_dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b`` in ``acc``'s precision (``sum_zeros``), for the sums over tiles: the
    forward's P @ V over keys, the backward's dQ over keys and dK, dV over query rows.

    fp32 inputs (``"ieee"``) sum in fp64 on the fp64 tensor cores (as ``dot_nt``'s scores) and
    are rounded once when stored. An fp32 sum is one FMA chain through every key or row of a head
    (Triton folds ``acc + dot`` into ``dot(a, b, acc)``), where PyTorch's fp32 product is split
    for few rows against a long sum (cuBLAS's gemv, split-K): the forward's chain came out 9-35x
    PyTorch's error with one query against 16384 near-uniform keys, the backward's dV 2-3x the
    bound with one key seen by 1803 rows (H200; docs/performance.md, "The long sums"). 16-bit
    inputs run the tensor cores in fp32.
    """
    if DOT_PRECISION == "ieee":
        return tl.dot(a.to(tl.float64), b.to(tl.float64), acc, out_dtype=tl.float64)
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def pv_start(l_i, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The forward's output accumulator (zeros) and running row sum ``l_i`` in ``sum_dot``'s
    precision: fp64 for fp32 inputs, fp32 otherwise."""
    acc = sum_zeros(BLOCK_M, BLOCK_DV, DOT_PRECISION)
    return acc, l_i.to(acc.dtype)


@triton.jit
def pv_finish(acc, m_i, l_i, EXP_E: tl.constexpr):
    """``(out, lse)`` in fp32 from the accumulator and row statistics (``pv_start``'s precision):
    rows normalised by their sum (an empty row, l = 0, stays 0) and their natural-log LSE."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    return out.to(tl.float32), row_lse(m_i, l_i, EXP_E).to(tl.float32)


@triton.jit
def load_lse2(lse_ptrs, offs_m, seqlen_q, EVEN_M: tl.constexpr, EXP_E: tl.constexpr = False):
    """The forward's per-row LSE in the scores' units, for the backward: base 2, or natural
    (as stored) with EXP_E.

    ``softmax_exp(s - lse2)`` recomputes the normalised probabilities. Rows that see no key (LSE
    -inf) and rows past seqlen_q get ``lse2 = +inf``, so their probabilities are exactly 0 (also
    where s is -inf) and they contribute nothing to any gradient, instead of ``-inf - -inf =
    NaN``.
    """
    if EVEN_M:
        lse = tl.load(lse_ptrs)
    else:
        lse = tl.load(lse_ptrs, mask=offs_m < seqlen_q, other=float("-inf"))
    if not EXP_E:
        lse = lse * LOG2E
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def load_row_stats(
    lse_ptrs, delta_ptrs, offs_m, seqlen_q, EVEN_M: tl.constexpr, EXP_E: tl.constexpr = False
):
    """Per-row ``(lse2, delta)`` for the backward (``load_lse2``); rows past seqlen_q get
    delta 0."""
    if EVEN_M:
        delta = tl.load(delta_ptrs)
    else:
        delta = tl.load(delta_ptrs, mask=offs_m < seqlen_q, other=0.0)
    return load_lse2(lse_ptrs, offs_m, seqlen_q, EVEN_M, EXP_E), delta


@triton.jit
def program_tile(n_tiles, REVERSE: tl.constexpr):
    """``(tile, off_bh)`` of this program on a 1-D grid of ``n_tiles * B * heads`` programs.

    One grid axis because CUDA caps axes 1 and 2 at 65535, which B * H (or the number of query
    tiles of a 16M-row sequence) can pass; axis 0 allows 2**31 - 1. Tiles of one (batch, head)
    are consecutive, so programs running together share its K/V in L2. REVERSE hands out a head's
    tiles last-first: for causal query tiles the last ones see the most keys, so the heavy
    programs start first and the light ones fill the tail of the launch.
    """
    pid = tl.program_id(0)
    off_bh = pid // n_tiles
    tile = pid % n_tiles
    if REVERSE:
        tile = n_tiles - 1 - tile
    return tile, off_bh


@triton.jit
def dot_nt(a, b, DOT_PRECISION: tl.constexpr):
    """``a @ b^T`` in fp32 for the score-like products ``Q K^T`` and ``dO V^T``.

    Half-precision tiles go to the tensor cores with fp32 accumulation. fp32 tiles
    (DOT_PRECISION "ieee") are multiplied in fp64 and rounded once: a sequential fp32 FMA chain
    over D put the scores far enough from float64 that fp32 outputs came out at ~1.9x PyTorch's
    fp32 error on average (H100, Sq=1, Sk=17, D=80: 8% of random inputs outside FlashAttention's
    rule, whatever the exp or division used; scratch measurement in docs/performance.md). Errors in
    the scores are what the softmax amplifies; the P @ V and gradient products stay in fp32. The
    fp64 product runs on Hopper's fp64 tensor cores (``mma ... f64``) and, in the interpreter, as
    a float64 numpy matmul.
    """
    if DOT_PRECISION == "ieee":
        return tl.dot(a.to(tl.float64), tl.trans(b.to(tl.float64))).to(tl.float32)
    else:
        return tl.dot(a, tl.trans(b), input_precision=DOT_PRECISION)
