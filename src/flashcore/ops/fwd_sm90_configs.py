"""The Hopper forward's tile configs (``Sm90Config``) and the rules that choose them for a
problem (``ops/fwd_sm90.py: plan`` applies them): two or three consumer warpgroups of 64 rows or
one a CTA, the key tile and ring depth, the flat or persistent grid, the causal work order and
the dynamic deal. Each rule carries the measurement it rests on; docs/hopper_fwd_configs.md has
the runs.
"""

from __future__ import annotations

from typing import NamedTuple

from flashcore.ops.problem import Varlen


class Sm90Config(NamedTuple):
    """Tiles of one launch: ``NUM_CONSUMERS`` warpgroups of 64 query rows, ``BLOCK_N`` keys per
    tile, ``NUM_STAGES`` K/V slots; ``consumer_regs`` per consumer thread (the producer warp
    keeps 24; with one consumer, the default partition, it takes what the producer leaves and
    the field is not read), ``maxnreg`` the cap at entry that the register split is carved from.
    ``persistent``: ``ctas_per_sm`` programs per SM looping over the tiles (True), one program
    per tile (False), or the launcher's choice by shape (None, ``use_persistent``).
    ``q_buffers``: Q buffers a consumer on the persistent grid (3: the next tiles' Q land during
    this one and O leaves through the Q slot; 1: O through one O tile of the CTA, the Q slot freed
    at the last ``Q K^T``, where three do not fit). ``dynamic_from``: the key length from which
    the persistent causal grid deals its items dynamically (``dynamic_deal``; None: never)."""

    num_consumers: int
    block_n: int
    num_stages: int
    consumer_regs: int
    maxnreg: int
    pingpong: bool = True
    persistent: bool | None = None
    ctas_per_sm: int = 1
    q_buffers: int = 3
    dynamic_from: int | None = None


