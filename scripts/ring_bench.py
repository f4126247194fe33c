"""Ring attention throughput on P GPUs against flashcore.attention on one.

    torchrun --nproc-per-node 2 scripts/ring_bench.py                 # defaults below
    torchrun --nproc-per-node 2 scripts/ring_bench.py --seqlen 32768 131072 --layout contiguous

Per global sequence length S: forward and forward + backward of ``flashcore.distributed.
ring_attention`` (causal, bf16, D=128, H=16 by default, zigzag) with S / P positions a rank, and of
``flashcore.attention`` over all S on rank 0's GPU alone; plus the ring's transfers alone (the
P - 1 K/V shifts of a forward, no compute), which the compute must hide for the ring to scale.
TFLOP/s count the causal FLOPs once (4 B H S^2 D / 2 forward, 2.5 times that backward), summed
over the GPUs for the ring; efficiency is ring TFLOP/s / (P x one GPU's).

Timing: CUDA events around ``--iters`` back-to-back calls after ``--warmup``, repeated ``--repeats``
times; the median and the spread (min-max) of the per-call time are printed, for the ring the
slowest rank's. ``triton.testing.do_bench`` is not used: it picks its repetition count from each
process's own first timing, and ranks that disagree would stop at different collectives.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import flashcore
from flashcore import distributed as fd


def timed(fn, iters: int, warmup: int, repeats: int, group=None) -> list[float]:
    """Per-call times in ms, one per repeat; with a group, each the slowest rank's."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms = torch.tensor(start.elapsed_time(end) / iters, device="cuda")
        if group is not None:
            dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
        times.append(ms.item())
    return times


def summary(times: list[float]) -> str:
    return f"{statistics.median(times):8.3f} ms [{min(times):.3f}-{max(times):.3f}]"


def tflops(flops: float, times: list[float]) -> float:
    return flops / (statistics.median(times) * 1e-3) / 1e12


def inputs(args, seqlen: int, device: torch.device):
    """q, k, v (requiring grad) and a gradient for out, bf16."""
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(b, heads, seqlen, d, device=device, dtype=torch.bfloat16)

    q, k, v = (rand(n).requires_grad_() for n in (h, hkv, hkv))
    return q, k, v, rand(h)


def bench_ring(args, seqlen: int, device: torch.device, timing: dict) -> dict[str, list[float]]:
    """The ring's forward, forward + backward, and its P - 1 K/V shifts alone."""
    group, world = dist.group.WORLD, dist.get_world_size()
    q, k, v, dout = inputs(args, seqlen // world, device)
    options = dict(causal=not args.no_causal, layout=args.layout)

    def forward():
        with torch.no_grad():
            fd.ring_attention(q, k, v, **options)

    def both():
        out = fd.ring_attention(q, k, v, **options)
        torch.autograd.grad(out, (q, k, v), dout)

    ring = fd._Ring(group)
    buffers = [torch.stack((k.detach(), v.detach())), torch.empty((2, *k.shape), **_like(k))]

    def shifts():
        for step in range(world - 1):
            fd._wait(ring.shift(buffers[step % 2], buffers[(step + 1) % 2], 0))

    return {
        "fwd": timed(forward, group=group, **timing),
        "fwd+bwd": timed(both, group=group, **timing),
        "shifts": timed(shifts, group=group, **timing),
    }


def _like(t: torch.Tensor) -> dict:
    return dict(dtype=t.dtype, device=t.device)


def bench_single(args, seqlen: int, device: torch.device, timing: dict) -> dict[str, list[float]]:
    """flashcore.attention over the whole sequence on this GPU alone."""
    q, k, v, dout = inputs(args, seqlen, device)
    causal = not args.no_causal

    def forward():
        with torch.no_grad():
            flashcore.attention(q, k, v, causal=causal)

    def both():
        out = flashcore.attention(q, k, v, causal=causal)
        torch.autograd.grad(out, (q, k, v), dout)

    return {"fwd": timed(forward, **timing), "fwd+bwd": timed(both, **timing)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layout", choices=fd.LAYOUTS, default="zigzag")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--single", action=argparse.BooleanOptionalAction, default=True,
                        help="also time flashcore.attention on one GPU (rank 0)")  # fmt: skip
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    # NVLink SHARP (multicast) stays off on the lent machines; read at the first communicator.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    causal = not args.no_causal
    timing = dict(iters=args.iters, warmup=args.warmup, repeats=args.repeats)
    if rank == 0:
        print(
            f"{world} x {torch.cuda.get_device_name()}, B={args.batch} H={args.heads} "
            f"Hkv={args.kv_heads} D={args.head_dim} bf16 {'causal' if causal else 'full'} "
            f"{args.layout}; torch {torch.__version__}"
        )
    for seqlen in args.seqlen:
        ring = bench_ring(args, seqlen, device, timing)
        single = bench_single(args, seqlen, device, timing) if args.single and rank == 0 else {}
        dist.barrier()
        if rank != 0:
            continue
        fwd_flops = 4 * args.batch * args.heads * seqlen**2 * args.head_dim / (2 if causal else 1)
        flops = {"fwd": fwd_flops, "fwd+bwd": 3.5 * fwd_flops}
        print(f"S={seqlen} ({seqlen // world} a rank); K/V shifts alone {summary(ring['shifts'])}")
        for name in ("fwd", "fwd+bwd"):
            line = f"  {name:8s} ring {summary(ring[name])} {tflops(flops[name], ring[name]):7.1f}"
            line += " TFLOP/s"
            if name in single:
                one, many = tflops(flops[name], single[name]), tflops(flops[name], ring[name])
                speedup = statistics.median(single[name]) / statistics.median(ring[name])
                line += (
                    f" | 1 GPU {summary(single[name])} {one:7.1f} TFLOP/s"
                    f" | speedup {speedup:.2f}x, efficiency {many / (world * one):.2f}"
                )
            print(line)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
