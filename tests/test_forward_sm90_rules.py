"""The Hopper forward's rules, on the CPU: which config, grid and work order a problem gets
(``ops/fwd_sm90_configs.py``, ``ops/fwd_sm90.py``), each against the measurement it rests on.
The launches themselves, on the GPU: ``test_forward_sm90.py``."""

import pytest
import torch

from flashcore import tuning


def test_sm90_forward_window_loop_keys(monkeypatch):
    """The keys the persistent rule counts: ``seqlen_k``, or with PERSISTENT_WINDOW_KEYS and a
    window the keys one query tile can see (an unbounded side arrives as Sq + Sk)."""
    from flashcore.ops import fwd_sm90_configs

    monkeypatch.setattr(fwd_sm90_configs, "PERSISTENT_WINDOW_KEYS", False)
    assert fwd_sm90_configs.loop_keys(16384, 128, True, True, 127, 0) == 16384
    monkeypatch.setattr(fwd_sm90_configs, "PERSISTENT_WINDOW_KEYS", True)
    # Causal: the right side is 0.
    assert fwd_sm90_configs.loop_keys(16384, 128, True, True, 127, 32768) == 255
    assert fwd_sm90_configs.loop_keys(16384, 192, False, True, 100, 50) == 342
    assert fwd_sm90_configs.loop_keys(16384, 128, False, True, 32768, 50) == 16384  # left unbounded
    assert fwd_sm90_configs.loop_keys(16384, 128, True, False, 0, 0) == 16384  # no window
    assert fwd_sm90_configs.loop_keys(200, 128, True, True, 127, 0) == 200
    keys = fwd_sm90_configs.loop_keys(16384, 128, True, True, 127, 0)
    assert fwd_sm90_configs.use_persistent(keys, 64, True, 128)


def test_sm90_forward_head_dim_256_from_256():
    """Auto takes the Hopper forward at head dim 256 (and the head dims run as 256) from 256
    queries and keys: 1.3-1.5x the portable forward at 256 and 512 (H200); shorter ones and
    problems below the FLOP floor stay portable."""
    from flashcore import tuning

    flops = 4 * 64 * 16 * 256 * 256 * 256
    assert tuning.sm90_forward(512, 512, 256, flops)
    assert tuning.sm90_forward(256, 256, 256, flops / 2, causal=True)
    assert not tuning.sm90_forward(255, 255, 256, flops)
    assert not tuning.sm90_forward(512, 512, 256, tuning.SM90_FWD_MIN_FLOPS / 2)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_persistent_up_to_32_key_tiles(head_dim, causal):
    """The launcher's schedule by length: persistent up to 32 key tiles of 128 (4096 keys) for
    every head dim, causal or not (D=128 non-causal included since it measured 2-3% faster
    persistent at 4096 on the H100), flat past it."""
    from flashcore.ops import fwd_sm90_configs

    assert fwd_sm90_configs.use_persistent(4096, head_dim, causal, 128)
    assert fwd_sm90_configs.use_persistent(2049, head_dim, causal, 128)
    assert not fwd_sm90_configs.use_persistent(4097, head_dim, causal, 128)
    assert fwd_sm90_configs.use_persistent(2048, head_dim, causal, 64)
    assert not fwd_sm90_configs.use_persistent(2049, head_dim, causal, 64)


@pytest.mark.parametrize(
    "head_dim, seqlen, causal, options, consumers, persistent",
    [
        (64, 4096, False, False, 3, True),
        (64, 2048, False, False, 3, True),
        (64, 1024, False, False, 2, None),  # two consumers below 2048 (and by the grid)
        (64, 512, False, False, 2, None),  # the launcher's schedule by length
        (64, 4096, True, False, 3, False),
        (64, 2048, True, False, 2, None),
        (64, 1024, True, False, 1, True),  # one consumer a CTA, causal up to 1024
        (64, 512, True, False, 1, True),
        (64, 2048, True, True, 2, None),  # window, softcap or ALiBi: two consumers
        (64, 8192, False, True, 2, None),
        (128, 8192, False, False, 2, None),
        (128, 512, True, False, 1, True),  # one consumer a CTA, causal up to 512
        (128, 768, True, False, 2, None),
        (128, 512, True, True, 2, None),
    ],
)
def test_sm90_forward_config(head_dim, seqlen, causal, options, consumers, persistent):
    """The Hopper forward's tiles per problem (a full grid): three consumer warpgroups at D=64
    from the measured lengths on, persistent when not causal; one consumer a CTA, two CTAs an
    SM, for causal problems up to 1024 (D=64) or 512 (D=128) queries and keys."""
    from flashcore.ops import fwd_sm90_configs

    cfg = fwd_sm90_configs.pick_config(head_dim, seqlen, seqlen, causal, options)
    assert (cfg.num_consumers, cfg.persistent) == (consumers, persistent)
    if consumers == 1:
        # Causal D=64 over a full grid: three CTAs an SM with 64-key tiles.
        want = (
            fwd_sm90_configs.ONE_D64_THREE_CTAS
            if head_dim == 64
            else fwd_sm90_configs.ONE[head_dim]
        )
        assert cfg == want and not cfg.pingpong
    else:
        assert cfg.ctas_per_sm == 1 and cfg.block_n == 128
    # Queries and keys of different lengths: the longer side decides the causal one-consumer
    # rule, the shorter one the three-consumer rule.
    if causal and not options:
        longer = fwd_sm90_configs.pick_config(head_dim, 256, 8192, causal, options)
        assert longer == fwd_sm90_configs.CONFIGS[head_dim]