# D=128: 2 x 64 query rows, 128-key tiles, 2 slots (Q 32 KB + K/V 128 KB of shared memory);
# 12 warps at 168 registers at entry = 240 + 240 + 24 after setmaxnreg.
# D=64: the same schedule; the K/V tiles are half the size, so 3 slots fit.
CONFIGS = {
    128: Sm90Config(2, 128, 2, 240, 168),
    64: Sm90Config(2, 128, 3, 240, 168),
    # D=192 / Dv=128: Q 2 x 24 KB, K 2 x 48 KB, V 2 x 32 KB (208 KB). A persistent grid's
    # further Q buffers do not fit, so it runs with one a consumer and O through a 16 KB tile of
    # its own (224 KB; ``q_buffers``). H200, bf16, 8k tokens of 16 heads, three rotated rounds
    # (scripts/fwd_config_ab.py --mla), TFLOP/s flat / persistent: causal 2048 521 / 568, 4096
    # 594 / 620, 8192 644 / 647, 16384 661 / 679; non-causal 4096 689 / 673, 8192 704 / 681. So
    # causal runs persistent, dealt dynamically from 4096 keys (``DYNAMIC_DEAL``), and
    # non-causal persistent up to 2048 keys and flat past them (``ONE_Q_FULL_MAX_KEY_TILES``).
    192: Sm90Config(2, 128, 2, 240, 168, q_buffers=1, dynamic_from=4096),
    # D=256: 64-key tiles (Q 2 x 32 KB, K and V 2 x 32 KB each: 192 KB; the O accumulator alone
    # takes 128 registers a thread), persistent with one Q buffer a consumer and a 32 KB O tile
    # (224 KB) where that measured faster: causal up to 2048 keys (``use_persistent``) and
    # non-causal up to 1024 (``ONE_Q_FULL_MAX_KEY_TILES``). H200,
    # bf16, 8k tokens of 16 heads, three rotated rounds (scripts/fwd_config_ab.py --d256), two
    # calls, TFLOP/s flat / persistent: causal 1024 471 / 488, 470 / 481; 2048 564 / 574, 565 /
    # 589; 4096 645 / 642; 8192 703 / 681; 16384 717 / 699; non-causal 4096 716 / 684.
    256: Sm90Config(2, 64, 2, 240, 168, q_buffers=1),
}
# D=64, long sequences: 3 x 64 query rows (13 warps at 128 registers at entry, 160 + 160 + 168
# for the consumers and 24 for the producer after setmaxnreg; 123 KB of shared memory). At
# D=64 a step's exponentials take the multi-function unit about as long as its two products
# take the tensor cores, so with two warpgroups their softmaxes overlap each other; a third
# gives each softmax two products' time (docs/hopper_fwd_configs.md, "Three consumers at D=64").
# Persistent non-causal, flat causal (measured: equal or ahead of the other schedule).
D64_THREE = Sm90Config(3, 128, 3, 160, 128)
# Three consumers from these lengths on (queries and keys); below them 192-row tiles lose
# more to the causal diagonal and to the last partial tile than the overlap gains (H100, bf16
# and fp16, scripts/hopper_fwd.py bench: the best three-consumer schedule 0.71-0.77x the best
# two-consumer one causal at S = 512 and 1024, 0.93-0.95x at 2048, 0.85-0.86x non-causal at
# 512). The window, softcap and ALiBi builds spill at 160 registers, so they keep two.
D64_THREE_MIN_SEQLEN = 2048
D64_THREE_MIN_SEQLEN_CAUSAL = 4096
# Non-causal, the grid decides too (``three_consumers_pay``): a program's tile is 192 rows
# against 128, so a problem of few tiles a head or few heads leaves whole SMs idle in its last
# round. Model: the time of a schedule is its rounds (``ceil(tiles / SMs)``) times its rows a
# tile, over its speed a row; three consumers run a row D64_THREE_SPEEDUP times as fast as two
# at long key loops and are taken when the model puts them D64_THREE_MARGIN ahead. H100, bf16,
# CUDA-graph replays (an A/B of both configs through ``plan(config=...)``, three rounds; time
# three / two consumers): (8, 32, 2048) 0.94, (4, 32, 4096) 0.91, (2, 32, 8192) 0.88,
# (1, 32, 16384) 0.90, (2, 16, 4096) 0.96, (1, 16, 4096) 0.99, (1, 8, 4096) 1.31, (2, 8, 2048)
# 1.28; at S = 1024 1.035 at (16, 32), 1.07 at (4, 16) and 1.35 at (2, 16), where the length
# floor above now keeps two (it was 1024). The model: 0.92, 0.92, 0.88, 0.88, 1.00, 1.00, 1.34,
# 1.34; at S = 1024 1.00, 1.00, 1.34.
D64_THREE_SPEEDUP = 1.12
D64_THREE_MARGIN = 0.97
# Causal (from D64_THREE_MIN_SEQLEN_CAUSAL on), three consumers only where their 192-row tiles
# fill at least this many rounds of the SMs (``three_consumers_fill``); below, one consumer a CTA
# (``ONE_D64``, persistent, heaviest tiles first), whose 64-row tiles balance a causal grid of
# few heads. H200, bf16, CUDA-graph replays of every config through ``flashcore.attention``
# (``pick_config`` replaced), two rounds, us: (1, 8, 4096) three 53.3, one 41.1, two 42.7;
# (1, 16, 4096) 86.3 / 78.9 / 81.7; (1, 32, 4096) and (2, 16, 4096) 162.7-163.9 each; (1, 4,
# 8192) 99.4 / 74.5; (1, 8, 8192) 154.1 / 148.4; (1, 2, 16384) 198.2 / 141.1; (1, 4, 16384)
# 294.4 / 291.3; but (1, 16, 8192) 288.8 / 324.1 / 309.3 and (1, 8, 16384) 578.7 / 637.7 /
# 607.6 (5.2 rounds), and the FA sweep's causal points (21-22 rounds) keep three consumers
# (docs/hopper_fwd_configs.md, "Causal D = 64 on few heads").
D64_THREE_MIN_ROUNDS_CAUSAL = 4.0


