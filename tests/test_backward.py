"""Gradients of flashcore.attention (dq, dk, dv) against autograd through the float64 reference."""

import contextlib

import pytest
import torch

import flashcore
from flashcore import tuning
from flashcore.ops import registry as ops
from flashcore.tuning import sm90_backward
from helpers import (
    PortableLaunched,
    alibi_slopes,
    capture_modes,
    check_backward,
    check_forward,
    make_qkv,
    mask_options,
    record_backward_tiers,
    record_sm90_forwards,
    require_sm90,
    sm90_backward_switch,
    spy_d256,
)
from shapes import BWD_GPU, BWD_INTERP, DTYPES, Case, MaskCase


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


SM90_BWD = [c for c in BWD_GPU if c.head_dim in (64, 128)] + [
    Case(2, 4, 4, 1000, 1000, 128),
    Case(1, 3, 3, 1500, 1000, 64),
    Case(2, 16, 1, 513, 257, 64),
    Case(1, 2, 2, 203, 113, 128),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", SM90_BWD, ids=[c.id for c in SM90_BWD])
def test_backward_gpu_sm90_tier(case, dtype, causal, layout):
    """The GPU cases the Hopper backward covers (D 64/128), forced onto it, both layouts."""
    q, k, v = make_qkv(case, dtype, "cuda", layout=layout)
    with flashcore.use_tier("sm90"):
        dq, dk, dv = check_backward(q, k, v, causal=causal)
    if layout == "bshd":
        assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())


# Head dim 256: the Gluon backward of ops/bwd256.py (a dQ and a dK/dV kernel).
D256_BWD = [
    Case(2, 4, 4, 1000, 1000, 256),
    Case(1, 4, 2, 513, 777, 256),
    Case(1, 4, 1, 777, 513, 256),
    Case(1, 2, 1, 203, 1100, 256),
    Case(1, 8, 8, 2048, 2048, 256),
    # Head dims 136-248 run the same kernels over 256-column boxes: the columns past the
    # tensors' load as zeros and are not stored (the gradients' padding is never written).
    Case(1, 4, 2, 600, 700, 136),
    Case(2, 4, 4, 513, 513, 192),
    Case(1, 4, 1, 700, 300, 248),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", D256_BWD, ids=[c.id for c in D256_BWD])
def test_backward_gpu_d256(case, dtype, causal, layout, monkeypatch):
    """Head dim 256 (and 136-248) on Hopper: GQA/MQA, ragged Sq and Sk either way, both layouts;
    the Gluon backward ran, and the gradients keep the inputs' strides."""
    calls = spy_d256(monkeypatch)
    q, k, v = make_qkv(case, dtype, "cuda", layout=layout)
    dq, dk, dv = check_backward(q, k, v, causal=causal)
    assert calls, "the head-dim-256 Gluon backward did not run"
    if layout == "bshd":
        assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())


