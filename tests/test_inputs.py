"""Unusual but valid inputs: empty sizes, requires_grad mixes, strides, NaN/Inf, many devices,
more than 2**31 elements, many heads."""

import os

import pytest
import torch

import flashcore
from flashcore import reference
from flashcore.ops import fwd, problem
from helpers import (
    check_backward,
    check_forward,
    check_grads,
    make_qkv,
)
from numerics import assert_fa_rule
from shapes import HUGE, Case


@pytest.fixture
def launches(monkeypatch) -> list:
    """The grids of the forward kernel's launches during the test (launches still run)."""
    kernel = fwd.kernel().fn
    grids: list = []
    real_run = kernel.run

    def run(*args, grid, **kwargs):
        grids.append(grid)
        return real_run(*args, grid=grid, **kwargs)

    monkeypatch.setattr(kernel, "run", run)
    return grids


# (batch, heads, kv_heads, seqlen_q, seqlen_k)
EMPTY = {
    "batch0": (0, 2, 1, 5, 7),
    "heads0": (1, 0, 0, 5, 7),
    "q_heads0": (1, 0, 1, 5, 7),
    "seqlen_q0": (2, 2, 1, 0, 7),
    "seqlen_k0": (2, 4, 2, 5, 0),
    "both0": (1, 2, 2, 0, 0),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(EMPTY))
def test_empty(name, causal, device, launches):
    """Empty results, or for Sk = 0 out = 0 and lse = -inf; never a launch."""
    b, h, hkv, sq, sk = EMPTY[name]
    q, k, v = make_qkv(Case(b, h, hkv, sq, sk, 32), torch.float16, device)
    out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    assert launches == []
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert torch.all(out == 0)
    assert torch.all(lse == float("-inf"))
    check_forward(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("name", list(EMPTY))
def test_empty_backward(name, device):
    """Zero gradients of the inputs' shapes."""
    b, h, hkv, sq, sk = EMPTY[name]
    q, k, v = (
        t.requires_grad_() for t in make_qkv(Case(b, h, hkv, sq, sk, 32), torch.float16, device)
    )
    out = flashcore.attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out), allow_unused=True)
    for arg, t, g in zip("qkv", (q, k, v), grads, strict=True):
        assert g is not None and g.shape == t.shape and g.dtype == t.dtype, f"d{arg}"
        assert torch.all(g == 0), f"d{arg} is not zero"


def test_nonempty_launches_once(device, launches):
    q, k, v = make_qkv(Case(1, 2, 1, 40, 9, 16), torch.float16, device)
    flashcore.attention(q, k, v)
    assert len(launches) == 1
    assert all(n > 0 for n in launches[0])


# Which of q, k, v require grad.
GRAD_MIXES = ["", "q", "k", "v", "kv", "qv", "qkv"]


@pytest.mark.parametrize("mix", GRAD_MIXES, ids=[m or "none" for m in GRAD_MIXES])
def test_requires_grad_mix(mix, device):
    """Any mix works; the forward is the no-grad one; grads exist exactly for those asked."""
    case = Case(1, 4, 2, 17, 29, 32)
    q, k, v = make_qkv(case, torch.float16, device)
    want = flashcore.attention(q, k, v, causal=True)
    inputs = {
        name: t.detach().requires_grad_(name in mix)
        for name, t in zip("qkv", (q, k, v), strict=True)
    }
    out = flashcore.attention(*inputs.values(), causal=True)
    assert out.requires_grad == bool(mix)
    assert torch.equal(out.detach(), want)
    if not mix:
        return
    dout = torch.randn_like(out)
    out.backward(dout)
    for name, t in inputs.items():
        assert (t.grad is not None) == (name in mix), f"{name}.grad"
    check_grads({n: inputs[n].grad for n in mix}, q, k, v, dout, causal=True)


