"""Bad input raises a clear error naming the argument, before any kernel launches."""

import math

import pytest
import torch

import flashcore


def qkv(device, *, b=1, h=2, hkv=2, sq=8, sk=8, d=16, dtype=torch.float16):
    return (
        torch.randn(b, h, sq, d, dtype=dtype, device=device),
        torch.randn(b, hkv, sk, d, dtype=dtype, device=device),
        torch.randn(b, hkv, sk, d, dtype=dtype, device=device),
    )


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if a kernel is launched."""
    from flashcore.ops import fwd

    def boom(*args, **kwargs):
        raise AssertionError("kernel launched despite invalid input")

    monkeypatch.setattr(fwd, "launch", boom)


@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_not_a_tensor(arg, device, no_launch):
    q, k, v = qkv(device)
    args = {"q": q, "k": k, "v": v}
    args[arg] = args[arg].tolist()
    with pytest.raises(TypeError, match=rf"^{arg} must be a torch.Tensor"):
        flashcore.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_wrong_rank(arg, device, no_launch):
    q, k, v = qkv(device)
    args = {"q": q, "k": k, "v": v}
    args[arg] = args[arg][0]
    with pytest.raises(ValueError, match=rf"^{arg} must have 4 dims"):
        flashcore.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.bool])
def test_unsupported_dtype(dtype, device, no_launch):
    q, k, v = qkv(device)
    with pytest.raises(TypeError, match=r"^q must be float16, bfloat16 or float32"):
        flashcore.attention(q.to(dtype), k, v)


def test_mismatched_dtype(device, no_launch):
    q, k, v = qkv(device)
    with pytest.raises(TypeError, match=r"^v.dtype must equal q.dtype"):
        flashcore.attention(q, k, v.float())


def test_mismatched_kv_shapes(device, no_launch):
    q, k, _ = qkv(device)
    _, _, v = qkv(device, sk=9)
    with pytest.raises(ValueError, match=r"^k and v must have the same shape"):
        flashcore.attention(q, k, v)


def test_mismatched_batch(device, no_launch):
    q, _, _ = qkv(device, b=2)
    _, k, v = qkv(device, b=1)
    with pytest.raises(ValueError, match=r"^k/v batch size"):
        flashcore.attention(q, k, v)


def test_mismatched_head_dim(device, no_launch):
    q, _, _ = qkv(device, d=32)
    _, k, v = qkv(device, d=16)
    with pytest.raises(ValueError, match=r"^k head_dim must equal q's \(32\), got 16"):
        flashcore.attention(q, k, v)
    # v's head dim may differ (out has it), within 1..256.
    q, k, v = qkv(device, d=32)
    with pytest.raises(NotImplementedError, match=r"head dims up to 256.*v.shape\[-1\] = 300"):
        flashcore.attention(q, k, torch.zeros(*v.shape[:-1], 300, device=device, dtype=v.dtype))
    with pytest.raises(ValueError, match=r"^head dims must be at least 1, got v.shape\[-1\] = 0"):
        flashcore.attention(q, k, v[..., :0])


def test_heads_not_divisible(device, no_launch):
    q, k, v = qkv(device, h=3, hkv=2)
    with pytest.raises(ValueError, match=r"^q's heads \(3\) must be a multiple of k/v's heads"):
        flashcore.attention(q, k, v)


def test_head_dim_too_large(device, no_launch):
    q, k, v = qkv(device, d=320)
    with pytest.raises(NotImplementedError, match=r"head dims up to 256.*q.shape\[-1\] = 320"):
        flashcore.attention(q, k, v)


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan])
def test_non_finite_scale(scale, device, no_launch):
    with pytest.raises(ValueError, match=r"^scale must be finite"):
        flashcore.attention(*qkv(device), scale=scale)


@pytest.mark.parametrize("scale", ["0.1", True, torch.tensor(0.1)])
def test_scale_type(scale, device, no_launch):
    with pytest.raises(TypeError, match=r"^scale must be a real number"):
        flashcore.attention(*qkv(device), scale=scale)


# Tensors without strides for q, k or v: each a clear error naming the argument, before any
# launch and before the express path keys the call (nested and CSR tensors refuse strides).
LAYOUTS = {
    "coo": lambda t: t.to_sparse(),
    "csr": lambda t: t[0, 0].to_sparse_csr(),
    "nested": lambda t: torch.nested.nested_tensor([t[0, 0], t[0, 0, :3]], layout=torch.jagged),
}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_not_dense(arg, layout, device, no_launch):
    q, k, v = qkv(device)
    args = {"q": q, "k": k, "v": v}
    args[arg] = LAYOUTS[layout](args[arg])
    with pytest.raises(TypeError, match=rf"^{arg} must be a dense \(strided\) tensor"):
        flashcore.attention(args["q"], args["k"], args["v"])
    if arg == "q":
        seqlens = torch.tensor([3], dtype=torch.int32, device=device)
        with pytest.raises(TypeError, match=r"^q must be a dense \(strided\) tensor"):
            flashcore.attention_with_kvcache(args["q"], k, v, cache_seqlens=seqlens)


def test_not_dense_options(device, no_launch):
    """The option tensors too: ALiBi slopes, sinks, a packed batch's offsets."""
    q, k, v = qkv(device)
    sparse = torch.zeros(2, device=device).to_sparse()
    for name in ("alibi_slopes", "sinks"):
        with pytest.raises(TypeError, match=rf"^{name} must be a dense \(strided\) tensor"):
            flashcore.attention(q, k, v, **{name: sparse})
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match=r"^cu_seqlens_q must be a dense \(strided\) tensor"):
        flashcore.attention_varlen(
            *(t[0].transpose(0, 1) for t in (q, k, v)), cu.to_sparse(), cu, 8, 8
        )