D256_MASKS = [
    (MaskCase(Case(1, 4, 2, 700, 900, 256), window=(200, 30)), torch.bfloat16),
    (MaskCase(Case(1, 4, 4, 900, 900, 256), causal=True, window=(300, 0)), torch.bfloat16),
    (MaskCase(Case(2, 4, 2, 600, 700, 256), causal=True, softcap=30.0), torch.bfloat16),
    (MaskCase(Case(1, 4, 1, 777, 513, 256), softcap=5.0), torch.float16),
    # Gemma 2's attention at head dim 256: causal, a sliding window and softcap 50.
    (
        MaskCase(Case(1, 4, 2, 1100, 1100, 256), causal=True, window=(300, 0), softcap=50.0),
        torch.bfloat16,
    ),
    (MaskCase(Case(1, 4, 4, 513, 777, 256), alibi="h"), torch.float16),
    (MaskCase(Case(2, 4, 2, 700, 600, 256), causal=True, alibi="bh"), torch.bfloat16),
    (
        MaskCase(Case(1, 4, 2, 600, 900, 256), window=(200, 30), softcap=20.0, alibi="h"),
        torch.float16,
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", D256_BWD[1:4] + D256_BWD[5:], ids=lambda c: c.id)
def test_backward_gpu_d256_tma_epilogue(case, causal, layout, monkeypatch):
    """dK and dV of the 64-key dK/dV kernel stored by TMA (``bwd256.DKDV_TMA_EPILOGUE``, forced):
    ragged Sk (the copy engine drops the rows past it), head dims below 256 (and the columns
    past them), GQA/MQA, both layouts."""
    from flashcore.ops import bwd256

    monkeypatch.setattr(bwd256, "DKDV_TMA_EPILOGUE", True)
    bwd256._PLANS.clear()
    calls = spy_d256(monkeypatch)
    q, k, v = make_qkv(case, torch.bfloat16, "cuda", layout=layout)
    check_backward(q, k, v, causal=causal)
    assert calls and all(p.dkdv[2]["TMA_EPILOGUE"] for p in bwd256._PLANS.values())


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("mc", "dtype"), D256_MASKS, ids=[f"{mc.id}-{str(d)[6:]}" for mc, d in D256_MASKS]
)
def test_backward_gpu_d256_masks(mc, dtype, monkeypatch):
    """Window, softcap and ALiBi (alone and together) at head dim 256 on Hopper."""
    calls = spy_d256(monkeypatch)
    q, k, v = make_qkv(mc.case, dtype, "cuda")
    check_backward(q, k, v, **mask_options(mc, "cuda"))
    assert calls


D256_MLA = [
    (MaskCase(Case(2, 4, 4, 1000, 1000, 192)), "bhsd", torch.bfloat16),
    (MaskCase(Case(1, 4, 2, 513, 777, 192), causal=True), "bshd", torch.float16),
    (MaskCase(Case(1, 4, 1, 777, 513, 192), causal=True), "bhsd", torch.bfloat16),
    (MaskCase(Case(1, 8, 8, 2048, 2048, 192), causal=True), "bhsd", torch.bfloat16),
    # Keys ending halfway through a 128-key block (the 128-key kernel's consumer 1 past Sk), and
    # fewer keys than one block with more queries than keys.
    (MaskCase(Case(1, 4, 1, 300, 1088, 192)), "bhsd", torch.float16),
    (MaskCase(Case(2, 4, 2, 130, 100, 192), causal=True), "bshd", torch.bfloat16),
    (
        MaskCase(Case(1, 4, 2, 600, 900, 192), window=(200, 30), softcap=20.0, alibi="h"),
        "bhsd",
        torch.float16,
    ),
]


# The consumers' fixed tiles' descriptors formed in the step loop in every build
# (``bwd_sm90.FRESH_DESC_ALWAYS``): causal and ragged lengths, GQA, a window, softcap and ALiBi,
# both head dims (at D = 64 K and V sit in registers in the plain builds, which the switch leaves
# as they are).
SM90_FRESH = [
    (MaskCase(Case(2, 4, 4, 1000, 1000, 128), causal=True), torch.bfloat16),
    (MaskCase(Case(2, 4, 4, 1000, 1000, 128)), torch.float16),
    (MaskCase(Case(1, 3, 3, 1500, 1000, 64), causal=True), torch.float16),
    (MaskCase(Case(1, 8, 2, 2048, 2048, 128), causal=True), torch.bfloat16),
    (MaskCase(Case(1, 4, 2, 300, 517, 128), causal=True, window=(100, 0)), torch.bfloat16),
    (MaskCase(Case(1, 4, 2, 517, 300, 64), window=(64, 16), softcap=30.0, alibi="bh"),
     torch.float16),
    (MaskCase(Case(1, 4, 4, 777, 700, 128), causal=True, softcap=20.0), torch.bfloat16),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("mc", "dtype"), SM90_FRESH, ids=[f"{mc.id}-{str(d)[6:]}" for mc, d in SM90_FRESH]
)
def test_backward_gpu_sm90_fresh_desc(mc, dtype, monkeypatch):
    """The Hopper backward (D 64/128, forced) with ``bwd_sm90.FRESH_DESC_ALWAYS``: the
    consumers' K, V and dQ K-column descriptors formed in the step loop in every build (shipped:
    in those with the dQ products beside dK)."""
    with sm90_backward_switch(monkeypatch, "FRESH_DESC_ALWAYS") as plans:
        q, k, v = make_qkv(mc.case, dtype, "cuda", layout="bshd")
        with flashcore.use_tier("sm90"):
            check_backward(q, k, v, **mask_options(mc, "cuda"))
        assert plans and all(
            p.main_meta["FRESH_DESC"] != p.main_meta["KV_REGS"] for p in plans.values()
        )


# The 128-key kernel as shipped, without SKIP_MASKED, MASK_EXPONENT, FRESH_DESC or SPLIT_DIAG; the
# 64-key fused kernel; the dQ kernel beside the 64-key dK/dV kernel; "-regs": dK and dV stored
# from registers instead of by TMA.
MLA_PATHS = ["wide", "wide-noskip", "wide-nomexp", "wide-nofresh", "wide-nosplit", "wide-regs"]
MLA_PATHS += ["fused-dq", "fused-dq-regs", "dq-kernel", "dq-kernel-regs"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", MLA_PATHS)
@pytest.mark.parametrize(
    ("mc", "layout", "dtype"),
    D256_MLA,
    ids=[f"{mc.id}-{layout}-{str(d)[6:]}" for mc, layout, d in D256_MLA],
)
def test_backward_gpu_d256_mla(mc, layout, dtype, path, monkeypatch):
    """MLA's head dims (q and k 192, v 128) through the head-dim-256 kernels (Q and K in a 128-
    and a 64-column tile): GQA/MQA, ragged lengths either way, causal, the score options; dQ in
    the dK/dV kernel, at 128 keys a program where the options allow (``bwd256.WIDE_MLA``, as
    shipped: "wide"; "wide-noskip" without skipping consumer 1's causal steps that see none of
    its keys, ``bwd256.WIDE_SKIP_MASKED``; "wide-nomexp" with its exponent formed after the
    masks' branches, ``bwd256.WIDE_MASK_EXPONENT`` off; "wide-nofresh" with its fixed tiles'
    descriptors formed before the step loop, ``bwd256.WIDE_FRESH_DESC`` off; "wide-nosplit" with
    the causal diagonal's steps in the same loop as the others, ``bwd256.WIDE_SPLIT_DIAG`` off) or
    at 64 ("fused-dq"), and by the dQ kernel ("dq-kernel"); "-regs": dK and dV stored from registers
    (``bwd256.WIDE_TMA_EPILOGUE`` and ``DKDV_TMA_EPILOGUE`` off; on elsewhere, by TMA)."""
    from flashcore.ops import bwd256

    monkeypatch.setattr(bwd256, "FUSED_MLA", not path.startswith("dq-kernel"))
    tma = not path.endswith("-regs")
    monkeypatch.setattr(bwd256, "DKDV_TMA_EPILOGUE", tma)
    monkeypatch.setattr(bwd256, "WIDE_MLA", path.startswith("wide"))
    monkeypatch.setattr(bwd256, "WIDE_SKIP_MASKED", path != "wide-noskip")
    monkeypatch.setattr(bwd256, "WIDE_MASK_EXPONENT", path != "wide-nomexp")
    monkeypatch.setattr(bwd256, "WIDE_FRESH_DESC", path != "wide-nofresh")
    monkeypatch.setattr(bwd256, "WIDE_SPLIT_DIAG", path != "wide-nosplit")
    monkeypatch.setattr(bwd256, "WIDE_TMA_EPILOGUE", tma)
    bwd256._PLANS.clear()
    calls = spy_d256(monkeypatch)
    q, k, _ = make_qkv(mc.case, dtype, "cuda", layout=layout)
    _, _, v = make_qkv(mc.case._replace(head_dim=128), dtype, "cuda", layout=layout)
    options = mask_options(mc, "cuda")
    dv = check_backward(q, k, v, **options)[2]
    assert calls, "the head-dim-256 Gluon backward did not run"
    assert dv.shape == v.shape
    plain = not (mc.window or mc.softcap or mc.alibi)
    assert any(p.wide for p in bwd256._PLANS.values()) == (path.startswith("wide") and plain)
    assert all(p.dkdv[2]["TMA_EPILOGUE"] == tma for p in bwd256._PLANS.values())
    wide = [p for p in bwd256._PLANS.values() if p.wide]
    assert all(p.dkdv[2]["FRESH_DESC"] == (path != "wide-nofresh") for p in wide)


@pytest.mark.gpu
def test_backward_gpu_d256_deterministic_and_lse_grad(monkeypatch):
    """No atomics: two backwards are bit-identical, ``deterministic=True`` takes the kernels
    too; a gradient through the LSE reaches the gradients (delta carries it)."""
    calls = spy_d256(monkeypatch)
    q, k, v = make_qkv(Case(1, 4, 2, 1000, 1100, 256), torch.bfloat16, "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flashcore.attention(q, k, v, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), dout)
    assert calls
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    q, k, v = (t.detach() for t in (q, k, v))
    check_backward(q, k, v, causal=False, dlse=torch.randn(1, 4, 1000, device="cuda"))


@pytest.mark.gpu
def test_backward_gpu_mla_deterministic(monkeypatch):
    """MLA's dQ is reduce-added in the dK/dV kernel by default (its plan holds the fp32
    accumulator) and by the dQ kernel with ``deterministic=True``, whose two backwards are
    bit-identical."""
    from flashcore.ops import bwd256

    calls = spy_d256(monkeypatch)
    q, k, _ = make_qkv(Case(1, 4, 2, 700, 900, 192), torch.bfloat16, "cuda")
    v = make_qkv(Case(1, 4, 2, 700, 900, 128), torch.bfloat16, "cuda")[2]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for deterministic in (False, True):
        bwd256._PLANS.clear()
        out = flashcore.attention(q, k, v, causal=True, deterministic=deterministic)
        dout = torch.randn_like(out)
        first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        second = torch.autograd.grad(out, (q, k, v), dout)
        (plan,) = bwd256._PLANS.values()
        assert (plan.acc is None) == deterministic
        if deterministic:
            for a, b in zip(first, second, strict=True):
                assert torch.equal(a, b)
        # Either way dK and dV are written once per program.
        assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])
    assert len(calls) == 4


@pytest.mark.gpu
def test_backward_gpu_d256_not_taken(monkeypatch):
    """fp32, a value head dim unlike the query's but MLA's, and head dims outside 136-256 or not
    a multiple of 8 keep the other backwards (``bwd256.takes``)."""
    calls = spy_d256(monkeypatch)
    q, k, v = make_qkv(Case(1, 2, 2, 300, 300, 256), torch.bfloat16, "cuda")
    check_backward(*(t.float() for t in (q, k, v)), causal=False)
    check_backward(q[..., :192], k[..., :192], v[..., :64], causal=True)
    q, k, v = make_qkv(Case(1, 2, 2, 300, 300, 132), torch.bfloat16, "cuda")
    check_backward(q, k, v, causal=False)
    q, k, v = make_qkv(Case(1, 2, 2, 300, 300, 120), torch.bfloat16, "cuda")
    check_backward(q, k, v, causal=False)
    assert not calls
    # MLA's head dims run these kernels causal; non-causal at every length where the 128-key
    # kernel takes them, else from MLA_NON_CAUSAL_MIN_SEQLEN keys (``bwd256.MLA_NON_CAUSAL``
    # off, as shipped).
    from flashcore.ops import bwd256

    monkeypatch.setattr(bwd256, "MLA_NON_CAUSAL", False)
    q, k, v = make_qkv(Case(1, 2, 2, 300, 300, 192), torch.bfloat16, "cuda")
    check_backward(q, k, v[..., :128], causal=False, softcap=20.0)
    check_backward(q, k, v[..., :128], causal=False, window=(100, 100))
    assert not calls
    check_backward(q, k, v[..., :128], causal=False)
    assert len(calls) == 1
    check_backward(q, k, v[..., :128], causal=True, softcap=20.0)
    assert len(calls) == 2
    long_k = torch.empty(1, 2, bwd256.MLA_NON_CAUSAL_MIN_SEQLEN, 192, device="cuda").bfloat16()
    long_v = long_k[..., :128]
    dout = torch.empty_like(q[..., :128])
    short = (q, long_k[:, :, :-1], long_v[:, :, :-1], dout, False, None, None)
    assert bwd256.takes(*short)
    assert not bwd256.takes(*short, (-1, -1), 20.0)
    assert not bwd256.takes(*short, deterministic=True)
    assert bwd256.takes(q, long_k, long_v, dout, False, None, None, (-1, -1), 20.0)
    monkeypatch.setattr(bwd256, "WIDE_MLA", False)
    assert not bwd256.takes(*short)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["grouped", "split"])
