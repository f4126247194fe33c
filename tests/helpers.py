"""Input construction and the forward and backward checks shared by the test modules."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path

import pytest
import torch

import flashcore
from flashcore import reference
from numerics import assert_fa_rule
from shapes import Case, MaskCase, VarlenCase

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@functools.cache
def load_script(name: str):
    """``scripts/<name>.py`` as a module (the scripts are not a package), loaded once."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_qkv(
    case: Case,
    dtype: torch.dtype,
    device: str,
    *,
    layout: str = "bhsd",
    head_dim_v: int | None = None,
):
    """Random q, k, v for a case. ``layout='bshd'`` returns (B, S, H, D) storage viewed as
    (B, H, S, D); ``'sliced'`` returns views into larger tensors (no unit stride on any dim but D).
    ``head_dim_v``: v's own head dim (the case's by default).
    """
    b, h, hkv, sq, sk, head_dim = case

    def rand(heads: int, seqlen: int, d: int = head_dim) -> torch.Tensor:
        if layout == "bshd":
            return torch.randn(b, seqlen, heads, d, dtype=dtype, device=device).transpose(1, 2)
        if layout == "sliced":
            big = torch.randn(b, heads + 1, seqlen + 3, d + 8, dtype=dtype, device=device)
            return big[:, 1:, 2 : seqlen + 2, 4 : d + 4]
        return torch.randn(b, heads, seqlen, d, dtype=dtype, device=device)

    return rand(h, sq), rand(hkv, sk), rand(hkv, sk, head_dim_v or head_dim)


def alibi_slopes(heads: int, batch: int | None, device: str) -> torch.Tensor:
    """The usual geometric slopes of ALiBi, fp32 ``2^(-8 (i + 1) / H)``: ``(H,)``, or with
    ``batch`` ``(B, H)``, each batch's row scaled by 0.5 ... 1.5."""
    slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1, dtype=torch.float32) / heads)
    if batch is not None:
        slopes = slopes * torch.linspace(0.5, 1.5, batch)[:, None]
    return slopes.to(device)


def mask_options(mc: MaskCase, device: str) -> dict:
    """``flashcore.attention``'s keyword options for a MaskCase (ALiBi slopes made here)."""
    opts = {"causal": mc.causal, "window": mc.window, "softcap": mc.softcap}
    if mc.alibi is not None:
        batch = mc.case.batch if mc.alibi == "bh" else None
        opts["alibi_slopes"] = alibi_slopes(mc.case.heads, batch, device)
    return opts


def check_forward(out, lse, q, k, v, *, causal: bool, scale=None, **masks) -> None:
    """``masks``: window, softcap, alibi_slopes, as ``flashcore.attention`` takes them."""
    ref = reference.attention(q, k, v, causal=causal, scale=scale, dtype=torch.float64, **masks)
    pt = reference.attention(q, k, v, causal=causal, scale=scale, dtype=q.dtype, **masks)
    assert out.dtype == q.dtype
    assert lse.dtype == torch.float32
    assert_fa_rule("out", out, pt.out, ref.out)
    assert_fa_rule("lse", lse, pt.lse, ref.lse)


def check_grads(
    grads: dict, q, k, v, dout, *, causal: bool, scale=None, dlse=None, **masks
) -> None:
    """Assert gradients ``{"q": dq, ...}`` (any subset of q, k, v) with FlashAttention's rule;
    ``dlse``: the gradient that reached the LSE, if any."""
    ref = reference_grads(
        q, k, v, dout, dlse, causal=causal, scale=scale, dtype=torch.float64, **masks
    )
    pt = reference_grads(q, k, v, dout, dlse, causal=causal, scale=scale, dtype=q.dtype, **masks)
    for name, grad in grads.items():
        assert grad is not None, f"d{name} is None"
        i = "qkv".index(name)
        assert_fa_rule(f"d{name}", grad, pt[i], ref[i])


