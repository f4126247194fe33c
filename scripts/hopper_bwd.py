"""Device-side check and timing of the Hopper (Gluon) backward, ``ops/bwd_sm90.py``.

    PYTHONPATH=src timeout 240 python scripts/hopper_bwd.py check   # dq, dk, dv vs float64
    PYTHONPATH=src timeout 240 python scripts/hopper_bwd.py bench   # TFLOP/s beside the others

``check`` applies FlashAttention's rule (``tests/numerics.py``) to dq, dk and dv: ``max|x -
ref64| <= 2 * max|pt - ref64| + eps(dtype) * max|ref64|``, ref64 being ``flashcore.reference``'s
attention differentiated in float64 and pt the same in the input dtype. The forward's out and LSE
come from the portable forward (``ops.fwd.launch``); dq, dk and dv are poisoned with NaN before
the launch (the launcher writes them in place), so an element no program writes fails.

``bench`` times ``attn_bwd_sm90``, the portable backward (``ops.bwd.launch``), FlashAttention-4's
backward where ``flash_attn.cute`` imports, and SDPA's cuDNN backward (autograd of
``scaled_dot_product_attention`` under ``SDPBackend.CUDNN_ATTENTION``) in one process,
``triton.testing.do_bench`` medians, 32k tokens (H = 16 at D=128, 32 at D=64); FLOPs are 2.5 x
the forward's ``4 B H D`` per visible (query, key) pair (causal: half the square; a window: its
band, ``visible_pairs``).

A kernel that hangs (an mbarrier waited on with the wrong phase) blocks the process inside a CUDA
synchronisation, where Python's signal handlers never run. Each case therefore arms
``faulthandler.dump_traceback_later(--case-timeout, exit=True)`` (a C watchdog thread: it prints
the stack and exits the process), 60 s by default; run the whole script under ``timeout 240`` as
well, and run ``check`` first: a deadlock shows there on a small case in seconds.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import importlib
import math
import sys
import time
import types
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parents[1] / "src"
# bench times bf16 only by default (fp16 on request), to stay within 4 minutes on the H100.
DTYPES = {"check": ["bf16", "fp16"], "bench": ["bf16"]}


def _import(name: str):
    """Import a flashcore module without running the package's ``__init__`` (this script needs
    only the launchers, the kernels and the reference)."""
    if "flashcore" not in sys.modules:
        for pkg in ("flashcore", "flashcore.ops", "flashcore.kernels", "flashcore.kernels.hopper"):
            mod = types.ModuleType(pkg)
            mod.__path__ = [str(SRC.joinpath(*pkg.split(".")))]
            sys.modules[pkg] = mod
    return importlib.import_module(name)


# (B, H, Hkv, Sq, Sk, D, causal, layout, dlse); layout "bhsd" or "bshd" (passed transposed).
CASES = [
    (2, 4, 4, 128, 128, 128, False, "bhsd", False),
    (1, 2, 2, 1, 1, 64, False, "bhsd", False),
    (1, 2, 2, 1, 113, 128, True, "bhsd", False),
    (1, 2, 2, 113, 203, 64, True, "bhsd", False),
    (1, 2, 2, 203, 113, 128, True, "bhsd", False),  # causal Sq > Sk: 90 rows see no key
    (1, 2, 2, 203, 113, 64, False, "bhsd", False),
    (2, 4, 4, 1000, 1000, 128, False, "bhsd", False),
    (2, 4, 4, 1000, 1000, 64, True, "bhsd", False),
    (1, 3, 3, 1000, 1500, 128, False, "bhsd", False),
    (1, 3, 3, 1500, 1000, 128, True, "bhsd", False),
    (1, 3, 3, 1000, 1500, 64, True, "bhsd", False),
    (1, 3, 3, 1500, 1000, 64, False, "bhsd", False),
    (2, 16, 4, 1000, 1500, 128, True, "bhsd", False),  # GQA 16/4
    (2, 16, 4, 1500, 1000, 64, False, "bhsd", False),
    (2, 16, 4, 777, 777, 128, False, "bhsd", False),
    (2, 16, 1, 513, 257, 64, True, "bhsd", False),  # MQA
    (2, 8, 2, 1024, 1024, 128, True, "bshd", False),
    (2, 8, 8, 777, 777, 64, False, "bshd", False),
    (1, 4, 4, 600, 700, 128, True, "bhsd", True),  # a gradient through the LSE
    (1, 4, 4, 4096, 4096, 128, True, "bhsd", False),
    (1, 4, 4, 4097, 1000, 64, False, "bhsd", False),
]
# Score options (window, softcap, ALiBi: "h" slopes (H,), "bh" (B, H)) on some of the cases.
OPTION_CASES = [
    ((2, 8, 2, 1000, 1500, 128, True, "bhsd", False), {"window": (300, 0)}),
    ((1, 4, 4, 777, 1100, 128, False, "bhsd", False), {"window": (200, 150)}),
    ((1, 4, 4, 1100, 777, 64, False, "bshd", False), {"window": (-1, 100)}),
    ((2, 4, 2, 700, 900, 128, False, "bhsd", False), {"softcap": 30.0}),
    ((2, 8, 2, 1000, 1500, 128, True, "bhsd", False), {"softcap": 30.0}),
    ((1, 4, 4, 1100, 700, 128, True, "bhsd", True), {"softcap": 20.0}),  # 400 rows see no key
    ((1, 8, 8, 900, 700, 64, True, "bhsd", True), {"softcap": 20.0, "window": (256, 0)}),
    ((2, 8, 2, 800, 1000, 128, True, "bhsd", False), {"alibi": "h"}),
    ((2, 4, 4, 1000, 800, 64, False, "bhsd", False), {"alibi": "bh", "softcap": 50.0}),
    (
        (1, 4, 1, 1024, 1024, 128, False, "bshd", True),
        {"alibi": "h", "window": (128, 64), "softcap": 15.0},
    ),
]


def make(b, heads, seqlen, head_dim, dtype, layout, gen):
    if layout == "bshd":
        t = torch.randn(b, seqlen, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
        return t.transpose(1, 2)
    return torch.randn(b, heads, seqlen, head_dim, device="cuda", dtype=dtype, generator=gen)


def reference_grads(ref, q, k, v, dout, dlse, causal, scale, dtype, **options):
    """``(dq, dk, dv)`` of ``flashcore.reference.attention`` computed in ``dtype``."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    r = ref.attention(q, k, v, causal=causal, scale=scale, dtype=dtype, **options)
    loss = (r.out * dout.to(dtype)).sum()
    if dlse is not None:
        fin = torch.isfinite(r.lse)
        loss = loss + (torch.where(fin, r.lse, 0.0) * dlse.to(dtype)).sum()
    return torch.autograd.grad(loss, (q, k, v))


