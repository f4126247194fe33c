"""Eager calls by signature (``ops.express``): a repeated call launches what its first call
planned, skipping the checks, and only where everything the checks and the plan depend on is
the same; every other call takes the full path, with its errors."""

import functools

import pytest
import torch

import flashcore
from flashcore import api
from flashcore.ops import bwd, decode, fwd
from helpers import check_backward, check_forward, check_grads, make_qkv, require_sm90
from shapes import Case, DecodeCase
from test_decode import check_decode, make_kvcache
from test_sinks import check_sinks_case

CASE = Case(1, 2, 1, 37, 45, 32)


def count_checks(monkeypatch) -> list:
    """A list that gains an entry per full input check of ``attention``/``attention_with_kvcache``
    (the checks still run)."""
    seen = []
    for name in ("check_inputs", "check_kvcache_inputs"):
        real = getattr(api, name)
        monkeypatch.setattr(api, name, lambda *a, _real=real: seen.append(1) or _real(*a))
    return seen


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_repeat_takes_the_kept_launch(causal, device, monkeypatch):
    """The second call of a signature skips the checks and gives the first's numbers bit for
    bit, on other tensors of that signature too; ``return_lse`` changes no launch."""
    checks = count_checks(monkeypatch)
    q, k, v = make_qkv(CASE, torch.float16, device)
    out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    assert len(checks) == 1 and len(fwd._LEARNED) == 1
    check_forward(out, lse, q, k, v, causal=causal)
    again = flashcore.attention(q, k, v, causal=causal)
    assert len(checks) == 1 and torch.equal(again, out)
    q2, k2, v2 = (t.flip(2).contiguous() for t in (q, k, v))
    out2, lse2 = flashcore.attention(q2, k2, v2, causal=causal, return_lse=True)
    assert len(checks) == 1
    check_forward(out2, lse2, q2, k2, v2, causal=causal)
    assert len(fwd._LEARNED) == 1


def test_other_signatures_plan_again(device, monkeypatch):
    """Another layout (strides), dtype, scale, mask or tier is another key: checked and planned
    on its own, and right."""
    checks = count_checks(monkeypatch)
    q, k, v = make_qkv(CASE, torch.float16, device)
    flashcore.attention(q, k, v)
    variants = [
        (make_qkv(CASE, torch.float16, device, layout="bshd"), {}),
        (make_qkv(CASE, torch.float32, device), {}),
        ((q, k, v), {"scale": 0.3}),
        ((q, k, v), {"causal": True}),
    ]
    for i, ((q_, k_, v_), options) in enumerate(variants):
        out, lse = flashcore.attention(q_, k_, v_, return_lse=True, **options)
        assert len(checks) == 2 + i
        check_forward(out, lse, q_, k_, v_, causal=options.get("causal", False),
                      scale=options.get("scale"))  # fmt: skip
    with flashcore.use_tier("portable"):
        flashcore.attention(q, k, v)
    assert len(checks) == 6 and len(fwd._LEARNED) == 6


def test_bad_arguments_still_raise_after_a_kept_launch(device):
    """A kept launch never lets through what the checks refuse: a flag of another type, a k of
    another dtype or shape, a scale that is not a float."""
    q, k, v = make_qkv(CASE, torch.float16, device)
    flashcore.attention(q, k, v, causal=True)
    flashcore.attention(q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flashcore.attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flashcore.attention(q, k, v, causal=True, return_lse=1)
    with pytest.raises(TypeError, match=r"k\.dtype must equal"):
        flashcore.attention(q, k.float(), v, causal=True)
    with pytest.raises(ValueError, match="scale must be finite"):
        flashcore.attention(q, k, v, causal=True, scale=float("nan"))
    with pytest.raises(TypeError, match="scale must be a real number"):
        flashcore.attention(q, k, v, causal=True, scale=True)
    with pytest.raises(ValueError, match="batch size"):
        flashcore.attention(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), causal=True)


def test_misaligned_tensors_take_the_full_path(device):
    """A q at an address that is not 16-byte aligned, with the kept signature's shape and
    strides: planned on its own (plans assume aligned addresses) and right."""
    q, k, v = make_qkv(CASE, torch.float16, device)
    flashcore.attention(q, k, v)
    run = next(iter(fwd._LEARNED.values()))
    buffer = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)
    shifted = buffer[1:].view(q.shape).copy_(q)
    assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
    out, lse = flashcore.attention(shifted, k, v, return_lse=True)
    check_forward(out, lse, shifted, k, v, causal=False)
    assert next(iter(fwd._LEARNED.values())) is run  # the aligned launch stays kept


