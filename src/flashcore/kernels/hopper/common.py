"""Device helpers of the Hopper (Gluon) forward, ``kernels/hopper/fwd.py``: the key tiles a query
tile sees, the score tile's masks and modifiers in the softmax's units, one online-softmax step,
the work-item order of the flat and persistent grids, and two code-generation workarounds
(``opaque``, ``snake``'s branch). The backward (``kernels/hopper/bwd.py``) shares the constants
and ``tanh``. See ``fwd.py``'s docstring for the schedule that calls them.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# The TMA copies by their name in this Triton: ``async_load`` and ``async_store`` from 3.8 on (the
# old names aliases of them there; 3.9 removed the store's), ``async_copy_global_to_shared`` and
# ``async_copy_shared_to_global`` in 3.6 and 3.7. The same instructions either way.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# A shared buffer viewed in another dtype, shape or layout, ``reinterpret(buffer, dtype, shape,
# layout)``: the descriptor's ``_reinterpret`` up to 3.8, ``reinterpret`` from 3.9 on (both
# builtins, called here with the buffer first).
reinterpret = (
    getattr(gl.shared_memory_descriptor, "reinterpret", None)
    or gl.shared_memory_descriptor._reinterpret
)


LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one m64 wgmma)
# Q buffers of the persistent forward (per consumer): tile i's Q lands while tile i - 1 runs, and
# its buffer is freed at the end of tile i + 1, when the copy engine has long read tile i's O out
# of it (``kernels/hopper/fwd.py``, "Persistent schedule").
Q_BUFFERS = gl.constexpr(3)


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
    VARLEN: gl.constexpr = False,
):
    """``(lo, full_lo, full_hi, hi)``: key tiles of rows ``[start_m, start_m + BLOCK_M)``, as
    ``kernels/common.py:kv_tile_range`` (tiles in ``[full_lo, full_hi)`` need no mask). With
    VARLEN (a grid sized by the longest sequence) rows starting past their own sequence's end
    see no key (``hi = lo``: nothing loaded, nothing stored); the producer and the consumers
    take a work tile's range from here alike."""
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
    if VARLEN:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if start_m >= seqlen_q:
            hi = lo
    return lo, full_lo, full_hi, hi


@gluon.jit
def seq_bounds(CU, b, total):
    """``(first row, length)`` of packed sequence b, as ``kernels/varlen.py: seq_bounds`` but in
    int32 (the TMA coordinates' type): ``CU[b]`` and ``CU[b + 1]`` clamped to ``[0, total]``, the
    end to at least the start, so offsets that are not prefix sums give wrong numbers for their
    own sequence, never an access outside the tensors."""
    start = gl.minimum(gl.maximum(gl.load(CU + b), 0), total)
    end = gl.minimum(gl.maximum(gl.load(CU + b + 1), start), total)
    return start, end - start


@gluon.jit
def sequence(
    CU_Q, CU_K, off_b, seqlen_q, seqlen_k, total_q, total_k, VARLEN: gl.constexpr,
    PAGED: gl.constexpr = False,
):  # fmt: skip
    """``(q_start, k_start, seqlen_q, seqlen_k, desc_b)`` of work item batch ``off_b``: with VARLEN
    its packed sequence's first rows and lengths, and batch coordinate 0 in the ``(1, heads,
    total, D)`` descriptors; dense, rows from 0, the problem's lengths and ``off_b`` itself.
    PAGED (with VARLEN): the keys are in pages, ``CU_K``'s differences only count them, at most
    ``total_k`` (the sequence's block-table row), and ``k_start`` is not a row of anything."""
    if VARLEN:
        q_start, seqlen_q = seq_bounds(CU_Q, off_b, total_q)
        if PAGED:
            k_start, seqlen_k = seq_bounds(CU_K, off_b, 2147483647)
            seqlen_k = gl.minimum(seqlen_k, total_k)
        else:
            k_start, seqlen_k = seq_bounds(CU_K, off_b, total_k)
        desc_b = 0
    else:
        q_start = 0
        k_start = 0
        desc_b = off_b
    return q_start, k_start, seqlen_q, seqlen_k, desc_b