@pytest.mark.parametrize(
    "head_dim, batch_heads, seqlen, consumers",
    [
        (64, 128, 4096, 3),  # 2816 tiles of 192 rows: 22 rounds on 132 SMs against 32 of 128 rows
        (64, 256, 2048, 3),
        (64, 32, 16384, 3),
        (64, 8, 4096, 1),  # 256 tiles of 128 rows: at most two rounds, one consumer a CTA
        (64, 16, 2048, 1),
        (64, 8, 512, 1),
        (64, 32, 2048, 2),  # 512 tiles: four rounds
        (64, 32, 4096, 2),  # three consumers modelled level (1.004): two
        (128, 8, 1024, 1),  # 64 tiles: half a round
        (128, 16, 1024, 2),
        (128, 16, 2048, 2),
    ],
)
def test_sm90_consumers_by_grid(head_dim, batch_heads, seqlen, consumers):
    """Non-causal: three consumer warpgroups (D=64) only where the rounds of 192-row tiles on the
    SMs beat those of 128-row tiles by the model (``fwd_sm90_configs.three_consumers_pay``); one
    consumer a CTA where 128-row tiles fill at most ``ONE_MAX_ROUNDS`` rounds
    (``one_consumer``)."""
    from flashcore.ops import fwd_sm90_configs

    grid = (batch_heads, 132)
    cfg = fwd_sm90_configs.pick_config(head_dim, seqlen, seqlen, False, False, grid=grid)
    assert cfg.num_consumers == consumers


@pytest.mark.parametrize(
    "batch_heads, seqlen, consumers",
    [
        (128, 4096, 3),  # the FA sweep's (4, 32, 4096): 2816 tiles of 192 rows, 21 rounds
        (32, 16384, 3),
        (16, 8192, 3),  # 688 tiles: 5.2 rounds
        (8, 16384, 3),
        (32, 4096, 3),  # 704 tiles: 5.3 rounds (level with one consumer, measured)
        (16, 4096, 1),  # 352 tiles: 2.7 rounds
        (8, 8192, 1),
        (8, 4096, 1),  # 1.3 rounds
        (4, 16384, 1),
        (2, 16384, 1),
    ],
)
def test_sm90_causal_d64_three_consumers_by_grid(batch_heads, seqlen, consumers):
    """Causal D=64 from 4096 on: three consumer warpgroups (flat) where their 192-row tiles fill
    ``D64_THREE_MIN_ROUNDS_CAUSAL`` rounds of the SMs (``three_consumers_fill``), one consumer a
    CTA (persistent, two CTAs an SM) below."""
    from flashcore.ops import fwd_sm90_configs

    cfg = fwd_sm90_configs.pick_config(64, seqlen, seqlen, True, False, grid=(batch_heads, 132))
    if consumers == 3:
        assert cfg == fwd_sm90_configs.D64_THREE._replace(persistent=False)
    else:
        assert cfg == fwd_sm90_configs.ONE_D64
    # A window, softcap or ALiBi keeps two consumers, whatever the grid; a packed batch whose
    # lengths vary keeps three consumers (the grid rule was measured on dense problems).
    grid = (batch_heads, 132)
    assert (
        fwd_sm90_configs.pick_config(64, seqlen, seqlen, True, True, grid=grid)
        == fwd_sm90_configs.CONFIGS[64]
    )
    packed = fwd_sm90_configs.pick_config(64, seqlen, seqlen, True, False, grid=grid, packed=True)
    assert packed == fwd_sm90_configs.D64_THREE._replace(persistent=False)


