import pytest
import torch

import flashcore
from flashcore import tuning
from helpers import (
    PortableLaunched,
    capture_modes,
    check_forward,
    launch_sm90_forward,
    make_qkv,
    mask_options,
    record_sm90_forwards,
    require_sm90,
)
from shapes import DTYPES, GPU, INTERP, Case, MaskCase


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", INTERP, ids=[c.id for c in INTERP])
def test_forward(case, dtype, causal, device):
    q, k, v = make_qkv(case, dtype, device)
    out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    check_forward(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("layout", ["bshd", "sliced"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_strided(layout, causal, device):
    case = Case(2, 4, 2, 45, 61, 64)
    q, k, v = make_qkv(case, torch.float16, device, layout=layout)
    assert not q.is_contiguous()
    out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    check_forward(out, lse, q, k, v, causal=causal)
    if layout == "bshd":
        # A dense (B, S, H, D) view gives its output in the same memory layout.
        assert out.stride() == q.stride()


def test_forward_strided_last_dim(device):
    case = Case(1, 2, 2, 40, 50, 32)
    q, k, v = (
        t.transpose(-1, -2).contiguous().transpose(-1, -2)
        for t in make_qkv(case, torch.float32, device)
    )
    assert q.stride(-1) != 1
    out, lse = flashcore.attention(q, k, v, return_lse=True)
    check_forward(out, lse, q, k, v, causal=False)


@pytest.mark.parametrize("scale", [0.05, 1.0, 2.5])
def test_forward_scale(scale, device):
    q, k, v = make_qkv(Case(1, 2, 1, 50, 70, 64), torch.float16, device)
    out, lse = flashcore.attention(q, k, v, causal=True, scale=scale, return_lse=True)
    check_forward(out, lse, q, k, v, causal=True, scale=scale)


def test_fully_masked_rows(device):
    # Sq > Sk causal: the first Sq - Sk rows see no key.
    q, k, v = make_qkv(Case(1, 2, 2, 70, 20, 64), torch.bfloat16, device)
    out, lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :, :50] == 0)
    assert torch.all(lse[:, :, :50] == float("-inf"))
    assert torch.isfinite(lse[:, :, 50:]).all()
    check_forward(out, lse, q, k, v, causal=True)


def test_default_returns_tensor(device):
    q, k, v = make_qkv(Case(1, 1, 1, 8, 8, 16), torch.float16, device)
    out = flashcore.attention(q, k, v)
    assert isinstance(out, torch.Tensor)
    assert out.shape == q.shape


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["auto", "tma"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", GPU, ids=[c.id for c in GPU])
def test_forward_gpu(case, dtype, causal, path, monkeypatch):
    # "auto" moves small problems' tiles with pointers (tuning.TMA_MIN_FLOPS); "tma" forces
    # tensor descriptors at every size.
    if path == "tma":
        monkeypatch.setattr(tuning, "TMA_MIN_FLOPS", 0)
    q, k, v = make_qkv(case, dtype, "cuda", layout="bshd" if case.head_dim == 80 else "bhsd")
    out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    check_forward(out, lse, q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", GPU, ids=[c.id for c in GPU])
def test_forward_gpu_sm90_tier(case, dtype, causal, layout):
    """Every GPU case through the Gluon tier where it runs (sm_90, D 64/128), else the portable
    fallback: the same rule either way."""
    q, k, v = make_qkv(case, dtype, "cuda", layout=layout)
    with flashcore.use_tier("sm90"):
        out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    check_forward(out, lse, q, k, v, causal=causal)


# Head dim 256 on the Hopper forward (ops/fwd_sm90.py: WIDE_HEAD_DIMS), launched directly:
# ragged lengths both ways, GQA and MQA, causal with Sq > Sk (rows that see no key), (B, S, H, D)
# views, window + softcap, ALiBi and sinks.
D256_CASES = [
    (MaskCase(Case(2, 4, 2, 300, 517, 256), causal=True), "bshd", False),
    (MaskCase(Case(1, 4, 1, 777, 1025, 256)), "bhsd", False),
    (MaskCase(Case(2, 4, 4, 700, 300, 256), causal=True), "bhsd", True),
    (MaskCase(Case(1, 4, 4, 513, 513, 256), window=(100, 20), softcap=30.0), "bhsd", False),
    (MaskCase(Case(1, 4, 2, 390, 600, 256), alibi="h"), "bshd", True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("mc", "layout", "with_sinks"),
    D256_CASES,
    ids=[f"{m.id}-{lay}{'-sinks' * s}" for m, lay, s in D256_CASES],
)
def test_forward_gpu_sm90_kernel_d256(mc, layout, with_sinks, dtype):
    """The Hopper forward at head dim 256 (64-key tiles), launched directly (``WIDE_VERIFIED``
    was set once this had passed on the H100): out and LSE against the float64 reference,
    every element of out written."""
    from flashcore.ops import fwd_sm90, runtime

    q, k, v = make_qkv(mc.case, dtype, "cuda", layout=layout)
    if not fwd_sm90.dense_problem(q, k, v, (fwd_sm90.WIDE_HEAD_DIMS,)):
        pytest.skip("needs an sm_90 GPU with Gluon")
    if not runtime.sm90_verified():
        pytest.skip("needs a Triton the sm90 tier was verified on")
    kw = mask_options(mc, "cuda")
    if with_sinks:
        kw["sinks"] = torch.randn(mc.case.heads, device="cuda")
    out, lse = launch_sm90_forward(q, k, v, **kw)
    assert not out.isnan().any()
    check_forward(out, lse, q, k, v, **kw)


@pytest.mark.gpu
def test_sm90_tier_is_taken_on_hopper(monkeypatch):
    """On an H100/H200 with a verified Triton, use_tier("sm90") really launches the Gluon kernel
    (and the portable one not at all) for a covered problem."""
    from flashcore.ops import fwd

    require_sm90()
    calls = record_sm90_forwards(monkeypatch)
    monkeypatch.setattr(fwd, "kernel", lambda: pytest.fail("portable kernel launched"))
    q, k, v = make_qkv(Case(2, 8, 2, 300, 517, 128), torch.bfloat16, "cuda")
    with flashcore.use_tier("sm90"):
        out, lse = flashcore.attention(q, k, v, causal=True, window=(200, 0), return_lse=True)
    assert calls == [1]
    check_forward(out, lse, q, k, v, causal=True, window=(200, 0))


@pytest.mark.gpu
def test_auto_takes_sm90_for_short_windows(monkeypatch):
    """ "auto" launches the Hopper forward for a short window below the window floor (tuning:
    ``short_window``) and the portable one for a longer window at the same length."""
    require_sm90()
    calls = record_sm90_forwards(monkeypatch)
    q, k, v = make_qkv(Case(32, 32, 8, 512, 512, 64), torch.bfloat16, "cuda")  # 3.4e10 FLOPs
    out, lse = flashcore.attention(q, k, v, causal=True, window=(127, 0), return_lse=True)
    assert calls == [1]
    check_forward(out, lse, q, k, v, causal=True, window=(127, 0))
    flashcore.attention(q, k, v, window=(400, 400))  # 801 keys a row: past WINDOW_ONE's
    assert calls == [1]


# The persistent causal grid's dynamic deal (ops/fwd_sm90_configs.py: DYNAMIC_DEAL) on shapes that
# take it: MLA's head dims from 4096 keys (several waves; fewer items than SMs, GQA, Sq < Sk, a
# ragged last key tile) and D = 64's three CTAs an SM.
DEALT = [
    (2, 8, 8, 4096, 4096, 192, 128),
    (1, 2, 1, 3000, 4200, 192, 128),
    (4, 32, 32, 1000, 1000, 64, 64),
]


def test_sm90_dynamic_deal_plan(monkeypatch):
    """Which plans deal their persistent grid dynamically (ops/fwd_sm90_configs.py: DYNAMIC_DEAL,
    the configs' ``dynamic_from``), decided on the host: causal MLA from 4096 keys and D = 64's
    three CTAs an SM, over one program an SM slot and the flat grid's head groups; not D = 128, not
    MLA below 4096 keys, not non-causal, not with the switch off."""
    from flashcore.ops import fwd_sm90, fwd_sm90_configs

    monkeypatch.setattr(fwd_sm90, "num_sms", lambda index: 132)

    def plan(batch, heads, seqlen, head_dim, head_dim_v, causal=True):
        q = torch.empty(batch, heads, seqlen, head_dim, dtype=torch.bfloat16)
        v = torch.empty(batch, heads, seqlen, head_dim_v, dtype=torch.bfloat16)
        return fwd_sm90.plan(
            q, q, v, torch.empty(batch, heads, seqlen), causal=causal, qk_scale=0.1,
            window_left=0, window_right=0, has_window=False, softcap=0.0, alibi=False,
            sinks=False, stride_ab=0,
        )  # fmt: skip

    mla = plan(1, 16, 8192, 192, 128)
    assert mla.meta["DYNAMIC"] and mla.grid == (132,) and mla.scalars[14] == 4
    three = plan(16, 32, 1024, 64, 64)
    assert three.meta["DYNAMIC"] and three.grid == (396,) and three.scalars[14] == 16
    for p in (plan(4, 16, 2048, 192, 128), plan(8, 16, 2048, 128, 128)):
        assert p.meta["PERSISTENT"] and not p.meta["DYNAMIC"]
    assert not plan(1, 16, 8192, 192, 128, causal=False).meta["DYNAMIC"]
    monkeypatch.setattr(fwd_sm90_configs, "DYNAMIC_DEAL", False)
    assert not plan(1, 16, 8192, 192, 128).meta["DYNAMIC"]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", DEALT, ids=lambda s: "b{}h{}kv{}-q{}k{}-d{}v{}".format(*s))
def test_sm90_dynamic_deal(shape, monkeypatch):
    """The dynamic deal computes each tile as the fixed snake does: out and the LSE bit for bit
    equal to it, launch after launch on one stream (the counter back at zero after each), on two
    streams at once (a counter each) and replayed from a CUDA graph (a counter of its own)."""
    from flashcore.ops import fwd_sm90, fwd_sm90_configs

    require_sm90()
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v = shape
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, kv_heads, seqlen_k, head_dim_v, device="cuda", dtype=torch.bfloat16)
    p = fwd_sm90.plan(
        q, k, v, torch.empty(q.shape[:3], device="cuda"), causal=True,
        qk_scale=head_dim**-0.5 * 1.4426950408889634, window_left=0, window_right=0,
        has_window=False, softcap=0.0, alibi=False, sinks=False, stride_ab=0,
    )  # fmt: skip
    assert p.meta["PERSISTENT"] and p.meta["DYNAMIC"]
    monkeypatch.setattr(fwd_sm90_configs, "DYNAMIC_DEAL", False)
    want = launch_sm90_forward(q, k, v, causal=True)
    monkeypatch.setattr(fwd_sm90_configs, "DYNAMIC_DEAL", True)
    check_forward(*want, q, k, v, causal=True)

    def same(got):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    for _ in range(3):
        same(launch_sm90_forward(q, k, v, causal=True))
    device = torch.device("cuda")
    assert fwd_sm90.work_counter(device).item() == 0
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    results = []
    for stream in streams:
        with torch.cuda.stream(stream):
            results.append([launch_sm90_forward(q, k, v, causal=True) for _ in range(3)])
    torch.cuda.synchronize()
    for got in results:
        for r in got:
            same(r)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        launch_sm90_forward(q, k, v, causal=True)  # compiled and warm before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            graphed = launch_sm90_forward(q, k, v, causal=True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        same(graphed)
    for stream in (None, *streams, side):
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            assert fwd_sm90.work_counter(device).item() == 0


def test_use_tier_is_scoped_and_checked():
    from flashcore.ops import runtime

    with pytest.raises(ValueError, match="tier must be one of"), flashcore.use_tier("fast"):
        pass
    with flashcore.use_tier("sm90"):
        assert runtime._tier.get() == "sm90"
        # A CPU tensor never takes a GPU tier.
        assert runtime.forward_tier(torch.device("cpu")) == "portable"
    assert runtime._tier.get() == "auto"


def test_forced_sm90_on_an_unverified_triton_warns(monkeypatch):
    """On an sm_90 GPU with a Triton the sm90 tier was not verified on (one newer than 3.9, or
    older than 3.6), both tiers' choice is the portable one; ``use_tier("sm90")`` says so, once a
    process, naming the Triton, and "auto" stays quiet. On the CPU: the capability and the
    version check stood in for."""
    import warnings

    from flashcore.ops import runtime

    monkeypatch.setattr(runtime, "capability", lambda device: (9, 0))
    monkeypatch.setattr(runtime, "sm90_verified", lambda: False)
    runtime._warn_unverified.cache_clear()
    device = torch.device("cpu")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert runtime.forward_tier(device) == runtime.backward_tier(device) == "portable"
        assert seen == []  # "auto"
        with flashcore.use_tier("sm90"):
            assert runtime.forward_tier(device) == "portable"
            assert runtime.backward_tier(device) == "portable"
    runtime._warn_unverified.cache_clear()
    import triton

    assert len(seen) == 1 and triton.__version__ in str(seen[0].message)
    assert "portable kernels" in str(seen[0].message)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 96, 128, 192, 256])
def test_forward_gpu_fp32(head_dim):
    q, k, v = make_qkv(Case(1, 4, 2, 300, 517, head_dim), torch.float32, "cuda")
    out, lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
    check_forward(out, lse, q, k, v, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q", [1, 4, 16])
def test_forward_gpu_fp32_long_sums(seqlen_q):
    """fp32, a few queries against 16384 near-uniform keys whose values sit near 3: the output
    is a long sum of like terms, where PyTorch's fp32 product is split (cuBLAS's split-K). An
    fp32 P @ V sum, one FMA chain through every key, came out 6-35x PyTorch's error (H200), now
    summed in fp64 (kernels/common.py, pv_start)."""
    torch.manual_seed(seqlen_q)
    q = torch.randn(1, 4, seqlen_q, 128, device="cuda") * 0.02
    k = torch.randn(1, 4, 16384, 128, device="cuda")
    v = torch.randn(1, 4, 16384, 128, device="cuda") + 3.0
    out, lse = flashcore.attention(q, k, v, return_lse=True)
    check_forward(out, lse, q, k, v, causal=False)


def test_small_problems_skip_descriptors():
    # Decided on the host alone: no GPU needed.
    small = tuning.fwd_config(64, 2, interpreted=False, seqlen_q=4096, flops=2**30)
    large = tuning.fwd_config(64, 2, interpreted=False, seqlen_q=4096, flops=2**36)
    assert not small.use_tma
    assert large.use_tma
    assert (small.block_m, small.block_n) == (large.block_m, large.block_n)
    # A small problem of short sequences takes narrower query tiles (more programs to spread).
    short = tuning.fwd_config(64, 2, interpreted=False, seqlen_q=512, flops=2**30)
    assert (short.block_m, short.block_n) == (64, 128)
    assert tuning.fwd_config(64, 2, interpreted=False, seqlen_q=512, flops=2**36).block_m == 128
    # Captured into a CUDA graph, the host cost of descriptors is gone: the same tiles, with them.
    graphed = tuning.fwd_config(64, 2, interpreted=False, seqlen_q=512, flops=2**30, graph=True)
    assert graphed.use_tma and (graphed.block_m, graphed.block_n) == (64, 128)
    # The interpreter keeps its own config (descriptors on) at every size.
    assert tuning.fwd_config(64, 2, interpreted=True, flops=1).use_tma


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


# Short causal problems: one consumer a CTA, two CTAs an SM (ops/fwd_sm90_configs.py: ONE, what the
# launcher picks), and two consumers with 64-key tiles, where the first consumer of each 128-row
# tile skips the key tiles its rows do not see (``fwd_steps.skips``). Ragged both ways, GQA/MQA,
# Sq > Sk (rows that see no key), one tile, and (last) more tiles than two programs an SM take
# in one round.
SHORT_CAUSAL_SHAPES = [(2, 4, 2, 300, 300), (1, 3, 3, 512, 512), (2, 2, 1, 129, 450),
                       (1, 2, 2, 64, 64), (3, 2, 2, 200, 77), (2, 4, 4, 448, 320),
                       (8, 8, 2, 500, 500)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["auto", "one", "one-3-ctas", "two-n64"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("shape", SHORT_CAUSAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_gpu_sm90_short_causal(shape, head_dim, dtype, schedule):
    """The Hopper forward's short causal configs: out and LSE against the float64 reference."""
    from flashcore.ops import fwd_sm90_configs

    require_sm90()
    if schedule == "one-3-ctas" and head_dim != 64:
        pytest.skip("three CTAs an SM are a D=64 config")
    batch, heads, kv_heads, seqlen_q, seqlen_k = shape
    config = {
        "auto": None,
        "one": fwd_sm90_configs.ONE[head_dim],
        "one-3-ctas": fwd_sm90_configs.ONE_D64_THREE_CTAS,
        "two-n64": fwd_sm90_configs.Sm90Config(2, 64, 4, 240, 168),
    }[schedule]
    q, k, v = make_qkv(Case(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim), dtype, "cuda")
    out, lse = launch_sm90_forward(q, k, v, causal=True, config=config)
    assert not out.isnan().any() and not lse.isnan().any()
    check_forward(out, lse, q, k, v, causal=True)


# Three consumers, causal, on the flat grid: each softmax under its own P V (kernels/hopper/fwd.py:
# OWN_PV, what "auto" runs at D = 64 causal from 4096 keys on grids that fill four rounds).
# Ragged both ways, GQA/MQA, Sq > Sk (rows that see no key), a single key tile, and many tiles.
THREE_CAUSAL_SHAPES = [(1, 4, 2, 1500, 1500), (2, 3, 1, 700, 1100), (1, 4, 4, 1025, 513),
                       (2, 2, 2, 100, 100), (1, 8, 2, 4096, 4096)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", THREE_CAUSAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_gpu_sm90_three_causal_flat(shape, dtype):
    """The three-consumer causal flat build (OWN_PV): out and LSE against the float64 reference;
    at 4096, "auto" too, which takes one consumer a CTA on a grid of 8 heads
    (``fwd_sm90_configs.three_consumers_fill``)."""
    from flashcore.ops import fwd_sm90, fwd_sm90_configs

    require_sm90()
    batch, heads, kv_heads, seqlen_q, seqlen_k = shape
    q, k, v = make_qkv(Case(batch, heads, kv_heads, seqlen_q, seqlen_k, 64), dtype, "cuda")
    config = fwd_sm90_configs.D64_THREE._replace(persistent=False)
    out, lse = launch_sm90_forward(q, k, v, causal=True, config=config)
    assert not out.isnan().any() and not lse.isnan().any()
    check_forward(out, lse, q, k, v, causal=True)
    if seqlen_q == seqlen_k == 4096:
        grid = (batch * heads, fwd_sm90.num_sms(q.device.index))
        assert (
            fwd_sm90_configs.pick_config(64, 4096, 4096, True, False, grid=grid)
            == fwd_sm90_configs.ONE_D64
        )
        auto_out, auto_lse = launch_sm90_forward(q, k, v, causal=True)
        assert not auto_out.isnan().any() and not auto_lse.isnan().any()
        check_forward(auto_out, auto_lse, q, k, v, causal=True)


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


# Windows that take ``fwd_sm90_configs.WINDOW_ONE`` as launched: gpt-oss's layers (D = 64, causal
# (127, 0), GQA, sinks), ragged lengths with Sq != Sk both ways, non-causal with softcap and
# ALiBi, fp16, windows at the rule's limits, and a head dim padded to 128.
WINDOW_ONE_CASES = [
    (MaskCase(Case(2, 8, 2, 2048, 2048, 64), causal=True, window=(127, 0)), True),
    (MaskCase(Case(1, 4, 1, 1000, 1333, 64), window=(300, 467)), False),
    (MaskCase(Case(1, 4, 4, 1333, 1000, 64), causal=True, window=(767, 0)), False),
    (MaskCase(Case(1, 4, 2, 3000, 3000, 128), causal=True, window=(255, 0)), True),
    (MaskCase(Case(1, 4, 4, 1000, 1777, 128), window=(64, 63), softcap=20.0, alibi="h"), False),
    (MaskCase(Case(2, 2, 1, 777, 555, 128), window=(200, 183)), False),
    (MaskCase(Case(1, 4, 2, 1500, 1500, 96), causal=True, window=(200, 0)), True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("mc", "with_sinks"), WINDOW_ONE_CASES, ids=lambda x: getattr(x, "id", str(x))
)
def test_forward_gpu_sm90_window_one(mc, with_sinks, dtype, monkeypatch):
    """Windowed problems the launcher gives ``WINDOW_ONE``'s configs: that config picked, out and
    LSE against the float64 reference, every element written."""
    from flashcore.ops import fwd_sm90, fwd_sm90_configs

    require_sm90()
    real, picked = fwd_sm90_configs.pick_config, []
    monkeypatch.setattr(
        fwd_sm90_configs,
        "pick_config",
        lambda *a, **kw: picked.append(real(*a, **kw)) or picked[-1],
    )
    q, k, v = make_qkv(mc.case, dtype, "cuda")
    kw = mask_options(mc, "cuda")
    if with_sinks:
        kw["sinks"] = torch.randn(mc.case.heads, device="cuda")
    out, lse = launch_sm90_forward(q, k, v, **kw)
    assert picked == [fwd_sm90_configs.WINDOW_ONE[fwd_sm90.kernel_head_dim(mc.case.head_dim)]]
    assert not out.isnan().any() and not lse.isnan().any()
    check_forward(out, lse, q, k, v, **kw)


# Windows past the persistent rule's key count (``fwd_sm90_configs.PERSISTENT_WINDOW_KEYS``) and
# past ``WINDOW_ONE_MAX_KEYS``: causal at D = 64, GQA; non-causal at D = 128 with Sq < Sk; MQA
# with a ragged length.
WINDOW_PERSISTENT = [
    (Case(1, 4, 2, 8192, 8192, 64), True, (1023, 0)),
    (Case(1, 4, 4, 6000, 6100, 128), False, (256, 256)),
    (Case(2, 2, 1, 5000, 5000, 64), True, (800, 0)),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "causal", "window"), WINDOW_PERSISTENT, ids=str)
def test_forward_gpu_sm90_window_persistent(case, causal, window, monkeypatch):
    """Long windowed problems with the persistent rule counting the window's keys (persistent
    grid) and ``seqlen_k`` (flat grid): both against the reference; out bit for bit equal, and
    the LSE within the rounding by which the two builds' epilogues differ (H200: at most 1.44
    units in the last place, and the same with no window; docs/performance_features.md)."""
    from flashcore.ops import fwd_sm90_configs

    require_sm90()
    q, k, v = make_qkv(case, torch.bfloat16, "cuda")
    real, picked, results = fwd_sm90_configs.use_persistent, [], {}
    monkeypatch.setattr(
        fwd_sm90_configs, "use_persistent", lambda *a: picked.append(real(*a)) or picked[-1]
    )
    for on in (False, True):
        monkeypatch.setattr(fwd_sm90_configs, "PERSISTENT_WINDOW_KEYS", on)
        results[on] = launch_sm90_forward(q, k, v, causal=causal, window=window)
        assert picked[-1] == on
        out, lse = results[on]
        assert not out.isnan().any() and not lse.isnan().any()
        check_forward(out, lse, q, k, v, causal=causal, window=window)
    (out0, lse0), (out1, lse1) = results[False], results[True]
    assert torch.equal(out0, out1)
    ulps = (lse1 - lse0).abs() / (lse0.abs().clamp(min=1.0) * 2.0**-23)
    assert ulps.max().item() <= 4.0


# One consumer a CTA beyond short causal problems: non-causal and causal, ragged, GQA/MQA,
# Sq > Sk and Sq < Sk, several tiles a program (the persistent grid is two programs an SM).
ONE_CASES = [
    (Case(2, 8, 2, 1000, 1000, 64), False), (Case(1, 4, 1, 777, 1500, 64), True),
    (Case(2, 4, 4, 1300, 600, 64), True), (Case(4, 16, 4, 2048, 2048, 64), True),
    (Case(2, 8, 2, 1000, 1000, 128), False), (Case(1, 4, 1, 777, 1500, 128), True),
    (Case(2, 4, 4, 1300, 600, 128), True), (Case(3, 8, 8, 333, 4096, 128), False),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("case", "causal"), ONE_CASES, ids=lambda x: getattr(x, "id", str(x)))
def test_forward_gpu_sm90_one_consumer(case, causal, dtype):
    """``fwd_sm90_configs.ONE`` launched directly at lengths and grids it is not picked for: out
    and LSE against the float64 reference, every element written."""
    from flashcore.ops import fwd_sm90_configs

    require_sm90()
    q, k, v = make_qkv(case, dtype, "cuda")
    out, lse = launch_sm90_forward(
        q, k, v, causal=causal, config=fwd_sm90_configs.ONE[case.head_dim]
    )
    assert not out.isnan().any() and not lse.isnan().any()
    check_forward(out, lse, q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("consumers", [2, 1], ids=["two-consumers", "one-consumer"])
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "flat"])
@pytest.mark.parametrize("order", [(1, 1), (4, 2), (4, 4), (7, 8)], ids=lambda o: f"{o[0]}x{o[1]}")
def test_forward_gpu_sm90_causal_orders(order, persistent, consumers, monkeypatch):
    """Every causal work order (``lpt_heads``) and a persistent grid of any size cover every tile
    once: out and LSE against the reference (B * H = 8 heads, 8 query tiles each, 5 tiles with
    a ragged last one; with one consumer a CTA, 64-row tiles: 16 and 10)."""
    from flashcore.ops import fwd_sm90_configs

    require_sm90()
    grid, lpt_heads = order
    for seqlen_q, seqlen_k in ((1024, 1024), (600, 700)):
        q, k, v = make_qkv(Case(2, 4, 2, seqlen_q, seqlen_k, 128), torch.bfloat16, "cuda")

        def order_of(costs, heads, sms, persistent_, kv_bytes, _grid=grid, _lpt=lpt_heads):
            n_work = len(costs) * heads
            return (min(_grid, n_work) if persistent_ else n_work), _lpt

        monkeypatch.setattr(fwd_sm90_configs, "causal_order", order_of)
        base = fwd_sm90_configs.CONFIGS[128] if consumers == 2 else fwd_sm90_configs.ONE[128]
        config = base._replace(persistent=persistent)
        out, lse = launch_sm90_forward(q, k, v, causal=True, config=config)
        assert not out.isnan().any() and not lse.isnan().any()
        check_forward(out, lse, q, k, v, causal=True)


def _stand_in_forwards(monkeypatch, capability: tuple[int, int]) -> list[str]:
    """Stand-ins for the device's capability, the Triton check, ``fwd_sm90.supports`` and both
    forwards (the Hopper plan and launch need a GPU; the portable launch raises
    ``PortableLaunched``); returns the list each forward run appends its tier to. The decision
    kept per problem signature starts from none."""
    from flashcore.ops import fwd, fwd_sm90, runtime

    ran = []
    monkeypatch.setattr(runtime, "capability", lambda device: capability)
    monkeypatch.setattr(runtime, "sm90_verified", lambda: True)
    monkeypatch.setattr(fwd_sm90, "supports", lambda *args, **kwargs: True)
    monkeypatch.setattr(fwd, "_SM90_PLANS", {})
    monkeypatch.setattr(fwd_sm90, "plan", lambda *args, **kwargs: "plan")
    monkeypatch.setattr(fwd_sm90, "launch", lambda *args, **kwargs: ran.append("sm90"))

    def portable():
        ran.append("portable")
        raise PortableLaunched

    monkeypatch.setattr(fwd, "kernel", portable)
    return ran


@pytest.mark.parametrize(
    "tier, capability, shape, options, want",
    [
        ("auto", (9, 0), (16, 16, 1024, 128), {}, "sm90"),
        ("auto", (9, 0), (4, 16, 4096, 128), {"causal": True}, "sm90"),
        ("auto", (9, 0), (32, 16, 512, 128), {}, "sm90"),
        ("auto", (9, 0), (64, 16, 511, 128), {}, "portable"),  # below SM90_FWD_MIN_SEQLEN
        ("auto", (9, 0), (32, 16, 512, 128), {"causal": True}, "sm90"),  # 3.4e10 FLOPs
        ("auto", (9, 0), (1, 8, 2048, 128), {}, "portable"),  # below SM90_FWD_MIN_FLOPS: host
        # Captured into a CUDA graph: SM90_FWD_MIN_FLOPS_GRAPH (kernel time alone).
        ("auto", (9, 0), (1, 8, 2048, 128), {"graph": True}, "sm90"),
        ("auto", (9, 0), (2, 8, 2048, 64), {"causal": True, "graph": True}, "sm90"),  # 8.6e9
        ("auto", (9, 0), (2, 8, 2048, 64), {"causal": True}, "portable"),
        ("auto", (9, 0), (1, 8, 1024, 128), {"causal": True, "graph": True}, "portable"),  # 2.1e9
        ("auto", (9, 0), (1, 8, 512, 64), {"graph": True}, "sm90"),  # D=64: no FLOP floor
        ("auto", (9, 0), (1, 1, 512, 64), {"causal": True, "graph": True}, "sm90"),
        ("auto", (9, 0), (1, 8, 511, 64), {"graph": True}, "portable"),  # the length floor
        ("auto", (9, 0), (1, 8, 512, 128), {"graph": True}, "portable"),  # 1.1e9 at D=128
        ("auto", (9, 0), (16, 32, 768, 64), {"causal": True, "graph": True}, "sm90"),
        ("auto", (9, 0), (32, 32, 512, 64), {}, "sm90"),  # D=64 non-causal from 512 on
        ("auto", (9, 0), (16, 32, 1024, 64), {"causal": True}, "sm90"),
        ("auto", (9, 0), (32, 32, 512, 64), {"causal": True}, "sm90"),  # one consumer a CTA
        ("auto", (9, 0), (16, 32, 768, 64), {"causal": True}, "sm90"),
        ("auto", (9, 0), (64, 32, 511, 64), {"causal": True}, "portable"),  # below 512
        # Timed as the D = 128 kernel it runs (fwd_sm90.PADDED_HEAD_DIMS; whether the tier
        # takes 96 at all is supports', stood in for here).
        ("auto", (9, 0), (4, 16, 4096, 96), {}, "sm90"),
        ("auto", (9, 0), (4, 16, 4096, 40), {}, "portable"),  # a head dim the tier lacks
        # V's head dim equal to Q's: 192 is timed as the D = 256 kernel it runs
        # (fwd_sm90.WIDE_PADDED_HEAD_DIMS), from 256 on; MLA's (192, 128) in test_value_dim.
        ("auto", (9, 0), (1, 16, 4096, 192), {}, "sm90"),
        ("auto", (9, 0), (4, 16, 2048, 192), {"causal": True}, "sm90"),
        ("auto", (9, 0), (16, 16, 512, 160), {}, "sm90"),
        ("auto", (9, 0), (128, 16, 255, 160), {}, "portable"),
        ("auto", (9, 0), (1, 16, 8192, 256), {}, "sm90"),  # D=256 from 256 on
        ("auto", (9, 0), (8, 16, 1024, 256), {"causal": True}, "sm90"),
        ("auto", (9, 0), (16, 16, 512, 256), {}, "sm90"),
        ("auto", (9, 0), (64, 16, 256, 256), {"causal": True}, "sm90"),
        ("auto", (9, 0), (128, 16, 255, 256), {}, "portable"),  # below 256
        ("auto", (9, 0), (4, 16, 256, 256), {}, "portable"),  # below the FLOP floor
        # A window from 2048 queries and keys on, softcap from 4096, ALiBi at head dim 128 from
        # 4096 (tuning).
        ("auto", (9, 0), (4, 16, 4096, 128), {"window": (256, 0)}, "sm90"),
        ("auto", (9, 0), (8, 16, 2048, 128), {"window": (256, 0), "causal": True}, "sm90"),
        ("auto", (9, 0), (16, 16, 1024, 128), {"window": (256, 256)}, "portable"),
        ("auto", (9, 0), (4, 16, 4096, 128), {"softcap": 30.0}, "sm90"),
        ("auto", (9, 0), (8, 16, 2048, 128), {"softcap": 30.0}, "portable"),
        ("auto", (9, 0), (4, 16, 4096, 128), {"alibi_slopes": torch.ones(16)}, "sm90"),
        ("auto", (9, 0), (8, 16, 2048, 128), {"alibi_slopes": torch.ones(16)}, "portable"),
        ("auto", (9, 0), (4, 32, 4096, 64), {"alibi_slopes": torch.ones(32)}, "portable"),
        ("auto", (8, 0), (4, 16, 4096, 128), {}, "portable"),  # not a Hopper GPU
        ("sm90", (9, 0), (1, 1, 512, 64), {"window": (256, 0)}, "sm90"),  # asked for: all of it
        ("sm90", (8, 0), (4, 16, 4096, 128), {}, "portable"),
        ("portable", (9, 0), (4, 16, 4096, 128), {}, "portable"),
    ],
)
def test_forward_dispatch(monkeypatch, tier, capability, shape, options, want):
    """The forward's choice of tier (on the CPU: the device, the Triton check and the Hopper
    launcher are stood in for; what is checked is the decision, not the kernels)."""
    import contextlib

    from flashcore.ops import fwd, runtime

    ran = _stand_in_forwards(monkeypatch, capability)
    q = torch.zeros(shape, dtype=torch.bfloat16)
    options = {"causal": False, **options}
    causal = options.pop("causal")
    graph = options.pop("graph", False)
    monkeypatch.setattr(runtime, "capturing", lambda t: graph)
    with flashcore.use_tier(tier), contextlib.suppress(PortableLaunched):
        fwd.launch(q, q, q, causal, 0.125, **options)
    assert ran == [want]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_capture_loads_nothing_its_warm_up_did_not(monkeypatch, causal):
    """A capture takes the Gluon forward below the eager floor (and descriptors for the small
    portable forward) only where the capture's choice already ran in this process
    (``as_captured``, as ``flashcore.warmup(..., graphs=True)``, or an earlier capture); after
    an eager warm-up alone it launches the eager call's variant, so nothing is loaded inside the
    capture (``runtime.in_capture``). Without any warm-up the capture chooses for itself."""
    from flashcore.ops import fwd

    ran = _stand_in_forwards(monkeypatch, (9, 0))
    monkeypatch.setattr(fwd, "_PLANS", {})
    run = capture_modes(monkeypatch, ran)
    q = torch.zeros(2, 8, 2048, 64, dtype=torch.bfloat16)  # under the eager floor

    def call(now):
        return run(now, lambda: fwd.launch(q, q, q, causal, 0.125))

    assert call("eager") == "portable"
    assert call("capture") == "portable"  # the warm-up's variant
    assert call("as_captured") == "sm90"
    assert call("capture") == "sm90"
    monkeypatch.setattr(fwd, "_SM90_PLANS", {})  # a process that ran nothing of this signature
    monkeypatch.setattr(fwd, "_PLANS", {})
    assert call("capture") == "sm90"
    # The portable tier alone (a small forward takes descriptors only when captured): the plans
    # built, by the capture flag they were built with.
    monkeypatch.setattr(fwd, "_PLANS", {})
    with flashcore.use_tier("portable"):
        for now, flags in [
            ("eager", [False]), ("capture", [False]), ("as_captured", [False, True]),
            ("capture", [False, True]),
        ]:  # fmt: skip
            assert call(now) == "portable"
            assert [key[-1] for key in fwd._PLANS] == flags, now


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_forward_rows_of_16_byte_multiples(monkeypatch, layout, device):
    """Head dim 56 through the pointer path (tiles moved without descriptors): its row strides are
    16-byte multiples but not multiples of 16 elements, which the launcher declares (``ALIGN``,
    ``kernels/common.py: aligned``); the result stays exact."""
    from flashcore.ops import fwd
    from flashcore.ops import problem as pb

    monkeypatch.setattr(pb, "tma_compatible", lambda t: False)  # every forward takes pointers
    monkeypatch.setattr(fwd, "_PLANS", {})
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    q, k, v = make_qkv(Case(2, 2, 1, 45, 77, 56), dtype, device, layout=layout)
    with flashcore.use_tier("portable"):
        out, lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
    check_forward(out, lse, q, k, v, causal=True)


# Running maxima that keep rising past the softmax's slack (kernels/hopper/common.py:
# RESCALE_SLACK): a key component that grows along the sequence, seen by some query rows only.
# Each warp rescales its O only when one of its rows needs it (``rescale``: rows r and r + 8 of
# each 16 are a thread's two rows), so the rows that rise are rows r + 8 only, rows r only, or
# scattered, against rows whose max never moves.
RISING = [
    ("hi", Case(2, 4, 2, 1000, 1000, 128), False, None),
    ("lo", Case(1, 4, 4, 700, 900, 128), True, None),
    ("scattered", Case(2, 4, 1, 777, 1500, 64), False, None),
    ("hi", Case(1, 4, 2, 1500, 1500, 64), True, "three"),
    ("scattered", Case(1, 4, 2, 1200, 1300, 64), True, "three-flat"),
    ("lo", Case(2, 4, 4, 500, 500, 64), True, "one"),
    ("hi", Case(2, 4, 4, 600, 600, 128), True, "one"),
    ("lo", Case(1, 4, 2, 700, 1100, 256), False, None),
    ("scattered", Case(1, 4, 4, 900, 900, 96), True, None),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("rows", "case", "causal", "config"),
    RISING,
    ids=[f"{r}-{c.id}-{'causal' if ca else 'full'}-{cf or 'auto'}" for r, c, ca, cf in RISING],
)
def test_forward_gpu_sm90_rising_max(rows, case, causal, config, dtype):
    """Rows whose running max moves many times (and by more than the slack) beside rows whose
    max never moves, on the Hopper forward: out and LSE against the float64 reference."""
    from flashcore.ops import fwd_sm90_configs

    require_sm90()
    cfg = {
        None: None,
        "three": fwd_sm90_configs.D64_THREE,
        "three-flat": fwd_sm90_configs.D64_THREE._replace(persistent=False),
        "one": fwd_sm90_configs.ONE.get(case.head_dim),
    }[config]
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = make_qkv(case, torch.float32, "cuda")
    i = torch.arange(case.seqlen_q, device="cuda")
    sel = {
        "hi": i % 16 >= 8,
        "lo": i % 16 < 8,
        "scattered": torch.rand(case.seqlen_q, device="cuda", generator=gen) < 0.1,
    }[rows]
    # Scores of the selected rows rise by about 45 (log2 units) over the keys: several moves of
    # the max past the slack of 8, in every key tile's softmax step.
    k[..., 0] = torch.linspace(0.0, 24.0, case.seqlen_k, device="cuda")
    q[..., 0] = torch.where(sel, 16.0, 0.0)[None, None] * case.head_dim**0.5 / 128**0.5
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out, lse = launch_sm90_forward(q, k, v, causal=causal, config=cfg)
    assert not out.isnan().any() and not lse.isnan().any()
    check_forward(out, lse, q, k, v, causal=causal)


# Head dims between 128 and 256 with V's equal (ops/fwd_sm90.py: WIDE_PADDED_HEAD_DIMS) on the
# Hopper forward: the D = 256 kernel over 256-column boxes, zero-filled past the head dim on
# loads and clipped on the O store. Ragged lengths both ways, GQA and MQA, causal with Sq > Sk,
# (B, S, H, D) views, window with softcap, ALiBi, sinks; one case takes its gradients too (the
# backward is portable at these head dims and reads the Hopper forward's out and LSE).
WIDE_PADDED_CASES = [
    (MaskCase(Case(2, 4, 2, 300, 517, 192), causal=True), "bshd", False, True),
    (MaskCase(Case(1, 4, 1, 777, 1025, 160)), "bhsd", False, False),
    (MaskCase(Case(2, 4, 4, 700, 300, 224), causal=True), "bhsd", True, False),
    (MaskCase(Case(1, 4, 4, 513, 513, 136), window=(100, 20), softcap=30.0), "bhsd", False, False),
    (MaskCase(Case(1, 4, 2, 390, 600, 248), alibi="h"), "bshd", False, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("mc", "layout", "with_sinks", "with_grads"),
    WIDE_PADDED_CASES,
    ids=[f"{m.id}-{lay}{'-sinks' * s}{'-grads' * g}" for m, lay, s, g in WIDE_PADDED_CASES],
)
def test_forward_gpu_sm90_wide_padded(monkeypatch, mc, layout, with_sinks, with_grads, dtype):
    """Head dims 136-248 through ``use_tier("sm90")`` (``WIDE_PADDED_VERIFIED`` set on for the
    test), the Hopper launch recorded: out and LSE (and gradients) against the float64
    reference."""
    from flashcore.ops import fwd_sm90
    from helpers import check_backward

    require_sm90()
    monkeypatch.setattr(fwd_sm90, "WIDE_PADDED_VERIFIED", True)
    forwards = record_sm90_forwards(monkeypatch)
    q, k, v = make_qkv(mc.case, dtype, "cuda", layout=layout)
    kw = mask_options(mc, "cuda")
    if with_sinks:
        kw["sinks"] = torch.randn(mc.case.heads, device="cuda")
    with flashcore.use_tier("sm90"):
        out, lse = flashcore.attention(q, k, v, return_lse=True, **kw)
        assert forwards == [1]
        assert not out.isnan().any() and not lse.isnan().any()
        check_forward(out, lse, q, k, v, **kw)
        if with_grads:
            check_backward(q, k, v, **kw)


# Head dims 72-96 with Q and K at their own width (ops/fwd_sm90.py: NARROW_QK): panels of 16
# (72 -> 80, 80) or 32 (88 -> 96, 96) against V and O at 128, the persistent grid's
# one-Q-buffer build; and 136-192 at 192 against 256 (NARROW_QK_WIDE). Ragged lengths both
# ways, GQA and MQA, causal with Sq > Sk and rows that see no key, (B, S, H, D) views, a window,
# sinks, programs with several tiles.
NARROW_QK_CASES = [
    (MaskCase(Case(2, 4, 2, 300, 517, 96), causal=True), "bshd", False),
    (MaskCase(Case(1, 4, 1, 777, 1025, 80)), "bhsd", True),
    (MaskCase(Case(2, 4, 4, 700, 300, 80), causal=True), "bhsd", False),
    (MaskCase(Case(1, 4, 4, 1500, 1500, 96), window=(500, 200)), "bhsd", True),
    (MaskCase(Case(1, 4, 2, 390, 600, 72)), "bshd", False),
    (MaskCase(Case(1, 8, 2, 1000, 3000, 88), causal=True), "bhsd", True),
    (MaskCase(Case(4, 16, 4, 1100, 1100, 96)), "bshd", False),
    # Head dims 136-192 (NARROW_QK_WIDE): Q and K at 192 in three 64-column panels, V and O at
    # 256, 64-key tiles.
    (MaskCase(Case(2, 4, 2, 300, 517, 192), causal=True), "bshd", True),
    (MaskCase(Case(1, 4, 1, 777, 1025, 160)), "bhsd", False),
    (MaskCase(Case(1, 4, 4, 1500, 1500, 136), window=(500, 200)), "bhsd", True),
    (MaskCase(Case(2, 8, 2, 1000, 700, 176), causal=True), "bshd", False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("mc", "layout", "with_sinks"),
    NARROW_QK_CASES,
    ids=[f"{m.id}-{lay}{'-sinks' * s}" for m, lay, s in NARROW_QK_CASES],
)
def test_forward_gpu_sm90_narrow_qk(monkeypatch, mc, layout, with_sinks, dtype):
    """The narrow-Q/K build launched directly into NaN-filled out and LSE (every element
    written), with the two-consumer config these small grids would not pick by themselves
    (``one_consumer`` off), then through ``use_tier("sm90")`` with its gradients: against the
    float64 reference, and the plan's Q/K width the narrow one."""
    from flashcore.ops import fwd_sm90, fwd_sm90_configs
    from helpers import check_backward

    require_sm90()
    monkeypatch.setattr(fwd_sm90_configs, "one_consumer", lambda *args, **kw: None)
    widths = []
    real = fwd_sm90.launch
    monkeypatch.setattr(
        fwd_sm90,
        "launch",
        lambda p, *a, **kw: widths.append(p.meta["HEAD_DIM"]) or real(p, *a, **kw),
    )
    q, k, v = make_qkv(mc.case, dtype, "cuda", layout=layout)
    kw = mask_options(mc, "cuda")
    if with_sinks:
        kw["sinks"] = torch.randn(mc.case.heads, device="cuda")
    narrow = fwd_sm90.narrow_qk_dim(mc.case.head_dim, mc.case.head_dim)
    out, lse = launch_sm90_forward(q, k, v, **kw)
    assert widths == [narrow]
    assert not out.isnan().any() and not lse.isnan().any()
    check_forward(out, lse, q, k, v, **kw)
    with flashcore.use_tier("sm90"):
        out, lse = flashcore.attention(q, k, v, return_lse=True, **kw)
        assert widths == [narrow, narrow]
        check_forward(out, lse, q, k, v, **kw)
        check_backward(q, k, v, **kw)


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
