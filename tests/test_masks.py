"""Sliding window, softcap and ALiBi: forward and backward against the reference.

Cases are ``shapes.MASKS`` (interpreter) and ``shapes.MASKS_GPU``. The ops' registration with
these options is opchecked in test_compile.py.
"""

import pytest
import torch

import flashcore
from flashcore import tuning
from flashcore.ops.problem import effective_window
from flashcore.reference import visible_mask
from helpers import (
    check_backward,
    check_forward,
    make_qkv,
    mask_options,
    record_backward_tiers,
    sm90_tier_runs,
)
from shapes import DTYPES, MASKS, MASKS_GPU, Case, MaskCase


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("mc", MASKS, ids=[m.id for m in MASKS])
def test_masks_forward(mc, dtype, device):
    q, k, v = make_qkv(mc.case, dtype, device)
    opts = mask_options(mc, device)
    out, lse = flashcore.attention(q, k, v, return_lse=True, **opts)
    check_forward(out, lse, q, k, v, **opts)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("mc", MASKS, ids=[m.id for m in MASKS])
def test_masks_backward(mc, dtype, device):
    q, k, v = make_qkv(mc.case, dtype, device)
    check_backward(q, k, v, **mask_options(mc, device))


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_window_rows_without_keys(dtype, device):
    # Sq > Sk, window (2, 1): row i sees keys [i - 32, i - 29], so rows 0..28 see none.
    q, k, v = make_qkv(Case(1, 2, 1, 60, 30, 32), dtype, device)
    slopes = torch.tensor([0.25, 0.5], device=device)
    opts = {"window": (2, 1), "softcap": 3.0, "alibi_slopes": slopes}
    out, lse = flashcore.attention(q, k, v, return_lse=True, **opts)
    assert torch.all(out[:, :, :29] == 0)
    assert torch.all(lse[:, :, :29] == float("-inf"))
    assert torch.isfinite(lse[:, :, 29:]).all()
    dlse = torch.randn_like(lse)
    dq, dk, dv = check_backward(q, k, v, causal=False, dlse=dlse, **opts)
    assert torch.all(dq[:, :, :29] == 0)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_window_sliced(device):
    """Unaligned views: the forward takes plain pointers (no tensor descriptors), whose key walk
    must start at the window's first tile."""
    mc = MaskCase(Case(1, 2, 1, 50, 90, 32), window=(20, 3), softcap=8.0)
    q, k, v = make_qkv(mc.case, torch.float16, device, layout="sliced")
    opts = mask_options(mc, device)
    out, lse = flashcore.attention(q, k, v, return_lse=True, **opts)
    check_forward(out, lse, q, k, v, **opts)
    check_backward(q, k, v, **opts)


def test_window_equivalences(device):
    """Windows that are another mask run that mask's kernel: bit-identical results."""
    q, k, v = make_qkv(Case(1, 2, 1, 40, 50, 32), torch.float16, device)

    def run(**kw):
        return flashcore.attention(q, k, v, return_lse=True, **kw)

    causal = run(causal=True)
    full = run()
    for same_as_causal in (run(window=(-1, 0)), run(window=(-1, 9), causal=True)):
        assert all(torch.equal(a, b) for a, b in zip(causal, same_as_causal, strict=True))
    for same_as_full in (run(window=(-1, -1)), run(window=(50, 40)), run(window=(49, 39))):
        assert all(torch.equal(a, b) for a, b in zip(full, same_as_full, strict=True))
    # A side that hides no key is unbounded: with Sq = 40 and Sk = 50 the last query sits at key
    # 49, so a left side of 49 (transformers' sliding window of 50) hides nothing.
    for same_as_causal in (run(window=(50, 0)), run(window=(49, 0))):
        assert all(torch.equal(a, b) for a, b in zip(causal, same_as_causal, strict=True))


def test_effective_window():
    """``effective_window`` drops exactly the sides that hide no key: the same visible keys as
    the window asked for (the reference's mask), and the window flag on only where one binds."""
    for seqlen_q, seqlen_k in ((1, 1), (1, 7), (5, 5), (6, 3), (3, 9)):
        for causal in (False, True):
            for left in range(-1, seqlen_k + 2):
                for right in range(-1, seqlen_q + 2):
                    window = (left, right)
                    got_causal, got = effective_window(causal, window, seqlen_q, seqlen_k)
                    want = visible_mask(seqlen_q, seqlen_k, causal=causal, window=window)
                    same = visible_mask(seqlen_q, seqlen_k, causal=got_causal, window=got)
                    assert torch.equal(want, same), (causal, window, seqlen_q, seqlen_k)
                    plain = visible_mask(seqlen_q, seqlen_k, causal=got_causal)
                    assert (got != (-1, -1)) == (not torch.equal(plain, want)), (causal, window)


