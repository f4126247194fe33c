"""``flashcore.scaled_dot_product_attention``: PyTorch's SDPA semantics, FlashCore's kernels.

Numbers are checked with FlashAttention's rule against the reference with a top-left causal mask;
that the reference's top-left mask is PyTorch's is checked against PyTorch's own SDPA in float64.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import flashcore
from flashcore import reference
from helpers import make_qkv
from numerics import assert_fa_rule
from shapes import SDPA, Case

pytestmark = pytest.mark.usefixtures("fresh_sdpa_warnings")


def fallback_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "ran PyTorch's SDPA instead" in str(w.message)]


def check_sdpa(out, q, k, v, *, is_causal, scale=None) -> None:
    """FA rule for a 4-D SDPA call against the reference with PyTorch's top-left mask."""

    def ref(dtype):
        return reference.attention(
            q, k, v, causal=is_causal, scale=scale, dtype=dtype, top_left=True
        )

    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    assert_fa_rule("out", out, ref(q.dtype).out, ref(torch.float64).out)


@pytest.mark.parametrize("case", SDPA, ids=[c.id for c in SDPA])
def test_reference_top_left_is_pytorchs(case):
    q, k, v = make_qkv(case, torch.float64, "cpu")
    gqa = case.heads != case.kv_heads
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    got = reference.attention(q, k, v, causal=True, top_left=True).out
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", SDPA, ids=[c.id for c in SDPA])
def test_sdpa(case, dtype, is_causal, device):
    q, k, v = make_qkv(case, dtype, device)
    gqa = case.heads != case.kv_heads
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = flashcore.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)
    assert not fallback_warnings(caught)
    check_sdpa(out, q, k, v, is_causal=is_causal)


def test_sdpa_scale_and_positional_args(device):
    q, k, v = make_qkv(Case(1, 2, 2, 30, 11, 32), torch.bfloat16, device)
    out = flashcore.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.3)
    check_sdpa(out, q, k, v, is_causal=True, scale=0.3)


def test_sdpa_mqa_broadcast_without_gqa(device):
    """PyTorch broadcasts one kv head without enable_gqa: that is MQA, run by FlashCore."""
    q, k, v = make_qkv(Case(1, 4, 1, 20, 20, 16), torch.float16, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = flashcore.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not fallback_warnings(caught)
    check_sdpa(out, q, k, v, is_causal=True)


# rank -> (the 4-D tensor's part the SDPA call sees, that part in that rank)
RANKS = {
    "2d": (lambda t: t[:1, :1], lambda t: t[0, 0]),
    "3d": (lambda t: t[:1], lambda t: t[0]),
    "5d": (lambda t: t, lambda t: t.unflatten(0, (2, 2))),
}


@pytest.mark.parametrize("rank", list(RANKS))
def test_sdpa_ranks(rank, device):
    """(L, E), (H, L, E) and (N, M, H, L, E) give the 4-D call's numbers in their own shape."""
    part, view = RANKS[rank]
    q, k, v = (part(t) for t in make_qkv(Case(4, 4, 2, 19, 27, 32), torch.float32, device))
    gqa = rank != "2d"
    out = flashcore.scaled_dot_product_attention(
        view(q), view(k), view(v), is_causal=True, enable_gqa=gqa
    )
    assert out.shape == view(q).shape
    check_sdpa(out.reshape(q.shape), q, k, v, is_causal=True)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("sq", "sk"), [(0, 5), (5, 0), (0, 0)])
def test_sdpa_empty(sq, sk, is_causal, device):
    """Same as PyTorch: zero keys give zeros (no NaN), zero queries an empty result."""
    q, k, v = make_qkv(Case(1, 2, 2, sq, sk, 16), torch.float32, device)
    out = flashcore.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    want = F.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu(), is_causal=is_causal)
    assert torch.equal(out.cpu(), want)


