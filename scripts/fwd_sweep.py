"""Device-side: ceilings, then forward configs and SDPA side by side (medians of do_bench).

Usage: python scripts/fwd_sweep.py [--quick] [--shape B,H,S,D ...] [--no-ceilings] [--graph]

``--graph`` times each call replayed from a CUDA graph (``do_bench_cudagraph``): the kernel's own
time, which small shapes need since an eager call there is paced by the host.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from flashcore import reference
from flashcore.ops.fwd import launch as attn_fwd
from flashcore.tuning import FwdConfig, fwd_config


def ceilings() -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    print(f"ceiling: bf16 matmul 8192^3 {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s")
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    print(f"ceiling: d2d copy {2 * x.numel() / ms / 1e6:.0f} GB/s (read + write)")


def tflops(b, h, sq, sk, d, causal, ms):
    flops = 4 * b * h * sq * sk * d / (2 if causal else 1)
    return flops / ms / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="time the default config only")
    ap.add_argument(
        "--shape",
        action="append",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        help="B,H,S,D (repeatable); default: four shapes of S 1024-4096, D 64-256",
    )
    ap.add_argument("--no-ceilings", action="store_true", help="skip the matmul/copy ceilings")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays")
    args = ap.parse_args()
    if args.graph:

        def bench(fn, return_mode="median"):
            with torch.cuda.stream(torch.cuda.Stream()):
                return do_bench_cudagraph(fn, return_mode=return_mode)
    else:
        bench = do_bench
    print(torch.cuda.get_device_name(), torch.__version__)
    if not args.no_ceilings:
        ceilings()
    shapes = args.shape or [
        (4, 16, 4096, 128), (4, 32, 4096, 64), (2, 8, 4096, 256), (16, 16, 1024, 128),
    ]  # fmt: skip
    small_d = [
        FwdConfig(bm, bn, w, st, tma)
        for (bm, bn, w, st), tma in itertools.product(
            [
                (128, 128, 8, 3),
                (128, 128, 8, 2),
                (128, 64, 8, 3),
                (128, 64, 8, 2),
                (128, 64, 4, 3),
                (128, 32, 8, 3),
                (64, 64, 4, 3),
                (64, 128, 4, 3),
                (64, 64, 4, 2),
                (64, 32, 4, 3),
                (64, 64, 4, 4),
                (32, 64, 4, 3),
            ],
            (True, False) if args.graph else (True,),
        )
    ]
    big_d = [
        FwdConfig(bm, bn, w, st, tma)
        for (bm, bn, w, st), tma in itertools.product(
            [(128, 64, 8, 2), (128, 64, 8, 1), (64, 64, 4, 2), (128, 32, 8, 2)], (True, False)
        )
    ]
    for (b, h, s, d), causal in itertools.product(shapes, (False, True)):
        dtype = torch.float16
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3))
        scale = d**-0.5
        ref = reference.attention(
            q[:1, :2], k[:1, :2], v[:1, :2], causal=causal, dtype=torch.float32
        )
        ms_sdpa = bench(
            functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal),
            return_mode="median",
        )
        default = fwd_config(d, 2, interpreted=False, seqlen_q=s, causal=causal)
        rows = []
        cands = big_d if d > 128 else small_d
        for cfg in [default] if args.quick else dict.fromkeys([default, *cands]):
            try:
                out, _ = attn_fwd(q, k, v, causal, scale, cfg)
                err = (out[:1, :2].float() - ref.out).abs().max().item()
                run = functools.partial(attn_fwd, q, k, v, causal, scale, cfg)
                ms = bench(run, return_mode="median")
            except Exception as e:  # out of shared memory etc.
                rows.append((float("inf"), cfg, type(e).__name__))
                continue
            rows.append((ms, cfg, f"err {err:.1e}"))
        rows.sort(key=lambda r: r[0])
        tag = f"B{b} H{h} S{s} D{d} causal={causal}"
        print(f"{tag}: sdpa {ms_sdpa:.3f} ms {tflops(b, h, s, s, d, causal, ms_sdpa):.0f} TF/s")
        for ms, cfg, note in rows[:6] + [r for r in rows if r[1] == default]:
            mark = "*" if cfg == default else " "
            print(
                f"  {mark}{cfg.block_m:4d}x{cfg.block_n:<4d} w{cfg.num_warps} s{cfg.num_stages} "
                f"{'tma' if cfg.use_tma else 'ptr'}: "
                f"{ms:.3f} ms {tflops(b, h, s, s, d, causal, ms):.0f} TF/s "
                f"({ms_sdpa / ms:.2f}x sdpa) {note}"
            )


if __name__ == "__main__":
    main()
