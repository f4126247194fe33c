"""Gradients of flashcore.attention (dq, dk, dv) against autograd through the float64 reference."""

import contextlib

import pytest
import torch

import flashcore
from flashcore import tuning
from flashcore.ops import registry as ops
from helpers import (
    PortableLaunched,
    alibi_slopes,
    capture_modes,
    check_backward,
    make_qkv,
)
from shapes import BWD_GPU, BWD_INTERP, DTYPES, Case


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", BWD_INTERP, ids=[c.id for c in BWD_INTERP])
def test_backward(case, dtype, causal, device):
    q, k, v = make_qkv(case, dtype, device)
    check_backward(q, k, v, causal=causal)


@pytest.mark.parametrize("layout", ["bshd", "sliced"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_strided(layout, causal, device):
    q, k, v = make_qkv(Case(2, 4, 2, 45, 61, 64), torch.float16, device, layout=layout)
    assert not q.is_contiguous()
    dq, dk, dv = check_backward(q, k, v, causal=causal)
    if layout == "bshd":
        # Gradients come back in their inputs' (B, S, H, D) memory layout.
        assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())


@pytest.mark.parametrize("kind", ["bshd", "sliced", "strided_last_dim", "broadcast"])
def test_backward_dout_layouts(kind, device):
    case = Case(1, 4, 2, 20, 37, 32)
    q, k, v = make_qkv(case, torch.float32, device)
    shape = (case.batch, case.heads, case.seqlen_q, case.head_dim)
    if kind == "bshd":
        dout = torch.randn(shape[0], shape[2], shape[1], shape[3], device=device).transpose(1, 2)
    elif kind == "sliced":
        dout = torch.randn(shape[0], shape[1] + 1, shape[2] + 5, shape[3] + 3, device=device)
        dout = dout[:, 1:, 3 : shape[2] + 3, 2 : shape[3] + 2]
    elif kind == "strided_last_dim":
        dout = torch.randn(shape, device=device).transpose(-1, -2).contiguous().transpose(-1, -2)
        assert dout.stride(-1) != 1
    else:
        # What out.sum().backward() hands over: a stride-0 expanded scalar.
        dout = torch.randn((), device=device).expand(shape)
    assert not dout.is_contiguous()
    check_backward(q, k, v, causal=True, dout=dout)


@pytest.mark.parametrize("with_dout", [True, False], ids=["out+lse", "lse_only"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_backward_lse_grad(dtype, with_dout, device):
    # Sq > Sk causal, so some rows see no key: their LSE is -inf and their gradients must be 0.
    case = Case(1, 4, 2, 45, 30, 64)
    q, k, v = make_qkv(case, dtype, device)
    dlse = torch.randn(case.batch, case.heads, case.seqlen_q, device=device)
    if with_dout:
        dq, _, _ = check_backward(q, k, v, causal=True, dlse=dlse)
    else:
        dout = torch.zeros(case.batch, case.heads, case.seqlen_q, case.head_dim, dtype=dtype)
        dq, dk, dv = check_backward(q, k, v, causal=True, dout=dout.to(device), dlse=dlse)
        # Differentiating lse alone (out's gradient arrives as None) gives the same gradients.
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        _, lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
        got = torch.autograd.grad(lse, (q, k, v), dlse)
        assert all(torch.equal(a, b) for a, b in zip(got, (dq, dk, dv), strict=True))
        assert torch.all(dv == 0)
    assert torch.all(dq[:, :, :15] == 0)


def test_backward_broadcast_grads(device):
    # out.sum() and lse.sum() hand the backward stride-0 (expanded) gradients.
    q, k, v = make_qkv(Case(2, 2, 1, 40, 50, 16), torch.float16, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
    (out.sum() + lse.sum()).backward()
    expected = check_backward(
        q, k, v, causal=True, dout=torch.ones_like(out), dlse=torch.ones_like(lse)
    )
    assert all(torch.equal(t.grad, e) for t, e in zip((q, k, v), expected, strict=True))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
def test_backward_large_negative_scores(device):
    # Every score near -470, so the LSE is too: exp(s - lse) of a padding key past Sk (which
    # loads as 0 and scores 0) overflows. The dQ kernel masks such keys; in the dK/dV kernel they
    # are the rows of its own K/V block that are never stored, whence the interpreter's overflow
    # warnings. Every stored gradient must be finite and accurate.
    case = Case(1, 2, 1, 37, 45, 16)
    q, k, v = make_qkv(case, torch.float16, device)
    q = q.abs() + 10.0
    k = -(k.abs() + 10.0)
    check_backward(q, k, v, causal=False)


@pytest.mark.parametrize("scale", [0.05, 2.5])
def test_backward_scale(scale, device):
    q, k, v = make_qkv(Case(1, 2, 1, 50, 70, 64), torch.float16, device)
    check_backward(q, k, v, causal=True, scale=scale)


def test_backward_fully_masked_rows(device):
    q, k, v = make_qkv(Case(1, 2, 2, 70, 20, 64), torch.bfloat16, device)
    dq, dk, dv = check_backward(q, k, v, causal=True)
    assert torch.all(dq[:, :, :50] == 0)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_backward_deterministic(device):
    case = Case(1, 4, 1, 77, 93, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(case, torch.float16, device))
    dout = torch.randn(case.batch, case.heads, case.seqlen_q, case.head_dim, dtype=q.dtype)
    dout = dout.to(device)

    def grads():
        out = flashcore.attention(q, k, v, causal=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("needs", ["q", "k", "v"])
def test_backward_partial_requires_grad(needs, device):
    q, k, v = make_qkv(Case(1, 2, 1, 30, 40, 16), torch.float16, device)
    inputs = {"q": q, "k": k, "v": v}
    inputs[needs].requires_grad_()
    out = flashcore.attention(inputs["q"], inputs["k"], inputs["v"], causal=True)
    (grad,) = torch.autograd.grad(out, inputs[needs], torch.ones_like(out))
    assert grad.shape == inputs[needs].shape
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize(
    "case",
    [Case(1, 2, 1, 0, 5, 16), Case(1, 2, 1, 5, 0, 16), Case(0, 2, 2, 5, 5, 16)],
    ids=["no_query", "no_key", "no_batch"],
)
def test_backward_zero_size(case, device, monkeypatch):
    from flashcore.ops import bwd

    monkeypatch.setattr(bwd, "kernels", lambda: pytest.fail("kernel launched on empty input"))
    q, k, v = (t.requires_grad_() for t in make_qkv(case, torch.float16, device))
    out = flashcore.attention(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert all(torch.all(g == 0) for g in (dq, dk, dv))


def test_backward_runs_on_the_forwards_tier(device, monkeypatch):
    """The backward (autograd's thread) sees the tier that was in effect at the forward, and
    ``deterministic`` reaches the launcher."""
    from flashcore.ops import bwd, runtime

    seen = []
    real = bwd.launch

    def launch(*args, **kwargs):
        seen.append((runtime.current_tier(), kwargs["deterministic"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(bwd, "launch", launch)
    q, k, v = (
        t.requires_grad_() for t in make_qkv(Case(1, 2, 1, 20, 33, 16), torch.float32, device)
    )
    with flashcore.use_tier("portable"):
        out = flashcore.attention(q, k, v, deterministic=True)
    out.sum().backward()
    out = flashcore.attention(q, k, v)
    out.sum().backward()
    assert seen == [("portable", True), ("auto", False)]


def test_deterministic_is_checked(device):
    q, k, v = make_qkv(Case(1, 2, 1, 8, 8, 16), torch.float32, device)
    with pytest.raises(TypeError, match="deterministic"):
        flashcore.attention(q, k, v, deterministic="yes")


def test_opcheck(device):
    q, k, v = make_qkv(Case(1, 2, 1, 20, 33, 16), torch.float32, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    options = (None, None, 0, 0, True, 0.25, -1, -1, 0.0, None)
    torch.library.opcheck(ops.attn_fwd, (q, k, v, *options))
    torch.library.opcheck(ops.attn_fwd, (q, k, v, *options, None, None, True))
    out, lse = ops.attn_fwd(q, k, v, *options)
    args = (torch.randn_like(out), q, k, v, out, lse, torch.randn_like(lse), *options)
    torch.library.opcheck(
        ops.attn_bwd, tuple(a.detach() if torch.is_tensor(a) else a for a in args)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", BWD_GPU, ids=[c.id for c in BWD_GPU])
def test_backward_gpu(case, dtype, causal):
    q, k, v = make_qkv(case, dtype, "cuda", layout="bshd" if case.head_dim == 80 else "bhsd")
    check_backward(q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 96, 128, 192, 256])
def test_backward_gpu_fp32(head_dim):
    q, k, v = make_qkv(Case(1, 4, 2, 300, 517, head_dim), torch.float32, "cuda")
    check_backward(q, k, v, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backward_gpu_fp32_gqa_long_group(seed, causal):
    """fp32 dK and dV over a group of 8 query heads and 1612 queries, summed in fp64
    (kernels/bwd.py, GQA). Summed in one fp32 accumulator they were 1.5-5.6x PyTorch's fp32
    error against float64 here (scripts/gpu_fuzz.py found it), outside FlashAttention's rule."""
    torch.manual_seed(seed)
    q, k, v = make_qkv(Case(1, 16, 2, 1612, 1612, 32), torch.float32, "cuda")
    check_backward(q, k, v, causal=causal, scale=0.05)


def test_backward_fp32_lone_key_interpreter(device):
    """The interpreter's fp32 backward in natural units, as its forward (EXP_E 2): one key seen
    by 1803 rows of two heads under ALiBi (scores down to -900), where every P is exactly 1. In
    base 2 the backward's ``lse * log2(e)`` put each row's exponent an ulp of its score off the
    forward's: dV 14x outside FlashAttention's rule. (On the GPU:
    test_backward_gpu_fp32_lone_key_alibi.)"""
    if device != "cpu":
        pytest.skip("the interpreter's case; on the GPU see test_backward_gpu_fp32_lone_key_alibi")
    q, k, v = make_qkv(Case(1, 2, 1, 1803, 1, 32), torch.float32, device)
    slopes = torch.tensor([0.5, 0.25], device=device)
    check_backward(q, k, v, causal=False, scale=0.3, alibi_slopes=slopes)


def test_backward_fp32_lone_key_softcap_interpreter(device):
    """Softcap's scores sit near their cap (7.2 in base 2), where the base-2 exponent's ulp was
    largest: one query against one key, dV = P dO with P exactly 1 in PyTorch's fp32 math, came
    out 2 ulp off in 2 seeds of 40 (scripts/sanitize_cases.py's options, interpreter)."""
    if device != "cpu":
        pytest.skip("the interpreter's case")
    for seed in range(40):
        torch.manual_seed(seed)
        q, k, v = make_qkv(Case(1, 1, 1, 1, 1, 16), torch.float32, device)
        check_backward(q, k, v, causal=True, softcap=5.0, window=(7, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backward_gpu_fp32_lone_key_alibi(seed, softcap):
    """fp32 with one key seen by 1803 query rows, far from it under ALiBi (scores near -1000):
    every P is exactly 1, so dV is the sum of dO's rows, 7212 of them for a KV head. With the
    backward's scores in base 2, P was off 1 (scripts/gpu_fuzz.py found it on a packed batch of
    these lengths: dV 1.95e-3 from float64 against a bound of 1.0e-4); in natural units P is 1
    (a one-hot dO gives dV's counts exactly) and what was left, 2.3e-4 to 3.4e-4, was the one
    fp32 FMA chain through every row: fp32 gradients now sum in fp64 (common.sum_dot)."""
    torch.manual_seed(seed)
    q, k, v = make_qkv(Case(1, 8, 2, 1803, 1, 128), torch.float32, "cuda")
    slopes = alibi_slopes(8, None, "cuda")
    check_backward(q, k, v, causal=False, scale=0.3, alibi_slopes=slopes, softcap=softcap)


@pytest.mark.gpu
def test_backward_gpu_lse_grad():
    case = Case(2, 8, 2, 1500, 1000, 128)
    q, k, v = make_qkv(case, torch.bfloat16, "cuda")
    dlse = torch.randn(case.batch, case.heads, case.seqlen_q, device="cuda")
    check_backward(q, k, v, causal=True, dlse=dlse)


@pytest.mark.parametrize(
    ("tier", "capability", "seqlen", "head_dim", "causal", "window", "deterministic", "want"),
    [
        ("auto", (9, 0), 2048, 128, True, (-1, -1), False, "sm90"),
        ("auto", (9, 0), 2048, 64, True, (-1, -1), False, "sm90"),
        ("auto", (9, 0), 1024, 128, False, (-1, -1), False, "sm90"),
        ("auto", (9, 0), 256, 128, True, (-1, -1), False, "portable"),
        ("auto", (9, 0), 512, 128, True, (-1, -1), False, "sm90"),
        ("auto", (9, 0), 2048, 128, False, (-1, -1), True, "portable"),
        ("auto", (9, 0), 2048, 128, False, (256, 0), False, "sm90"),
        ("auto", (9, 0), 2048, 64, False, (256, 0), False, "sm90"),
        ("auto", (9, 0), 1024, 64, True, (-1, -1), False, "sm90"),
        ("auto", (9, 0), 256, 64, True, (-1, -1), False, "portable"),
        ("auto", (9, 0), 512, 64, True, (-1, -1), False, "sm90"),
        ("sm90", (9, 0), 128, 64, False, (-1, -1), False, "sm90"),
        ("sm90", (9, 0), 128, 64, False, (-1, -1), True, "portable"),
        ("portable", (9, 0), 4096, 128, False, (-1, -1), False, "portable"),
        ("auto", (8, 0), 4096, 128, False, (-1, -1), False, "portable"),
        ("sm90", (10, 0), 4096, 128, False, (-1, -1), False, "portable"),
    ],
)
def test_backward_dispatch(
    monkeypatch, tier, capability, seqlen, head_dim, causal, window, deterministic, want
):
    """The launcher's choice of backward (runs on the CPU: the device, the Triton check and the
    Hopper launcher are stood in for; what is checked is the decision, not the kernels)."""
    from flashcore.ops import bwd

    ran = _stand_in_backwards(monkeypatch, capability)
    # The lengths decide here (one head: far below the eager FLOP floor,
    # test_backward_dispatch_flop_floor's subject).
    monkeypatch.setattr(tuning, "SM90_BWD_MIN_FLOPS", 0.0)
    q = torch.zeros(1, 1, seqlen, head_dim, dtype=torch.bfloat16)
    lse = torch.zeros(1, 1, seqlen)
    with flashcore.use_tier(tier), contextlib.suppress(PortableLaunched):
        bwd.launch(
            q, q, q, q, q, lse, None, causal, 0.125, window=window, deterministic=deterministic
        )
    assert ran == [want]


def _stand_in_backwards(monkeypatch, capability: tuple[int, int]) -> list[str]:
    """Stand-ins for the device's capability, the Triton check, ``bwd_sm90.supports`` and both
    backwards (the portable one raises ``PortableLaunched`` instead of launching); returns the
    list each backward run appends its tier to. The decision kept per problem signature starts
    from none."""
    from flashcore.ops import bwd, bwd_sm90, runtime

    ran = []
    monkeypatch.setattr(runtime, "capability", lambda device: capability)
    monkeypatch.setattr(runtime, "sm90_verified", lambda: True)
    monkeypatch.setattr(bwd_sm90, "supports", lambda *args, **kwargs: True)
    monkeypatch.setattr(bwd, "_SM90", {})

    def sm90(dout, q, k, v, out, lse, causal, scale, dlse, dq, dk, dv, **kwargs):
        ran.append("sm90")
        return dq, dk, dv, torch.zeros_like(lse)

    def portable():
        ran.append("portable")
        raise PortableLaunched

    monkeypatch.setattr(bwd_sm90, "attn_bwd_sm90", sm90)
    monkeypatch.setattr(bwd, "kernels", portable)
    return ran


@pytest.mark.parametrize(
    ("heads", "capturing", "want"),
    [
        (8, False, "portable"),  # (1, 8, 2048, 128): 1.7e10 FLOPs, under the eager floor
        (8, True, "sm90"),  # captured: no FLOP floor
        (32, False, "sm90"),  # 6.9e10 FLOPs
    ],
)
def test_backward_dispatch_flop_floor(monkeypatch, heads, capturing, want):
    """ "auto" keeps an eager backward below ``tuning.SM90_BWD_MIN_FLOPS`` on the portable
    kernels and takes the Hopper one when the call is being captured (the choice is kept per
    signature, capture included)."""
    from flashcore.ops import bwd, runtime

    ran = _stand_in_backwards(monkeypatch, (9, 0))
    monkeypatch.setattr(runtime, "capturing", lambda t: capturing)
    q = torch.zeros(1, heads, 2048, 128, dtype=torch.bfloat16)
    lse = torch.zeros(1, heads, 2048)
    with contextlib.suppress(PortableLaunched):
        bwd.launch(q, q, q, q, q, lse, None, False, 0.125)
    assert ran == [want]


def test_backward_dispatch_honours_torch_deterministic(monkeypatch):
    from flashcore.ops import bwd, bwd_sm90, runtime

    monkeypatch.setattr(runtime, "capability", lambda device: (9, 0))
    monkeypatch.setattr(runtime, "sm90_verified", lambda: True)
    monkeypatch.setattr(bwd_sm90, "supports", lambda *args, **kwargs: True)
    monkeypatch.setattr(bwd, "_SM90", {})
    monkeypatch.setattr(bwd_sm90, "attn_bwd_sm90", lambda *a, **kw: pytest.fail("sm90 ran"))

    def portable():
        raise PortableLaunched

    monkeypatch.setattr(bwd, "kernels", portable)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    q = torch.zeros(1, 1, 4096, 128, dtype=torch.bfloat16)
    with pytest.raises(PortableLaunched):
        bwd.launch(q, q, q, q, q, torch.zeros(1, 1, 4096), None, False, 0.125)


def test_backward_capture_loads_nothing_its_warm_up_did_not(monkeypatch):
    """A capture takes the Hopper backward below the eager floor only where the capture's choice
    already ran in this process (``as_captured``, as ``flashcore.warmup(..., graphs=True)``, or
    an earlier capture); after an eager warm-up alone it takes the eager call's kernels, so
    nothing is loaded inside the capture (``runtime.in_capture``). Without any warm-up the
    capture chooses for itself."""
    from flashcore.ops import bwd

    ran = _stand_in_backwards(monkeypatch, (9, 0))
    q = torch.zeros(1, 8, 2048, 128, dtype=torch.bfloat16)  # 1.7e10 FLOPs: under the eager floor
    lse = torch.zeros(1, 8, 2048)
    run = capture_modes(monkeypatch, ran)

    def call(now):
        return run(now, lambda: bwd.launch(q, q, q, q, q, lse, None, False, 0.125))

    assert call("eager") == "portable"
    assert call("capture") == "portable"  # the warm-up's kernels
    assert call("as_captured") == "sm90"
    assert call("capture") == "sm90"
    monkeypatch.setattr(bwd, "_SM90", {})  # a process that ran nothing of this signature
    assert call("capture") == "sm90"


def test_stride_align():
    from flashcore.ops.problem import stride_align

    assert stride_align((56 * 300, 56, 56 * 300 * 4), 2) == 8  # head dim 56: 112-byte rows
    assert stride_align((64 * 300, 64, 64), 2) == 1  # multiples of 16: Triton's own
    assert stride_align((52, 52), 2) == 1  # rows not 16-byte multiples
    assert stride_align((44, 44 * 8), 4) == 4  # fp32


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_backward_rows_of_16_byte_multiples(layout, device):
    """Head dim 56 (row strides 16-byte multiples but not multiples of 16 elements): the portable
    backward is told so (``ALIGN``, ``kernels/common.py: aligned``) and stays exact."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    q, k, v = make_qkv(Case(1, 2, 2, 33, 47, 56), dtype, device, layout=layout)
    with flashcore.use_tier("portable"):
        check_backward(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=["f64", "f16"])
def test_reference_grads_by_chunks(dtype, monkeypatch):
    """The test helper's reference backward by (batch, kv heads) chunks (``REF_CHUNK_SCORES``,
    the GPU tests' memory) gives the gradients of the whole problem: GQA, ALiBi per batch and
    head, sinks, a window, softcap and a gradient through the LSE. In float64 bit for bit; in
    float16 (the same-precision baseline of FlashAttention's rule) within that precision's own
    error: smaller matrix products may round differently (the GPU machine's CPU BLAS did)."""
    import helpers

    b, h, hkv, sq, sk, d = 2, 6, 3, 7, 9, 8
    q = torch.randn(b, h, sq, d, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, sk, d, dtype=torch.float64) for _ in range(2))
    dout, dlse = torch.randn(b, h, sq, d, dtype=torch.float64), torch.randn(b, h, sq)
    opts = {
        "window": (4, 2),
        "softcap": 5.0,
        "alibi_slopes": torch.rand(b, h),
        "sinks": torch.randn(h),
    }
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    whole = helpers.reference_grads(q, k, v, dout, dlse, causal=True, dtype=dtype, **opts)
    monkeypatch.setattr(helpers, "REF_CHUNK_SCORES", 2 * sq * sk)  # one kv head (2 query heads)
    chunks = helpers.reference_grads(q, k, v, dout, dlse, causal=True, dtype=dtype, **opts)
    exact = helpers.reference_grads(
        *(t.double() for t in (q, k, v, dout)), dlse, causal=True, dtype=torch.float64, **opts
    )
    for name, a, c, e in zip("qkv", whole, chunks, exact, strict=True):
        assert a.shape == c.shape, name
        if dtype == torch.float64:
            torch.testing.assert_close(c, a, rtol=0, atol=0, msg=f"d{name}")
        else:
            whole_err = (a.double() - e).abs().max().item()
            assert (c.double() - e).abs().max().item() <= 2 * whole_err + 1e-3, f"d{name}"


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing(reentrant, device):
    """``torch.utils.checkpoint`` (both kinds) recomputes the forward in the backward: the same
    output and gradients bit for bit as without it (sinks included), the repeat of a kept
    launch too."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = (torch.randn(1, 2, 24, 32, device=device, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, device=device, requires_grad=True)

    def block(q, k, v, sinks):
        plain = flashcore.attention(q, k, v, causal=True)
        return plain + flashcore.attention(q, k, v, window=(5, 0), sinks=sinks)

    leaves = (q, k, v, sinks)
    for _ in range(2):
        out = checkpoint(block, *leaves, use_reentrant=reentrant)
        out.square().sum().backward()
        got = [t.grad for t in leaves]
        for t in leaves:
            t.grad = None
        want_out = block(*leaves)
        want_out.square().sum().backward()
        assert torch.equal(out, want_out)
        for name, g, t in zip(("q", "k", "v", "sinks"), got, leaves, strict=True):
            assert torch.equal(g, t.grad), name
            t.grad = None


@pytest.mark.parametrize(
    "options", [{}, {"window": (3, 1), "softcap": 5.0}], ids=["plain", "window-softcap"]
)
def test_second_derivative_raises(options, device):
    """A gradient taken with ``create_graph=True`` has the first-order values, and a loss built
    from it raises when differentiated (FlashCore's backward has no derivative) instead of taking
    it as a constant: ``once_differentiable`` alone let a gradient penalty's term drop silently,
    since the gradient reaching the backward (of ``out.sum()``) does not require grad."""
    case = Case(1, 2, 1, 9, 7, 16)
    q, k, v = (t.requires_grad_() for t in make_qkv(case, torch.float32, device))
    for _ in range(2):  # the second call of the signature takes the kept launch
        out = flashcore.attention(q, k, v, causal=True, **options)
        grads = torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
        plain = torch.autograd.grad(
            flashcore.attention(q, k, v, causal=True, **options).sum(), (q, k, v)
        )
        for g, p in zip(grads, plain, strict=True):
            torch.testing.assert_close(g.detach(), p)
        with pytest.raises(RuntimeError, match="attention backward is not differentiable"):
            (out.sum() + grads[0].pow(2).sum()).backward()
