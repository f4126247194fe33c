"""The producer warp of the Hopper forward (``kernels/hopper/fwd.py``, whose docstring states the
schedule): per work tile, each consumer's Q block and then the K and V tiles of the key loop into
the ring, by TMA, each load after the barrier that says its slot is free; with PERSISTENT, the
program's tiles in the order the consumers walk them, the ring and the Q buffers running on
across tiles.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from flashcore.kernels.hopper.common import Q_BUFFERS, ROWS, kv_tile_range, opaque, snake, work


@gluon.jit
def _load(desc, off_b, off_h, row, bar, smem, first, PANELS: gl.constexpr):
    """One tile of ``desc`` from ``row`` on, by TMA onto ``bar`` (armed with its bytes), in PANELS
    column panels of the descriptor's box width, into buffers ``first .. first + PANELS - 1``."""
    PANEL: gl.constexpr = desc.block_type.shape[3]
    mbarrier.expect(bar, PANELS * desc.block_type.nbytes)
    for i in gl.static_range(PANELS):
        tma.async_copy_global_to_shared(
            desc, [off_b, off_h, row, i * PANEL], bar, smem.index(first + i)
        )


@gluon.jit
def _producer_tile(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    k_smem,
    v_smem,
    q_ready,
    q_empty,
    k_ready,
    v_ready,
    kv_empty,
    w,
    it,
    kv0,
    num_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    lpt_heads,
    divisors,
    window_left,
    window_right,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """Loads of work item ``w``, this program's tile number ``it``, whose K/V tiles take ring
    entries ``kv0, kv0 + 1, ...``; returns how many it took."""
    # Q and K arrive in PANELS column panels of PANEL (head dim 192: three of 64, as a TMA box
    # must be a power of two wide); one panel otherwise.
    PANELS: gl.constexpr = k_smem.shape[0] // NUM_STAGES
    tile_m, off_b, off_h = work(
        w, gl.cdiv(seqlen_q, BLOCK_M), lpt_heads, num_heads, divisors, IS_CAUSAL, PERSISTENT
    )
    start_m = tile_m * BLOCK_M
    off_hk = off_h // kv_group
    lo, _, _, hi = kv_tile_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
        IS_CAUSAL, HAS_WINDOW,
    )  # fmt: skip
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)  # hi >= lo: 0 for a tile that sees no key
    if PERSISTENT:
        # Q buffer it % Q_BUFFERS, once its consumer has stored the O of tile it - Q_BUFFERS
        # from it. A tile with no key completes q_ready without a load, so that every tile
        # takes one phase.
        for c in gl.static_range(NUM_CONSUMERS):
            qi = (it % Q_BUFFERS) * NUM_CONSUMERS + c
            mbarrier.wait(q_empty.index(qi), ((it // Q_BUFFERS) & 1) ^ 1)
            bar = q_ready.index(qi)
            if hi > lo:
                _load(q_desc, off_b, off_h, start_m + c * ROWS, bar, q_smem, qi * PANELS, PANELS)
            else:
                mbarrier.arrive(bar, count=1)
    if hi > lo:
        if not PERSISTENT:
            for c in gl.static_range(NUM_CONSUMERS):
                _load(
                    q_desc, off_b, off_h, start_m + c * ROWS, q_ready.index(c), q_smem,
                    c * PANELS, PANELS,
                )  # fmt: skip
        for t in range(n_tiles):
            g = kv0 + t
            slot = g % NUM_STAGES
            phase = (g // NUM_STAGES) & 1
            start_n = lo + t * BLOCK_N
            mbarrier.wait(kv_empty.index(slot), phase ^ 1)  # K of entry g - NUM_STAGES read
            _load(
                k_desc, off_b, off_hk, start_n, k_ready.index(slot), k_smem, slot * PANELS, PANELS
            )
            mbarrier.wait(kv_empty.index(NUM_STAGES + slot), phase ^ 1)  # and its V
            _load(v_desc, off_b, off_hk, start_n, v_ready.index(slot), v_smem, slot, 1)
    return n_tiles


@gluon.jit
def producer(
    run,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """The producer warp's partition; ``run`` holds the kernel's runtime values it needs
    (``kernels/hopper/fwd.py: attn_fwd_sm90_kernel``)."""
    (
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
        kv_empty, num_heads, kv_group, seqlen_q, seqlen_k, lpt_heads, divisors, window_left,
        window_right,
    ) = run  # fmt: skip
    if PERSISTENT:
        pid = gl.program_id(0)
        grid = gl.num_programs(0)
        seqlen_q = opaque(seqlen_q)
        seqlen_k = opaque(seqlen_k)
        num_heads = opaque(num_heads)
        lpt_heads = opaque(lpt_heads)
        n_work = gl.cdiv(seqlen_q, BLOCK_M) * opaque(q_desc.shape[0]) * num_heads
        kv = 0
        for wave in range(gl.cdiv(n_work, grid)):
            # Every wave but the last gives each program a tile, so the wave is the tile count.
            w = snake(wave, pid, grid)
            if w < n_work:
                kv += _producer_tile(
                    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                    v_ready, kv_empty, w, wave, kv, num_heads, kv_group, seqlen_q, seqlen_k,
                    lpt_heads, divisors, window_left, window_right, BLOCK_M, BLOCK_N, NUM_STAGES,
                    NUM_CONSUMERS, IS_CAUSAL, HAS_WINDOW, PERSISTENT,
                )  # fmt: skip
    else:
        _producer_tile(
            q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
            kv_empty, gl.program_id(0), 0, 0, num_heads, kv_group, seqlen_q, seqlen_k,
            lpt_heads, divisors, window_left, window_right, BLOCK_M, BLOCK_N, NUM_STAGES,
            NUM_CONSUMERS, IS_CAUSAL, HAS_WINDOW, PERSISTENT,
        )  # fmt: skip
