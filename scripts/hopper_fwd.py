"""Device-side check and timing of the Hopper (Gluon) forward tier, ``ops/fwd_sm90.py``.

    PYTHONPATH=src python scripts/hopper_fwd.py check          # numerics vs float64, every case
    PYTHONPATH=src python scripts/hopper_fwd.py bench --runs 2 # TFLOP/s beside SDPA (cuDNN)

``check`` runs every case through both schedules, the flat grid and the persistent one
(``--schedules`` narrows it); ``bench`` times both beside cuDNN (``flat``, ``persistent``; the
launcher's default is marked with ``*``).

``check`` applies FlashAttention's rule to out and LSE: ``max|x - ref64| <= 2 * max|pt - ref64| +
floor``, pt being plain PyTorch math in the input dtype; outputs are poisoned with NaN first, and
rows that see no key must give out 0 and LSE -inf exactly. ``bench`` times medians with
``triton.testing.do_bench`` beside SDPA's cuDNN backend and the portable FlashCore forward in the
same process; FLOPs are ``4 B H Sq Sk D`` (halved for causal).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import sys
import time
import types
from pathlib import Path

import torch

LOG2E = 1.4426950408889634
SRC = Path(__file__).resolve().parents[1] / "src"


def _import(name: str):
    """Import a flashcore module without running the package's ``__init__`` (the public API may be
    mid-refactor; this script needs only the launcher, the kernels and the reference)."""
    if "flashcore" not in sys.modules:
        for pkg in ("flashcore", "flashcore.ops", "flashcore.kernels", "flashcore.kernels.hopper"):
            mod = types.ModuleType(pkg)
            mod.__path__ = [str(SRC.joinpath(*pkg.split(".")))]
            sys.modules[pkg] = mod
    return importlib.import_module(name)


def window_bounds(causal, left, right, seqlen_q, seqlen_k):
    """As ``ops.fwd.window_bounds``: (IS_CAUSAL, HAS_WINDOW, left, right), unbounded = Sq + Sk."""
    unbounded = seqlen_q + seqlen_k
    causal = causal or right == 0
    left = unbounded if left < 0 or left >= seqlen_k else left
    right = unbounded if causal or right < 0 or right >= seqlen_q else right
    return causal, left < unbounded or right < unbounded, left, right


def run_sm90(
    q,
    k,
    v,
    *,
    causal,
    scale,
    window=(-1, -1),
    softcap=0.0,
    alibi=None,
    sinks=None,
    out=None,
    lse=None,
    config=None,
):
    sm90 = _import("flashcore.ops.fwd_sm90")
    batch, heads, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    if out is None:
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, seqlen_q, device=q.device, dtype=torch.float32)
    is_causal, has_window, left, right = window_bounds(causal, *window, seqlen_q, seqlen_k)
    qk_scale, cap = scale * LOG2E, 0.0
    if softcap > 0:
        qk_scale, cap = scale / softcap, softcap * LOG2E
    stride_ab = 0
    if alibi is not None:
        alibi = alibi.contiguous()
        stride_ab = alibi.stride(0) if alibi.dim() == 2 else 0
    sm90.attn_fwd_sm90(
        q, k, v, out, lse, causal=is_causal, qk_scale=qk_scale, window_left=left,
        window_right=right, has_window=has_window, softcap=cap, alibi=alibi, stride_ab=stride_ab,
        sinks=sinks, config=config,
    )  # fmt: skip
    return out, lse


# (B, H, Hkv, Sq, Sk, D, causal, layout, extras); layout "bhsd" or "bshd" (passed transposed).
CASES = [
    (2, 4, 4, 128, 128, 128, False, "bhsd", {}),
    (2, 4, 4, 1000, 1000, 128, False, "bhsd", {}),
    (2, 4, 4, 1000, 1000, 128, True, "bhsd", {}),
    (1, 2, 2, 1, 1, 64, False, "bhsd", {}),
    (1, 2, 2, 1, 113, 128, True, "bhsd", {}),
    (1, 2, 2, 113, 203, 64, True, "bhsd", {}),
    (1, 2, 2, 203, 113, 128, True, "bhsd", {}),
    (1, 2, 2, 203, 113, 64, False, "bhsd", {}),
    (1, 3, 3, 4097, 1000, 128, False, "bhsd", {}),
    (1, 3, 3, 1000, 4097, 64, True, "bhsd", {}),
    (2, 16, 4, 257, 513, 128, True, "bhsd", {}),
    (2, 16, 1, 513, 257, 64, False, "bhsd", {}),
    (2, 8, 2, 1024, 1024, 128, True, "bshd", {}),
    (2, 8, 8, 777, 777, 64, False, "bshd", {}),
    (1, 4, 4, 2048, 2048, 128, False, "bhsd", {"window": (256, 128)}),
    (1, 4, 4, 1000, 1500, 64, True, "bhsd", {"window": (300, -1)}),
    (1, 4, 2, 700, 900, 128, False, "bhsd", {"softcap": 30.0}),
    (2, 4, 4, 600, 600, 64, True, "bhsd", {"alibi": True}),
    (1, 4, 4, 513, 1025, 128, True, "bshd", {"window": (64, -1), "softcap": 20.0, "alibi": True}),
    (2, 4, 4, 8192, 8192, 128, True, "bhsd", {}),
    (2, 8, 8, 4096, 4096, 64, False, "bhsd", {}),
    # More tiles than SMs, so that persistent programs loop, with tiles that see no key among
    # them: causal Sq > Sk (query tiles 0-4 empty), a window that leaves rows < 1068 keyless.
    (4, 16, 4, 1000, 300, 64, True, "bhsd", {}),
    (4, 16, 4, 1000, 300, 128, True, "bhsd", {}),
    (4, 16, 16, 1500, 400, 128, False, "bhsd", {"window": (32, 32)}),
    (2, 16, 16, 700, 900, 64, False, "bshd", {"softcap": 30.0, "alibi": True}),
    (8, 16, 8, 1024, 1024, 128, True, "bhsd", {}),
    # Sinks (gpt-oss): with causal Sq > Sk (keyless rows give 0 and the sink), a window, softcap,
    # a -inf sink among the heads, and the three-consumer lengths at D=64.
    (2, 8, 2, 300, 200, 64, True, "bhsd", {"sinks": True}),
    (1, 4, 4, 700, 900, 128, False, "bshd", {"sinks": True, "window": (128, 0)}),
    (2, 4, 2, 513, 513, 64, False, "bhsd", {"sinks": True, "softcap": 30.0}),
    (2, 8, 8, 4096, 4096, 64, True, "bhsd", {"sinks": True}),
    (1, 8, 8, 2048, 2048, 64, False, "bhsd", {"sinks": True}),
]

SCHEDULES = {"flat": False, "persistent": True}


def schedule_config(head_dim: int, persistent: bool):
    """The launcher's config for ``head_dim`` with the schedule forced."""
    sm90 = _import("flashcore.ops.fwd_sm90_configs")
    return sm90.CONFIGS[head_dim]._replace(persistent=persistent)