@gluon.jit
def tanh(x):
    """fp32 tanh for the softcap of 16-bit problems: ``1 - 2 / (2^(2 x log2 e) + 1)`` with an
    approximate reciprocal (``div.full``). Its absolute error is about 1e-7 everywhere, which is
    what the capped score ``c * tanh`` needs (its exponential is relative to it); the relative
    error of small results, which ``kernels/common.py: tanh`` keeps to a few ulp with a
    polynomial for fp32 inputs, does not matter here. Saturates to +-1 (``2^x`` overflowing to
    inf or underflowing to 0). Five instructions, two of them on the multi-function unit,
    against about twenty-five for the polynomial form."""
    e = gl.exp2(x * (2.0 * LOG2E))
    return 1.0 - gl.fdiv(2.0, e + 1.0, ieee_rounding=False)


@gluon.jit
def interleave(w, n_items, lpt_heads):
    """``(i, off_bh)`` of work item ``w`` when each head has ``n_items`` items and groups of
    ``lpt_heads`` heads (a divisor of ``B * H``) take them in turn: group g's items are its heads'
    item 0, one per head, then their item 1, and so on. ``lpt_heads = 1`` is head-major (a head's
    items consecutive). Causal kernels order each head's items heaviest first, so a group of
    heads meets the SMs heaviest first (``ops/fwd_sm90_configs.py: causal_order``)."""
    per_group = n_items * lpt_heads
    group = w // per_group
    r = w - group * per_group
    return r // lpt_heads, group * lpt_heads + r % lpt_heads


@gluon.jit
def fast_div(n, magic, shift):
    """``n // d`` for ``0 <= n < 2**30``, from ``(magic, shift) = ops/fwd_sm90.py:
    fast_divisor(d)`` (a round-up multiplier: ``(umulhi(n, magic) + n) >> shift``). A division
    by a runtime value is about twenty instructions and a hundred clocks of dependent latency;
    this is three."""
    return (gl.umulhi(n, magic) + n) >> shift


@gluon.jit
def work(w, n_tiles, lpt_heads, num_heads, divisors, REVERSE: gl.constexpr, FAST: gl.constexpr):
    """``(tile, off_b, off_h)`` of the forward's work item ``w`` out of ``n_tiles * B * H``, as
    ``interleave`` orders them; REVERSE (causal, where a query tile's cost grows with its index)
    takes each head's tiles last-first. Without REVERSE and with ``lpt_heads = 1``, as
    ``common.program_tile``. FAST (the persistent grid, which decodes a work item per tile):
    the divisions by ``n_tiles * lpt_heads``, ``lpt_heads`` and ``num_heads`` by ``fast_div``
    (``divisors``: their six constants, ``fast_divisor``); the flat grid decodes once per
    program and keeps plain divisions (with the constants live, its causal ragged D=128 build
    spilled 32 B)."""
    if FAST:
        group_m, group_s, lpt_m, lpt_s, heads_m, heads_s = divisors
        group = fast_div(w, group_m, group_s)
        r = w - group * (n_tiles * lpt_heads)
        tile = fast_div(r, lpt_m, lpt_s)
        off_bh = group * lpt_heads + (r - tile * lpt_heads)
        off_b = fast_div(off_bh, heads_m, heads_s)
    else:
        tile, off_bh = interleave(w, n_tiles, lpt_heads)
        off_b = off_bh // num_heads
    if REVERSE:
        tile = n_tiles - 1 - tile
    return tile, off_b, off_bh - off_b * num_heads


