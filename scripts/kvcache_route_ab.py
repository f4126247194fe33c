"""Device-side: `attention_with_kvcache` on long chunks, packed route against decode kernel.

Usage: PYTHONPATH=src python scripts/kvcache_route_ab.py [--rounds 3]

For each case (bf16, 32 query heads on 8 kv heads, D = 128, causal, full caches; paged or dense),
times the API call with ``ops.decode.packed_prefill_wanted`` as it is (the packed route through
the forward kernels, ``ops/decode.py: packed_prefill``) and turned off (the decode kernel), rounds
alternated in one process; prints the medians and ranges of ``do_bench`` medians (us), their
ratio, and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import flashcore
from flashcore.ops import decode

# (batch, cache keys, page size (0: dense), new queries)
CASES = [
    (4, 8192, 256, 512), (4, 8192, 256, 1024), (4, 8192, 16, 1024), (4, 8192, 0, 1024),
    (16, 2048, 256, 512), (1, 16384, 256, 2048), (1, 16384, 0, 4096),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    real = decode.packed_prefill_wanted
    sides = {"route": real, "decode": lambda *a: False}
    torch.manual_seed(0)
    heads, kv_heads, d = 32, 8, 128
    for b, cache, block_size, sq in CASES:
        if block_size:
            num_blocks = b * cache // block_size
            shape = (num_blocks, kv_heads, block_size, d)
            table = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(b, -1)
        else:
            shape, table = (b, kv_heads, cache, d), None
        k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        lens = torch.full((b,), cache, device="cuda", dtype=torch.int32)
        q = torch.randn(b, heads, sq, d, device="cuda", dtype=torch.bfloat16)

        def call(q=q, k=k, v=v, lens=lens, table=table):
            return flashcore.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table)

        times: dict[str, list[float]] = {name: [] for name in sides}
        outs = {}
        for _ in range(args.rounds):
            for name, wanted in sides.items():
                decode.packed_prefill_wanted = wanted
                outs[name] = call().float()
                times[name].append(do_bench(call, return_mode="median") * 1e3)
        decode.packed_prefill_wanted = real
        diff = (outs["route"] - outs["decode"]).abs().max().item()
        r, dk = sorted(times["route"]), sorted(times["decode"])
        pages = f"paged{block_size}" if block_size else "dense"
        print(
            f"B{b} cache{cache} {pages} Sq{sq}: route {r[len(r) // 2]:.1f} us "
            f"({r[0]:.1f}-{r[-1]:.1f}), decode {dk[len(dk) // 2]:.1f} ({dk[0]:.1f}-{dk[-1]:.1f}), "
            f"ratio {r[len(r) // 2] / dk[len(dk) // 2]:.2f}, max diff {diff:.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