@pytest.mark.parametrize(
    "batch_heads, seqlen, consumers",
    [
        (32, 2048, 1),  # 512 tiles of 128 rows: 3.9 rounds
        (24, 2048, 1),
        (16, 3072, 1),  # 384 tiles: 2.9 rounds
        (48, 2048, 2),  # 5.8 rounds
        (256, 2048, 2),  # the FA sweep's (8, 32, 2048): 15.5 rounds
        (32, 3072, 2),
    ],
)
def test_sm90_causal_d64_one_consumer_by_grid(batch_heads, seqlen, consumers):
    """Causal D=64 between 1024 and 4096: one consumer a CTA (``ONE_D64``) where 128-row tiles
    fill at most ``ONE_MAX_ROUNDS_CAUSAL`` rounds of the SMs, two consumers past that."""
    from flashcore.ops import fwd_sm90_configs

    cfg = fwd_sm90_configs.pick_config(64, seqlen, seqlen, True, False, grid=(batch_heads, 132))
    assert cfg == (fwd_sm90_configs.ONE_D64 if consumers == 1 else fwd_sm90_configs.CONFIGS[64])
    # A packed batch whose lengths vary keeps the two-round limit (ONE_MAX_ROUNDS): every grid
    # here is past it.
    packed = fwd_sm90_configs.pick_config(
        64, seqlen, seqlen, True, False, grid=(batch_heads, 132), packed=True
    )
    assert packed == fwd_sm90_configs.CONFIGS[64]


@pytest.mark.parametrize(
    "batch_heads, seqlen, ctas",
    [
        (1024, 512, 3),  # the FA sweep's (32, 32, 512): 31 rounds of 128-row tiles
        (256, 512, 3),  # 7.8 rounds
        (128, 512, 2),  # 3.9 rounds
        (512, 1024, 3),
        (32, 1024, 2),
        (8, 512, 2),
    ],
)
def test_sm90_causal_d64_ctas_by_grid(batch_heads, seqlen, ctas):
    """Causal D=64 up to 1024: one consumer a CTA, three CTAs an SM with 64-key tiles from
    ``ONE_THREE_CTAS_MIN_ROUNDS`` rounds of 128-row tiles on, two with 128-key tiles below."""
    from flashcore.ops import fwd_sm90_configs

    cfg = fwd_sm90_configs.pick_config(64, seqlen, seqlen, True, False, grid=(batch_heads, 132))
    assert (cfg.num_consumers, cfg.ctas_per_sm) == (1, ctas)
    assert cfg.block_n == (64 if ctas == 3 else 128)


@pytest.mark.parametrize(
    "shape, persistent, want",
    [
        # One batch row of 16 heads at 4k: 512 tiles of 32 lengths on 132 SMs. The snake over
        # each head's tiles leaves the SMs a third idle (modelled); heaviest-first over all 16
        # heads balances it.
        ((1, 16, 4096, 128), True, (132, 16)),
        # 4 heads of 8k (flat): heaviest first across all 4 (64 MB of K/V would pass the L2
        # limit at 16 heads; 4 x 4 MB does not).
        ((1, 4, 8192, 128), False, (256, 4)),
        ((1, 32, 8192, 128), False, (2048, 8)),  # 8 heads' K and V are 32 MB
        # 4 batch rows: the snake over whole heads pairs long and short tiles already.
        ((4, 16, 4096, 128), True, (132, 1)),
        # 24 heads of 4k: 128 programs hold 4 whole heads a wave, and the snake pairs their
        # tiles; 132 would not (modelled 1.27x the even split against 1.03x).
        ((1, 24, 4096, 128), True, (128, 1)),
    ],
)
def test_sm90_causal_order(shape, persistent, want):
    """The causal work order and grid the Hopper launcher takes, from its load model."""
    from flashcore.ops import fwd_sm90_configs

    batch, heads, seqlen, head_dim = shape
    costs = fwd_sm90_configs.tile_costs(seqlen, seqlen, 128, 128, 0, False)
    assert costs[0] == 1 + fwd_sm90_configs.LPT_TILE_COST and costs[-1] == seqlen // 128 + 1
    kv_bytes = seqlen * 2 * head_dim * 2
    got = fwd_sm90_configs.causal_order(costs, batch * heads, 132, persistent, kv_bytes)
    assert got == want