@gluon.jit
def work_item(
    WORK,
    CU_Q,
    w,
    seqlen_q,
    total_q,
    lpt_heads,
    num_heads,
    divisors,
    BLOCK_M: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    PERSISTENT: gl.constexpr,
    VARLEN: gl.constexpr,
):
    """``(tile, off_b, off_h)`` of the forward's work item ``w``: ``work``'s, or with a work
    list (``VARLEN == 2``, a packed batch) pair ``w`` of WORK, ``(b, r)`` (from ``WORK[2]``)
    (``kernels/varlen.py: work_list_kernel``): ``work``'s item ``r`` of a grid over sequence b
    alone (its own query tiles, at most the grid's ``cdiv(seqlen_q, BLOCK_M)``)."""
    if VARLEN == 2:
        off_b = gl.load(WORK + 2 + 2 * w)
        r = gl.load(WORK + 3 + 2 * w)
        _, len_q = seq_bounds(CU_Q, off_b, total_q)
        n_tiles = gl.minimum(gl.cdiv(len_q, BLOCK_M), gl.cdiv(seqlen_q, BLOCK_M))
        tile, _, off_h = work(r, n_tiles, lpt_heads, num_heads, divisors, IS_CAUSAL, False)
    else:
        tile, off_b, off_h = work(
            w, gl.cdiv(seqlen_q, BLOCK_M), lpt_heads, num_heads, divisors, IS_CAUSAL, PERSISTENT
        )
    return tile, off_b, off_h


@gluon.jit
def opaque(x):
    """``x`` (a 32-bit scalar, int32 or fp32) through a side-effecting ``mov``, so that nothing
    computed from it leaves its partition. Without it, in the persistent loops, LLVM's codegen
    (Triton 3.6) hoists what the partitions compute alike from the arguments (``cdiv(Sq,
    BLOCK_M)``, ``B * H``, sign fix-ups of the divisions; with one Q buffer a consumer at head
    dim 256, two constants of the lazy rescale from ``qk_scale``) into the entry block, before
    ``setmaxnreg``, and ptxas spills each such value live into a partition (24 B at D=128).
    An integer argument equal to 1 arrives as a constant (Triton's specialisation): an int32."""
    x = gl.to_tensor(x)
    return gl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=1
    )


@gluon.constexpr_function
def _pack_asm(dtype):
    assert dtype in (gl.bfloat16, gl.float16), dtype
    kind = "bf16x2" if dtype == gl.bfloat16 else "f16x2"
    return f"cvt.rn.{kind}.f32 $0, $2, $1;"


@gluon.jit
def to_operand(p, dtype: gl.constexpr):
    """``p`` (fp32) rounded to ``dtype`` (fp16 or bf16) two values an instruction, each pair
    packed in the register the ``P V`` product reads (``cvt.rn.{bf16x2,f16x2}.f32``: the
    first value in the low half). ``p.to(dtype)`` rounds alike, but one value at a time, leaving
    the pairing to ptxas, which in the three-consumer builds packed the halves the wrong way
    round and swapped them back with a ``PRMT`` a register (32 a step at D = 64)."""
    return gl.inline_asm_elementwise(
        _pack_asm(dtype), "=r,r,r", [p], dtype=dtype.value, is_pure=True, pack=2
    )


@gluon.jit
def programs(pid, OPAQUE: gl.constexpr):
    """``gl.num_programs(0)`` for a persistent partition; with OPAQUE read by a side-effecting
    ``mov`` (``pid`` only orders it). LLVM (Triton 3.6) merges the partitions' reads of
    ``%nctaid.x`` into one in the entry block, before ``setmaxnreg``, and in the builds whose
    partitions hold a few more values ptxas spilled it (VARLEN: 24-28 B at D = 128; one Q buffer a
    consumer at head dim 256), so those take OPAQUE."""
    if OPAQUE:
        n = gl.inline_asm_elementwise(
            "mov.u32 $0, %nctaid.x;", "=r,r", [pid], dtype=gl.int32, is_pure=False, pack=1
        )
    else:
        n = gl.num_programs(0)
    return n


@gluon.jit
def item_post(items, i, w, WARPS: gl.constexpr):
    """Write work item ``w`` into cell ``i`` of ``items`` (int32 ``[cells, 1]`` in shared memory)
    from a partition of WARPS warps (every thread writes the same value)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    # racecheck hand-over: work item
    items.index(i).store(gl.full([1], 0, gl.int32, layout) + w)


@gluon.jit
def item_read(items, i, WARPS: gl.constexpr):
    """The work item in cell ``i`` of ``items`` (``item_post``), read by a partition of WARPS
    warps."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    # racecheck hand-over: work item
    return gl.max(items.index(i).load(layout), axis=0)