# Score elements a reference backward holds per call: a larger problem runs by (batch, kv
# heads) chunks, which are independent (a kv head's gradients come from its own query heads). At
# (1, 16, 4096, 4096) the whole float64 backward holds ~13 GB at once, and 16 GPU test workers ran
# an H200 out of memory (docs/maintainers.md); a chunk of 2^26 scores holds about 2 GB.
REF_CHUNK_SCORES = 2**26


def reference_grads(q, k, v, dout, dlse, *, causal: bool, scale=None, dtype: torch.dtype, **masks):
    """``(dq, dk, dv)`` by autograd through the reference computed in ``dtype``.

    Fresh leaves are made in ``dtype`` so a float64 gradient is not rounded back to q's dtype.
    ``dlse`` may be None (the LSE output is not differentiated). ``masks`` as in check_forward.
    Problems of more than REF_CHUNK_SCORES scores run by chunks of batches and kv heads.
    """
    batch, heads, seqlen_q = q.shape[:3]
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    if kv_heads == 0 or batch * heads * seqlen_q * seqlen_k <= REF_CHUNK_SCORES:
        return _reference_grads(
            q, k, v, dout, dlse, causal=causal, scale=scale, dtype=dtype, **masks
        )
    group = heads // kv_heads
    step = max(1, REF_CHUNK_SCORES // (group * seqlen_q * seqlen_k))
    rows = []
    for b in range(batch):
        parts = []
        for g in range(0, kv_heads, step):
            kv, hs = slice(g, g + step), slice(g * group, (g + step) * group)
            opts = dict(masks)
            alibi = opts.get("alibi_slopes")
            if alibi is not None:
                opts["alibi_slopes"] = alibi[hs] if alibi.dim() == 1 else alibi[b : b + 1, hs]
            if opts.get("sinks") is not None:
                opts["sinks"] = opts["sinks"][hs]
            part_dlse = None if dlse is None else dlse[b : b + 1, hs]
            parts.append(_reference_grads(
                q[b : b + 1, hs], k[b : b + 1, kv], v[b : b + 1, kv], dout[b : b + 1, hs],
                part_dlse, causal=causal, scale=scale, dtype=dtype, **opts,
            ))  # fmt: skip
        rows.append([torch.cat(grads, dim=1) for grads in zip(*parts, strict=True)])
    return tuple(torch.cat(grads, dim=0) for grads in zip(*rows, strict=True))


def _reference_grads(q, k, v, dout, dlse, *, causal, scale, dtype, **masks):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, causal=causal, scale=scale, dtype=dtype, **masks)
    outputs, grads = [ref.out], [dout.to(dtype)]
    if dlse is not None:
        outputs.append(ref.lse)
        grads.append(dlse.to(dtype))
    return torch.autograd.grad(outputs, leaves, grads)


def check_backward(q, k, v, *, causal: bool, scale=None, dout=None, dlse=None, **masks):
    """Run flashcore.attention forward and backward and check dq, dk, dv with the FA rule.

    ``dout`` defaults to a random tensor shaped like the output; ``dlse`` (the gradient reaching
    the LSE) defaults to none; ``masks`` as in check_forward. Returns the kernel's gradients.
    """
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flashcore.attention(q, k, v, causal=causal, scale=scale, return_lse=True, **masks)
    if dout is None:
        dout = torch.randn_like(out)
    outputs, grads = [out], [dout]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse)
    got = torch.autograd.grad(outputs, (q, k, v), grads)
    ref = reference_grads(
        q, k, v, dout, dlse, causal=causal, scale=scale, dtype=torch.float64, **masks
    )
    pt = reference_grads(q, k, v, dout, dlse, causal=causal, scale=scale, dtype=q.dtype, **masks)
    for name, g, t, p, r in zip(("dq", "dk", "dv"), got, (q, k, v), pt, ref, strict=True):
        assert g.dtype == t.dtype, f"{name}: dtype {g.dtype} != {t.dtype}"
        assert_fa_rule(name, g, p, r)
    return got