@pytest.mark.parametrize(
    "mc",
    [
        MaskCase(Case(2, 8, 2, 700, 1100, 128), causal=True),
        MaskCase(Case(1, 4, 1, 513, 777, 64), window=(200, 30), softcap=20.0, alibi="h"),
    ],
    ids=["gqa-causal", "mqa-window-softcap-alibi"],
)
def test_backward_gpu_sm90_group_split(mc, split, monkeypatch):
    """GQA/MQA on the Hopper backward both ways (``bwd_sm90.split_group`` forced): a program per
    kv head walking its group, and a program per query head with K/V repeated and dK/dV summed
    per group; strided (B, S, H, D) gradients written in place."""
    from flashcore.ops import bwd_sm90

    require_sm90()
    monkeypatch.setattr(bwd_sm90, "split_group", lambda *args: split)
    q, k, v = make_qkv(mc.case, torch.bfloat16, "cuda", layout="bshd")
    with flashcore.use_tier("sm90"):
        _, dk, dv = check_backward(q, k, v, **mask_options(mc, "cuda"))
    assert (dk.stride(), dv.stride()) == (k.stride(), v.stride())


# Steps a consumer's keys are not seen in, skipped: consumer 1's first causal step
# (``bwd_sm90.SKIP_MASKED``, on) with GQA (the skip is the group's first head's step), queries
# longer and shorter than the keys, the dQ warpgroup (D = 64), a window with a softcap at D = 64
# (with a softcap D = 128 keeps each dQ in its step and takes no skip), and 4096 rows, where the
# dQ products run beside dK; consumer 0's last step at a window's left edge
# and, not causal, consumer 1's first at its right edge (``bwd_sm90.SKIP_MASKED_WINDOW``, on),
# causal and not, with GQA, the dQ warpgroup and the dQ products beside dK (non-causal).
SM90_SKIP = [
    ("SKIP_MASKED", MaskCase(Case(2, 8, 2, 700, 1100, 128), causal=True), torch.bfloat16),
    ("SKIP_MASKED", MaskCase(Case(1, 4, 4, 1100, 700, 128), causal=True), torch.float16),
    ("SKIP_MASKED", MaskCase(Case(2, 4, 4, 1000, 1000, 64), causal=True), torch.bfloat16),
    ("SKIP_MASKED", MaskCase(Case(1, 4, 2, 777, 513, 64), causal=True, window=(300, 0),
                             softcap=20.0), torch.float16),
    ("SKIP_MASKED", MaskCase(Case(1, 8, 8, 4096, 4096, 128), causal=True), torch.bfloat16),
    ("SKIP_MASKED_WINDOW", MaskCase(Case(1, 4, 4, 1000, 1000, 128), causal=True, window=(128, 0)),
     torch.bfloat16),
    ("SKIP_MASKED_WINDOW", MaskCase(Case(2, 8, 2, 1100, 700, 128), causal=True, window=(256, 0)),
     torch.float16),
    ("SKIP_MASKED_WINDOW", MaskCase(Case(1, 4, 4, 2048, 2048, 128), window=(300, 200)),
     torch.bfloat16),
    ("SKIP_MASKED_WINDOW", MaskCase(Case(2, 4, 4, 700, 900, 64), window=(200, 50)), torch.float16),
    ("SKIP_MASKED_WINDOW", MaskCase(Case(1, 4, 2, 777, 513, 64), causal=True, window=(100, 0),
                                  softcap=20.0), torch.bfloat16),
    # BAND_MASK (on as shipped): causal windows' two masks as one comparison; the same P, so
    # the same bits in dK and dV as with the two masks apart.
    ("BAND_MASK", MaskCase(Case(1, 4, 4, 1000, 1000, 128), causal=True, window=(128, 0)),
     torch.bfloat16),
    ("BAND_MASK", MaskCase(Case(2, 8, 2, 1100, 700, 128), causal=True, window=(256, 0),
                           softcap=30.0), torch.float16),
    ("BAND_MASK", MaskCase(Case(1, 4, 2, 777, 513, 64), causal=True, window=(100, 0),
                           softcap=20.0), torch.bfloat16),
    ("BAND_MASK", MaskCase(Case(2, 4, 4, 700, 900, 64), causal=True, window=(200, 0), alibi="bh"),
     torch.float16),
    ("BAND_MASK", MaskCase(Case(1, 8, 8, 4096, 4096, 128), causal=True, window=(4095 - 64, 0)),
     torch.bfloat16),
    # DQ_LAG_OPTIONS: softcap, and causal ALiBi, at D=128 with each step's dQ a step late, and
    # with it the skipped steps and the dQ products beside dK.
    ("DQ_LAG_OPTIONS", MaskCase(Case(2, 8, 2, 1100, 700, 128), causal=True, softcap=30.0),
     torch.bfloat16),
    ("DQ_LAG_OPTIONS", MaskCase(Case(1, 4, 4, 777, 513, 128), softcap=20.0), torch.float16),
    ("DQ_LAG_OPTIONS", MaskCase(Case(1, 4, 4, 1000, 1000, 128), causal=True, alibi="bh"),
     torch.bfloat16),
    ("DQ_LAG_OPTIONS", MaskCase(Case(1, 4, 2, 1100, 1100, 128), causal=True, window=(256, 0),
                                softcap=50.0), torch.bfloat16),
    ("DQ_LAG_OPTIONS", MaskCase(Case(2, 4, 4, 700, 900, 128), window=(200, 50), softcap=20.0,
                                alibi="h"), torch.float16),
    ("DQ_LAG_OPTIONS", MaskCase(Case(1, 8, 8, 4096, 4096, 128), causal=True, softcap=30.0),
     torch.bfloat16),
]  # fmt: skip
SKIP_META = {"SKIP_MASKED": "SKIP_MASKED", "SKIP_MASKED_WINDOW": "SKIP_WINDOW",
             "BAND_MASK": "BAND_MASK", "DQ_LAG_OPTIONS": "LAG_OPTIONS"}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("switch", "mc", "dtype"),
    SM90_SKIP,
    ids=[f"{sw.lower()}-{mc.id}-{str(d)[6:]}" for sw, mc, d in SM90_SKIP],
)
def test_backward_gpu_sm90_skip_masked(switch, mc, dtype, monkeypatch):
    """The Hopper backward (D 64/128, forced) with a skip switch off and on: the skipped steps'
    products are exactly zero, so dK and dV are bit for bit equal, dQ equal to its reduce
    order, and each passes the FA rule. The same for BAND_MASK (the masks of a causal window
    formed another way) and DQ_LAG_OPTIONS (softcap and ALiBi with the dQ a step late)."""
    from flashcore.ops import bwd, bwd_sm90

    require_sm90()
    q, k, v = make_qkv(mc.case, dtype, "cuda", layout="bshd")
    grads = {}
    for on in (False, True):
        monkeypatch.setattr(bwd_sm90, switch, on)
        bwd_sm90._PLANS.clear()
        bwd.forget()
        torch.manual_seed(1)
        with flashcore.use_tier("sm90"):
            grads[on] = check_backward(q, k, v, **mask_options(mc, "cuda"))
        assert all(p.main_meta[SKIP_META[switch]] == on for p in bwd_sm90._PLANS.values())
    bwd_sm90._PLANS.clear()
    bwd.forget()
    (dq0, dk0, dv0), (dq1, dk1, dv1) = grads[False], grads[True]
    assert torch.equal(dk0, dk1) and torch.equal(dv0, dv1)
    # dQ's fp32 sums reduce-added in another order: at most a rounding of its dtype apart.
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    assert (dq1.float() - dq0.float()).abs().max() <= ulp * dq0.float().abs().max()


