"""Throughput, SM clock and board power of one kernel run back to back for a few seconds, beside
``triton.testing.do_bench``'s median of the same call (H100 machine; nvidia-smi sampled every
100 ms, the first quarter of the samples dropped while the clock settles).

    PYTHONPATH=src python scripts/sustained_rate.py [--seconds 3]

Providers: cuBLAS (bf16 8192^3 ``torch.mm``), the Hopper forward (``use_tier("sm90")``), cuDNN's
SDPA, and FlashAttention-4 where ``flash_attn.cute`` imports; D = 128, non-causal, (1, 16, 16384)
bf16. "of peak at that clock": TFLOP/s over 132 SMs x 4096 dense bf16 FLOP per clock at the
sampled SM clock. A board held at its power limit lowers the clock: do_bench's short windows
(about 100 ms, with an L2 flush between calls) see more of the boost clock than a sustained load
does, and not alike for every kernel (docs/performance.md, "Power, clocks and the two ways of
timing").
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
    args = parser.parse_args()
    shape = (1, 16, 16384, 128)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    attn_flops = 4.0 * 16 * 16384 * 16384 * 128
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def ours():
        with flashcore.use_tier("sm90"):
            flashcore.attention(q, k, v)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v)

    cases = [("cublas 8192^3", lambda: torch.mm(a, b), 2.0 * 8192**3)]
    cases += [("flashcore sm90", ours, attn_flops), ("cudnn", cudnn, attn_flops)]
    try:
        from flash_attn.cute import flash_attn_func

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        cases.append(("fa4", lambda: flash_attn_func(qt, kt, vt, causal=False), attn_flops))
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
