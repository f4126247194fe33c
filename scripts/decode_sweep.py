"""Device-side: decode configs and split counts against SDPA, kernel time from CUDA-graph replays.

Usage: PYTHONPATH=src python scripts/decode_sweep.py [--shape B,H,Hkv,S ...] [--head-dim 128]
       [--page-size N] [--tuned-only] [--top 5]

For each shape (one new query per sequence against a full dense cache of S keys, bf16): SDPA
(``enable_gqa``, PyTorch's backend choice), then ``flashcore.attention_with_kvcache`` with every
``DecodeConfig`` of a small grid and split counts from the tuned choice up and down, each timed
with ``triton.testing.do_bench_cudagraph`` (medians). Prints the best few, the tuned default
(``*``) and the bandwidth each reaches (K and V read once). ``--page-size N``: the same cache
as pages of N keys in shuffled order (``block_table``), against SDPA on the dense cache; the
split counts then also include the dense cache's choice. ``--tuned-only``: the launcher's own
config and split count alone (an A/B of two trees, one process each).
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

import flashcore
from flashcore.bench.providers import to_paged
from flashcore.ops import decode
from flashcore.tuning import DecodeConfig


def add_shape_option(ap: argparse.ArgumentParser) -> None:
    """The decode scripts' repeatable ``--shape B,H,Hkv,S``."""
    ap.add_argument(
        "--shape",
        action="append",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        help="B,H,Hkv,S (repeatable)",
    )


def bench(fn) -> float:
    with torch.cuda.stream(torch.cuda.Stream()):
        return do_bench_cudagraph(fn, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    add_shape_option(ap)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=0, help="keys a page (0: dense cache)")
    ap.add_argument("--tuned-only", action="store_true", help="the launcher's choice alone")
    ap.add_argument("--top", type=int, default=5, help="rows printed a shape, fastest first")
    args = ap.parse_args()
    shapes = args.shape or [
        (1, 32, 8, 4096), (1, 32, 8, 32768), (8, 32, 8, 4096), (8, 32, 8, 32768)
    ]  # fmt: skip
    d = args.head_dim
    print(torch.cuda.get_device_name(), torch.__version__)
    configs = [
        DecodeConfig(bn, w, st) for bn, w, st in itertools.product((64, 128), (4, 8), (2, 3, 4))
    ]
    tuned_config = decode.decode_config
    for b, h, hkv, s in shapes:
        q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        mbytes = 2 * k.numel() * k.element_size() / 1e6  # MB per ms = GB/s
        ms_sdpa = bench(functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True))
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).float()
        paged = args.page_size > 0
        extra = {}
        k_cache, v_cache = k, v
        if paged:
            k_cache, v_cache, extra["block_table"] = to_paged(k, v, args.page_size)
        # The launcher's own split counts (its plan), for the paged cache and the dense one.
        options = (False, d**-0.5, -1, -1, 0.0, 0, False)
        auto = decode._plan(q, k_cache, v_cache, extra.get("block_table"), None, options)
        auto = auto.num_splits
        dense_auto = decode._plan(q, k, v, None, None, options).num_splits
        default = tuned_config(d, 2, interpreted=False, capacity=s, paged=paged)
        rows = []
        splits_grid = sorted(
            {max(1, auto // 4), max(1, auto // 2), auto, auto * 2, auto * 4, dense_auto}
        )
        candidates = itertools.product(configs, splits_grid)
        if args.tuned_only:
            candidates = [(default, auto)]
        for cfg, splits in candidates:
            if splits > 64:
                continue
            decode.decode_config = lambda *a, cfg=cfg, **kw: cfg
            # Launch plans are kept per problem signature and split count, not per config.
            decode.forget()  # the plans and ops.express's kept launches
            try:
                call = functools.partial(
                    flashcore.attention_with_kvcache,
                    q,
                    k_cache,
                    v_cache,
                    cache_seqlens=seqlens,
                    num_splits=splits,
                    **extra,
                )

                err = (call().float() - ref).abs().max().item()
                ms = bench(call)
            except Exception as e:  # out of resources
                rows.append((float("inf"), cfg, splits, type(e).__name__))
                continue
            finally:
                decode.decode_config = tuned_config
                decode.forget()  # the plans and ops.express's kept launches
            rows.append((ms, cfg, splits, f"err {err:.1e}"))
        rows.sort(key=lambda r: r[0])
        where = f" pages of {args.page_size}" if paged else ""
        print(
            f"B{b} H{h}/{hkv} S{s} D{d}{where}: sdpa {ms_sdpa * 1e3:.1f} us "
            f"{mbytes / ms_sdpa:.0f} GB/s; tuned splits {auto}"
        )
        marked = [r for r in rows if r[1] == default and r[2] == auto]
        for ms, cfg, splits, note in rows[: args.top] + marked:
            mark = "*" if (cfg == default and splits == auto) else " "
            print(
                f"  {mark}bn{cfg.block_n:<4d} w{cfg.num_warps} s{cfg.num_stages} "
                f"splits {splits:<3d} {ms * 1e3:7.1f} us {mbytes / ms:5.0f} GB/s "
                f"({ms_sdpa / ms:.2f}x sdpa) {note}"
            )


if __name__ == "__main__":
    main()