def make(shape_b, heads, kv_heads, seqlen, head_dim, dtype, layout, gen):
    if layout == "bshd":
        t = torch.randn(shape_b, seqlen, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
        return t.transpose(1, 2)
    return torch.randn(shape_b, heads, seqlen, head_dim, device="cuda", dtype=dtype, generator=gen)


def check(args) -> int:
    ref = _import("flashcore.reference")
    variants = parse_variants(args.variant)
    gen = torch.Generator(device="cuda").manual_seed(0)
    failures = 0
    for dtype in args.dtypes:
        for case in CASES:
            b, h, hkv, sq, sk, d, causal, layout, extra = case
            q = make(b, h, hkv, sq, d, dtype, layout, gen)
            k = make(b, hkv, hkv, sk, d, dtype, layout, gen)
            v = make(b, hkv, hkv, sk, d, dtype, layout, gen)
            scale = 1.0 / math.sqrt(d)
            window = extra.get("window", (-1, -1))
            softcap = extra.get("softcap", 0.0)
            alibi = sinks = None
            if extra.get("alibi"):
                alibi = torch.rand(b, h, device="cuda", generator=gen) * 0.5 + 0.01
            if extra.get("sinks"):
                sinks = torch.randn(h, device="cuda", generator=gen) * 2.0
                sinks[0] = float("-inf")  # no sink for head 0
            name = f"{str(dtype)[6:]} B{b} H{h}/{hkv} Sq{sq} Sk{sk} D{d} c{int(causal)} {layout}"
            name += f" {extra}"
            print(f"RUN  {name}", flush=True)
            sm90 = _import("flashcore.ops.fwd_sm90")
            assert sm90.supports(
                q, k, v, causal=causal, window=window, softcap=softcap, alibi=alibi
            ), name
            kw = dict(
                causal=causal, scale=scale, softcap=softcap or None, alibi_slopes=alibi,
                window=None if window == (-1, -1) else window, sinks=sinks,
            )  # fmt: skip
            r64 = ref.attention(q, k, v, dtype=torch.float64, **kw)
            rpt = ref.attention(q, k, v, dtype=dtype, **kw)
            empty = torch.isinf(r64.lse)
            fin = ~empty
            tol_o = 2 * (rpt.out.double() - r64.out).abs().max().item() + 1e-5
            tol_l = (
                2 * (rpt.lse.double() - r64.lse)[fin].abs().max().item() + 1e-5
                if fin.any()
                else 0.0
            )
            configs = [(s, schedule_config(d, SCHEDULES[s])) for s in args.schedules]
            configs += [(label, cfg) for label, head_dim, cfg in variants if head_dim == d]
            for schedule, config in configs:
                out = torch.full_like(q, float("nan"))
                lse = torch.full((b, h, sq), float("nan"), device="cuda")
                run_sm90(
                    q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                    alibi=alibi, sinks=sinks, out=out, lse=lse, config=config,
                )  # fmt: skip
                torch.cuda.synchronize()
                ok = not out.isnan().any().item() and not lse.isnan().any().item()
                err_o = (out.double() - r64.out).abs().max().item()
                err_l = (lse.double() - r64.lse)[fin].abs().max().item() if fin.any() else 0.0
                ok &= err_o <= tol_o and err_l <= tol_l
                if empty.any():
                    ok &= bool((lse[empty] == float("-inf")).all())
                    ok &= bool((out[empty] == 0).all())
                failures += not ok
                status = "ok  " if ok else "FAIL"
                print(
                    f"{status} {schedule:10s} {name}: out {err_o:.2e} <= {tol_o:.2e},"
                    f" lse {err_l:.2e} <= {tol_l:.2e}, empty rows {int(empty.sum())}",
                    flush=True,
                )
    print(f"{failures} failures")
    return 1 if failures else 0


def time_case(q, k, v, causal, portable, variants, schedules) -> dict[str, float]:
    """Median milliseconds of each provider on one problem (do_bench, same process)."""
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda")

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scale
            )

    fns = {}
    for schedule in schedules:
        cfg = schedule_config(q.shape[-1], SCHEDULES[schedule])
        fns[schedule] = functools.partial(
            run_sm90, q, k, v, causal=causal, scale=scale, out=out, lse=lse, config=cfg
        )
    fns["cudnn"] = cudnn
    for label, head_dim, cfg in variants:
        if head_dim == q.shape[-1]:
            fns[f"sm90[{label}]"] = functools.partial(
                run_sm90, q, k, v, causal=causal, scale=scale, out=out, lse=lse, config=cfg
            )
    if portable is not None:
        fns["portable"] = lambda: portable(q, k, v, causal, scale)
    ms = {}
    for name, fn in fns.items():
        try:
            ms[name] = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
        except Exception as exc:
            print(f"{name} failed: {exc!r}", flush=True)
            ms[name] = float("nan")
    return ms