def test_unsupported_device():
    """A device other than CUDA, the CPU (interpreted) or meta: a clear error (``checks``)."""
    from flashcore.checks import check_runnable

    class OnXpu:
        device = torch.device("xpu")

    with pytest.raises(ValueError, match=r"^q must be on a CUDA device .* got xpu"):
        check_runnable(OnXpu())


@pytest.mark.parametrize("flag", ["causal", "return_lse"])
def test_flag_type(flag, device, no_launch):
    with pytest.raises(TypeError, match=rf"^{flag} must be a bool"):
        flashcore.attention(*qkv(device), **{flag: 1})


def test_options_are_keyword_only(device):
    with pytest.raises(TypeError):
        flashcore.attention(*qkv(device), True)  # type: ignore[misc]


def test_device_mismatch(no_launch):
    q, k, v = qkv("cpu")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^k must be on q's device"):
            flashcore.attention(q, k.cuda(), v)
    else:
        meta_k = torch.empty_like(k, device="meta")
        with pytest.raises(ValueError, match=r"^k must be on q's device"):
            flashcore.attention(q, meta_k, v)


def varlen_args(device, *, h=4, hkv=2, d=16):
    """Packed q, k, v and cu_seqlens for sequences of (3, 5) queries and (4, 6) keys."""
    return {
        "q": torch.randn(8, h, d, dtype=torch.float16, device=device),
        "k": torch.randn(10, hkv, d, dtype=torch.float16, device=device),
        "v": torch.randn(10, hkv, d, dtype=torch.float16, device=device),
        "cu_seqlens_q": torch.tensor([0, 3, 8], dtype=torch.int32, device=device),
        "cu_seqlens_k": torch.tensor([0, 4, 10], dtype=torch.int32, device=device),
        "max_seqlen_q": 5,
        "max_seqlen_k": 6,
    }


@pytest.fixture
def no_varlen_launch(monkeypatch):
    from flashcore.ops import fwd

    def boom(*args, **kwargs):
        raise AssertionError("kernel launched despite invalid input")

    monkeypatch.setattr(fwd, "launch", boom)