def check(args) -> int:
    ref = _import("flashcore.reference")
    numerics = importlib.import_module("numerics")
    fwd = _import("flashcore.ops.fwd")
    sm90 = _import("flashcore.ops.bwd_sm90")
    if args.rows != "rule":
        # The dQ staging rows permuted on every dense problem, or on none (``rows_permuted``).
        permuted = args.rows == "permuted"
        sm90.rows_permuted = lambda cfg, head_dim, varlen, *options: permuted and not varlen
    gen = torch.Generator(device="cuda").manual_seed(0)
    failures = 0
    for dtype in args.dtypes:
        plain = [] if args.options_only else [(c, {}) for c in CASES]
        for case, opts in plain + OPTION_CASES:
            b, h, hkv, sq, sk, d, causal, layout, with_dlse = case
            name = f"{str(dtype)[6:]} B{b} H{h}/{hkv} Sq{sq} Sk{sk} D{d} c{int(causal)} {layout}"
            name += " dlse" if with_dlse else ""
            name += "".join(f" {key}={value}" for key, value in opts.items())
            options = dict(opts)
            if "alibi" in options:
                shape = (h,) if options["alibi"] == "h" else (b, h)
                options["alibi_slopes"] = torch.rand(shape, device="cuda", generator=gen) * 0.5
                del options["alibi"]
            print(f"RUN  {name}", flush=True)
            faulthandler.dump_traceback_later(args.case_timeout, exit=True)
            q = make(b, h, sq, d, dtype, layout, gen)
            k = make(b, hkv, sk, d, dtype, layout, gen)
            v = make(b, hkv, sk, d, dtype, layout, gen)
            dout = make(b, h, sq, d, dtype, layout, gen)
            scale = 1.0 / math.sqrt(d)
            dlse = None
            if with_dlse:
                dlse = torch.randn(b, h, sq, device="cuda", generator=gen)
            out, lse = fwd.launch(q, k, v, causal, scale, **options)[:2]
            dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
            alibi = options.get("alibi_slopes")
            assert sm90.supports(q, k, v, dq, dk, dv, alibi=alibi), name
            sm90.attn_bwd_sm90(
                dout, q, k, v, out, lse, causal, scale, dlse, dq, dk, dv,
                window=options.get("window", (-1, -1)), softcap=options.get("softcap", 0.0),
                alibi=alibi,
            )  # fmt: skip
            torch.cuda.synchronize()
            g64 = reference_grads(ref, q, k, v, dout, dlse, causal, scale, torch.float64, **options)
            gpt = reference_grads(ref, q, k, v, dout, dlse, causal, scale, dtype, **options)
            ok, notes = True, []
            for label, got, pt, r64 in zip(("dq", "dk", "dv"), (dq, dk, dv), gpt, g64, strict=True):
                try:
                    numerics.assert_fa_rule(label, got, pt, r64)
                    err = (got.double() - r64).abs().max().item()
                    notes.append(f"{label} {err:.2e}")
                except AssertionError as exc:
                    ok = False
                    notes.append(str(exc))
            faulthandler.cancel_dump_traceback_later()
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name}: {', '.join(notes)}", flush=True)
    print(f"{failures} failures")
    return 1 if failures else 0