def three_consumers_pay(seqlen_q: int, batch_heads: int, sms: int) -> bool:
    """Whether 192-row tiles on ``sms`` SMs beat 128-row ones by the model above."""

    def cost(rows: int, speed: float) -> float:
        tiles = -(-seqlen_q // rows) * batch_heads
        return -(-tiles // sms) * rows / speed

    return cost(192, D64_THREE_SPEEDUP) <= D64_THREE_MARGIN * cost(128, 1.0)


def three_consumers_fill(seqlen_q: int, batch_heads: int, sms: int) -> bool:
    """Causal: whether 192-row tiles fill ``D64_THREE_MIN_ROUNDS_CAUSAL`` rounds of ``sms`` SMs."""
    return -(-seqlen_q // 192) * batch_heads >= D64_THREE_MIN_ROUNDS_CAUSAL * sms


# One consumer warpgroup of 64 query rows a CTA and two CTAs an SM, persistent over twice as
# many programs as SMs (8 warps at 128 registers at entry, 232 for the consumer and 24 for the
# producer after setmaxnreg; D=64 128-key tiles in 2 slots, 90 KB of shared memory a CTA; D=128
# 64-key tiles in 2 slots, 115 KB: two fit the SM's 228 KB). The SM still holds two consumer
# warpgroups, but each walks its own work tile with no turn to wait for, so one CTA's tile ends
# (the last P V, the epilogue, the next Q) while the other's products run, and the 64-row
# tiles halve the rows a causal diagonal wastes and double the tiles a small grid has. H100,
# bf16, CUDA-graph replays of both configs through ``plan(config=...)``, three rounds in one
# process (docs/hopper_fwd_configs.md, "One consumer a CTA, two CTAs an SM"), TFLOP/s two
# consumers / one: D=64 causal (32, 32, 512) 231 / 249, (16, 32, 1024) 294 / 298, (2, 16,
# 1024) 248 / 275, (2, 8, 2048) 332 / 348, (8, 32, 2048) 349 / 348, (1, 32, 4096) against three
# consumers 392 / 393; D=64 non-causal (1, 8, 512) 60 / 88, (2, 8, 2048) 405 / 426, (1, 32,
# 1024) 364 / 386, but (4, 8, 2048) 426 / 413 and (32, 32, 512) 377 / 361; D=128 causal (32,
# 16, 512) 280 / 313, (8, 16, 512) 261 / 283, (1, 8, 1024) 128 / 150, but (16, 16, 1024) 399 /
# 376 and (2, 8, 2048) 501 / 418; D=128 non-causal (1, 8, 1024) 261 / 323, but (2, 8, 2048) 569
# / 504. At D=128 128-key tiles do not fit (180 KB, spills).
ONE_D64 = Sm90Config(1, 128, 2, 232, 128, pingpong=False, persistent=True, ctas_per_sm=2)
ONE_D128 = Sm90Config(1, 64, 2, 232, 128, pingpong=False, persistent=True, ctas_per_sm=2)
ONE = {64: ONE_D64, 128: ONE_D128}
# Causal D=64 up to 1024 queries and keys over a grid of at least ONE_THREE_CTAS_MIN_ROUNDS
# rounds of 128-row tiles: 64-key tiles and three CTAs an SM (80 registers at entry, 136 for the
# consumer after setmaxnreg, 58 KB of shared memory a CTA). H100, the same A/B (three rounds,
# TFLOP/s two CTAs / three): bf16 (32, 32, 512) 250 / 272 by do_bench and 249 / 267 fp16,
# (8, 32, 512) 231 / 240, (16, 32, 1024) 313 / 324, (20, 32, 768) 279 / 288; but fewer tiles
# lose: (4, 32, 512) 229 / 214, (2, 16, 1024) 278 / 243, (1, 8, 512) 41 / 38.
ONE_D64_THREE_CTAS = Sm90Config(
    1, 64, 2, 136, 80, pingpong=False, persistent=True, ctas_per_sm=3, dynamic_from=0
)
ONE_THREE_CTAS_MIN_ROUNDS = 6.0
# Where one consumer is taken (``one_consumer``): causal up to these lengths, and otherwise
# where the two-consumer grid of 128-row tiles fills at most ONE_MAX_ROUNDS rounds of the SMs
# (D=64: 2; D=128: half of one). Through flashcore-bench's FA sweep (bf16, two runs) one
# consumer at D=64 causal 2048 read 365-366 TFLOP/s against 375-376 for two consumers in the
# previous session's runs, so causal D=64 takes it up to 1024 only (and by the grid rule).
ONE_CAUSAL_MAX_SEQLEN = {64: 1024, 128: 512}
ONE_MAX_ROUNDS = {64: 2.0, 128: 0.5}
# Causal D=64 longer than that, up to four rounds (H200, bf16, CUDA-graph replays of each config
# through flashcore.attention, two rounds, us, two consumers / one): (1, 32, 2048) 47.5 / 46.6,
# (4, 8, 2048) 47.2 / 46.0, (1, 24, 2048) 44.4 / 42.8, (1, 16, 3072) 53.4 / 49.0; past four
# rounds within 3% either way: (2, 24, 2048) 70.5 / 68.6, (1, 64, 2048) 91.7 / 91.1, (2, 32,
# 3072) 190.5 / 190.6, and two consumers ahead at the FA sweep's (8, 32, 2048) (15.5 rounds,
# above). From 4096 on the causal three-consumer rule decides (``three_consumers_fill``).
ONE_MAX_ROUNDS_CAUSAL = {**ONE_MAX_ROUNDS, 64: 4.0}

# Windows of few keys a row (``window_keys``: left + 1 + right, right 0 when causal): one
# consumer a CTA on 64-row tiles and 64-key tiles, three CTAs an SM at D = 64 and two at
# D = 128. A 128-row tile with 128-key tiles computes twice the pairs a 128-key window leaves
# it; 64 x 64 tiles compute 1.5 times, and the CTAs' tiles (two key steps each) overlap one
# another's fill and epilogue, where two consumers of one tile cannot. H200, bf16, 16k tokens
# (2048 / D heads), three rotated rounds of do_bench through ``flashcore.attention`` with
# ``pick_config`` replaced (scripts/fwd_window_config_ab.py), default / one time:
# D = 128 causal window (127, 0) at 4096 and 16384 keys 1.57-1.65 (1.27 on 8 heads of 4096),
# (255, 0) 1.21, (383, 0) 1.07, (511, 0) 0.98, (1023, 0) 0.93; non-causal (64, 63) 1.84,
# (128, 127) 1.33, (256, 256) 0.99. D = 64 (three CTAs) causal (127, 0) 1.69-1.72 (1.07 on 8
# heads of 4096), (511, 0) 1.16, (767, 0) 1.06, (1023, 0) 1.01; non-causal (256, 256) 1.15,
# (384, 384) 1.10; 4 heads of 2048 with (255, 0) 1.00. Two CTAs of 128-row tiles at D = 64 gained
# less (1.24), and two consumers on 64-key tiles less still (1.22-1.42, and 0.89-0.95 past 512).
WINDOW_ONE = {64: ONE_D64_THREE_CTAS, 128: ONE_D128}
WINDOW_ONE_MAX_KEYS = {64: 768, 128: 384}


def window_keys(causal: bool, has_window: bool, left: int, right: int) -> int | None:
    """The keys a window leaves a query row (``left + 1 + right``; right 0 when causal, an
    unbounded side as ``ops.fwd.window_bounds`` gives it), or None without a window."""
    return left + 1 + (0 if causal else right) if has_window else None


def short_window(head_dim: int, keys: int | None) -> bool:
    """Whether a window of ``keys`` keys a row (``window_keys``; None: no window) is one
    ``WINDOW_ONE`` has a config for at kernel head dim ``head_dim``."""
    return keys is not None and keys <= WINDOW_ONE_MAX_KEYS.get(head_dim, 0)


def takes_window_one(head_dim: int, causal: bool, window: tuple[int, int]) -> bool:
    """Whether ``pick_config`` gives a dense problem with ``window`` (as ``flashcore.attention``
    takes it, -1 for a side without bound) a ``WINDOW_ONE`` config (``short_window``)."""
    left, right = window
    if left < 0 or (right < 0 and not causal):
        return False
    return short_window(head_dim, window_keys(causal, True, left, right))


def one_consumer(
    head_dim: int,
    seqlen_q: int,
    seqlen_k: int,
    causal: bool,
    grid: tuple[int, int] | None,
    packed: bool = False,
) -> Sm90Config | None:
    """The one-consumer config a problem takes by the measured rules above (``ONE`` or
    ``ONE_D64_THREE_CTAS``), or None; ``grid``: ``(batch * heads, SMs)`` (without it, a full grid
    is assumed); ``packed``: a packed batch whose lengths vary, which keeps ``ONE_MAX_ROUNDS``
    (the causal limit was measured on dense problems)."""
    if head_dim not in ONE:
        return None
    rounds = None if grid is None else -(-seqlen_q // 128) * grid[0] / grid[1]
    if causal and max(seqlen_q, seqlen_k) <= ONE_CAUSAL_MAX_SEQLEN[head_dim]:
        if head_dim == 64 and (rounds is None or rounds >= ONE_THREE_CTAS_MIN_ROUNDS):
            return ONE_D64_THREE_CTAS
        return ONE[head_dim]
    limit = (ONE_MAX_ROUNDS_CAUSAL if causal and not packed else ONE_MAX_ROUNDS)[head_dim]
    if rounds is not None and rounds <= limit:
        return ONE[head_dim]
    return None


def pick_config(
    head_dim: int,
    seqlen_q: int,
    seqlen_k: int,
    causal: bool,
    options: bool,
    grid: tuple[int, int] | None = None,
    packed: bool = False,
    keys: int | None = None,
) -> Sm90Config:
    """The launch config of a problem: ``CONFIGS``, three consumers at D=64 where they measured
    faster, or one consumer a CTA for short causal problems, long causal ones on few heads and
    small grids, and windows of at most ``WINDOW_ONE_MAX_KEYS`` keys a row (``keys``, as
    ``window_keys`` counts them; None without a window). ``options``: a window, softcap or ALiBi
    is on, which keeps ``CONFIGS``' two consumers short of three; ``grid``: ``(batch * heads,
    SMs)``, which assumes a full grid without it; ``packed``: a packed batch whose lengths vary
    (``varlen_spread``), for which the grid and window rules, measured on dense problems, are not
    taken: long causal D=64 keeps three consumers on the flat grid and its work list."""
    if not packed and short_window(head_dim, keys):
        return WINDOW_ONE[head_dim]
    floor = D64_THREE_MIN_SEQLEN_CAUSAL if causal else D64_THREE_MIN_SEQLEN
    long = head_dim == 64 and not options and min(seqlen_q, seqlen_k) >= floor
    if long and causal:
        if grid is None or packed or three_consumers_fill(seqlen_q, *grid):
            return D64_THREE._replace(persistent=False)
        return ONE_D64
    if long and (grid is None or three_consumers_pay(seqlen_q, *grid)):
        return D64_THREE._replace(persistent=True)
    one = None if options else one_consumer(head_dim, seqlen_q, seqlen_k, causal, grid, packed)
    return one or CONFIGS[head_dim]


# Persistent up to this many key tiles per query tile (Sk <= 4096 at BLOCK_N = 128). Measured on
# the H100 (bf16, two runs, 32k tokens, docs/hopper_fwd_configs.md "Persistent schedule"),
# persistent / flat TFLOP/s: D=128 non-causal +15-19% at S=512, +7% at 1k, +2-3% at 2k; D=128
# causal +2-5% at 512, +9-15% at 1k, +8-9% at 2k, +4-5% at 4k (despite 16 B of spills in its
# persistent build); D=64 non-causal +30-31% at 512 ... -0..+1% at 4k; D=64 causal +10-12% at
# 512, +21-22% at 1k, +5-7% at 4k. D=128 non-causal at 4k measured -1..-3% then and stayed flat
# to 2k; with today's kernels it gains 2-3% there (H100, scripts/fwd_switch_ab.py's method,
# nine rotated rounds, two runs, 16k tokens of 16 heads: 1.021-1.033x; 8k 1.000-1.007x, 16k
# 0.993-1.001x; docs/hopper_fwd_configs.md "Persistent D = 128 non-causal at 4096 keys"), so it
# takes the same limit. At 16k every case is flat or up to 4% slower with persistence.
PERSISTENT_MAX_KEY_TILES = 32


# With a window, count the keys it leaves a query tile (``loop_keys``) instead of ``seqlen_k``:
# a long windowed problem's tiles are as short as a short problem's and take the persistent grid
# the same. H200, bf16, scripts/fwd_switch_ab.py PERSISTENT_WINDOW_KEYS, 16k tokens, two runs,
# off / on time (outputs bit for bit equal): causal (127, 0) at 8192-16384 keys D = 64
# 1.29-1.30, D = 128 1.04 at 16384 and 0.995-0.998 at 8192, 4096 (persistent either way)
# 0.996-1.000; (256, 256) at 8192-16384 D = 64 1.24-1.28, D = 128 1.12-1.15, 2048 0.999-1.004.
# (Measured before ``WINDOW_ONE``, which now takes the shorter of these windows.)
PERSISTENT_WINDOW_KEYS = True


def loop_keys(
    seqlen_k: int, block_m: int, causal: bool, has_window: bool, left: int, right: int
) -> int:
    """The keys one query tile of ``block_m`` rows can see: ``seqlen_k``, or with a window
    (``PERSISTENT_WINDOW_KEYS``) at most ``left + block_m + right`` (right 0 when causal; an
    unbounded side arrives as ``Sq + Sk``, ``ops.fwd.window_bounds``)."""
    if not (PERSISTENT_WINDOW_KEYS and has_window):
        return seqlen_k
    return min(seqlen_k, window_keys(causal, True, left, right) - 1 + block_m)


def use_persistent(
    seqlen_k: int,
    head_dim: int,
    causal: bool,
    block_n: int,
    max_key_tiles: int = PERSISTENT_MAX_KEY_TILES,
) -> bool:
    """The default schedule: persistent for short key loops, up to ``max_key_tiles`` key tiles
    (see the measurements above; ``ONE_Q_FULL_MAX_KEY_TILES`` for the one-Q-buffer configs
    without causal masking)."""
    return -(-seqlen_k // block_n) <= max_key_tiles


# Non-causal with one Q buffer a consumer (head dims 192 and 256, ``CONFIGS``): persistent up to
# this many key tiles (MLA up to 2048 keys, head dim 256 up to 1024), flat past it. H200, bf16,
# 8k tokens of 16 heads, three rotated rounds (scripts/fwd_config_ab.py --mla / --d256), two
# calls for MLA, TFLOP/s flat / persistent: MLA 512 keys 439 / 529 and 442 / 529, 1024 556 / 607
# and 557 / 598, 2048 632 / 641 and 618 / 644, 4096 658 / 659 (670 for "auto", the same flat
# config); head dim 256 512 487 / 521, 1024 593 / 606, 2048 663 / 647, 4096 695 / 680.
ONE_Q_FULL_MAX_KEY_TILES = 16


# Causal work orders (``kernels/hopper/common.py: work``). A causal query tile's cost grows
# with its index, so the order in which tiles meet the SMs sets the tail. The flat grid's
# programs are handed out as SMs free up (greedy, in order): heaviest first across groups of up
# to LPT_MAX_HEADS heads balances it. The persistent grid deals items to programs in a fixed
# snake (``snake``): each head's tiles last-first balances it when the grid holds whole heads
# (132 SMs against 32 tiles a head does not: a list-scheduling model of (1, 16, 4096, 128)
# puts the makespan at 1.5x the even split), so the launcher models the snake for a few grids
# and orders and takes the shortest (``causal_order``). A group's heads read their K and V at
# once: at most LPT_L2_BYTES of them (the H100 has 50 MB of L2), and at most LPT_MAX_HEADS, so
# that every head has several tiles in flight reading its keys together.
LPT_MAX_HEADS = 16
LPT_L2_BYTES = 32 * 2**20
# A tile's fixed cost (Q load, epilogue, pipeline fill) in key tiles, for the model.
LPT_TILE_COST = 1.0
# Grids tried below the SM count for the persistent snake (an eighth of the SMs at most).
LPT_GRID_SLACK = 8


def tile_costs(
    seqlen_q: int,
    seqlen_k: int,
    block_m: int,
    block_n: int,
    window_left: int,
    has_window: bool,
) -> list[float]:
    """Modelled cost of each causal query tile of ``block_m`` rows: the key tiles it walks
    (``kv_tile_range``) plus ``LPT_TILE_COST``."""
    diag = seqlen_k - seqlen_q
    costs = []
    for t in range(-(-seqlen_q // block_m)):
        start = t * block_m
        hi = min(seqlen_k, max(start + block_m + diag, 0))
        lo = (max(start + diag - window_left, 0) // block_n) * block_n if has_window else 0
        costs.append(max(-(-(hi - lo) // block_n), 0) + LPT_TILE_COST)
    return costs


def lpt_group(heads: int, bytes_per_head: int) -> int:
    """The most heads a causal order interleaves (``kernels/hopper/common.py: interleave``): a
    divisor of ``heads`` (B * H), at most LPT_MAX_HEADS, whose reads (``bytes_per_head`` each)
    fit LPT_L2_BYTES together; 1 where none does."""
    return max(
        d for d in range(1, min(heads, LPT_MAX_HEADS) + 1)
        if heads % d == 0 and (d == 1 or d * bytes_per_head <= LPT_L2_BYTES)
    )  # fmt: skip


def causal_order(
    costs: list[float], heads: int, sms: int, persistent: bool, kv_bytes: int
) -> tuple[int, int]:
    """``(grid, lpt_heads)`` of a causal forward with per-tile ``costs`` over ``heads`` (B * H)
    heads whose K and V take ``kv_bytes`` each: the flat grid takes the widest group the limits
    allow; the persistent one the modelled-shortest snake over grids ``sms - sms //
    LPT_GRID_SLACK .. sms`` and groups of 1 or the widest (ties to the full grid, then to 1)."""
    n_work = len(costs) * heads
    widest = lpt_group(heads, kv_bytes)
    if not persistent:
        return n_work, widest
    import torch  # the model's arithmetic, on the CPU

    per_tile = torch.tensor(costs, dtype=torch.float64)
    best = None
    top = min(sms, n_work)
    for group in dict.fromkeys((1, widest)):
        # Item w's cost in this order (work): group, then tile last-first, then head.
        order = per_tile.flip(0).repeat_interleave(group).repeat(heads // group)
        for grid in range(top, max(top - sms // LPT_GRID_SLACK, 1) - 1, -1):
            waves = -(-n_work // grid)
            dealt = torch.zeros(waves * grid, dtype=torch.float64)
            dealt[:n_work] = order
            dealt = dealt.view(waves, grid)
            dealt[1::2] = dealt[1::2].flip(1)
            span = float(dealt.sum(0).max())
            if best is None or span < best[0] * (1 - 1e-9):
                best = (span, grid, group)
    return best[1], best[2]


# The persistent causal grid's items past the first wave from a counter (DYNAMIC, dense problems,
# ``kernels/hopper/fwd.py``, "Dynamic deal"): whichever program is free first takes the next
# heaviest tile, in the flat grid's order, instead of the fixed snake, whose modelled makespan
# (``causal_order``) is 3% over an even split at (1, 16, 8192) and (2, 16, 4096) against 0-0.2%
# for the first-come deal. Measured (H200, bf16, the two plans launched directly and through
# scripts/fwd_switch_ab.py, 3-9 rotated rounds, several device calls; snake time / dealt time):
# MLA (192, 128) 1.005-1.028 at (2, 16, 4096), 1.015-1.027 at (2, 16, 8192), 0.978-1.022 at
# (1, 16, 8192), 0.96-1.00 from 2048 keys down; D = 64 three CTAs an SM (16, 32, 1024)
# 1.021-1.047; but D = 128 0.95-1.01 at 1024-4096 keys (0.96 at (2, 16, 4096)), 0.98 at (32,
# 16, 512) one consumer, D = 64 two consumers (8, 32, 2048) 0.99-1.00. So the configs that
# gained carry ``dynamic_from``; head dim 256 never (its consumers spill 128 B with it, none
# without).
DYNAMIC_DEAL = True


def dynamic_deal(
    cfg: Sm90Config, persistent: bool, causal: bool, varlen: Varlen | None, seqlen_k: int
) -> bool:
    """Whether a plan deals its persistent grid's items dynamically (``DYNAMIC_DEAL``, the
    config's ``dynamic_from``)."""
    return (
        DYNAMIC_DEAL and persistent and causal and varlen is None
        and cfg.dynamic_from is not None and seqlen_k >= cfg.dynamic_from
    )  # fmt: skip


# A packed batch whose lengths vary runs the flat grid: the persistent one deals work items to
# programs in a fixed order, blind to their lengths (the grid's longest, an empty tile past a
# short sequence's end), and the hardware's hand-out balances them. H100, bf16,
# scripts/varlen_bench.py, the same config on either grid (docs/hopper_fwd_configs.md, "Packed
# batches"), flat / persistent time: 16 sequences of 256-4096 tokens 0.91-0.92 (D = 64
# non-causal) and 0.95-0.96 (D = 128 causal), 192 of 16-512 0.91-0.92 and 0.83 (D = 128; but
# 1.05-1.07 at D = 64 non-causal, where "auto" runs the portable forward), 8192,
# 8192, 1000, 77 and 3 tokens 0.95-0.96 (D = 64 non-causal) and 0.99-1.01 (D = 128); 16 x 2048
# 0.99-1.16 (the rule leaves it persistent). Taken where the grid's rows (batch x the longest)
# are at least VARLEN_FLAT_SPREAD times the packed rows, with two or three consumers (the
# one-consumer configs, two or three CTAs an SM, were not timed flat with varlen).
VARLEN_FLAT_SPREAD = 1.25


def varlen_spread(batch: int, longest: int, total: int) -> bool:
    """Whether a packed batch of ``total`` rows in ``batch`` sequences, the longest ``longest``
    (``total`` 0: dense), varies enough in length for the flat grid (``VARLEN_FLAT_SPREAD``)."""
    return total > 0 and batch * longest >= VARLEN_FLAT_SPREAD * total
