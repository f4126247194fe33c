"""Device time of each kernel of one backward, per provider, on a GPU:

    PYTHONPATH=src python scripts/bwd_kernel_times.py [--providers flashcore,fa4,sdpa-cudnn]
        [--shape D,CAUSAL,S ...] [--window LEFT,RIGHT]

For each shape (bf16, the FA sweep's: B x S = 16384 tokens, H x D = 2048; default the five of
docs/performance_backward.md, "The dQ conversion and the short floors"), ``torch.profiler`` over
10 calls of ``autograd.grad`` on one kept forward (after 3 warm-ups): each kernel's device time
per backward, the largest first, and their sum as TFLOP/s (2.5x the forward's FLOPs, halved
causal; with ``--window`` of the visible pairs, as ``flashcore-bench`` counts them). Device time
only: launch gaps and host time are not in it (``flashcore-bench`` times the whole call), and
kernels launched by programmatic dependent launch (the Hopper backward's, ``ops/bwd_sm90.PDL``)
count the time they wait for the kernel before them, so their sum exceeds the call's time; set
``PDL`` off for a clean split. Providers by ``flashcore-bench``'s names (``fa4`` needs
FlashAttention-4 importable, ``flash_attn.cute``).
"""

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flashcore.bench.cases import Case, Shape, parse_window
from flashcore.bench.metrics import attention_flops
from flashcore.bench.providers import PROVIDERS

SHAPES = ["128,0,1024", "128,1,1024", "64,0,512", "64,1,512", "128,0,8192"]
CALLS = 10


def provider(name: str, case: Case):
    """The bench's provider ``name`` for ``case``, inside its backend context."""
    prov = PROVIDERS[name]
    fn = prov.prepare(case, torch.device("cuda"))

    def call(q, k, v):
        with prov.context():
            return fn(q, k, v)

    return call


def inputs(shape: tuple[int, ...]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """q, k, v (bf16, requiring grad) and an output gradient of ``shape``, on the GPU."""
    leaves = [
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    ]
    return leaves, torch.randn(shape, device="cuda", dtype=torch.bfloat16)


def device_times(grads, calls: int = CALLS) -> list[tuple[float, str]]:
    """(us per call, kernel name) of each kernel that ``grads()`` ran at least once a call, over
    ``calls`` profiled calls after three unprofiled ones."""
    for _ in range(3):
        grads()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            grads()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", 0)
        if total > 0 and event.count >= calls:
            rows.append((total / calls, event.key))
    return sorted(rows, reverse=True)


def kernel_times(fn, leaves, dout) -> list[tuple[float, str]]:
    """(us per backward, kernel name) of each kernel that ran at least once a backward."""
    out = fn(*leaves)
    return device_times(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--providers", default="flashcore,fa4,sdpa-cudnn", help="bench names")
    parser.add_argument("--shape", action="append", help="D,CAUSAL,S (CAUSAL 0 or 1)")
    parser.add_argument(
        "--window", type=parse_window, help="LEFT,RIGHT: every shape with this local window"
    )
    args = parser.parse_args()
    for spec in args.shape or SHAPES:
        head_dim, causal, seqlen = (int(x) for x in spec.split(","))
        batch, heads = 16384 // seqlen, 2048 // head_dim
        torch.manual_seed(0)
        leaves, dout = inputs((batch, heads, seqlen, head_dim))
        for name in args.providers.split(","):
            case = Case(
                Shape(batch, heads, seqlen, head_dim, heads, seqlen, head_dim),
                bool(causal),
                window=args.window,
            )
            flops = attention_flops(case, "bwd")
            rows = kernel_times(provider(name, case), leaves, dout)
            total = sum(t for t, _ in rows)
            print(f"{case.label} {name}: {total:.1f} us ({flops / total / 1e6:.0f} TFLOP/s)")
            for t, key in rows[:8]:
                print(f"    {t:9.1f} us  {key[:90]}")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
