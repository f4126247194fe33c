"""Device-side: host cost per call of each layer of a flashcore call, and a cProfile of 200 calls.

Usage: PYTHONPATH=src python scripts/host_overhead.py

Each layer runs 400 times back to back with one synchronise at the end; at these shapes the host,
not the GPU, sets the pace, so the per-call wall time is the host cost (docs/performance_host.md).
"""

import cProfile
import io
import math
import pstats
import time

import torch
import torch.nn.functional as F

import flashcore
from flashcore.ops import bwd as bwd_mod
from flashcore.ops import fwd as fwd_mod
from flashcore.ops import problem
from flashcore.ops import registry as ops

dev = "cuda"
N = 400


def per_call(fn, n=N):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def report(name, fn):
    host, total = per_call(fn)
    print(f"{name:40s} host {host:7.1f} us/call   incl. drain {total:7.1f}")


def profile_shape(shape: tuple[int, int, int, int], dt: torch.dtype) -> None:
    print("==", shape, dt)
    q, k, v = (torch.randn(shape, device=dev, dtype=dt) for _ in range(3))
    scale = 1 / math.sqrt(shape[-1])
    report("sdpa", lambda: F.scaled_dot_product_attention(q, k, v))
    report("flashcore.attention", lambda: flashcore.attention(q, k, v))
    dense = (None, None, 0, 0)
    report(
        "ops.attn_fwd (custom op)",
        lambda: ops.attn_fwd(q, k, v, *dense, False, scale, -1, -1, 0.0, None),
    )
    report("fwd.launch (launcher)", lambda: fwd_mod.launch(q, k, v, False, scale))
    report(
        "ops.attention (direct)",
        lambda: ops.attention(q, k, v, *dense, False, scale, -1, -1, 0.0, None),
    )
    report("4x TensorDescriptor()", lambda: [problem.descriptor(t, 128, 64) for t in (q, k, v, q)])
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)

    def fb_fc():
        flashcore.attention(qg, kg, vg).backward(do)

    def fb_sdpa():
        F.scaled_dot_product_attention(qg, kg, vg).backward(do)

    report("sdpa fwd+bwd", fb_sdpa)
    report("flashcore fwd+bwd", fb_fc)
    out, lse = fwd_mod.launch(q, k, v, False, scale)
    report(
        "bwd.launch (launcher)",
        lambda: bwd_mod.launch(do, q, k, v, out, lse, None, False, scale),
    )
    report("torch.empty_like x4", lambda: [torch.empty_like(t) for t in (q, k, v, lse)])

    for name, fn in [
        ("flashcore.attention", lambda: flashcore.attention(q, k, v)),
        ("fwd+bwd", fb_fc),
    ]:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        for order in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(order).print_stats(30)
            print("---- cProfile", name, "(200 calls), by", order)
            print("\n".join(s.getvalue().splitlines()[:50]))


if __name__ == "__main__":
    for shape in [(1, 8, 512, 64), (2, 8, 2048, 128)]:
        profile_shape(shape, torch.float16)
