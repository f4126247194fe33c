"""Throughput, SM clock and board power of one kernel run back to back for a few seconds, beside
``triton.testing.do_bench``'s median of the same call (H100 machine; nvidia-smi sampled every
100 ms, the first quarter of the samples dropped while the clock settles).

    PYTHONPATH=src python scripts/sustained_rate.py [--seconds 3] [--mode fwd|bwd]
        [--shape B,H,S,D] [--causal]

Providers: cuBLAS (bf16 8192^3 ``torch.mm``), the Hopper tier (``use_tier("sm90")``), cuDNN's
SDPA, and FlashAttention-4 where ``flash_attn.cute`` imports; bf16, by default D = 128,
non-causal, (1, 16, 16384). ``--mode bwd`` runs each provider's backward (``autograd.grad`` of
one kept forward; 2.5x the forward's FLOPs): at (2, 16, 8192, 128) ours held a higher clock
than FA4's under the 700 W cap and did 60% of peak a clock against FA4's 64.5% (H200;
docs/performance_backward.md, "The eager floor counts programs; clocks and power"). "of peak
at that clock": TFLOP/s over 132 SMs x 4096 dense bf16 FLOP per clock at the sampled SM clock. A
board held at its power limit lowers the clock: do_bench's short windows (about 100 ms, with an
L2 flush between calls) see more of the boost clock than a sustained load does, and not alike
for every kernel (docs/performance.md, "Power, clocks and the two ways of timing").
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashcore

PEAK_FLOP_PER_CLOCK = 132 * 4096  # H100 SXM, dense bf16


def sustained(fn, flops: float, seconds: float) -> tuple[float, float, float]:
    """(TFLOP/s, median SM clock in MHz, median board power in W) over ``seconds`` of calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    query = "--query-gpu=clocks.sm,power.draw"
    smi = subprocess.Popen(
        ["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE,
        text=True,
    )
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, calls = time.time(), 0
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [[float(x) for x in line.split(",")] for line in smi.communicate()[0].split("\n")[:-1]]
    rows = rows[len(rows) // 4 :]
    ms = start.elapsed_time(end) / calls
    clock, power = (statistics.median(r[i] for r in rows) for i in (0, 1))
    return flops / ms / 1e9, clock, power


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--mode", choices=["fwd", "bwd"], default="fwd")
    parser.add_argument("--shape", default="1,16,16384,128", help="B,H,S,D")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    batch, heads, seqlen, head_dim = (int(x) for x in args.shape.split(","))
    shape = (batch, heads, seqlen, head_dim)
    causal, backward = args.causal, args.mode == "bwd"
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
        for _ in range(3)
    )
    attn_flops = 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    attn_flops *= 2.5 if backward else 1.0
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def ours(q, k, v):
        with flashcore.use_tier("sm90"):
            return flashcore.attention(q, k, v, causal=causal)

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def timed(attn):
        """The call to time: the forward, or the backward of one kept forward."""
        if not backward:
            return lambda: attn(q, k, v)
        out = attn(q, k, v)
        dout = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    cases = [("cublas 8192^3", lambda: torch.mm(a, b), 2.0 * 8192**3)]
    cases += [("flashcore sm90", timed(ours), attn_flops), ("cudnn", timed(cudnn), attn_flops)]
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v):
            out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal)
            out = out[0] if isinstance(out, tuple) else out
            return out.transpose(1, 2)

        cases.append(("fa4", timed(fa4), attn_flops))
    except ImportError:
        print("fa4: flash_attn.cute does not import; skipped")
    for name, fn, flops in cases:
        rate, clock, power = sustained(fn, flops, args.seconds)
        share = rate * 1e12 / (PEAK_FLOP_PER_CLOCK * clock * 1e6)
        burst = flops / do_bench(fn, return_mode="median") / 1e9
        print(
            f"{name}: sustained {rate:.0f} TFLOP/s at {clock:.0f} MHz, {power:.0f} W "
            f"({share:.1%} of peak at that clock); do_bench {burst:.0f} TFLOP/s"
        )


if __name__ == "__main__":
    main()
