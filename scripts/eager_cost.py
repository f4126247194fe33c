"""Device-side: wall time per eager call of the public API at small shapes (host-bound there).

Usage: PYTHONPATH=<tree>/src python scripts/eager_cost.py   (run it for two trees to compare)

Each case runs 300 calls back to back with one synchronise at the end, after a warm-up; the
median of 5 such loops is printed in microseconds per call.
"""

import functools
import statistics
import time

import torch

import flashcore


def per_call(fn, n=300, loops=5):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def main() -> None:
    dt = torch.bfloat16
    for shape, causal in (((1, 8, 512, 64), False), ((1, 8, 512, 64), True)):
        q, k, v = (torch.randn(shape, device="cuda", dtype=dt, requires_grad=True) for _ in "qkv")
        do = torch.randn_like(q)
        with torch.no_grad():
            fwd = per_call(functools.partial(flashcore.attention, q, k, v, causal=causal))

        def fwdbwd(q=q, k=k, v=v, do=do, causal=causal):
            out = flashcore.attention(q, k, v, causal=causal)
            torch.autograd.grad(out, (q, k, v), do)

        both = per_call(fwdbwd)
        print(f"{shape} causal={causal}: fwd {fwd:6.1f} us/call  fwd+bwd {both:6.1f} us/call")


if __name__ == "__main__":
    main()