@functools.cache
def _fa4():
    """FlashAttention-4's ``flash_attn_func`` where it imports (pip ``flash-attn-4``), else
    None."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int]) -> float:
    """(query, key) pairs a head computes: the forward's FLOPs are ``4 D`` per pair. Causal
    counts half the square (the FA papers' convention); a window counts its band exactly (row i
    sees keys ``[i + d - left, i + d + right]`` within ``[0, Sk)``, ``d = Sk - Sq``)."""
    left, right = window
    if left < 0 and right < 0:
        return seqlen_q * seqlen_k / (2 if causal else 1)
    rows = torch.arange(seqlen_q, dtype=torch.float64)
    diag = seqlen_k - seqlen_q
    lo = rows + diag - left if left >= 0 else torch.zeros_like(rows)
    hi = rows + diag + (0 if causal else right) if causal or right >= 0 else rows * 0 + seqlen_k
    lo, hi = lo.clamp(0, seqlen_k), (hi + 1).clamp(0, seqlen_k)
    return float((hi - lo).clamp(min=0).sum())


def time_case(
    q, k, v, causal, fwd, bwd, sm90, ablate=False, stages=None, options=None
) -> dict[str, float]:
    """Median milliseconds of each backward on one problem (do_bench, same process). With score
    ``options`` (window, softcap, alibi_slopes) only the two flashcore backwards."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    options = options or {}
    scale = 1.0 / math.sqrt(q.shape[-1])
    dout = torch.randn_like(q)
    out, lse = fwd.launch(q, k, v, causal, scale, **options)[:2]
    cfg = sm90.CONFIGS[q.shape[-1]]
    if stages:
        cfg = cfg._replace(num_stages=stages)
    kw = {
        "window": options.get("window", (-1, -1)),
        "softcap": options.get("softcap", 0.0),
        "alibi": options.get("alibi_slopes"),
    }
    fns = {
        "sm90": lambda: sm90.attn_bwd_sm90(
            dout, q, k, v, out, lse, causal, scale, config=cfg, **kw
        ),
        # deterministic: the portable kernels (without it, "auto" takes the sm90 one here).
        "portable": lambda: bwd.launch(
            dout, q, k, v, out, lse, None, causal, scale, deterministic=True,
            window=kw["window"], softcap=kw["softcap"], alibi_slopes=kw["alibi"],
        ),
    }  # fmt: skip
    if options:
        return _time(fns)
    if ablate:
        # Measurement only (wrong dQ): dQ computed but not reduced into memory. (Without dQ at
        # all, ABLATE=2, Triton 3.6's ptxas crashed.)
        for mode, name in ((1, "noreduce"),):
            ablated = cfg._replace(ablate=mode)
            fns[name] = functools.partial(
                sm90.attn_bwd_sm90, dout, q, k, v, out, lse, causal, scale, config=ablated
            )
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(
            qg, kg, vg, is_causal=causal, scale=scale
        )
    fns["cudnn"] = lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)
    fa4 = _fa4()
    if fa4 is not None:
        # FlashAttention-4 takes (B, S, H, D) tensors and returns (out, lse).
        qf, kf, vf = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        of = fa4(qf, kf, vf, softmax_scale=scale, causal=causal)[0]
        dof = dout.transpose(1, 2).contiguous()
        fns["fa4"] = lambda: torch.autograd.grad(of, (qf, kf, vf), dof, retain_graph=True)
    return _time(fns)