def test_sm90_backward_group_split_rule():
    """When GQA/MQA runs a program per query head: causal below two programs per SM, otherwise
    only when it takes fewer waves than the grouped grid's longest program."""
    from flashcore.ops import bwd_sm90
    from flashcore.ops.bwd_sm90 import split_group

    full = (-1, -1)
    assert not split_group(1, 16, 132, True, full)  # no group
    assert split_group(4, 128, 132, True, full)  # (1, 16/4, 4096): 32 key blocks x 4
    assert not split_group(4, 2048, 132, True, full)  # (8, 32/8, 4096)
    assert split_group(4, 32, 132, False, full)  # one wave either way, a quarter of the steps
    assert not split_group(4, 128, 132, False, full)  # 4 waves of 1/4 against 1 of 4/4
    assert not split_group(4, 128, 132, True, (512, 0))  # a window: work spread evenly
    # Never more extra memory than SPLIT_MAX_BYTES (MQA with many heads at long keys).
    limit = bwd_sm90.SPLIT_MAX_BYTES
    assert split_group(4, 128, 132, True, full, limit)
    assert not split_group(64, 256, 132, True, full, limit + 1)


@pytest.mark.parametrize(("major", "want"), [(12, 96), (13, 80), (14, 80)])
def test_dq_warpgroup_registers_follow_the_ptxas(monkeypatch, major, want):
    """The D=64 backward's dQ warpgroup: 96 registers where Triton compiles sm_90 with CUDA 12's
    ptxas (3.6-3.8), 80 with CUDA 13's (3.9 on, which spilled consumer 0's loop at 96); D=128
    has no dQ warpgroup. (The ptxas version stood in for; the installed one read as such.)"""
    pytest.importorskip("triton.backends.nvidia")
    import triton

    from flashcore.ops import bwd_sm90

    # The wheels' own ptxas for sm_90 (read from each): CUDA 12's up to 3.8, 13's in 3.9.
    known = {"3.6.": 12, "3.7.": 12, "3.8.": 12, "3.9.": 13}
    prefix = ".".join(triton.__version__.split(".")[:2]) + "."
    if prefix in known:
        assert bwd_sm90.ptxas_major() == known[prefix]
    monkeypatch.setattr(bwd_sm90, "ptxas_major", lambda: major)
    dq_regs = bwd_sm90.dq_regs.__wrapped__
    assert dq_regs(bwd_sm90.CONFIGS[64]) == want
    assert dq_regs(bwd_sm90.CONFIGS[128]) == bwd_sm90.CONFIGS[128].dq_regs


