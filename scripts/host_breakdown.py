"""Device-side: where the host time of an eager forward + backward goes, layer by layer.

Usage: PYTHONPATH=src python scripts/host_breakdown.py [--calls N]

Each listed function is wrapped with a timer (about 0.3 us of overhead per wrapped call), then
``flashcore.attention(...).backward(dout)`` runs N times with one synchronise at the end, at
shapes whose kernels take far less than the host's time per call (so the launch queue never
fills and the loop runs at the host's pace). Printed per call: the forward (``attention``
returning), the backward (``.backward`` returning), and the time inside each wrapped layer
(inclusive of what it calls); "engine" is the backward's time outside FlashCore's own backward.
A ``torch.autograd.Function`` that only allocates its outputs and SDPA run the same loop for
scale. docs/performance_host.md holds the results.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

import flashcore
from flashcore.ops import bwd, bwd_sm90, fwd, fwd_sm90, launch, registry

SPENT: dict[str, float] = defaultdict(float)


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t0

    return wrapper


def instrument() -> None:
    registry._attn_fwd = timed("registry._attn_fwd", registry._attn_fwd)
    registry._attn_bwd = timed("registry._attn_bwd", registry._attn_bwd)
    # The eager path's autograd Function saves through _save and runs _direct_backward (the
    # registered op's _setup_context and _backward serve torch.compile and dispatch modes).
    registry._save = timed("registry._save", registry._save)
    registry._direct_backward = timed("registry._direct_backward", registry._direct_backward)
    fwd.launch = timed("fwd.launch", fwd.launch)
    bwd.launch = timed("bwd.launch", bwd.launch)
    fwd_sm90.attn_fwd_sm90 = timed("fwd_sm90.attn_fwd_sm90", fwd_sm90.attn_fwd_sm90)
    bwd_sm90.attn_bwd_sm90 = timed("bwd_sm90.attn_bwd_sm90", bwd_sm90.attn_bwd_sm90)
    call = launch.Launcher.__call__

    def launcher_call(self, grid, args, meta):
        t0 = time.perf_counter()
        try:
            return call(self, grid, args, meta)
        finally:
            SPENT["Launcher: " + getattr(self.fn, "__name__", "?")] += time.perf_counter() - t0

    launch.Launcher.__call__ = launcher_call


class Alloc(torch.autograd.Function):
    """A Function with attention's signature that only allocates (the autograd floor)."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def loop(step, calls: int) -> tuple[float, float]:
    """Per-call host microseconds of ``step``'s forward and backward halves."""
    fwd_s = bwd_s = 0.0
    for _ in range(3):  # compiles and loads every kernel of both halves
        out, finish = step()
        finish(out)
    torch.cuda.synchronize()
    SPENT.clear()
    for _ in range(calls):
        t0 = time.perf_counter()
        out, finish = step()
        t1 = time.perf_counter()
        finish(out)
        t2 = time.perf_counter()
        fwd_s += t1 - t0
        bwd_s += t2 - t1
    torch.cuda.synchronize()
    return fwd_s / calls * 1e6, bwd_s / calls * 1e6


def run(shape, causal: bool, calls: int) -> None:
    b, h, s, d, hkv = shape
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    dout = torch.randn_like(q)

    def backward(out):
        out.backward(dout)

    def flash():
        return flashcore.attention(q, k, v, causal=causal), backward

    def alloc():
        return Alloc.apply(q, k, v)[0], backward

    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != h)
        return out, backward

    print(f"== (B, H, S, D, Hkv) = {shape}, causal={causal}, bf16, {calls} calls")
    for name, step in [("sdpa", sdpa), ("alloc-only Function", alloc)]:
        f, bw = loop(step, calls)
        print(f"{name:24s} forward {f:7.1f} us  backward {bw:7.1f} us  total {f + bw:7.1f}")
    for tier in ("portable", "sm90"):
        with flashcore.use_tier(tier):
            f, bw = loop(flash, calls)
        print(f"flashcore {tier:14s} forward {f:7.1f} us  backward {bw:7.1f} us  total", end="")
        print(f" {f + bw:7.1f}")
        ours = SPENT.get("registry._direct_backward", 0.0) / calls * 1e6
        print(f"    engine (backward outside registry._direct_backward): {bw - ours:7.1f} us")
        for name, spent in sorted(SPENT.items(), key=lambda kv: -kv[1]):
            print(f"    {name:34s} {spent / calls * 1e6:7.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    instrument()
    for shape, causal in [((1, 4, 256, 128, 4), False), ((1, 16, 256, 128, 4), True)]:
        run(shape, causal, args.calls)
    with torch.autograd.set_multithreading_enabled(False):
        print("-- torch.autograd.set_multithreading_enabled(False)")
        run((1, 4, 256, 128, 4), False, args.calls)


if __name__ == "__main__":
    main()