@pytest.fixture
def launcher_inputs(monkeypatch) -> list:
    """The (q, k, v) tensors the launcher hands to the kernel, recorded (the launch still runs).

    The launcher passes each input through ``unit_stride_last_dim`` (which copies only a tensor
    whose last dim is strided); the spy records what comes out, grouped per call.
    """
    seen: list = []
    pending: list = []
    real = problem.unit_stride_last_dim

    def spy(t):
        got = real(t)
        pending.append(got)
        if len(pending) == 3:
            seen.append(tuple(pending))
            pending.clear()
        return got

    monkeypatch.setattr(problem, "unit_stride_last_dim", spy)
    return seen


@pytest.mark.parametrize("layout", ["bshd", "sliced"])
def test_strided_inputs_not_copied(layout, device, launcher_inputs):
    q, k, v = make_qkv(Case(2, 4, 2, 30, 21, 32), torch.float16, device, layout=layout)
    flashcore.attention(q, k, v)
    for given, got in zip((q, k, v), launcher_inputs[0], strict=True):
        assert got.data_ptr() == given.data_ptr() and got.stride() == given.stride()


def test_last_dim_strided_copied(device, launcher_inputs):
    """Only a tensor whose last dim is strided is copied (and the caller's tensor is untouched)."""
    q, k, v = make_qkv(Case(1, 2, 2, 40, 50, 32), torch.float32, device)
    k = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    k_before = k.clone()
    out, lse = flashcore.attention(q, k, v, return_lse=True)
    got_q, got_k, got_v = launcher_inputs[0]
    assert got_q.data_ptr() == q.data_ptr() and got_v.data_ptr() == v.data_ptr()
    assert got_k.stride(-1) == 1 and got_k.data_ptr() != k.data_ptr()
    assert torch.equal(k, k_before) and k.stride(-1) != 1
    check_forward(out, lse, q, k, v, causal=False)


def test_head_dim_one_strided_not_copied(device, launcher_inputs):
    q, k, v = make_qkv(Case(1, 2, 2, 9, 9, 1), torch.float32, device)
    q = q.expand(1, 2, 9, 1).as_strided((1, 2, 9, 1), (18, 9, 1, 7))
    flashcore.attention(q, k, v)
    assert launcher_inputs[0][0].data_ptr() == q.data_ptr()


# --- NaN and Inf -------------------------------------------------------------------------------
#
# Expected: the pattern of non-finite entries of the float64 reference, where a masked key is
# absent (its score is -inf whatever q and k hold), as in PyTorch's fused SDPA backends; finite
# entries follow FlashAttention's rule. (PyTorch's math backend adds the -inf mask to the scores,
# so there a NaN key poisons even rows that do not see it.)

NAN_CASE = Case(1, 4, 2, 45, 70, 32)  # GQA, ragged in both directions, several tiles each way
# The interpreter computes with numpy, which warns about the very NaN arithmetic tested here.
numpy_nan_warnings = pytest.mark.filterwarnings(
    "ignore:(invalid value encountered|All-NaN slice encountered):RuntimeWarning"
)
POSITIONS = {"first": 0, "middle": 33, "last": -1}


def check_nonfinite(out, lse, q, k, v, *, causal: bool, rows=None) -> None:
    """Same non-finite pattern as the reference; finite entries by the FA rule.

    ``rows``: optional (B, H, Sq) bool mask of the rows to check (others are not compared).
    """
    ref = reference.attention(q, k, v, causal=causal, dtype=torch.float64)
    pt = reference.attention(q, k, v, causal=causal, dtype=q.dtype)
    if rows is None:
        rows = torch.ones(q.shape[:3], dtype=torch.bool)
    for name, got, want, plain in (("out", out, ref.out, pt.out), ("lse", lse, ref.lse, pt.lse)):
        got, want, plain = (t.detach().cpu()[rows] for t in (got, want, plain))
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), f"{name}: non-finite pattern"
        finite = torch.isfinite(want)
        assert_fa_rule(name, got[finite], plain[finite], want[finite])