@gluon.jit
def dealt_item(COUNTER, n_work, grid):
    """The next work item of a dynamic persistent deal: ``grid + `` an atomic ticket from
    ``COUNTER`` (each program's first item is its own index, the rest first come, first served).
    A launch draws exactly ``n_work`` tickets (one per item past the first wave and one past the
    end per program), so the draw that gets ticket ``n_work - 1`` is the launch's last: it puts
    the counter back to zero for the next launch on the stream. Relaxed: the tickets order
    nothing else (one address's atomics are ordered among themselves, and launches on a stream by
    their boundaries); acq_rel put a ``MEMBAR.ALL.GPU`` before each draw and an L1 invalidation
    after it, in the producer's path between tiles."""
    ticket = gl.atomic_add(COUNTER, 1, sem="relaxed")
    if ticket == n_work - 1:
        gl.atomic_xchg(COUNTER, 0, sem="relaxed")
    return grid + ticket


@gluon.jit
def snake(wave, pid, grid):
    """Work item of persistent program ``pid`` in ``wave``: ``wave * grid + pid`` on even waves,
    ``wave * grid + grid - 1 - pid`` on odd ones (see the module docstring). Written as a
    branch: the select form keeps ``grid - 1 - 2 pid`` live across the loop, spilled at D=128."""
    w = wave * grid + pid
    if wave % 2 == 1:
        w = (wave + 1) * grid - 1 - pid
    return w