def cu_seqlens(seqlens: tuple[int, ...], device: str) -> torch.Tensor:
    """int32 ``[0, s_0, s_0 + s_1, ...]``, as ``attention_varlen`` takes it."""
    return torch.tensor((0, *seqlens), device=device).cumsum(0).to(torch.int32)


def paged_pools(ks: list, vs: list, block_size: int, generator: torch.Generator | None = None):
    """Sequence b's keys and values ``ks[b]``, ``vs[b]`` (``(L_b, Hkv, D)``, Dv for v) in pages of
    a shuffled pool: ``(k pool, v pool, block table)``, the pools ``(num_blocks, Hkv,
    block_size, D)``, the table int32 ``(B, max_blocks)``. Pool rows no sequence owns are NaN
    and unused table entries point at a used page, so that a read of either would show."""
    counts = [-(-t.shape[0] // block_size) for t in ks]
    num_blocks = sum(counts) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    table = torch.full((len(ks), max([*counts, 1])), order[0], dtype=torch.int32)
    pools = []
    for dense in (ks, vs):
        like = dense[0]
        pool = torch.full((num_blocks, like.shape[1], block_size, like.shape[2]), float("nan"),
                          dtype=like.dtype, device=like.device)  # fmt: skip
        used = 0
        for b, t in enumerate(dense):
            for j in range(counts[b]):
                rows = t[j * block_size : (j + 1) * block_size]
                pool[order[used], :, : rows.shape[0]] = rows.transpose(0, 1)
                table[b, j] = order[used]
                used += 1
        pools.append(pool)
    return pools[0], pools[1], table.to(ks[0].device)


def make_varlen(case: VarlenCase, dtype: torch.dtype, device: str):
    """Packed ``(q, k, v, cu_seqlens_q, cu_seqlens_k)`` for a varlen case (v at the case's value
    head dim)."""
    total_q, total_k = sum(case.seqlens_q), sum(case.seqlens_k)
    head_dim_v = case.head_dim_v or case.head_dim
    q = torch.randn(total_q, case.heads, case.head_dim, dtype=dtype, device=device)
    k = torch.randn(total_k, case.kv_heads, case.head_dim, dtype=dtype, device=device)
    v = torch.randn(total_k, case.kv_heads, head_dim_v, dtype=dtype, device=device)
    return q, k, v, cu_seqlens(case.seqlens_q, device), cu_seqlens(case.seqlens_k, device)


def check_varlen(case: VarlenCase, q, k, v, cu_q, cu_k, *, causal: bool, backward: bool, **masks):
    """``attention_varlen`` forward (and with ``backward``, dq, dk, dv through out and lse)
    against the per-sequence reference, concatenated, with FlashAttention's rule. ``masks``:
    ``window``, ``softcap``, ``alibi_slopes``, passed to both. Returns out, lse and the
    gradients (None without ``backward``)."""
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    out, lse, grads, dout, dlse = run_varlen(case, q, k, v, cu_q, cu_k, causal=causal, **masks)
    check_varlen_results(q, k, v, cu_q, cu_k, out, lse, grads, dout, dlse, causal=causal, **masks)
    return out, lse, grads


def run_varlen(case: VarlenCase, q, k, v, cu_q, cu_k, *, causal: bool, **masks):
    """``attention_varlen`` of a packed batch: ``(out, lse, grads, dout, dlse)``, the gradients
    of q, k and v (when they require grad, else None) through out and lse along random ``dout``
    and ``dlse``."""
    maxima = max(case.seqlens_q), max(case.seqlens_k)
    out, lse = flashcore.attention_varlen(
        q, k, v, cu_q, cu_k, *maxima, causal=causal, return_lse=True, **masks
    )
    assert (out.shape, out.dtype) == ((*q.shape[:2], v.shape[-1]), q.dtype)
    assert (lse.shape, lse.dtype) == ((case.heads, q.shape[0]), torch.float32)
    if not q.requires_grad:
        return out, lse, None, None, None
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    return out, lse, grads, dout, dlse


def check_varlen_results(q, k, v, cu_q, cu_k, out, lse, grads, dout, dlse, *, causal, **masks):
    """``run_varlen``'s results against the per-sequence reference on the inputs' device (which
    may be the CPU, for results computed elsewhere), with FlashAttention's rule; ``grads`` None
    checks the forward alone."""
    backward = grads is not None
    q, k, v = (t.detach() for t in (q, k, v))

    def ref(dtype):
        leaves = [t.to(dtype).requires_grad_(backward) for t in (q, k, v)]
        ref = reference.attention_varlen(*leaves, cu_q, cu_k, causal=causal, dtype=dtype, **masks)
        return leaves, ref

    (leaves64, ref64), (leaves_pt, pt) = ref(torch.float64), ref(q.dtype)
    assert_fa_rule("out", out, pt.out, ref64.out)
    assert_fa_rule("lse", lse, pt.lse, ref64.lse)
    if not backward:
        return
    want64 = torch.autograd.grad((ref64.out, ref64.lse), leaves64, (dout.double(), dlse.double()))
    want_pt = torch.autograd.grad((pt.out, pt.lse), leaves_pt, (dout, dlse.to(q.dtype)))
    for name, g, p, r in zip(("dq", "dk", "dv"), grads, want_pt, want64, strict=True):
        assert g.dtype == q.dtype, f"{name}: dtype {g.dtype} != {q.dtype}"
        assert_fa_rule(name, g, p, r)


def record_backward_tiers(monkeypatch) -> list[str]:
    """Record which backward each call runs, in order: "sm90" (``ops.bwd_sm90.attn_bwd_sm90``)
    or "portable" (the kernels of ``ops.bwd``); both still run. Quick backwards (``ops.bwd``),
    which a repeated signature would take without either, are off meanwhile."""
    from flashcore.ops import bwd, bwd_sm90

    monkeypatch.setattr(bwd, "_quick", lambda key: None)
    ran = []
    real_sm90, real_portable = bwd_sm90.attn_bwd_sm90, bwd.kernels

    def sm90(*args, **kwargs):
        ran.append("sm90")
        return real_sm90(*args, **kwargs)

    def portable():
        ran.append("portable")
        return real_portable()

    monkeypatch.setattr(bwd_sm90, "attn_bwd_sm90", sm90)
    monkeypatch.setattr(bwd, "kernels", portable)
    return ran


def sm90_tier_runs(device: torch.device) -> bool:
    """Whether the Hopper tier can run on ``device`` (an sm_90 GPU and a verified Triton)."""
    from flashcore.ops import runtime

    return runtime.capability(device) == (9, 0) and runtime.sm90_verified()


def require_sm90() -> None:
    """Skip the calling test unless the Hopper tier can run here (``sm90_tier_runs``)."""
    if not torch.cuda.is_available() or not sm90_tier_runs(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU and a Triton the sm90 tier was verified on")


@contextlib.contextmanager
def sm90_backward_switch(monkeypatch, name: str):
    """The Hopper backward (D 64/128) with the boolean ``ops/bwd_sm90.py`` switch ``name`` on;
    yields its plans, and drops every plan and kept backward before and after, so that none built
    with the switch outlives the block."""
    from flashcore.ops import bwd, bwd_sm90

    require_sm90()
    monkeypatch.setattr(bwd_sm90, name, True)
    bwd_sm90._PLANS.clear()
    bwd.forget()
    try:
        yield bwd_sm90._PLANS
    finally:
        bwd_sm90._PLANS.clear()
        bwd.forget()


def spy_d256(monkeypatch) -> list:
    """Force the head-dim-256 Hopper backward on (``bwd256.VERIFIED``; MLA's head dims non-causal
    too), drop kept backwards, and return a list that gains an entry per run of it."""
    from flashcore.ops import bwd, bwd256

    require_sm90()
    monkeypatch.setattr(bwd256, "VERIFIED", True)
    monkeypatch.setattr(bwd256, "MLA_NON_CAUSAL", True)
    bwd.forget()
    calls = []
    real = bwd256.backward
    monkeypatch.setattr(bwd256, "backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def record_sm90_forwards(monkeypatch) -> list:
    """A list that gains an entry per Hopper forward launch (``ops.fwd_sm90.launch``, which
    still runs). Quick Hopper forwards (``ops.fwd.Quick.sm90``), which a repeated signature would
    take without it, are off meanwhile."""
    from flashcore.ops import fwd, fwd_sm90

    monkeypatch.setattr(fwd.Quick, "sm90", classmethod(lambda cls, *args: None))
    forwards = []
    real = fwd_sm90.launch
    monkeypatch.setattr(fwd_sm90, "launch", lambda *a, **kw: forwards.append(1) or real(*a, **kw))
    return forwards


def launch_sm90_forward(
    q,
    k,
    v,
    *,
    causal=False,
    window=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    config=None,
    varlen=None,
    use_work_list=True,
):
    """The Hopper forward launched directly (no dispatch, no ``supports``: for builds the
    dispatch does not take yet, and for configs it would not pick) into NaN-filled out and LSE,
    so that an element it never writes shows; returns ``(out, lse)``. Options as
    ``flashcore.attention`` takes them; ``config`` an ``Sm90Config`` (None: the launcher's);
    ``varlen`` an ``ops.problem.Varlen`` for packed q, k, v (``use_work_list``: as
    ``fwd_sm90.plan`` takes it)."""
    from flashcore.ops import fwd_sm90
    from flashcore.ops import problem as pb

    lengths = (q.shape[2], k.shape[2]) if varlen is None else varlen[2:]
    sc = pb.scores(
        causal, window or (-1, -1), softcap or 0.0, q.shape[-1] ** -0.5,
        alibi_slopes is not None, *lengths,
    )  # fmt: skip
    lse = torch.full(pb.lse_shape(q, varlen is not None), float("nan"), device=q.device)
    alibi, stride_ab = pb.alibi_arg(alibi_slopes, lse)
    out = torch.full((*q.shape[:-1], v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    fwd_sm90.attn_fwd_sm90(
        q, k, v, out, lse, causal=sc.is_causal, qk_scale=sc.qk_scale,
        window_left=sc.window_left, window_right=sc.window_right, has_window=sc.has_window,
        softcap=sc.softcap, alibi=None if alibi_slopes is None else alibi, stride_ab=stride_ab,
        sinks=sinks, config=config, varlen=varlen, use_work_list=use_work_list,
    )  # fmt: skip
    return out, lse


class PortableLaunched(Exception):
    """Raised by a test's stand-in for the portable kernels: where only the tier decision is
    checked, the launch itself is not needed."""


def capture_modes(monkeypatch, ran: list[str]):
    """Stand-ins for ``runtime.capturing`` and ``runtime.in_capture`` (CPU tensors are never
    captured); returns ``run(now, launch)``, which calls ``launch()`` as a call made ``now``:
    "eager", "as_captured" (``flashcore.warmup(..., graphs=True)``'s calls) or "capture" (a
    real capture), and returns the tier it ran (the last of ``ran``)."""
    from flashcore.ops import runtime

    mode = {"now": "eager"}
    monkeypatch.setattr(runtime, "capturing", lambda t: mode["now"] != "eager")
    monkeypatch.setattr(runtime, "in_capture", lambda t: mode["now"] == "capture")

    def run(now: str, launch) -> str:
        mode["now"] = now
        with contextlib.suppress(PortableLaunched):
            launch()
        return ran[-1]

    return run