def _raises_like_torch(*args, **kwargs) -> None:
    with pytest.raises(Exception) as want:  # whatever PyTorch raises
        F.scaled_dot_product_attention(*args, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(want.type) as got:
            flashcore.scaled_dot_product_attention(*args, **kwargs)
    assert str(got.value) == str(want.value)
    assert not fallback_warnings(caught), "a call PyTorch rejects must not warn about fallback"


def test_sdpa_heads_need_enable_gqa(device):
    q, k, v = make_qkv(Case(1, 4, 2, 8, 8, 16), torch.float16, device)
    _raises_like_torch(q, k, v)


def test_sdpa_gqa_heads_not_divisible(device):
    q, k, v = make_qkv(Case(1, 4, 3, 8, 8, 16), torch.float16, device)
    _raises_like_torch(q, k, v, enable_gqa=True)


def test_sdpa_bad_arguments(device):
    q, k, v = make_qkv(Case(1, 2, 2, 8, 8, 16), torch.float16, device)
    _raises_like_torch(q, k, v.float())
    _raises_like_torch(q.tolist(), k, v)
    _raises_like_torch(q, k, v, is_causal=1)
    if q.device.type == "cpu":
        # On CUDA, torch 2.11 routes this to cuDNN, whose frontend error leaves state behind: the
        # next identical call (the fallback's) segfaulted on the H100. PyTorch's bug, not ours.
        _raises_like_torch(q, k[..., :8], v)
    _raises_like_torch(q[0, 0], k[0, 0], v[0, 0], enable_gqa=True)


def test_sdpa_value_head_dim(device):
    """A value head dim unlike the query's runs on FlashCore (out has the value's)."""
    q, k, _ = make_qkv(Case(1, 4, 2, 20, 20, 32), torch.float16, device)
    v = torch.randn(1, 2, 20, 16, dtype=torch.float16, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = flashcore.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert not fallback_warnings(caught)
    assert out.shape == (1, 4, 20, 16)
    check_sdpa(out, q, k, v, is_causal=True)


def _mask(q, k):
    return torch.rand(q.shape[-2], k.shape[-2], device=q.device) > 0.3


# name -> (reason the warning names, how to make the call from q, k, v)
FALLBACKS = {
    "bool_mask": ("attn_mask", lambda q, k, v: ((q, k, v, _mask(q, k)), {})),
    "float_mask": ("attn_mask", lambda q, k, v: ((q, k, v, _mask(q, k).float()), {})),
    "dropout": ("dropout_p", lambda q, k, v: ((q, k, v), {"dropout_p": 0.5})),
    "float64": ("dtype", lambda q, k, v: ((q.double(), k.double(), v.double()), {})),
    "value_dim": ("head dim", lambda q, k, v: ((q, k, torch.cat([v] * 19, -1)[..., :300]), {})),
    "batch_broadcast": ("shape", lambda q, k, v: ((q, k[:1], v[:1]), {})),
    "kv_heads_differ": ("shape", lambda q, k, v: ((q, k, v[:, :1]), {"enable_gqa": True})),
    "inf_scale": ("scale", lambda q, k, v: ((q, k, v), {"scale": float("inf")})),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_sdpa_fallback(name, device):
    """Unsupported calls give PyTorch's result and warn once per reason."""
    reason, make = FALLBACKS[name]
    q, k, v = make_qkv(Case(2, 4, 2, 12, 9, 16), torch.float32, device)
    args, kwargs = make(q, k, v)
    kwargs.setdefault("is_causal", "mask" not in name)
    kwargs.setdefault("enable_gqa", True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            torch.manual_seed(1)  # the same dropout mask for both
            got = flashcore.scaled_dot_product_attention(*args, **kwargs)
            torch.manual_seed(1)
            want = F.scaled_dot_product_attention(*args, **kwargs)
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    messages = fallback_warnings(caught)
    assert len(messages) == 1, messages
    assert f"({reason})" in messages[0]


def test_sdpa_warns_once_per_reason(device):
    q, k, v = make_qkv(Case(1, 2, 2, 8, 8, 16), torch.float32, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            flashcore.scaled_dot_product_attention(q, k, v, _mask(q, k))
            flashcore.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    messages = fallback_warnings(caught)
    assert len(messages) == 2
    assert "(attn_mask)" in messages[0] and "(dropout_p)" in messages[1]