@pytest.mark.parametrize("return_lse", [False, True])
def test_autograd_calls_share_the_kept_launch(return_lse, device, monkeypatch):
    """A call that records autograd keeps its launch as one that does not (the same launch),
    and a repeat either way runs it inside the autograd Function, skipping the checks: the
    same outputs bit for bit, gradients (through the LSE too) right. An empty problem
    launches nothing, so nothing is kept."""
    checks = count_checks(monkeypatch)
    q, k, v = make_qkv(CASE, torch.float16, device)
    dout = torch.randn_like(q)
    dlse = torch.randn(q.shape[:3], device=device) if return_lse else None
    results = []
    for grad in (True, True, False):
        leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        out, lse = flashcore.attention(*leaves, causal=True, return_lse=True)
        assert len(fwd._LEARNED) == 1 and out.requires_grad is grad
        results.append((out.detach(), lse.detach()))
        if grad:
            torch.autograd.backward(
                (out, lse) if return_lse else out, (dout, dlse)[: 1 + return_lse]
            )
            grads = dict(zip("qkv", (t.grad for t in leaves), strict=True))
            check_grads(grads, q, k, v, dout, causal=True, dlse=dlse)
    assert len(checks) == 1
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    empty = torch.empty(1, 2, 0, 32, dtype=torch.float16, device=device)
    flashcore.attention(empty, k, v)
    assert len(fwd._LEARNED) == 1


def test_replaced_plans_are_planned_again(device, monkeypatch):
    """Replacing the plan maps (as tests do to plan again) or ``forget`` retires the kept
    launches."""
    checks = count_checks(monkeypatch)
    q, k, v = make_qkv(CASE, torch.float16, device)
    flashcore.attention(q, k, v)
    monkeypatch.setattr(fwd, "_PLANS", {})
    flashcore.attention(q, k, v)
    assert len(checks) == 2 and len(fwd._PLANS) == 1
    fwd.forget()
    flashcore.attention(q, k, v)
    assert len(checks) == 3


@pytest.mark.parametrize(("causal", "window"), [(False, (5, 3)), (True, (7, 0))], ids=str)
def test_windowed_repeat_takes_the_kept_launch(causal, window, device, monkeypatch):
    """A window is part of the key: the second call of a windowed signature skips the checks and
    gives the first's numbers bit for bit; another window, no window, and a window given as a
    list (which the key does not take) are checked and planned on their own, and right."""
    checks = count_checks(monkeypatch)
    q, k, v = make_qkv(CASE, torch.float16, device)
    out, lse = flashcore.attention(q, k, v, causal=causal, window=window, return_lse=True)
    assert len(checks) == 1 and len(fwd._LEARNED) == 1
    check_forward(out, lse, q, k, v, causal=causal, window=window)
    again = flashcore.attention(q, k, v, causal=causal, window=window)
    assert len(checks) == 1 and torch.equal(again, out)
    other = (window[0] + 4, window[1])
    out2, lse2 = flashcore.attention(q, k, v, causal=causal, window=other, return_lse=True)
    check_forward(out2, lse2, q, k, v, causal=causal, window=other)
    plain, plain_lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    check_forward(plain, plain_lse, q, k, v, causal=causal)
    assert len(checks) == 3 and len(fwd._LEARNED) == 3
    for _ in range(2):
        listed = flashcore.attention(q, k, v, causal=causal, window=list(window))
        assert torch.equal(listed, out)
    assert len(checks) == 5 and len(fwd._LEARNED) == 3


def test_bad_windows_still_raise_after_a_kept_launch(device):
    """A kept windowed launch lets through no window the checks refuse, nor one of another type:
    a side below -1, a float, a bool, a tuple of three; an integer of another type (numpy's) is
    taken, through the full path."""
    np = pytest.importorskip("numpy")
    q, k, v = make_qkv(CASE, torch.float16, device)
    want = flashcore.attention(q, k, v, window=(5, 3))
    flashcore.attention(q, k, v, window=(5, 3))
    with pytest.raises(ValueError, match="window left must be >= -1"):
        flashcore.attention(q, k, v, window=(-2, 3))
    with pytest.raises(TypeError, match="window right must be an int"):
        flashcore.attention(q, k, v, window=(5, 3.0))
    with pytest.raises(TypeError, match="window left must be an int"):
        flashcore.attention(q, k, v, window=(True, 3))
    with pytest.raises(TypeError, match="window must be a"):
        flashcore.attention(q, k, v, window=(5, 3, 1))
    assert torch.equal(flashcore.attention(q, k, v, window=(np.int64(5), np.int64(3))), want)