def parse_variants(specs: list[str]) -> list[tuple]:
    """``(label, head_dim, Sm90Config)`` of each ``label:D:consumers,block_n,stages,regs,
    maxnreg,pingpong[,persistent]`` spec (e.g. ``s3:128:2,128,3,240,168,1``: three K/V slots at
    D=128; ``c3:64:3,128,3,160,128,1``: three consumer warpgroups at D=64). Without the
    persistent field (0 or 1) the launcher picks the schedule by shape."""
    sm90 = _import("flashcore.ops.fwd_sm90_configs")
    variants = []
    for spec in specs:
        label, head_dim, fields = spec.split(":")
        values = [int(x) for x in fields.split(",")]
        persistent = bool(values[6]) if len(values) > 6 else None
        config = sm90.Sm90Config(*values[:5], bool(values[5]), persistent)
        variants.append((label, int(head_dim), config))
    return variants


def bench(args) -> int:
    try:
        launch = _import("flashcore.ops.fwd").launch
        runtime = _import("flashcore.ops.runtime")

        def portable(q, k, v, causal, scale):
            with runtime.use_tier("portable"):
                return launch(q, k, v, causal, scale)

    except Exception as exc:  # the portable tier may be mid-refactor
        print(f"portable forward unavailable: {exc!r}")
        portable = None
    if args.no_portable:
        portable = None
    sm90 = _import("flashcore.ops.fwd_sm90_configs")
    variants = parse_variants(args.variant)
    for run in range(args.runs):
        for dtype in args.dtypes:
            for head_dim in args.head_dims:
                heads = 16 if head_dim == 128 else 32
                for causal in (False, True):
                    for seqlen in args.seqlens:
                        batch = max(1, args.tokens // seqlen)
                        shape = (batch, heads, seqlen, head_dim)
                        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
                        flops = 4.0 * batch * heads * seqlen * seqlen * head_dim
                        flops /= 2 if causal else 1
                        ms = time_case(q, k, v, causal, portable, variants, args.schedules)
                        tf = {name: flops / t / 1e9 for name, t in ms.items()}
                        default = "persistent" if sm90.use_persistent(
                            seqlen, head_dim, causal, sm90.CONFIGS[head_dim].block_n
                        ) else "flat"  # fmt: skip
                        cols = " ".join(
                            f"{name}{'*' if name == default else ''} {value:.0f}"
                            for name, value in tf.items()
                        )
                        ratios = " ".join(
                            f"{name}/cudnn {tf[name] / tf['cudnn']:.3f}" for name in args.schedules
                        )
                        print(
                            f"run{run} {str(dtype)[6:]} D{head_dim} causal{int(causal)} S{seqlen}"
                            f" B{batch} H{heads}: {cols} TFLOP/s  {ratios}",
                            flush=True,
                        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    b = sub.add_parser("bench")
    for p in (c, b):
        p.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
        p.add_argument("--dtypes", nargs="+", choices=["bf16", "fp16"], default=["bf16", "fp16"])
    b.add_argument("--no-portable", action="store_true", help="skip the portable forward")
    b.add_argument("--runs", type=int, default=2)
    b.add_argument("--tokens", type=int, default=32768)
    b.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    b.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    for p in (c, b):
        p.add_argument(
            "--variant",
            action="append",
            default=[],
            help="an extra sm90 config checked or timed beside the default: "
            "label:D:consumers,block_n,stages,regs,maxnreg,pingpong[,persistent]",
        )
    args = parser.parse_args()
    args.dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in args.dtypes]
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    rc = check(args) if args.cmd == "check" else bench(args)
    print(f"elapsed {time.time() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
