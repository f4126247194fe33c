"""Device-side: the decode's read floor, a plain read of K and V over the split-KV partition.

    PYTHONPATH=src python scripts/decode_read_floor.py [--shape B,H,Hkv,S ...] [--top 6]

For each shape (one new query per sequence against a dense bf16 cache full to its capacity,
head dim 128): SDPA (``enable_gqa``) and ``flashcore.attention_with_kvcache``, then a kernel with
the decode's grid, one program a (batch, kv head) and split, each streaming its split's K and V
tiles and summing them (so that nothing is optimised away), over tiles of 64 or 128 keys, 2-6
pipeline stages, 8-32 splits, through pointers or tensor descriptors. Every time is the median of
``triton.testing.do_bench_cudagraph``; the bandwidth counts K and V read once. The best read is
the floor a decode of that partition could reach; what a decode takes beyond it is its fixed
cost (the split kernel's work besides streaming, the combine kernel).
docs/performance_host.md, "Decode against a read floor", has one run.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from decode_sweep import add_shape_option, bench  # scripts/, the directory Python runs this from
from triton.tools.tensor_descriptor import TensorDescriptor

import flashcore

HEAD_DIM = 128


@triton.jit
def read_kv(
    K, V, OUT, seqlen, keys_per_split,
    SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
):  # fmt: skip
    """Sum program (pair, split)'s keys and values; K and V are tensor descriptors over the
    flattened ``(B * Hkv * S, D)`` caches with DESCRIPTORS, else pointers to them."""
    pair = tl.program_id(0)
    split = tl.program_id(1)
    lo = split * keys_per_split
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    for n in tl.range(lo, lo + keys_per_split, BLOCK_N, num_stages=STAGES):
        if DESCRIPTORS:
            k = K.load([pair * seqlen + n, 0])
            v = V.load([pair * seqlen + n, 0])
        else:
            rows = pair.to(tl.int64) * seqlen * D + (n + offs_n)[:, None] * D + offs_d[None, :]
            k = tl.load(K + rows)
            v = tl.load(V + rows)
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)
    tl.store(OUT + (pair * SPLITS + split) * D + offs_d, acc)


def microseconds(fn) -> float:
    """``decode_sweep.bench`` (a CUDA-graph replay's median, on a side stream) in us."""
    return bench(fn) * 1e3


def reads(k: torch.Tensor, v: torch.Tensor, seqlen: int):
    """``(label, fn)`` of every read config of the partition that fits (shared memory)."""
    d = HEAD_DIM
    pairs = k.shape[0] * k.shape[1]
    flat_k, flat_v = k.view(-1, d), v.view(-1, d)
    for splits, block_n, stages, kind in itertools.product(
        (8, 16, 32), (64, 128), (2, 3, 4, 6), ("pointers", "descriptors")
    ):
        per_split = seqlen // splits
        if per_split < block_n:
            continue
        out = torch.empty(pairs * splits * d, device=k.device)
        args = (k, v)
        if kind == "descriptors":
            args = tuple(TensorDescriptor.from_tensor(t, [block_n, d]) for t in (flat_k, flat_v))
        fn = functools.partial(
            read_kv[(pairs, splits)], *args, out, seqlen, per_split, splits, block_n, d, stages,
            kind == "descriptors", num_warps=4,
        )  # fmt: skip
        yield f"{kind} splits {splits} keys {block_n} stages {stages}", fn


def main() -> None:
    ap = argparse.ArgumentParser()
    add_shape_option(ap)
    ap.add_argument("--top", type=int, default=6, help="read configs printed a shape")
    args = ap.parse_args()
    shapes = args.shape or [
        (1, 32, 8, 4096), (1, 32, 8, 16384), (1, 32, 8, 32768), (8, 32, 8, 4096),
        (8, 32, 8, 32768),
    ]  # fmt: skip
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for b, h, hkv, s in shapes:
        q = torch.randn(b, h, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, s, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        mbytes = 2 * k.numel() * k.element_size() / 1e6  # MB per us = TB/s
        sdpa = microseconds(
            functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True)
        )
        ours = microseconds(
            functools.partial(flashcore.attention_with_kvcache, q, k, v, cache_seqlens=seqlens)
        )
        print(
            f"B{b} H{h}/{hkv} S{s}: {mbytes:.0f} MB; sdpa {sdpa:.1f} us "
            f"({mbytes / sdpa:.2f} TB/s), flashcore {ours:.1f} us ({mbytes / ours:.2f} TB/s)",
            flush=True,
        )
        rows = []
        for label, fn in reads(k, v, s):
            try:
                fn()
                torch.cuda.synchronize()
                rows.append((microseconds(fn), label))
            except triton.runtime.errors.OutOfResources:
                continue
        rows.sort()
        for us, label in rows[: args.top]:
            print(f"  read {label}: {us:.1f} us {mbytes / us:.2f} TB/s")
        print(f"  flashcore - best read: {ours - rows[0][0]:.1f} us", flush=True)


if __name__ == "__main__":
    main()