def test_windowed_autograd_calls_share_the_kept_launch(device, monkeypatch):
    """A windowed call that records autograd runs its kept launch inside the autograd Function
    with the window: the gradients right (the backward sees the window), the outputs bit for
    bit those of a call without autograd."""
    checks = count_checks(monkeypatch)
    q, k, v = make_qkv(CASE, torch.float16, device)
    dout = torch.randn_like(q)
    window = (6, 2)
    first = flashcore.attention(q, k, v, causal=True, window=window)
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flashcore.attention(*leaves, causal=True, window=window)
        assert torch.equal(out.detach(), first)
        out.backward(dout)
        grads = dict(zip("qkv", (t.grad for t in leaves), strict=True))
        check_grads(grads, q, k, v, dout, causal=True, window=window)
    assert len(checks) == 1 and len(fwd._LEARNED) == 1


def test_sinks_repeat_takes_the_kept_launch(device, monkeypatch):
    """Sinks (gpt-oss's layers, with a window) are keyed by their signature: a repeat skips the
    checks and reads this call's sinks (other values, the same signature, right against the
    reference); sinks of another stride take the full path each call, and right."""
    checks = count_checks(monkeypatch)
    q, k, v = make_qkv(CASE, torch.float16, device)
    opts = {"causal": True, "window": (9, 0)}
    for i in range(3):
        sinks = torch.randn(CASE.heads, device=device) + i
        out, lse = flashcore.attention(q, k, v, sinks=sinks, return_lse=True, **opts)
        check_forward(out, lse, q, k, v, sinks=sinks, **opts)
    assert len(checks) == 1 and len(fwd._LEARNED) == 1
    wide = torch.randn(2 * CASE.heads, device=device)[::2]
    for _ in range(2):
        out, lse = flashcore.attention(q, k, v, sinks=wide, return_lse=True, **opts)
        check_forward(out, lse, q, k, v, sinks=wide, **opts)
    assert len(checks) == 3 and len(fwd._LEARNED) == 1


def test_bad_sinks_still_raise_after_a_kept_launch(device):
    """A kept launch with sinks lets through no sinks the checks refuse: another dtype, another
    number of heads, another rank."""
    q, k, v = make_qkv(CASE, torch.float16, device)
    sinks = torch.randn(CASE.heads, device=device)
    for _ in range(2):
        flashcore.attention(q, k, v, sinks=sinks)
    with pytest.raises(TypeError, match="sinks"):
        flashcore.attention(q, k, v, sinks=sinks.half())
    with pytest.raises(ValueError, match="sinks"):
        flashcore.attention(q, k, v, sinks=torch.randn(CASE.heads + 1, device=device))
    with pytest.raises(ValueError, match="sinks"):
        flashcore.attention(q, k, v, sinks=sinks[:, None])


def test_sinks_autograd_calls_share_the_kept_launch(device, monkeypatch):
    """Calls with sinks that require grad run the kept launch inside the autograd Function with
    those sinks: out, the LSE and dq, dk, dv and dsinks right, call after call."""
    checks = count_checks(monkeypatch)
    q, k, v = make_qkv(CASE, torch.float16, device)
    for i in range(3):
        sinks = torch.randn(CASE.heads, device=device) - i
        check_sinks_case(q, k, v, sinks, causal=True, window=(9, 0))
    assert len(checks) == 1 and len(fwd._LEARNED) == 1


def test_sinks_parameter_takes_the_kept_launch(device, monkeypatch):
    """Sinks held as a module's ``nn.Parameter`` (gpt-oss's) are keyed as a tensor: a repeat skips
    the checks, with autograd (dsinks reaches the parameter, as the full path gives it) and
    without (out right)."""
    checks = count_checks(monkeypatch)
    q, k, v = make_qkv(CASE, torch.float16, device)
    sinks = torch.nn.Parameter(torch.randn(CASE.heads, device=device))
    dout = torch.randn_like(q)
    grads = []
    for _ in range(2):
        sinks.grad = None
        out = flashcore.attention(q, k, v, causal=True, window=(9, 0), sinks=sinks)
        out.backward(dout)
        grads.append(sinks.grad.clone())
    with torch.no_grad():
        kept, lse = flashcore.attention(q, k, v, causal=True, window=(9, 0), sinks=sinks,
                                        return_lse=True)  # fmt: skip
    assert len(checks) == 1 and len(fwd._LEARNED) == 1
    assert torch.equal(kept, out.detach()) and torch.equal(grads[0], grads[1])
    check_forward(kept, lse, q, k, v, causal=True, window=(9, 0), sinks=sinks.detach())
    # The full path (a window as a list is not keyed) gives the same dsinks bit for bit.
    sinks.grad = None
    flashcore.attention(q, k, v, causal=True, window=[9, 0], sinks=sinks).backward(dout)
    assert len(checks) == 2 and torch.equal(sinks.grad, grads[0])