# (argument, replacement built from the valid arguments, error, message)
VARLEN_INVALID = {
    "q_rank": ("q", lambda a: a["q"][None], ValueError, r"^q must have 3 dims \(total, heads,"),
    "k_dtype": ("k", lambda a: a["k"].float(), TypeError, r"^k.dtype must equal q.dtype"),
    "v_rows": ("v", lambda a: a["v"][:9], ValueError, r"^k and v must have the same shape \(to"),
    "kv_head_dim": ("k", lambda a: a["k"][..., :8], ValueError, r"^k head_dim must equal q's"),
    "heads": ("q", lambda a: a["q"][:, :3], ValueError, r"^q's heads \(3\) must be"),
    "cu_list": ("cu_seqlens_q", lambda a: [0, 3, 8], TypeError, r"^cu_seqlens_q must be a torch"),
    "cu_int64": ("cu_seqlens_k", lambda a: a["cu_seqlens_k"].long(), TypeError, r"be int32"),
    "cu_rank": ("cu_seqlens_q", lambda a: a["cu_seqlens_q"][None], ValueError, r"\(batch \+ 1,\)"),
    "cu_empty": ("cu_seqlens_q", lambda a: a["cu_seqlens_q"][:0], ValueError, r"\(batch \+ 1,\)"),
    "cu_batch": ("cu_seqlens_k", lambda a: a["cu_seqlens_k"][:2], ValueError, r"^cu_seqlens_k mu"),
    "cu_device": (
        "cu_seqlens_k",
        lambda a: torch.empty_like(a["cu_seqlens_k"], device="meta"),
        ValueError,
        r"^cu_seqlens_k must be on q's device",
    ),
    "max_float": ("max_seqlen_q", lambda a: 5.0, TypeError, r"^max_seqlen_q must be an int, got f"),
    "max_bool": ("max_seqlen_k", lambda a: True, TypeError, r"^max_seqlen_k must be an int, got b"),
    "max_tensor": ("max_seqlen_q", lambda a: torch.tensor(5), TypeError, r"^max_seqlen_q must be"),
    "max_negative": ("max_seqlen_q", lambda a: -1, ValueError, r"from 1 to total_q \(8\).* got -1"),
    "max_over_total": ("max_seqlen_k", lambda a: 11, ValueError, r"total_k \(10\).* got 11"),
    "max_zero": ("max_seqlen_q", lambda a: 0, ValueError, r"^max_seqlen_q must be .* got 0"),
    "alibi_batch": (
        "alibi_slopes",
        lambda a: torch.ones(3, 4, device=a["q"].device),
        ValueError,
        r"^alibi_slopes must have shape \(heads,\) = \(4,\) or \(batch, heads\) = \(2, 4\)",
    ),
    "window": ("window", lambda a: (-3, 0), ValueError, r"^window left must be >= -1"),
}


@pytest.mark.parametrize(
    ("arg", "value", "error", "message"), VARLEN_INVALID.values(), ids=VARLEN_INVALID.keys()
)
def test_varlen_invalid(arg, value, error, message, device, no_varlen_launch):
    args = varlen_args(device)
    args[arg] = value(args)
    with pytest.raises(error, match=message):
        flashcore.attention_varlen(**args)


def test_varlen_options(device, no_varlen_launch):
    with pytest.raises(TypeError, match=r"^causal must be a bool"):
        flashcore.attention_varlen(**varlen_args(device), causal=1)
    with pytest.raises(ValueError, match=r"^scale must be finite"):
        flashcore.attention_varlen(**varlen_args(device), scale=math.inf)
    with pytest.raises(NotImplementedError, match=r"head dims up to 256"):
        flashcore.attention_varlen(**varlen_args(device, d=320))
    with pytest.raises(TypeError):
        flashcore.attention_varlen(*varlen_args(device).values(), True)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("window", "error", "match"),
    [
        (5, TypeError, r"^window must be a \(left, right\) tuple"),
        ((1, 2, 3), TypeError, r"^window must be a \(left, right\) tuple"),
        ("ab", TypeError, r"^window must be a \(left, right\) tuple"),
        ((1.5, 0), TypeError, r"^window left must be an int, got float"),
        ((0, True), TypeError, r"^window right must be an int, got bool"),
        ((-2, 0), ValueError, r"^window left must be >= -1 \(-1: unbounded\), got -2"),
        ((4, -5), ValueError, r"^window right must be >= -1 \(-1: unbounded\), got -5"),
    ],
)
def test_bad_window(window, error, match, device, no_launch):
    with pytest.raises(error, match=match):
        flashcore.attention(*qkv(device), window=window)