@gluon.jit
def scores(
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
            # In fp32 from the row and column vectors (exact below 2^24 positions): a
            # subtraction and an FMA a score, where the integer distance took a conversion too.
            dist = (rows + (seqlen_k - seqlen_q)).to(gl.float32) - cols.to(gl.float32)
            s = s - slope * gl.abs(dist)
    if MASKED:
        if CHECK_N:
            s = gl.where(cols < seqlen_k, s, float("-inf"))
        if IS_CAUSAL and HAS_WINDOW:
            # Key j is seen from row i when 0 <= i + diag - j <= left: one unsigned comparison
            # (a key past the diagonal wraps to a large lag; the backward's BAND_MASK).
            lag = (rows + (seqlen_k - seqlen_q) - cols).to(gl.uint32, bitcast=True)
            s = gl.where(lag <= window_left.to(gl.uint32, bitcast=True), s, float("-inf"))
        elif IS_CAUSAL:
            s = gl.where(cols <= rows + (seqlen_k - seqlen_q), s, float("-inf"))
        elif HAS_WINDOW:
            s = gl.where(cols >= rows + (seqlen_k - seqlen_q - window_left), s, float("-inf"))
            s = gl.where(cols <= rows + (seqlen_k - seqlen_q + window_right), s, float("-inf"))
    return s


@gluon.jit
def tile_scores(
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
    """``scores`` of the tile at key ``start_n``: masked unless it lies in the full range."""
    cols = gl.expand_dims(start_n + offs_n, 0)
    if (start_n < full_lo) | (start_n >= full_hi):
        s = scores(
            s, rows, cols, seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap,
            slope, True, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, RAW_MAX, CHECK_N,
        )  # fmt: skip
    else:
        s = scores(
            s, rows, cols, seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap,
            slope, False, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, RAW_MAX, CHECK_N,
        )  # fmt: skip
    return s


@gluon.jit
def _row_max(x, like):
    """Row max of a score-shaped tile, in the layout of the row vector ``like``: the even and odd
    columns (each thread holds columns in pairs, so the split moves no data) combined first, so
    that each thread's chain of dependent operations per row is half as long as
    ``gl.max(x, 1)``'s (ptxas keeps the reduction's order)."""
    even, odd = x.reshape([x.shape[0], x.shape[1] // 2, 2]).split()
    return gl.convert_layout(gl.max(gl.maximum(even, odd), 1), like.type.layout)


@gluon.jit
def _thread_sums(p):
    """Row sums of a score-shaped tile within each thread, ``[rows, 4]``: the wgmma accumulator
    holds a row in a quad of four threads, each with its columns in pairs eight apart (column
    ``8 j + 2 lane + pair``), so summing the pair, then ``j``, never leaves the thread. The row's
    total is the sum over the quad (``row_total``), taken once after the key loop instead of by
    shuffles at every step."""
    x = p.reshape([p.shape[0], p.shape[1] // 8, 4, 2])
    return gl.sum(gl.sum(x, 3), 1)


@gluon.jit
def sums_start(total, BLOCK_N: gl.constexpr):
    """The running row sums before the first key tile (``softmax``'s ``l``): each thread's share
    ``[rows, 4]`` of a row total ``total`` (0, or a sink's 1), a quarter each (exact)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    return _thread_sums(gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)) + total * 0.25


@gluon.jit
def row_total(l_i, like):
    """The row sums whose shares ``softmax`` carries, in the layout of the row vector ``like``."""
    return gl.convert_layout(gl.sum(l_i, 1), like.type.layout)


# How far (log2 units) a row's running max may rise above the max its exponentials and its O
# accumulator are kept against before both are rescaled (``softmax`` and ``rescale`` with LAZY):
# P then stays within 2^8, and a warp whose rows all keep theirs skips the accumulator's
# multiplies. Taken where the O accumulator is wider than the key tile (``lazy_rescale``).
RESCALE_SLACK = gl.constexpr(8.0)


@gluon.constexpr_function
def lazy_rescale(head_dim_v, block_n):
    """Whether a consumer's softmax keeps its rows' max within RESCALE_SLACK instead of moving
    it at every step: where a step's O rescale (``head_dim_v / 2`` multiplies a thread) is at
    least twice its exponentials (``block_n / 2``): head dim 256, and 128 with 64-key tiles.
    At D = 128 with 128-key tiles it measured within the rounds' spread, and the exact max
    keeps a row's largest weight exactly 1 (docs/hopper_fwd_configs.md, "Lazy O rescale")."""
    return head_dim_v > block_n


@gluon.jit
def softmax(s, m_i, l_i, qk_scale, RAW_MAX: gl.constexpr, LAZY: gl.constexpr):
    """One online-softmax step on a score tile: ``(p, alpha, m, l)``, ``m`` the max the row's
    exponentials are taken against. Without LAZY, the row's running max; with it, moved to the
    running max only when that rises more than RESCALE_SLACK above it (always from -inf), so
    that ``alpha`` is exactly 1 at most steps and ``p <= 2^RESCALE_SLACK``. A row with every
    score -inf so far keeps ``m = -inf`` and gets ``p = 0`` (``alpha = 0`` without LAZY).
    ``l`` is the running row sums as each thread's share (``sums_start``, ``row_total``): the
    quad's shuffles leave the step (docs/hopper_fwd_configs.md, "Row sums per thread")."""
    m_new = gl.maximum(m_i, _row_max(s, m_i))
    if LAZY:
        if RAW_MAX:
            moved = m_new * qk_scale > m_i * qk_scale + RESCALE_SLACK
        else:
            moved = m_new > m_i + RESCALE_SLACK
        m_new = gl.where(moved, m_new, m_i)
    if RAW_MAX:
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
        p = gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(m_ref, 1)))
        alpha = gl.exp2(m_i * qk_scale - m_ref)
    else:
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_ref, 1))
        alpha = gl.exp2(m_i - m_ref)
    if LAZY:
        alpha = gl.where(moved, alpha, 1.0)
    a = gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))
    l_new = l_i * gl.expand_dims(a, 1) + _thread_sums(p)
    return p, alpha, m_new, l_new


@gluon.constexpr_function
def _rescale_asm(n):
    """PTX of ``rescale`` for ``n`` accumulator registers a thread: ``$0..$n-1`` out (tied to
    ``$n..$2n-1`` in), the row factors at ``$2n..$3n-1``. Registers ``4j, 4j+1`` of a thread's
    wgmma accumulator are in its row r, ``4j+2, 4j+3`` in row r + 8 (the m64nNk16 fragment), so
    ``$2n`` and ``$2n+2`` are its two rows' factors."""
    mul = "".join(f"mul.f32 ${i}, ${n + i}, ${2 * n + i};\n" for i in range(n))
    return (
        "{\n.reg .pred %fc_a;\n.reg .pred %fc_b;\n"
        f"setp.neu.f32 %fc_a, ${2 * n}, 0f3F800000;\n"
        f"setp.neu.f32 %fc_b, ${2 * n + 2}, 0f3F800000;\n"
        "or.pred %fc_a, %fc_a, %fc_b;\n"
        "vote.sync.any.pred %fc_a, %fc_a, 0xffffffff;\n"
        "@!%fc_a bra.uni fc_kept;\n"
        f"{mul}fc_kept:\n}}"
    )