@numpy_nan_warnings
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pos", list(POSITIONS))
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_query(value, pos, causal, device):
    """A NaN or +Inf in query row i makes row i non-finite, and only row i."""
    q, k, v = make_qkv(NAN_CASE, torch.float16, device)
    q[0, 1, POSITIONS[pos], 5] = value
    out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    check_nonfinite(out, lse, q, k, v, causal=causal)
    bad_rows = (~torch.isfinite(out).all(-1)).nonzero().tolist()
    assert bad_rows == [[0, 1, POSITIONS[pos] % NAN_CASE.seqlen_q]]
    assert not torch.isfinite(out[0, 1, POSITIONS[pos]]).any()


@numpy_nan_warnings
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pos", list(POSITIONS))
def test_nan_key(pos, causal, device):
    """A NaN in key j: NaN in every row (of its query heads) that sees j, exact elsewhere."""
    q, k, v = make_qkv(NAN_CASE, torch.bfloat16, device)
    k[0, 1, POSITIONS[pos], 7] = float("nan")
    out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    check_nonfinite(out, lse, q, k, v, causal=causal)


@numpy_nan_warnings
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pos", list(POSITIONS))
def test_nan_value(pos, causal, device):
    """A NaN in ``v[j, d]``: column d is NaN in every row that sees j; all else exact.

    A causal row that does not see j may also get NaN in column d when it shares a key tile with
    j (``0 * NaN`` in the P @ V product); where finite, it must be right. "Right" is the result
    with that value zeroed, which every entry but column d of the rows that see j equals.
    """
    case, d = NAN_CASE, 3
    q, k, v = make_qkv(case, torch.float32, device)
    j = POSITIONS[pos] % case.seqlen_k
    v[0, 1, j, d] = float("nan")
    out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)

    sees_j = reference.causal_mask(case.seqlen_q, case.seqlen_k)[:, j] | (not causal)
    group = case.heads // case.kv_heads
    reads_kv1 = (torch.arange(case.heads) // group == 1)[:, None, None]  # query heads of kv head 1
    column = (torch.arange(case.head_dim) == d)[None, None, :]
    must_be_nan = (reads_kv1 & sees_j[None, :, None] & column)[None]  # (1, H, Sq, D)
    may_be_nan = (reads_kv1 & column)[None] & ~must_be_nan
    out = out.cpu()
    assert torch.isnan(out[must_be_nan]).all()
    checked = ~must_be_nan & ~(may_be_nan & torch.isnan(out))
    clean_v = v.clone()
    clean_v[0, 1, j, d] = 0.0
    ref = reference.attention(q, k, clean_v, causal=causal, dtype=torch.float64)
    pt = reference.attention(q, k, clean_v, causal=causal, dtype=q.dtype)
    assert_fa_rule("out", out[checked], pt.out.cpu()[checked], ref.out[checked])
    assert_fa_rule("lse", lse, pt.lse, ref.lse)


# --- GPU only ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_inputs_on_different_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    q, k, v = make_qkv(Case(1, 2, 2, 8, 8, 16), torch.float16, "cuda:0")
    with pytest.raises(ValueError, match=r"^k must be on q's device \(cuda:0\), got cuda:1"):
        flashcore.attention(q, k.to("cuda:1"), v)
    with pytest.raises(ValueError, match=r"^v must be on q's device \(cuda:0\), got cuda:1"):
        flashcore.attention(q, k, v.to("cuda:1"))


@pytest.mark.gpu
def test_on_second_gpu():
    """All inputs on cuda:1 while cuda:0 is current: the launch goes to cuda:1."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    q, k, v = make_qkv(Case(1, 4, 2, 300, 517, 64), torch.bfloat16, "cuda:1")
    assert torch.cuda.current_device() == 0
    out, lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
    assert out.device == q.device
    check_forward(out, lse, q, k, v, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", HUGE, ids=[c.id for c in HUGE])
def test_more_than_2_31_elements(case, causal):
    """q and out with more than 2**31 elements (int64 offsets); a few rows against the reference.

    Needs ~9 GB of GPU memory. Rows checked: the last 300 of every head (bottom-right causal
    depends only on the distance to the last row, so they can be checked on their own), and for
    the full mask also the first rows; with the causal mask the first Sq - Sk rows must be empty.
    """
    b, h, _, sq, _, d = case
    assert b * h * sq * d > 2**31
    if torch.cuda.get_device_properties(0).total_memory < 16 * 2**30:
        pytest.skip("needs 16 GB of GPU memory")
    q, k, v = make_qkv(case, torch.float16, "cuda", layout="bshd" if h > 1 else "bhsd")
    out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    tail = slice(sq - 300, sq)
    check_forward(out[:, :, tail], lse[:, :, tail], q[:, :, tail], k, v, causal=causal)
    head = slice(0, 100)
    if causal:
        assert torch.all(out[:, :, head] == 0) and torch.all(lse[:, :, head] == float("-inf"))
    else:
        check_forward(out[:, :, head], lse[:, :, head], q[:, :, head], k, v, causal=False)


@pytest.mark.gpu
def test_batch_times_heads_above_65535():
    case = Case(2048, 33, 1, 3, 16, 16)
    q, k, v = make_qkv(case, torch.float16, "cuda")
    # More programs per grid row than CUDA's 65535 limit on grid axes 1 and 2: the 1-D grid.
    out, lse = flashcore.attention(q, k, v, return_lse=True)
    torch.cuda.synchronize()
    check_forward(out, lse, q, k, v, causal=False)
    check_backward(q, k, v, causal=True)


def test_meta_tensors(monkeypatch):
    """Meta tensors (shape inference, deferred initialisation) give meta outputs of the right
    shapes and gradients, through the registered ops' fake implementations; nothing launches."""
    from flashcore.ops import bwd, decode

    def launched(*args, **kwargs):
        raise AssertionError("a launcher was called for meta tensors")

    for module in (fwd, bwd, decode):
        monkeypatch.setattr(module, "launch", launched)
    meta = {"device": "meta"}
    q = torch.empty(2, 4, 5, 16, **meta, requires_grad=True)
    k, v = torch.empty(2, 2, 7, 16, **meta), torch.empty(2, 2, 7, 8, **meta)
    for _ in range(2):  # the second call as a repeat of the first's signature
        out, lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
        assert (out.shape, out.device, lse.shape) == ((2, 4, 5, 8), q.device, (2, 4, 5))
    out = flashcore.attention(q, k, v, window=(2, 1), softcap=5.0, sinks=torch.zeros(4, **meta))
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert (dq.shape, dq.device) == (q.shape, q.device)
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32, **meta)
    cu_k = torch.tensor([0, 7, 14], dtype=torch.int32, **meta)
    packed = torch.empty(14, 2, 16, **meta)
    out = flashcore.attention_varlen(packed[:12].repeat(1, 2, 1), packed, packed, cu_q, cu_k, 7, 7)
    assert (out.shape, out.device) == ((12, 4, 16), q.device)
    cache = torch.empty(2, 2, 32, 16, **meta)
    lengths = torch.tensor([3, 9], dtype=torch.int32, **meta)
    for _ in range(2):
        out = flashcore.attention_with_kvcache(
            q.detach()[:, :, :1], cache, cache, cache_seqlens=lengths
        )
        assert (out.shape, out.device) == ((2, 4, 1, 16), q.device)
    out = flashcore.scaled_dot_product_attention(
        q.detach(), cache[:, :, :7], cache[:, :, :7], enable_gqa=True
    )
    assert (out.shape, out.device) == ((2, 4, 5, 16), q.device)


def test_import_leaves_triton_unimported():
    """``import flashcore`` must not import triton: the interpreter flag is read when triton's own
    jit helpers are defined, so a user (or flashcore-bench) may set TRITON_INTERPRET=1 after
    importing flashcore and before the first call."""
    import subprocess
    import sys

    code = (
        "import os, sys, torch, flashcore\n"
        "assert 'triton' not in sys.modules, 'import flashcore imported triton'\n"
        "if not torch.cuda.is_available():\n"
        "    os.environ['TRITON_INTERPRET'] = '1'\n"
        "    q = torch.randn(1, 1, 8, 16)\n"
        "    assert flashcore.attention(q, q, q).shape == q.shape\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