def test_alibi_slopes_layouts(device):
    """(H,) slopes equal the same (B, H) slopes repeated; a strided (B, H) view works."""
    case = Case(2, 2, 2, 21, 33, 16)
    q, k, v = make_qkv(case, torch.float32, device)
    slopes = torch.tensor([0.3, 0.7], device=device)
    per_head = flashcore.attention(q, k, v, alibi_slopes=slopes)
    per_batch = flashcore.attention(q, k, v, alibi_slopes=slopes.expand(2, 2))
    assert torch.equal(per_head, per_batch)
    strided = torch.rand(2, 4, device=device)[:, ::2]
    out, lse = flashcore.attention(q, k, v, alibi_slopes=strided, return_lse=True)
    check_forward(out, lse, q, k, v, causal=False, alibi_slopes=strided)


def test_alibi_slopes_get_no_grad(device):
    """The slopes take no gradient: slopes that require one are refused while grad mode is on
    (they would silently get none, tests/test_validation.py); detached, q, k, v get theirs."""
    q, k, v = (t.requires_grad_() for t in make_qkv(Case(1, 2, 1, 9, 9, 16), torch.float32, device))
    slopes = torch.tensor([0.5, 0.25], device=device, requires_grad=True)
    with pytest.raises(ValueError, match=r"^alibi_slopes requires grad"):
        flashcore.attention(q, k, v, alibi_slopes=slopes)
    out = flashcore.attention(q, k, v, alibi_slopes=slopes.detach())
    out.sum().backward()
    assert slopes.grad is None
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_masks_compile(device):
    """The new options trace without a graph break and match eager."""
    torch._dynamo.reset()
    q, k, v = make_qkv(Case(1, 2, 1, 30, 41, 32), torch.float16, device)
    slopes = torch.tensor([0.5, 0.25], device=device)

    def fn(q, k, v, slopes):
        return flashcore.attention(
            q, k, v, window=(8, 2), softcap=5.0, alibi_slopes=slopes, return_lse=True
        )

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, slopes)
    assert all(torch.equal(a, b) for a, b in zip(got, fn(q, k, v, slopes), strict=True))
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["auto", "tma"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mc", MASKS_GPU, ids=[m.id for m in MASKS_GPU])
def test_masks_forward_gpu(mc: MaskCase, dtype, path, monkeypatch):
    if path == "tma":  # descriptors at every size (see test_forward_gpu)
        monkeypatch.setattr(tuning, "TMA_MIN_FLOPS", 0)
    q, k, v = make_qkv(mc.case, dtype, "cuda", layout="bshd" if mc.case.head_dim == 80 else "bhsd")
    opts = mask_options(mc, "cuda")
    out, lse = flashcore.attention(q, k, v, return_lse=True, **opts)
    check_forward(out, lse, q, k, v, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mc", MASKS_GPU, ids=[m.id for m in MASKS_GPU])
def test_masks_backward_gpu(mc: MaskCase, dtype):
    q, k, v = make_qkv(mc.case, dtype, "cuda")
    check_backward(q, k, v, **mask_options(mc, "cuda"))


SM90_MASKS = [m for m in MASKS_GPU if m.case.head_dim in (64, 128)] + [
    MaskCase(Case(1, 4, 2, 300, 517, 128), causal=True, window=(100, 0)),
    MaskCase(Case(1, 4, 2, 517, 300, 64), window=(64, 16), softcap=30.0, alibi="bh"),
    MaskCase(Case(1, 4, 4, 777, 700, 128), window=(-1, 0), alibi="h"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mc", SM90_MASKS, ids=[m.id for m in SM90_MASKS])
def test_masks_backward_gpu_sm90_tier(mc: MaskCase, dtype, monkeypatch):
    """Window, softcap and ALiBi through the Hopper backward (forced), with a check that it ran
    there on an sm_90 GPU."""
    ran = record_backward_tiers(monkeypatch)
    q, k, v = make_qkv(mc.case, dtype, "cuda", layout="bshd")
    with flashcore.use_tier("sm90"):
        check_backward(q, k, v, **mask_options(mc, "cuda"))
    assert ran == ["sm90" if sm90_tier_runs(q.device) else "portable"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mc",
    [
        MaskCase(Case(1, 4, 2, 300, 517, 128), causal=True, window=(100, 0)),
        MaskCase(Case(1, 4, 2, 517, 300, 64), window=(64, 16), softcap=30.0, alibi="bh"),
    ],
    ids=lambda m: m.id,
)
def test_masks_gpu_fp32(mc: MaskCase):
    q, k, v = make_qkv(mc.case, torch.float32, "cuda")
    opts = mask_options(mc, "cuda")
    out, lse = flashcore.attention(q, k, v, return_lse=True, **opts)
    check_forward(out, lse, q, k, v, **opts)
    check_backward(q, k, v, **opts)