@gluon.constexpr_function
def _rescale_constraints(n):
    return ",".join(["=f"] * n + [str(i) for i in range(n)] + ["f"] * n)


@gluon.jit
def rescale(acc, alpha, LAZY: gl.constexpr):
    """``acc * alpha`` by rows (``alpha`` in the layout of ``acc``'s rows). With LAZY, as one
    branch per warp: a warp in which every row's factor is 1 (``softmax`` kept its max) skips
    the multiplies."""
    a = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    if LAZY:
        a = gl.broadcast(a, acc)[0]
        N: gl.constexpr = acc.shape[0] * acc.shape[1] // (32 * gl.num_warps())
        acc = gl.inline_asm_elementwise(
            _rescale_asm(N), _rescale_constraints(N), [acc, a], dtype=gl.float32,
            is_pure=True, pack=N,
        )  # fmt: skip
    else:
        acc = acc * a
    return acc


@gluon.jit
def zero_rows(tile, keep):
    """Zero rows ``keep ..`` of a ``[rows, D]`` NVMMA-swizzled tile in shared memory, by this
    warp, in 8-row by 64-column pieces (the swizzle's atom: slices along both dims stay
    addressable). Each piece that reaches past ``keep`` is read, masked and written back."""
    ROWS_T: gl.constexpr = tile.shape[0]
    COLS: gl.constexpr = tile.shape[1]
    PIECE_C: gl.constexpr = 64 if COLS > 64 else COLS
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    r = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(1, layout)), 1)
    for i in gl.static_range(ROWS_T // 8):
        if i * 8 + 8 > keep:
            for c in gl.static_range(COLS // PIECE_C):
                piece = tile.slice(i * 8, 8, dim=0).slice(c * PIECE_C, PIECE_C, dim=1)
                x = piece.load(layout)
                # racecheck hand-over: zeroed rows
                piece.store(gl.where(r + i * 8 >= keep, gl.zeros_like(x), x))


@gluon.jit
def store_rows(O, o_desc, o_tile, acc, row, n_rows, off_h, stride_ot, stride_oh):
    """The first ``n_rows`` rows of ``acc`` into O (the tensor of ``o_desc``, with row stride
    ``stride_ot``) from ``row`` on (VARLEN: the rows after them are the next sequence's), through
    the shared-memory tile ``o_tile``: written in the accumulator's layout, read
    back in 16-byte row pieces and stored with a row mask (and a column mask at 8-column
    granularity: O's real width, below the tile's for the padded head dims; every head dim the
    tier takes is a multiple of 8, so the stores stay 16 bytes wide)."""
    ROWS_T: gl.constexpr = o_tile.shape[2]
    DV: gl.constexpr = o_tile.shape[3]
    tile = o_tile.reshape([ROWS_T, DV])
    tile.store(acc.to(o_desc.dtype))
    TC: gl.constexpr = DV // 8 if DV < 256 else 32  # threads along a row, 8 columns each
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TC, TC], [4, 1], [1, 0])
    o = tile.load(layout)
    r = gl.arange(0, ROWS_T, layout=gl.SliceLayout(1, layout))
    c = gl.expand_dims(gl.arange(0, DV, layout=gl.SliceLayout(0, layout)), 0)
    offs = gl.expand_dims((row + r).to(gl.int64) * stride_ot, 1) + c
    mask = gl.expand_dims(r < n_rows, 1) & (c // 8 < o_desc.shape[3] // 8)
    gl.store(O + off_h.to(gl.int64) * stride_oh + offs, o, mask=mask)