def test_sm90_fast_divisor():
    """The Hopper forward's work-item divisions (``kernels/hopper/common.py: fast_div``, a 32-bit
    multiply-high, an add and a shift) equal ``//`` for every divisor the plan can pass, at the
    numerators where rounding would show (multiples of the divisor and one below), computed
    with the kernel's 32-bit wrap-around; out-of-range divisors are refused."""
    import random

    from flashcore.ops import fwd_sm90

    rng = random.Random(0)
    divisors = [*range(1, 2050), *(2**k + e for k in range(11, 30) for e in (-1, 0, 1))]
    divisors += [rng.randrange(1, 2**30) for _ in range(2000)]
    for d in divisors:
        magic, shift = fwd_sm90.fast_divisor(d)
        assert -(2**31) <= magic < 2**31 and 0 <= shift <= 30
        numerators = {0, 1, d - 1, d, d + 1, 2**30 - 1, 2**30 - d}
        numerators |= {
            d * rng.randrange(1, max(2, 2**30 // d)) + e for e in (-1, 0) for _ in range(8)
        }
        for n in numerators:
            if 0 <= n < 2**30:
                hi = (n * (magic & 0xFFFFFFFF)) >> 32  # mul.hi.u32 of the int32's bits
                assert (hi + n) >> shift == n // d, (n, d)
    for bad in (0, -3, 2**30):
        with pytest.raises(ValueError, match="fast_divisor"):
            fwd_sm90.fast_divisor(bad)


def test_sm90_forward_window_config():
    """Windows of few keys a row take one consumer a CTA on 64-row, 64-key tiles (three CTAs an
    SM at D = 64, two at D = 128), up to ``WINDOW_ONE_MAX_KEYS``; longer windows, other head
    dims and packed batches of varying lengths keep the other rules."""
    from flashcore.ops import fwd_sm90_configs

    def pick(head_dim, keys, causal=True, packed=False):
        return fwd_sm90_configs.pick_config(
            head_dim, 16384, 16384, causal, True, grid=(32, 132), packed=packed, keys=keys
        )

    assert fwd_sm90_configs.window_keys(True, True, 127, 32768) == 128  # causal: right is 0
    assert fwd_sm90_configs.window_keys(False, True, 64, 63) == 128
    assert fwd_sm90_configs.window_keys(False, True, 32768, 63) > 768  # left unbounded
    assert fwd_sm90_configs.window_keys(True, False, 127, 0) is None
    assert pick(64, 128) == pick(64, 768) == fwd_sm90_configs.ONE_D64_THREE_CTAS
    assert pick(128, 128) == pick(128, 384, causal=False) == fwd_sm90_configs.ONE_D128
    assert pick(64, 769) == pick(64, None) == fwd_sm90_configs.CONFIGS[64]
    assert pick(128, 385) == pick(128, None) == fwd_sm90_configs.CONFIGS[128]
    assert pick(64, 128, packed=True) == fwd_sm90_configs.CONFIGS[64]
    assert pick(192, 128) == fwd_sm90_configs.CONFIGS[192]
    assert pick(256, 128) == fwd_sm90_configs.CONFIGS[256]


def test_sm90_forward_short_window_floor():
    """ "auto" takes the Hopper forward for a window below ``SM90_FWD_MIN_SEQLEN_WINDOW`` only where
    the one-consumer configs take the window (dense, from the general floors; captured, from
    ``SM90_FWD_MIN_FLOPS_GRAPH`` at D = 64 too); other windows keep the floor."""
    from flashcore.ops import fwd_sm90_configs

    assert fwd_sm90_configs.takes_window_one(64, True, (127, 0))
    assert fwd_sm90_configs.takes_window_one(64, True, (767, -1))  # causal: the right side is 0
    assert fwd_sm90_configs.takes_window_one(64, False, (255, 255))
    assert not fwd_sm90_configs.takes_window_one(64, False, (127, -1))
    assert not fwd_sm90_configs.takes_window_one(64, True, (-1, 0))
    assert not fwd_sm90_configs.takes_window_one(64, False, (384, 384))
    assert fwd_sm90_configs.takes_window_one(128, False, (192, 191))
    assert not fwd_sm90_configs.takes_window_one(128, False, (255, 255))
    assert not fwd_sm90_configs.takes_window_one(192, True, (127, 0))
    flops = 4.0 * 32 * 32 * 512 * 512 * 64 / 2  # (32, 32, 512, 64) causal: 3.4e10
    assert tuning.sm90_forward(512, 512, 64, flops, True, window=True, short_window=True)
    assert not tuning.sm90_forward(512, 512, 64, flops, True, window=True)
    assert not tuning.sm90_forward(256, 256, 64, flops, True, window=True, short_window=True)
    assert not tuning.sm90_forward(
        512, 512, 64, flops, True, window=True, short_window=True, varlen=True
    )
    assert tuning.sm90_forward(2048, 2048, 64, flops, True, window=True)
    small = 4.0 * 2 * 8 * 1024 * 1024 * 64 / 2  # (2, 8, 1024, 64) causal: 2.7e8
    assert tuning.sm90_forward(2048, 2048, 64, small, True, graph=True, window=True)
    assert not tuning.sm90_forward(
        1024, 1024, 64, small, True, graph=True, window=True, short_window=True
    )
    assert tuning.sm90_forward(1024, 1024, 64, small * 16, True, graph=True, window=True,
                               short_window=True)  # fmt: skip


def test_sm90_narrow_qk_plan(monkeypatch):
    """Where the narrow-Q/K build is planned: head dims 72-96 (rounded up to 16; panels of 16 or
    32) on the two-consumer D = 128 config and 136-192 (at 192) on the D = 256 one, persistent
    with one Q buffer a consumer at every length; not 104-128 or 200-256, not with softcap or
    ALiBi, not on one consumer."""
    from flashcore.ops import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "num_sms", lambda index: 132)
    options = dict(
        causal=False, qk_scale=0.1, window_left=-1, window_right=-1, has_window=False,
        softcap=0.0, alibi=False, sinks=False, stride_ab=0,
    )  # fmt: skip
    widths = {72: (80, 16), 80: (80, 16), 88: (96, 32), 96: (96, 32)}
    for d, (width, panel) in widths.items():
        for seqlen, causal in ((4096, False), (16384, False), (4096, True)):
            q = torch.empty(1, 16, seqlen, d, dtype=torch.bfloat16)
            lse = torch.empty(1, 16, seqlen)
            p = fwd_sm90.plan(q, q, q, lse, **{**options, "causal": causal})
            assert (p.meta["HEAD_DIM"], p.boxes[0][3], p.boxes[2][3]) == (width, panel, 128), d
            assert p.meta["PERSISTENT"] and p.meta["Q_BUFS"] == 1 and p.grid == (132,)
    q = torch.empty(1, 16, 4096, 96, dtype=torch.bfloat16)
    lse = torch.empty(1, 16, 4096)
    for extra in ({"softcap": 30.0}, {"alibi": True}):
        assert fwd_sm90.plan(q, q, q, lse, **{**options, **extra}).meta["HEAD_DIM"] == 128
    monkeypatch.setattr(fwd_sm90, "NARROW_QK", False)
    plan = fwd_sm90.plan(q, q, q, lse, **options)
    assert plan.meta["HEAD_DIM"] == 128 and plan.meta["Q_BUFS"] == 3
    monkeypatch.setattr(fwd_sm90, "NARROW_QK", True)
    for d in (104, 112, 120, 128, 64, 200, 248, 256):
        assert fwd_sm90.narrow_qk_dim(d, d) is None
    assert fwd_sm90.narrow_qk_dim(96, 64) is None
    assert fwd_sm90.narrow_qk_dim(192, 128) is None  # MLA's own build
    # 136-192 (NARROW_QK_WIDE): 192 in 64-column panels against V at 256, 64-key tiles,
    # persistent at every length (the flat build would pass O through Q's narrower slot).
    for d in (136, 160, 192):
        for seqlen, causal in ((512, False), (8192, False), (8192, True)):
            q = torch.empty(2, 16, seqlen, d, dtype=torch.bfloat16)
            p = fwd_sm90.plan(q, q, q, torch.empty(2, 16, seqlen), **{**options, "causal": causal})
            assert (p.meta["HEAD_DIM"], p.boxes[0][3], p.boxes[2][3]) == (192, 64, 256), d
            assert p.meta["PERSISTENT"] and p.meta["Q_BUFS"] == 1 and p.meta["BLOCK_N"] == 64
    # One consumer a CTA (a small grid) keeps the padded build.
    short = torch.empty(1, 4, 512, 96, dtype=torch.bfloat16)
    assert fwd_sm90.plan(short, short, short, lse[:, :4, :512], **options).meta["HEAD_DIM"] == 128


def test_sm90_kernel_head_dims():
    """The forward kernel's head dims: 128 for 72-120, 64 for 48 and 56, 256 for 136-248 with V's
    equal; MLA's (192, 128) and the kernels' own head dims as they are."""
    from flashcore.ops.fwd_sm90 import kernel_head_dims

    assert kernel_head_dims(96, 96) == (128, 128)
    assert kernel_head_dims(56, 56) == (64, 64)
    assert kernel_head_dims(192, 192) == kernel_head_dims(136, 136) == (256, 256)
    assert kernel_head_dims(248, 248) == (256, 256)
    assert kernel_head_dims(192, 128) == (192, 128)
    assert kernel_head_dims(128, 128) == (128, 128)
    assert kernel_head_dims(256, 256) == (256, 256)
