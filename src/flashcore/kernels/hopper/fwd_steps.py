"""One consumer warpgroup's key loop in the Hopper forward (``kernels/hopper/fwd.py``, whose
docstring states the schedule): ``attend`` walks a work tile's key tiles, computing those its 64
rows can see (``_steps``: the prologue, the steady-state step with ``Q K_t^T`` and
``P_{t-1} V_{t-1}`` in flight, the last ``P V``) and, with three consumers, sitting out the
others (``_sit_out``) so that the ring's releases and the ping-pong turns stay in step with
the other warpgroups.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashcore.kernels.hopper.common import (
    ROWS,
    lazy_rescale,
    rescale,
    scores,
    softmax,
    tile_scores,
    to_operand,
)


@gluon.jit
def _scores(q_smem, qi, k_smem, slot, zero_s, BLOCK_N: gl.constexpr, PANELS: gl.constexpr):
    """Issue ``S = Q K^T`` (async) for Q slot ``qi`` against ring slot ``slot``: one wgmma, or
    one per column panel into the same accumulator when Q and K come in panels (head dim 192)."""
    PANEL: gl.constexpr = k_smem.shape[4]
    s = zero_s
    for i in gl.static_range(PANELS):
        q = q_smem.index(qi * PANELS + i).reshape([ROWS, PANEL])
        k_t = k_smem.index(slot * PANELS + i).reshape([BLOCK_N, PANEL]).permute((1, 0))
        s = warpgroup_mma(q, k_t, s, use_acc=i > 0, is_async=True)
    return s


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, PACKED: gl.constexpr):
    """P in ``dtype`` as the register A operand of ``P V``; PACKED rounds two values an
    instruction (``common.to_operand``)."""
    if PACKED:
        p_op = to_operand(p, dtype)
    else:
        p_op = p.to(dtype)
    return gl.convert_layout(p_op, p_layout)


# Named hardware barriers for the ping-pong turns (PINGPONG == 2): consumer c takes its turn
# with ``bar.sync TURN_BARRIER + c, 256`` (its own 128 threads and the 128 of the consumer before
# it), which that consumer's ``bar.arrive`` completes when it passes the turn on. Triton's
# partitions use barriers 0 to 3. PINGPONG == 1 takes the turns through mbarriers ``turn``.
TURN_BARRIER = 8


@gluon.constexpr_function
def _bar_asm(op, consumer):
    return f"bar.{op} {TURN_BARRIER + consumer}, 256;\nmov.b32 $0, $1;"


@gluon.jit
def _named_barrier(OP: gl.constexpr, CONSUMER: gl.constexpr, t):
    """``bar.sync`` or ``bar.arrive`` on consumer ``CONSUMER``'s turn barrier (``t`` orders it)."""
    gl.inline_asm_elementwise(
        _bar_asm(OP, CONSUMER), "=r,r", [t], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def turn_take(turn, t, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr):
    """Wait for this consumer's turn ``t`` on the tensor cores (its ``t``-th since the start)."""
    if PINGPONG == 2:
        _named_barrier("sync", CONSUMER, t)
    elif PINGPONG:
        mbarrier.wait(turn.index(CONSUMER), t & 1)


@gluon.jit
def turn_pass(turn, t, NEXT: gl.constexpr, PINGPONG: gl.constexpr):
    """Pass the turn on to consumer ``NEXT``."""
    if PINGPONG == 2:
        _named_barrier("arrive", NEXT, t)
    elif PINGPONG:
        mbarrier.arrive(turn.index(NEXT), count=1)


@gluon.constexpr_function
def skips(num_consumers, block_n, is_causal):
    """Whether each consumer computes only the key tiles its own rows see (``attend``)."""
    return num_consumers > 2 or (is_causal and block_n < ROWS * num_consumers)


@gluon.jit
def _sit_out(
    k_ready,
    v_ready,
    kv_empty,
    turn,
    g,
    turn_t,
    CONSUMER: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    PINGPONG: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    RELEASE: gl.constexpr,
):
    """A step this consumer sits out: with RELEASE, it frees ring entry ``g``'s K and V once
    they have landed (arriving earlier could count towards the slot's previous use), and it takes
    turn ``turn_t`` and passes it on, so that every consumer takes the same turns."""
    if RELEASE:
        slot = g % NUM_STAGES
        mbarrier.wait(k_ready.index(slot), (g // NUM_STAGES) & 1)
        mbarrier.arrive(kv_empty.index(slot), count=1)
        mbarrier.wait(v_ready.index(slot), (g // NUM_STAGES) & 1)
        mbarrier.arrive(kv_empty.index(NUM_STAGES + slot), count=1)
    turn_take(turn, turn_t, CONSUMER, PINGPONG)
    turn_pass(turn, turn_t, (CONSUMER + 1) % NUM_CONSUMERS, PINGPONG)


@gluon.jit
def attend(
    q_smem,
    qi,
    k_smem,
    v_smem,
    k_ready,
    v_ready,
    kv_empty,
    turn,
    kv0,
    turn0,
    n_tiles,
    t0,
    t1,
    lo,
    full_lo,
    full_hi,
    rows,
    seqlen_q,
    seqlen_k,
    qk_scale,
    window_left,
    window_right,
    softcap,
    slope,
    m_i,
    l_i,
    CONSUMER: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    PINGPONG: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    RAW_MAX: gl.constexpr,
    EVEN_N: gl.constexpr,
    OWN_PV: gl.constexpr = False,
    q_free=None,
    FREE_Q: gl.constexpr = False,
    SPLIT: gl.constexpr = False,
    o_free=None,
    O_LATE: gl.constexpr = False,
    o_pending=False,
):
    """The key loop of one work tile (``n_tiles >= 1``): ring entries ``kv0 .. kv0 + n_tiles -
    1``, turns ``turn0 .. turn0 + n_tiles``, from the running max and sum ``(m_i, l_i)`` (a
    sink's, or none); returns ``(m, l, O)``. This consumer computes
    tiles ``[t0, t1)`` (all of them with two consumers) and sits out the others (``_sit_out``):
    turn ``t`` for tile ``t < t0``, ``t + 1`` for tile ``t >= t1``, one more when it computes
    none. FREE_Q (one Q buffer a consumer, ``kernels/hopper/fwd.py``): this consumer arrives on
    ``q_free`` as soon as its last ``Q K^T`` has completed, where it computes a tile at all (the
    caller frees the slot otherwise). SPLIT: the causal tiles below ``full_hi`` in a loop of
    their own, without the masks' code (``_steps``). O_LATE with ``o_pending`` (the CTA's one O
    tile, ``kernels/hopper/fwd.py``): the copy engine's read of this consumer's previous O is
    waited for, and the O tile freed on ``o_free``, right after the first ``Q K^T`` issue (the
    caller does it where this consumer computes no tile)."""
    HEAD_DIM_V: gl.constexpr = v_smem.shape[4]  # V's (and O's) head dim; HEAD_DIM is Q's and K's
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM_V, 16]
    )
    acc = gl.zeros([ROWS, HEAD_DIM_V], gl.float32, layout=o_layout)
    # Three consumers (BLOCK_M = 192 rows against 128-key tiles) skip the tiles none of their
    # rows sees (at the causal diagonal, and all of them for rows past Sq), and hold 160
    # registers each: P goes to its operand form right after its softmax and the wait that
    # frees the previous one (``_steps``), so that the 16-bit P, not the fp32 one, stays live
    # while the next Q K^T writes its accumulator. Two consumers skip them causal with key
    # tiles narrower than the CTA's 128 rows (the first consumer's last diagonal tile; the
    # second's last step then runs beside the first's epilogue), else compute every tile.
    SKIP: gl.constexpr = skips(NUM_CONSUMERS, BLOCK_N, IS_CAUSAL)

    if SKIP:
        for t in range(0, t0):
            _sit_out(k_ready, v_ready, kv_empty, turn, kv0 + t, turn0 + t, CONSUMER, NUM_CONSUMERS,
                  PINGPONG, NUM_STAGES, True)  # fmt: skip
        if t1 > t0:
            m_i, l_i, acc = _steps(
                q_smem, qi, k_smem, v_smem, k_ready, v_ready, kv_empty, turn, kv0 + t0, turn0 + t0,
                t1 - t0, lo + t0 * BLOCK_N, full_lo, full_hi, rows, seqlen_q, seqlen_k,
                qk_scale, window_left, window_right, softcap, slope, m_i, l_i, acc, CONSUMER,
                NUM_CONSUMERS, PINGPONG, HEAD_DIM, BLOCK_N, NUM_STAGES, IS_CAUSAL, HAS_WINDOW,
                SOFTCAP, HAS_ALIBI, RAW_MAX, EVEN_N, OWN_PV, q_free, FREE_Q, SPLIT, o_free,
                O_LATE, o_pending,
            )  # fmt: skip
        else:
            _sit_out(k_ready, v_ready, kv_empty, turn, kv0, turn0 + t0, CONSUMER, NUM_CONSUMERS,
                  PINGPONG, NUM_STAGES, False)  # fmt: skip
        for t in range(t1, n_tiles):
            _sit_out(k_ready, v_ready, kv_empty, turn, kv0 + t, turn0 + t + 1, CONSUMER,
                  NUM_CONSUMERS, PINGPONG, NUM_STAGES, True)  # fmt: skip
    else:
        m_i, l_i, acc = _steps(
            q_smem, qi, k_smem, v_smem, k_ready, v_ready, kv_empty, turn, kv0, turn0, n_tiles, lo,
            full_lo, full_hi, rows, seqlen_q, seqlen_k, qk_scale, window_left, window_right,
            softcap, slope, m_i, l_i, acc, CONSUMER, NUM_CONSUMERS, PINGPONG, HEAD_DIM, BLOCK_N,
            NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, RAW_MAX, EVEN_N, OWN_PV,
            q_free, FREE_Q, SPLIT, o_free, O_LATE, o_pending,
        )  # fmt: skip
    return m_i, l_i, acc


@gluon.jit
def _steps(
    q_smem,
    qi,
    k_smem,
    v_smem,
    k_ready,
    v_ready,
    kv_empty,
    turn,
    kv0,
    turn0,
    n_tiles,
    lo,
    full_lo,
    full_hi,
    rows,
    seqlen_q,
    seqlen_k,
    qk_scale,
    window_left,
    window_right,
    softcap,
    slope,
    m_i,
    l_i,
    acc,
    CONSUMER: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    PINGPONG: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    RAW_MAX: gl.constexpr,
    EVEN_N: gl.constexpr,
    OWN_PV: gl.constexpr,
    q_free,
    FREE_Q: gl.constexpr,
    SPLIT: gl.constexpr,
    o_free,
    O_LATE: gl.constexpr,
    o_pending,
):
    """Tiles ``0 .. n_tiles - 1`` (``n_tiles >= 1``) from key ``lo``, ring entry ``kv0`` and
    turn ``turn0`` on, each computed: the schedule of the module docstring."""
    dtype: gl.constexpr = q_smem.dtype
    NEXT: gl.constexpr = (CONSUMER + 1) % NUM_CONSUMERS
    HEAD_DIM_V: gl.constexpr = v_smem.shape[4]
    PANELS: gl.constexpr = k_smem.shape[0] // NUM_STAGES  # Q and K column panels (_scores)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM_V, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=col_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    CHECK_N: gl.constexpr = not EVEN_N
    # See attend's SKIP; with Q and K in panels (head dim 192) it keeps the causal ragged build
    # free of spills (32 B without), and with a window, softcap or ALiBi the D = 128 builds (up
    # to 496 B without: docs/hopper_fwd_configs.md, "Score-option builds").
    P_EARLY: gl.constexpr = (
        (NUM_CONSUMERS > 2) or (PANELS > 1) or HAS_WINDOW or SOFTCAP or HAS_ALIBI
    )
    LAZY: gl.constexpr = lazy_rescale(HEAD_DIM_V, BLOCK_N)
    # P packed by hand (common.to_operand says why) with three consumers: 2-3% faster causal at
    # D = 64. Taken in every build, it spilled 8-12 B in two two-consumer builds
    # (docs/hopper_fwd_configs.md, "P packed a pair an instruction").
    PACKED_P: gl.constexpr = NUM_CONSUMERS > 2

    # Prologue: tile 0's scores and softmax (one turn on the tensor cores).
    mbarrier.wait(k_ready.index(kv0 % NUM_STAGES), (kv0 // NUM_STAGES) & 1)
    turn_take(turn, turn0, CONSUMER, PINGPONG)
    s_tok = _scores(q_smem, qi, k_smem, kv0 % NUM_STAGES, zero_s, BLOCK_N, PANELS)
    turn_pass(turn, turn0, NEXT, PINGPONG)
    if O_LATE:  # noqa: SIM102
        if o_pending:
            # The previous tile's O has been read out of the O tile while this Q K^T runs.
            tma.store_wait(0)
            mbarrier.arrive(o_free, count=1)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    mbarrier.arrive(kv_empty.index(kv0 % NUM_STAGES), count=1)  # K_0 read
    if FREE_Q:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if n_tiles == 1:
            mbarrier.arrive(q_free, count=1)  # the last Q K^T has completed
    s = tile_scores(
        s, lo, full_lo, full_hi, rows, offs_n, seqlen_q, seqlen_k, qk_scale, window_left,
        window_right, softcap, slope, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI, RAW_MAX,
        CHECK_N,
    )  # fmt: skip
    p, alpha, m_i, l_i = softmax(s, m_i, l_i, qk_scale, RAW_MAX, LAZY)
    if P_EARLY:
        p_op = _p_operand(p, dtype, p_layout, PACKED_P)

    # SPLIT (the caller's choice, ``kernels/hopper/fwd.py``): tiles [1, t_mid) below full_hi in
    # a loop without the masks' code, then [t_mid, n_tiles) masked; else one loop, the mask
    # chosen per tile (``tile_scores``). The same tiles get the same code either way.
    gl.static_assert(
        not SPLIT or (IS_CAUSAL and EVEN_N and not (HAS_WINDOW or P_EARLY)),
        "SPLIT: causal builds without a window, ragged keys or P_EARLY",
    )
    t_mid = n_tiles
    if SPLIT:
        t_mid = gl.minimum(gl.maximum((full_hi - lo) // BLOCK_N, 1), n_tiles)
    for half in gl.static_range(2 if SPLIT else 1):
        t_begin = 1 if half == 0 else t_mid
        t_end = t_mid if SPLIT and half == 0 else n_tiles
        for t in range(t_begin, t_end):
            g = kv0 + t
            slot = g % NUM_STAGES
            prev = (g - 1) % NUM_STAGES
            mbarrier.wait(k_ready.index(slot), (g // NUM_STAGES) & 1)
            turn_take(turn, turn0 + t, CONSUMER, PINGPONG)
            s_tok = _scores(q_smem, qi, k_smem, slot, zero_s, BLOCK_N, PANELS)
            # While Q K_t^T runs: rescale O by the previous step's alpha, P to the A operand.
            acc = rescale(acc, alpha, LAZY)
            if not P_EARLY:
                p_op = _p_operand(p, dtype, p_layout, PACKED_P)
            mbarrier.wait(v_ready.index(prev), ((g - 1) // NUM_STAGES) & 1)
            v_t = v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM_V])
            acc_tok = warpgroup_mma(p_op, v_t, acc, is_async=True)
            turn_pass(turn, turn0 + t, NEXT, PINGPONG)
            s = warpgroup_mma_wait(1, deps=[s_tok])
            # K_t is read: the producer may load tile t + NUM_STAGES's K while V_{t-1} is in use.
            mbarrier.arrive(kv_empty.index(slot), count=1)
            if FREE_Q:  # noqa: SIM102
                if t == n_tiles - 1:
                    mbarrier.arrive(q_free, count=1)  # the last Q K^T has completed
            if SPLIT:
                # The first loop's tiles lie below full_hi (every row sees every key), the
                # second's are the masked ones: the branch of ``tile_scores`` taken per loop.
                s = scores(
                    s, rows, gl.expand_dims(lo + t * BLOCK_N + offs_n, 0), seqlen_q, seqlen_k,
                    qk_scale, window_left, window_right, softcap, slope, half == 1, IS_CAUSAL,
                    HAS_WINDOW, SOFTCAP, HAS_ALIBI, RAW_MAX, CHECK_N,
                )  # fmt: skip
            else:
                s = tile_scores(
                    s, lo + t * BLOCK_N, full_lo, full_hi, rows, offs_n, seqlen_q, seqlen_k,
                    qk_scale, window_left, window_right, softcap, slope, IS_CAUSAL, HAS_WINDOW,
                    SOFTCAP, HAS_ALIBI, RAW_MAX, CHECK_N,
                )  # fmt: skip
            # Tile t's softmax runs while P_{t-1} V_{t-1} is on the tensor cores.
            p, alpha, m_i, l_i = softmax(s, m_i, l_i, qk_scale, RAW_MAX, LAZY)
            if OWN_PV:
                # K_t's phase completed above and cannot complete again before this consumer frees
                # the slot: a wait that passes at once, but a loop, which ptxas does not move its
                # DEPBAR across (docs/hopper_fwd.md, "Compile-time evidence"), so the exponentials
                # stay before the wait for P_{t-1} V_{t-1}.
                mbarrier.wait(k_ready.index(slot), (g // NUM_STAGES) & 1)
            acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])
            mbarrier.arrive(kv_empty.index(NUM_STAGES + prev), count=1)  # V_{t-1} read
            if P_EARLY:
                p_op = _p_operand(p, dtype, p_layout, PACKED_P)

    # The last tile's P V.
    g = kv0 + n_tiles - 1
    last = g % NUM_STAGES
    mbarrier.wait(v_ready.index(last), (g // NUM_STAGES) & 1)
    turn_take(turn, turn0 + n_tiles, CONSUMER, PINGPONG)
    acc = rescale(acc, alpha, LAZY)
    if not P_EARLY:
        p_op = _p_operand(p, dtype, p_layout, PACKED_P)
    v_t = v_smem.index(last).reshape([BLOCK_N, HEAD_DIM_V])
    acc_tok = warpgroup_mma(p_op, v_t, acc, is_async=True)
    turn_pass(turn, turn0 + n_tiles, NEXT, PINGPONG)
    acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])
    mbarrier.arrive(kv_empty.index(NUM_STAGES + last), count=1)
    return m_i, l_i, acc