DECODE_CASE = DecodeCase(2, 4, 2, 1, 100, 32, (100, 37), 0)


@pytest.mark.parametrize("block_size", [0, 32], ids=["dense", "paged"])
def test_decode_repeat_takes_the_kept_launch(block_size, device, monkeypatch):
    """A repeated decode call (other lengths, other cache contents) skips the checks and is
    right; a cache_seqlens of another dtype still raises; ``flashcore.checked()`` still reads
    the lengths."""
    checks = count_checks(monkeypatch)
    q, k, v, lens, table = make_kvcache(DECODE_CASE._replace(block_size=block_size),
                                        torch.float16, device)  # fmt: skip
    check_decode(q, k, v, lens, table, causal=True)
    assert len(checks) == 1 and len(decode._LEARNED) == 1
    check_decode(q, k.clone().normal_(), v.clone().normal_(), lens - 11, table, causal=True)
    assert len(checks) == 1
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        flashcore.attention_with_kvcache(q, k, v, cache_seqlens=lens.long(), block_table=table)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flashcore.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table, causal=1)
    with pytest.raises(TypeError, match="num_splits must be an int"):
        flashcore.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                                         num_splits=True)  # fmt: skip
    too_long = torch.full_like(lens, 10**6)
    with flashcore.checked(), pytest.raises(ValueError, match="cache_seqlens"):
        flashcore.attention_with_kvcache(q, k, v, cache_seqlens=too_long, block_table=table)


def test_windowed_decode_repeat_takes_the_kept_launch(device, monkeypatch):
    """A windowed decode call's window is part of its key: a repeat (other lengths) skips the
    checks and is right; another window is checked and planned on its own; a bad one raises."""
    checks = count_checks(monkeypatch)
    q, k, v, lens, table = make_kvcache(DECODE_CASE, torch.float16, device)
    check_decode(q, k, v, lens, table, causal=True, window=(20, 0))
    assert len(checks) == 1 and len(decode._LEARNED) == 1
    check_decode(q, k, v, lens - 11, table, causal=True, window=(20, 0))
    assert len(checks) == 1
    check_decode(q, k, v, lens, table, causal=True, window=(9, 0))
    assert len(checks) == 2 and len(decode._LEARNED) == 2
    with pytest.raises(ValueError, match="window left must be >= -1"):
        flashcore.attention_with_kvcache(q, k, v, cache_seqlens=lens, window=(-3, 0))


@pytest.mark.parametrize("block_size", [0, 32], ids=["dense", "paged"])
def test_sinks_decode_repeat_takes_the_kept_launch(block_size, device, monkeypatch):
    """gpt-oss's decode (a window and sinks): a repeat with other sinks values skips the checks
    and reads this call's sinks, right against the reference; sinks that require grad or of
    another dtype still raise."""
    checks = count_checks(monkeypatch)
    q, k, v, lens, table = make_kvcache(DECODE_CASE._replace(block_size=block_size),
                                        torch.float16, device)  # fmt: skip
    for i in range(3):
        sinks = torch.randn(DECODE_CASE.heads, device=device) + i
        check_decode(q, k, v, lens - i, table, causal=True, window=(20, 0), sinks=sinks)
    assert len(checks) == 1 and len(decode._LEARNED) == 1
    with pytest.raises(ValueError, match="sinks"):
        flashcore.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                                         sinks=sinks.requires_grad_())  # fmt: skip
    with pytest.raises(TypeError, match="sinks"):
        flashcore.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                                         sinks=sinks.detach().half())  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("block_size", [0, 16, 256], ids=["dense", "paged16", "paged256"])
def test_quick_decode_repeats_the_first(block_size, splits, device):
    """On a GPU a decode call's kept launch calls the kernels' native launchers itself
    (``ops.decode._run_quick``, the splits' partials in one workspace): a repeat gives the
    first call's out and LSE bit for bit, with and without ``return_lse``, on other lengths
    right by FlashAttention's rule, and a misaligned q takes the full launcher, also bit for
    bit."""
    if device != "cuda":
        pytest.skip("needs a CUDA device (the interpreter keeps nothing compiled)")
    case = DecodeCase(3, 8, 2, 1, 1000, 64, (1000, 377, 1), block_size)
    q, k, v, lens, table = make_kvcache(case, torch.float16, device)

    def call(q, **options):
        return flashcore.attention_with_kvcache(
            q, k, v, cache_seqlens=lens, block_table=table, num_splits=splits, **options
        )

    first = call(q, return_lse=True)  # through Launcher (``_run``); its launches kept
    ((run, *_),) = decode._LEARNED.values()
    assert run.func is decode._run_quick
    check_decode(q, k, v, lens, table, causal=True, num_splits=splits)
    again = call(q, return_lse=True)
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    assert torch.equal(call(q), first[0])
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)
    shifted = buf[1:].view(q.shape)
    shifted.copy_(q)
    assert shifted.data_ptr() % 16
    moved = call(shifted, return_lse=True)
    assert torch.equal(moved[0], first[0]) and torch.equal(moved[1], first[1])
    lens.sub_(torch.tensor([500, 0, 1], dtype=lens.dtype, device=device))
    check_decode(q, k, v, lens, table, causal=True, num_splits=splits)
    assert len(decode._LEARNED) == 1