@pytest.mark.gpu
def test_backward_gpu_sm90_lse_grad():
    case = Case(2, 8, 2, 1500, 1000, 128)
    q, k, v = make_qkv(case, torch.bfloat16, "cuda")
    dlse = torch.randn(case.batch, case.heads, case.seqlen_q, device="cuda")
    with flashcore.use_tier("sm90"):
        check_backward(q, k, v, causal=True, dlse=dlse)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("tier", "deterministic", "torch_flag", "want"),
    [
        ("auto", False, False, "sm90"),
        ("sm90", False, False, "sm90"),
        ("portable", False, False, "portable"),
        ("auto", True, False, "portable"),
        ("sm90", True, False, "portable"),
        ("auto", False, True, "portable"),
    ],
)
def test_backward_tier_choice(monkeypatch, tier, deterministic, torch_flag, want):
    """Which backward runs: the tier in effect at the forward (the backward runs on autograd's
    thread, outside the block), never the Hopper one with ``deterministic`` or under
    ``torch.use_deterministic_algorithms``; "auto" takes it for long sequences."""
    require_sm90()
    ran = record_backward_tiers(monkeypatch)
    # 6.9e10 FLOPs (causal): above tuning.SM90_BWD_MIN_FLOPS, so "auto" takes the tier eagerly.
    q, k, v = make_qkv(Case(1, 16, 4, 4096, 4096, 128), torch.bfloat16, "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: torch_flag)
    with flashcore.use_tier(tier):
        out = flashcore.attention(q, k, v, causal=True, deterministic=deterministic)
    out.backward(torch.randn_like(out))
    assert ran == [want]


@pytest.mark.gpu
def test_backward_auto_keeps_short_sequences_portable(monkeypatch):
    require_sm90()
    ran = record_backward_tiers(monkeypatch)
    # 256 queries against 16k keys: above the FLOP floor (6.9e10), below the length floor.
    case = Case(2, 16, 16, 256, 16384, 128)
    q, k, v = (t.requires_grad_() for t in make_qkv(case, torch.bfloat16, "cuda"))
    flashcore.attention(q, k, v).sum().backward()
    assert ran == ["portable"]


@pytest.mark.parametrize(
    ("seqlen", "head_dim", "causal", "varlen", "want"),
    [
        (512, 128, False, False, True),  # dense: from 512 on, D=128 or 64, causal or not
        (511, 128, False, False, False),
        (512, 128, True, False, True),
        (511, 128, True, False, False),
        (512, 64, False, False, True),
        (511, 64, False, False, False),
        (511, 64, True, False, False),
        (512, 64, True, False, True),
        (256, 128, False, True, True),  # packed batches (mean lengths): D=128 from 256 on
        (255, 128, False, True, False),
        (383, 128, True, True, False),  # causal from 384 on
        (384, 128, True, True, True),
        (383, 64, False, True, False),  # D=64 from 384 on, causal or not
        (384, 64, True, True, True),
    ],
)
def test_sm90_backward_auto_rule(seqlen, head_dim, causal, varlen, want):
    """Where "auto" takes the Hopper backward by lengths (tuning.sm90_backward: the measured
    crossovers), above its FLOP floor; the shorter side decides."""
    flops = 1e12
    assert sm90_backward(seqlen, seqlen, head_dim, flops, causal, varlen=varlen) is want
    assert sm90_backward(seqlen, 1 << 16, head_dim, flops, causal, varlen=varlen) is want
    assert sm90_backward(1 << 16, seqlen, head_dim, flops, causal, varlen=varlen) is want


def test_sm90_backward_flop_floor():
    """An eager call takes the Hopper backward from ``SM90_BWD_MIN_FLOPS`` on (below it the host's
    cost sets the pace); a call being captured into a CUDA graph has no FLOP floor."""
    from flashcore import tuning

    floor = tuning.SM90_BWD_MIN_FLOPS
    assert sm90_backward(4096, 4096, 128, floor)
    assert not sm90_backward(4096, 4096, 128, floor * 0.99)
    assert sm90_backward(4096, 4096, 128, floor * 0.01, graph=True)
    assert sm90_backward(1024, 1024, 64, 1.0, True, True)
    assert not sm90_backward(511, 511, 64, 1e12, True, True)  # the length floors still apply


@pytest.mark.parametrize(
    ("shape", "causal", "work", "want"),
    [
        ((16, 16, 16, 512, 128), True, 3.221e10, True),  # 1.7e10 FLOPs in 1024 programs
        ((16, 32, 32, 512, 64), True, 3.221e10, True),
        ((4, 16, 16, 1024, 128), True, 2.47e10, False),  # the same FLOPs in 512 programs
        ((2, 8, 8, 2048, 128), True, 2.094e10, False),  # and in 128
        ((8, 32, 8, 512, 128), True, 2.416e10, False),  # GQA: a program per kv head
        ((8, 32, 32, 512, 128), True, 3.221e10, True),  # the same without GQA
        ((2, 8, 8, 2048, 128), False, 3.704e10, True),  # 3.4e10 FLOPs: over by FLOPs alone
    ],
)
def test_sm90_backward_work_counts_programs(shape, causal, work, want):
    """The eager floor weighs the Hopper backward's work as its grid does it: each program (128
    keys of one kv head) costs ``SM90_BWD_PROGRAM_STEPS`` steps of 64 query rows besides its
    products, and causal one more for each query head's key block; many short programs pass
    the floor (``tuning.SM90_BWD_MIN_FLOPS``, 3e10) at fewer FLOPs (docs/performance_backward.md,
    "The eager floor counts programs"; the floor: docs/performance_host.md, "Quick
    backwards")."""
    from flashcore import tuning

    batch, heads, kv_heads, seqlen, head_dim = shape
    got = tuning.sm90_backward_work(
        batch, heads, kv_heads, seqlen, seqlen, head_dim, causal, 64, 128
    )
    assert got == pytest.approx(work, rel=1e-3)
    assert sm90_backward(seqlen, seqlen, head_dim, got, causal) is want


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


# Head dims between 64 and 128 on the Hopper tiers (ops/fwd_sm90.py: PADDED_HEAD_DIMS): the D = 128
# kernels over 128-column boxes, which the copy engine pads with zeros on loads and clips on
# stores. Ragged lengths both ways, GQA and MQA, causal with Sq > Sk, (B, S, H, D) views, a window
# with softcap, ALiBi, and a gradient through the LSE.
PADDED_CASES = [
    (MaskCase(Case(2, 4, 2, 300, 517, 96), causal=True), "bshd", False),
    (MaskCase(Case(1, 4, 1, 777, 1025, 80)), "bhsd", True),
    (MaskCase(Case(2, 4, 4, 700, 300, 112), causal=True), "bhsd", False),
    (MaskCase(Case(1, 4, 4, 513, 513, 96), window=(100, 20), softcap=30.0), "bhsd", False),
    (MaskCase(Case(1, 4, 2, 390, 600, 72), alibi="h"), "bshd", False),
    # Below 64, on the D = 64 kernels (fwd_sm90.NARROW_HEAD_DIMS).
    (MaskCase(Case(2, 4, 2, 300, 517, 56), causal=True), "bshd", False),
    (MaskCase(Case(1, 4, 1, 777, 1025, 48)), "bhsd", True),
    (MaskCase(Case(1, 4, 4, 513, 513, 48), window=(100, 20), softcap=30.0), "bhsd", False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("mc", "layout", "with_dlse"),
    PADDED_CASES,
    ids=[f"{m.id}-{lay}{'-dlse' * g}" for m, lay, g in PADDED_CASES],
)
def test_sm90_padded_head_dims(monkeypatch, mc, layout, with_dlse, dtype):
    """Forward and backward at head dims 48-112 through the Hopper tiers (``use_tier("sm90")``;
    ``PADDED_VERIFIED`` and ``NARROW_VERIFIED`` set on for the test), both launchers
    recorded: out, LSE, dq, dk and dv against the float64 reference."""
    from flashcore.ops import fwd_sm90

    require_sm90()
    monkeypatch.setattr(fwd_sm90, "PADDED_VERIFIED", True)
    monkeypatch.setattr(fwd_sm90, "NARROW_VERIFIED", True)
    forwards = record_sm90_forwards(monkeypatch)
    backwards = record_backward_tiers(monkeypatch)
    q, k, v = make_qkv(mc.case, dtype, "cuda", layout=layout)
    kw = mask_options(mc, "cuda")
    dlse = torch.randn(q.shape[:3], device="cuda") if with_dlse else None
    with flashcore.use_tier("sm90"):
        out, lse = flashcore.attention(q, k, v, return_lse=True, **kw)
        check_forward(out, lse, q, k, v, **kw)
        check_backward(q, k, v, dlse=dlse, **kw)
    assert forwards == [1, 1] and backwards == ["sm90"]


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


# Triton 3.6's interpreter rounds fp32 to bf16 toward zero (the GPU to nearest even): bf16 is
# checked on the GPU only.
@pytest.mark.parametrize(
    "dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize(
    "shape, acc_rows, packed",
    [((2, 3, 70, 80), 128, False), ((1, 2, 64, 64), 64, False), ((1, 3, 130, 48), 130, True)],
)
def test_sm90_dq_conversion_kernel(device, dtype, shape, acc_rows, packed):
    # The Hopper backward's last kernel: dQ = scale * its fp32 accumulator, rounded as
    # torch.mul(acc, scale, out=dq) rounds it, bit for bit; rows past Sq (permuted rows pad the
    # accumulator to seqlen_pad) and padded head dims (BLOCK_D above D) left out; dq by strides
    # ((B, S, H, D) views; a packed batch's (total, H, D)).
    pytest.importorskip("triton.experimental.gluon")
    import triton

    from flashcore.kernels.hopper import bwd_rows
    from flashcore.ops.bwd_sm90 import dq_strides

    batch, heads, seqlen, dim = shape
    acc = torch.randn(batch, heads, acc_rows, dim, device=device, dtype=torch.float32) * 100
    scale = dim**-0.5
    if packed:
        dq = torch.full((seqlen, heads, dim), float("nan"), device=device, dtype=dtype)
        want = torch.mul(acc[0].transpose(0, 1), scale).to(dtype)
    else:
        dq = torch.full((batch, seqlen, heads, dim), float("nan"), device=device, dtype=dtype)
        dq = dq.transpose(1, 2)
        want = torch.empty_like(dq)
        torch.mul(acc[:, :, :seqlen], scale, out=want)
    strides = dq_strides(dq, packed)
    block_d = triton.next_power_of_2(dim)
    grid = (triton.cdiv(seqlen, 64) * batch * heads,)
    bwd_rows.bwd_dq_kernel[grid](
        acc, dq, scale, *strides, heads, seqlen, acc_rows, HEAD_DIM=dim, BLOCK_D=block_d,
        BLOCK_M=64,
    )  # fmt: skip
    assert torch.equal(dq.float(), want.float())


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
