"""Device-side: wall time per eager call of the public API at small shapes (host-bound there).

Usage: PYTHONPATH=<tree>/src python scripts/eager_cost.py   (run it for two trees to compare)

Each case runs 300 calls back to back with one synchronise at the end, after a warm-up; the
median of 5 such loops is printed in microseconds per call. Then gpt-oss's windowed layer
(causal (127, 0) window and sinks, 64 heads over 8 kv heads, D = 64), forward at 512 tokens and
decode from a 4k cache, each twice: as ``ops.express`` keys it (a window tuple, sinks of unit
stride) and on the full path (the same window as a list, which the key does not take), so the
two rows differ by the express path's saving.
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
    windowed()


def windowed() -> None:
    dt = torch.bfloat16
    q = torch.randn(1, 64, 512, 64, device="cuda", dtype=dt)
    k, v = (torch.randn(1, 8, 512, 64, device="cuda", dtype=dt) for _ in "kv")
    sinks = torch.randn(64, device="cuda")
    cache_k, cache_v = (torch.randn(1, 8, 4096, 64, device="cuda", dtype=dt) for _ in "kv")
    q1 = torch.randn(1, 64, 1, 64, device="cuda", dtype=dt)
    lens = torch.full((1,), 4096, dtype=torch.int32, device="cuda")
    for name, window in (("keyed", (127, 0)), ("full path", [127, 0])):
        with torch.no_grad():
            fwd = per_call(functools.partial(
                flashcore.attention, q, k, v, causal=True, window=window, sinks=sinks
            ))  # fmt: skip
            dec = per_call(functools.partial(
                flashcore.attention_with_kvcache, q1, cache_k, cache_v, cache_seqlens=lens,
                window=window, sinks=sinks,
            ))  # fmt: skip
        print(f"gpt-oss window+sinks, {name}: fwd (1,64,512,64) {fwd:6.1f} us/call  "
              f"decode 4k {dec:6.1f} us/call")  # fmt: skip


if __name__ == "__main__":
    main()