def test_dispatch_modes_still_see_the_ops(device):
    """After a kept launch, a call under a dispatch mode of the same signature goes through the
    registered op (as ``ops.registry.direct`` sends it), for both functions."""
    from test_dispatch import _Recorder

    q, k, v = make_qkv(CASE, torch.float16, device)
    flashcore.attention(q, k, v)
    with _Recorder() as rec:
        flashcore.attention(q, k, v)
    assert any("flashcore.attn_fwd" in op for op in rec.ops), rec.ops
    qd, kc, vc, lens, _ = make_kvcache(DECODE_CASE, torch.float16, device)
    flashcore.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens)
    with _Recorder() as rec:
        flashcore.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens)
    assert any("flashcore.attn_kvcache" in op for op in rec.ops), rec.ops


QUICK_CASES = [Case(1, 2, 1, 37, 45, 32), Case(2, 4, 4, 1024, 1024, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case, tier, tiles",
    [
        (Case(1, 2, 1, 37, 45, 32), "portable", False),
        (Case(2, 8, 8, 2048, 2048, 128), "portable", True),
        (Case(2, 8, 8, 2048, 2048, 128), "sm90", True),
    ],
    ids=["pointers", "descriptors", "hopper"],
)
def test_quick_forward_repeats_the_first(case, tier, tiles, device):
    """On a GPU a kept forward calls the kernel's native launcher itself (``ops.fwd.Quick``;
    descriptors expanded once per address): a repeat gives the first call's out and LSE bit
    for bit, recording autograd too; other tensors of the signature are right by
    FlashAttention's rule; with a launch hook registered it launches through ``Launcher``, so
    the hook sees it."""
    if device != "cuda":
        pytest.skip("needs a CUDA device (the interpreter keeps nothing compiled)")
    if tier == "sm90":
        require_sm90()
    from triton import knobs

    q, k, v = make_qkv(case, torch.bfloat16, device)
    with flashcore.use_tier(tier):
        first = flashcore.attention(q, k, v, return_lse=True)  # through Launcher; kept
        ((run, *_),) = fwd._LEARNED.values()
        assert type(run) is fwd.Quick and (run.describe is not None) == tiles
        assert run.hopper == (tier == "sm90")
        for _ in range(2):  # a new set of addresses, then the same again
            again = flashcore.attention(q, k, v, return_lse=True)
            assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        recorded = flashcore.attention(*leaves, return_lse=True)
        assert recorded[0].requires_grad
        assert torch.equal(recorded[0], first[0]) and torch.equal(recorded[1], first[1])
        q2, k2, v2 = (t.flip(2).contiguous() for t in (q, k, v))
        check_forward(*flashcore.attention(q2, k2, v2, return_lse=True), q2, k2, v2, causal=False)
        seen = []

        def hook(metadata):
            seen.append(metadata.get()["name"])

        knobs.runtime.launch_enter_hook.add(hook)
        try:
            hooked = flashcore.attention(q, k, v, return_lse=True)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        assert seen and seen[-1].startswith("attn_fwd")
        assert torch.equal(hooked[0], first[0]) and torch.equal(hooked[1], first[1])
        assert len(fwd._LEARNED) == 1


@pytest.mark.parametrize("tier", ["portable", "sm90"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", QUICK_CASES, ids=["ragged", "d128"])
def test_quick_backward_repeats_the_first(case, causal, tier, device):
    """A backward without options keeps its launches on a GPU (``ops.bwd``, "Quick
    backwards"): a repeat of its signature takes them, with the first's gradients bit for bit,
    and on other tensors of the signature right by FlashAttention's rule. Nothing is kept
    under the interpreter (nothing is compiled)."""
    if tier == "sm90":
        require_sm90()
    if device == "cpu" and case.seqlen_q > 64:
        pytest.skip("a GPU case (the interpreter keeps nothing)")
    q, k, v = make_qkv(case, torch.bfloat16, device)
    dout = torch.randn(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=device)

    def grads(q, k, v):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with flashcore.use_tier(tier):
            out = flashcore.attention(*leaves, causal=causal)
        out.backward(dout)
        return [t.grad for t in leaves]

    first = grads(q, k, v)
    kept = len(bwd._QUICK)
    assert kept == (1 if device == "cuda" else 0)
    second = grads(q, k, v)
    assert len(bwd._QUICK) == kept
    # dQ of the Hopper backward is a sum of atomic adds, equal to rounding only: checked below.
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])
    if tier == "portable":
        assert torch.equal(first[0], second[0])
    check_grads({"q": second[0]}, q, k, v, dout, causal=causal)
    q2, k2, v2 = (t.flip(2).contiguous() for t in (q, k, v))
    dq, dk, dv = grads(q2, k2, v2)
    check_grads({"q": dq, "k": dk, "v": dv}, q2, k2, v2, dout, causal=causal)
    assert len(bwd._QUICK) == kept


def test_quick_backward_keeps_nothing_with_options(device):
    """A backward with a gradient reaching the LSE, a window, or under ``deterministic`` plans
    each call (their launches depend on more than the signature); their gradients are right."""
    q, k, v = make_qkv(QUICK_CASES[0], torch.float16, device)
    check_backward(q, k, v, causal=False, window=(8, 0))
    dout = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    flashcore.attention(*leaves, deterministic=True).backward(dout)
    check_grads(dict(zip("qkv", (t.grad for t in leaves), strict=True)), q, k, v, dout,
                causal=False)  # fmt: skip
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flashcore.attention(*leaves, return_lse=True)
    (out.float().sum() + lse.sum()).backward()
    assert not bwd._QUICK


@pytest.mark.gpu
def test_quick_backward_misaligned_tensors_take_the_full_path(device):
    """A repeat of a kept signature on tensors that are not 16-byte aligned plans as a first
    call would, and is right. (Captured calls: tests/test_graphs.py captures backwards after
    eager ones of the same signature.)"""
    if device != "cuda":
        pytest.skip("needs a CUDA device")
    case = QUICK_CASES[0]
    q, k, v = make_qkv(case, torch.float16, device)
    check_backward(q, k, v, causal=True)
    assert len(bwd._QUICK) == 1
    # The same shape and strides one element into a larger buffer: 2-byte aligned.
    shifted = []
    for t in (q, k, v):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        shifted.append(view)
    check_backward(*shifted, causal=True)
    assert len(bwd._QUICK) == 1


@pytest.mark.parametrize("permuted", [False, True], ids=["rows", "permuted"])
def test_quick_hopper_backward_arguments(permuted):
    """``bwd_sm90.Quick`` passes the main kernel the arguments ``attn_bwd_sm90`` passes it:
    the descriptors of q, k, v, dout, lse2, delta, the dQ accumulator (the permuted view where
    the plan permutes its rows), dk, dv, then the LSE for ALiBi and both offsets, dk, dv, lse2,
    delta; each descriptor's expansion is kept under its address, so that a new set of
    addresses encodes only its new tensors. (On the CPU: a stand-in for the expansion.)"""
    import math
    import types

    from flashcore.ops import bwd_sm90

    b, h, s, d = 2, 3, 128, 64
    rows = b * h * s
    plan = types.SimpleNamespace(
        rows=rows, acc_shape=(b, h, s, d), permuted_rows=permuted, layouts=("tile", "1d", "dq"),
        boxes=([1, 1, 64, d], [8, 4, 2, d // 2] if permuted else [1, 1, 64, d // 2]),
    )  # fmt: skip
    encoded = []

    from flashcore.ops.launch import Bound

    class Main:
        part = Bound.part  # the kept expansions as the real launch keeps them

        def __init__(self):
            self.parts = {}

        def expand(self, i, desc):
            encoded.append(i)
            return [(i, desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides),
                     list(desc.block_shape), desc.layout)]  # fmt: skip

    quick = bwd_sm90.Quick(plan, 0, None, Main(), None)
    q, k, v, dout, dk, dv = (torch.randn(b, h, s, d) for _ in range(6))
    lse = torch.randn(b, h, s)
    fp32 = torch.empty(2 * rows + math.prod(plan.acc_shape))
    delta, lse2, acc = fp32.split_with_sizes((rows, rows, rows * d))
    acc = acc.view(plan.acc_shape)
    acc = bwd_sm90.dq_view(acc) if permuted else acc
    addresses = [t.data_ptr() for t in (q, k, v, dout, fp32, dk, dv, lse)]
    front = quick._front(tuple(addresses), q, k, v, dout, fp32, dk, dv)
    tile, dq_box = [1, 1, 64, d], plan.boxes[1]
    want = [
        (i, t.data_ptr(), tuple(t.shape), t.stride(), box, layout)
        for i, (t, box, layout) in enumerate([
            (q, tile, "tile"), (k, tile, "tile"), (v, tile, "tile"), (dout, tile, "tile"),
            (lse2, [64], "1d"), (delta, [64], "1d"), (acc, dq_box, "dq"), (dk, tile, "tile"),
            (dv, tile, "tile"),
        ])
    ]  # fmt: skip
    plain = [lse.data_ptr()] * 3 + [dk.data_ptr(), dv.data_ptr(), lse2.data_ptr(), delta.data_ptr()]
    assert front == want + plain and encoded == list(range(9))
    dk2 = torch.randn_like(dk)
    addresses[5] = dk2.data_ptr()
    front = quick._front(tuple(addresses), q, k, v, dout, fp32, dk2, dv)
    assert encoded == [*range(9), 7] and front[7][1] == dk2.data_ptr()


class _Recorder:
    """Stands for a ``Launcher``: records each call's grid, pointer arguments and constexprs."""

    def __init__(self, name: str, num_pointers: int, calls: list) -> None:
        self.name, self.num_pointers, self.calls = name, num_pointers, calls

    def __call__(self, grid, args, meta, planned=False):
        self.calls.append((self.name, grid, list(args[: self.num_pointers]), meta))


def _fake_bound(calls: list) -> type:
    """A stand-in for ``ops.launch.Bound``: ``of`` keeps the launcher's name, grid and
    constexprs; a call records its pointer arguments in ``calls``; a descriptor expands to one
    tagged entry."""

    from flashcore.ops.launch import Bound

    class FakeBound:
        part = Bound.part  # the kept expansions as the real launch keeps them

        def __init__(self, name, grid, meta):
            self.name, self.grid, self.meta = name, grid, meta
            self.parts = {}

        @classmethod
        def of(cls, launcher, grid, meta):
            return cls(launcher.name, grid, meta)

        def expand(self, position, desc):
            return [("desc", desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides),
                     list(desc.block_shape))]  # fmt: skip

        def __call__(self, stream, front):
            calls.append((self.name, self.grid, list(front), self.meta))

    return FakeBound


def _roles(calls: list, names: dict) -> list:
    """``calls`` with each address (or descriptor's base) named by ``names`` (else kept)."""
    from flashcore.ops.launch import Descriptor

    def name(a):
        if isinstance(a, torch.Tensor):
            a = a.data_ptr()
        if isinstance(a, Descriptor):
            a = ("desc", a.base.data_ptr(), tuple(a.shape), tuple(a.strides), list(a.block_shape))
        if isinstance(a, tuple):
            return (a[0], names.get(a[1], a[1]), *a[2:])
        return names.get(a, a)

    return [(n, grid, [name(a) for a in args], meta) for n, grid, args, meta in calls]


@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("lse_wanted", [True, False], ids=["lse", "no_lse"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("block_size", [0, 16, 128], ids=["dense", "paged16", "paged128"])
def test_quick_decode_arguments(block_size, splits, lse_wanted, with_sinks, monkeypatch):
    """``decode._run_quick`` passes both kernels, by address, what ``decode._run`` passes them
    through ``Launcher`` (the same grids and constexprs; the sinks where given), the splits'
    partial outputs and LSEs (and an LSE not asked for) at disjoint 16-byte aligned parts of one
    workspace that holds them. (On the CPU: stand-ins for the launches.)"""
    case = DecodeCase(3, 8, 2, 1, 256, 72, (256, 37, 1), block_size)
    q, k, v, lens, table = make_kvcache(case, torch.float32, "cpu")
    sinks = torch.randn(8) if with_sinks else None
    options = (True, 0.125, -1, -1, 0.0, splits, with_sinks)
    p = decode._plan(q, k, v, table, None, options)
    assert p.num_splits == splits
    calls = []
    monkeypatch.setattr(decode, "kernels", lambda: (
        _Recorder("split", 9, calls), _Recorder("combine", 4, calls)
    ))  # fmt: skip
    out, lse = decode._run(p, q, k, v, lens, table, sinks=sinks)
    # Dense: the lengths stand in for the table; paged: the (clamped) table's rows.
    tensors = (("q", q), ("k", k), ("v", v), ("lens", lens))
    if with_sinks:
        tensors += (("sinks", sinks),)
    names = {t.data_ptr(): n for n, t in tensors}
    names.update({out.data_ptr(): "out", lse.data_ptr(): "lse"})
    if splits > 1:
        names.update({calls[0][2][3].data_ptr(): "o_part", calls[0][2][4].data_ptr(): "lse_part"})
    names.setdefault(calls[0][2][6].data_ptr(), "table")
    want = _roles(calls, names)

    quick_calls = []
    monkeypatch.setattr(decode, "Bound", _fake_bound(quick_calls))
    monkeypatch.setattr(decode, "current_stream", lambda device: 0)
    monkeypatch.setattr(decode, "no_launch_hooks", lambda: True)
    run = decode._quick(p, 0)
    assert run.func is decode._run_quick
    out2, lse2 = run(q, k, v, lens, table, lse_wanted=lse_wanted, sinks=sinks)
    assert (lse2 is not None) == lse_wanted and out2.shape == out.shape
    assert ("sinks" in str(want)) == with_sinks
    names = {t.data_ptr(): n for n, t in tensors}
    names[out2.data_ptr()] = "out"
    split = quick_calls[0][2]
    a_lse = lse2.data_ptr() if lse_wanted else (quick_calls[-1][2][-1] if splits > 1 else split[4])
    names[a_lse] = "lse"
    sizes = {"o_part": splits * 3 * 8 * 72 * 4, "lse_part": splits * 3 * 8 * 4}
    if splits > 1:
        names.update({split[3]: "o_part", split[4]: "lse_part"})
        assert split[3] % 16 == 0 and split[4] - split[3] >= sizes["o_part"]
        assert split[4] % 16 == 0
        if not lse_wanted:
            assert a_lse % 16 == 0 and a_lse - split[4] >= sizes["lse_part"]
    names.setdefault(split[6], "table")
    assert _roles(quick_calls, names) == want


@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("kind", ["pointers", "descriptors", "hopper", "hopper-dynamic"])
def test_quick_forward_arguments(kind, with_sinks, monkeypatch):
    """``fwd.Quick`` passes the kernel, by address, what ``_learned_portable`` /
    ``fwd_sm90.launch`` pass it through ``Launcher`` for a dense problem (the same grid and
    constexprs; descriptors of q, k, v and out with the plan's boxes; a dynamic deal's counter
    where the work list goes; the sinks where given); each descriptor is expanded once per
    address, so a call with a new out encodes only out's. (On the CPU: stand-ins for the
    launches.)"""
    from flashcore.ops import fwd_sm90

    q, k, v = make_qkv(Case(2, 4, 2, 128, 96, 64), torch.float16, "cpu")
    calls = []
    counter = torch.zeros(1, dtype=torch.int32)
    if kind.startswith("hopper"):
        boxes = ([1, 1, 128, 64], [1, 1, 64, 64], [1, 1, 64, 64], [1, 1, 128, 64])
        meta = {"BLOCK": 1, "DYNAMIC": kind == "hopper-dynamic"}
        plan = fwd_sm90.Plan((8,), boxes, (1, 2, 3), meta)
        monkeypatch.setattr(fwd_sm90, "work_counter", lambda device: counter)
        monkeypatch.setattr(fwd_sm90, "launcher", lambda: _Recorder("fwd", 12, calls))
        fallback = functools.partial(fwd._learned_sm90, plan, 64)
    else:
        tiles = (64, 32, 64, 64) if kind == "descriptors" else None
        plan = ((8,), (1, 2, 3), {"BLOCK": 1}, tiles)
        monkeypatch.setattr(fwd, "kernel", lambda: _Recorder("fwd", 10, calls))
        fallback = functools.partial(fwd._learned_portable, plan, 64)
    sinks = torch.randn(4) if with_sinks else None
    out, lse = fallback(q, k, v, sinks)

    def named(out, lse):
        tensors = (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("counter", counter))
        names = {t.data_ptr(): n for n, t in tensors}
        return names if sinks is None else {**names, sinks.data_ptr(): "sinks"}

    want = _roles(calls, named(out, lse))
    assert ("counter" in want[0][2]) == (kind == "hopper-dynamic")
    quick_calls = []
    monkeypatch.setattr(fwd, "Bound", _fake_bound(quick_calls))
    monkeypatch.setattr(fwd, "current_stream", lambda device: 0)
    monkeypatch.setattr(fwd, "no_launch_hooks", lambda: True)
    make = fwd.Quick.sm90 if kind.startswith("hopper") else fwd.Quick.portable
    run = make(plan, 0, 64, fallback)
    out2, lse2 = run(q, k, v, sinks)
    assert _roles(quick_calls, named(out2, lse2)) == want
    assert any("sinks" in str(role) for role in want) == with_sinks
    assert len(run.launch.parts) == (0 if kind == "pointers" else 4)
    # Again while out2 lives (a new address for out): only out's descriptor is expanded.
    out3, lse3 = run(q, k, v, sinks)
    assert _roles(quick_calls[-1:], named(out3, lse3)) == want
    assert len(run.launch.parts) == (0 if kind == "pointers" else 5)
