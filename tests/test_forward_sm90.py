"""The Hopper forward tier on the GPU: each config and schedule the launcher picks (and some it
does not) against the float64 reference, the tier's choice under "auto", and its dynamic deal.
The rules that choose them, on the CPU: ``test_forward_sm90_rules.py``."""

import pytest
import torch

import flashcore
from helpers import (
    check_forward,
    launch_sm90_forward,
    make_qkv,
    mask_options,
    record_sm90_forwards,
    require_sm90,
)
from shapes import GPU, Case, MaskCase


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