@pytest.mark.parametrize("softcap", [-1.0, math.inf, math.nan])
def test_bad_softcap_value(softcap, device, no_launch):
    with pytest.raises(ValueError, match=r"^softcap must be finite and >= 0 \(0: off\), got"):
        flashcore.attention(*qkv(device), softcap=softcap)


@pytest.mark.parametrize("softcap", ["1.0", True, torch.tensor(1.0)])
def test_bad_softcap_type(softcap, device, no_launch):
    with pytest.raises(TypeError, match=r"^softcap must be a real number or None"):
        flashcore.attention(*qkv(device), softcap=softcap)


def test_alibi_slopes_not_a_tensor(device, no_launch):
    with pytest.raises(TypeError, match=r"^alibi_slopes must be a torch.Tensor or None, got list"):
        flashcore.attention(*qkv(device), alibi_slopes=[0.5, 0.25])


def test_alibi_slopes_requiring_grad(device, no_launch):
    """Learnable slopes would silently get no gradient: an error while grad mode is on, in every
    function that takes them; under no_grad (nothing to differentiate) they are fine."""
    q, k, v = qkv(device)
    slopes = torch.full((2,), 0.5, device=device, requires_grad=True)
    match = r"^alibi_slopes requires grad, but FlashCore computes no gradient for the slopes"
    with pytest.raises(ValueError, match=match):
        flashcore.attention(q, k, v, alibi_slopes=slopes)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=match):
        flashcore.attention_varlen(
            *(t[0].transpose(0, 1) for t in (q, k, v)), cu, cu, 8, 8, alibi_slopes=slopes
        )
    lengths = torch.tensor([8], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=match):
        flashcore.attention_with_kvcache(
            q[:, :, :1], k, v, cache_seqlens=lengths, alibi_slopes=slopes
        )
    # Under no_grad the call passes its checks and reaches the (stubbed) launch.
    with torch.no_grad(), pytest.raises(AssertionError, match="kernel launched"):
        flashcore.attention(q, k, v, alibi_slopes=slopes)


@pytest.mark.parametrize("shape", [(3,), (1, 3), (2, 2), (1, 2, 1), ()])
def test_alibi_slopes_shape(shape, device, no_launch):
    slopes = torch.ones(shape, device=device)
    match = r"^alibi_slopes must have shape \(heads,\) = \(2,\) or \(batch, heads\) = \(1, 2\), got"
    with pytest.raises(ValueError, match=match):
        flashcore.attention(*qkv(device), alibi_slopes=slopes)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_alibi_slopes_dtype(dtype, device, no_launch):
    slopes = torch.ones(2, dtype=dtype, device=device)
    with pytest.raises(TypeError, match=rf"^alibi_slopes must be float32, got {dtype}"):
        flashcore.attention(*qkv(device), alibi_slopes=slopes)


def test_alibi_slopes_device(device, no_launch):
    # On a GPU machine: cuda inputs, CPU slopes; on the interpreter: CPU inputs, meta slopes.
    q, k, v = qkv(device)
    slopes = torch.ones(2, device="cpu" if device == "cuda" else "meta")
    with pytest.raises(ValueError, match=r"^alibi_slopes must be on q's device \(.*\), got"):
        flashcore.attention(q, k, v, alibi_slopes=slopes)
