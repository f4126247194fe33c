import pytest
import torch

import flashcore
from flashcore import tuning
from helpers import (
    PortableLaunched,
    capture_modes,
    check_forward,
    make_qkv,
)
from shapes import DTYPES, GPU, INTERP, Case


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