def _time(fns) -> dict[str, float]:
    import triton

    ms = {}
    for name, fn in fns.items():
        try:
            ms[name] = triton.testing.do_bench(fn, warmup=25, rep=100)
        except Exception as exc:
            print(f"{name} failed: {exc!r}", flush=True)
            ms[name] = float("nan")
    return ms


def bench(args) -> int:
    fwd = _import("flashcore.ops.fwd")
    bwd = _import("flashcore.ops.bwd")
    sm90 = _import("flashcore.ops.bwd_sm90")
    for run in range(args.runs):
        for dtype in args.dtypes:
            for head_dim in args.head_dims:
                heads = 16 if head_dim == 128 else 32
                for causal in (False, True):
                    for seqlen in args.seqlens:
                        faulthandler.dump_traceback_later(args.case_timeout, exit=True)
                        batch = max(1, args.tokens // seqlen)
                        shape = (batch, heads, seqlen, head_dim)
                        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
                        window = tuple(args.window) if args.window else (-1, -1)
                        flops = 2.5 * 4.0 * batch * heads * head_dim
                        flops *= visible_pairs(seqlen, seqlen, causal, window)
                        options = {}
                        if args.window:
                            options["window"] = tuple(args.window)
                        if args.softcap:
                            options["softcap"] = args.softcap
                        if args.alibi:
                            options["alibi_slopes"] = torch.rand(heads, device="cuda") * 0.5
                        ms = time_case(
                            q, k, v, causal, fwd, bwd, sm90, args.ablate, args.stages, options
                        )
                        faulthandler.cancel_dump_traceback_later()
                        tf = {name: flops / t / 1e9 for name, t in ms.items()}
                        cols = " ".join(f"{name} {value:.0f}" for name, value in tf.items())
                        print(
                            f"run{run} {str(dtype)[6:]} D{head_dim} causal{int(causal)} S{seqlen}"
                            f"{' ' + ','.join(options) if options else ''}"
                            f" B{batch} H{heads}: {cols} TFLOP/s"
                            + "".join(
                                f" sm90/{name} {tf['sm90'] / tf[name]:.3f}"
                                for name in ("cudnn", "portable", "fa4")
                                if name in tf
                            ),
                            flush=True,
                        )
                        del q, k, v
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    b = sub.add_parser("bench")
    for cmd, p in (("check", c), ("bench", b)):
        p.add_argument("--dtypes", nargs="+", choices=["bf16", "fp16"], default=DTYPES[cmd])
        p.add_argument(
            "--case-timeout", type=float, default=60.0, help="seconds before a case is a hang"
        )
    c.add_argument("--options-only", action="store_true", help="only the score-option cases")
    c.add_argument(
        "--rows",
        choices=["rule", "permuted", "in-order"],
        default="rule",
        help="dQ staging rows: as ops/bwd_sm90.py's rows_permuted says, or forced either way",
    )
    b.add_argument("--runs", type=int, default=1)
    b.add_argument("--tokens", type=int, default=32768)
    b.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    b.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    b.add_argument("--window", type=int, nargs=2, default=None, help="left right (-1 unbounded)")
    b.add_argument("--softcap", type=float, default=0.0)
    b.add_argument("--alibi", action="store_true", help="random (H,) slopes")
    b.add_argument("--stages", type=int, default=None, help="slots of the Q/dO ring (sm90)")
    b.add_argument("--ablate", action="store_true", help="also time without dQ's reduce")
    args = parser.parse_args()
    args.dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in args.dtypes]
    sys.path.insert(0, str(SRC.parent / "tests"))  # numerics.py: the rule the tests apply
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    rc = check(args) if args.cmd == "check" else bench(args)
    print(f"elapsed {time.time() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
