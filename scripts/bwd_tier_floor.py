"""Device-side: the eager backward on each tier ("portable", "sm90", "auto") across problem
sizes, and a cProfile of each tier's backward at a small shape: where the Hopper backward's
heavier host path stops mattering (``tuning.SM90_BWD_MIN_FLOPS``, applied to
``tuning.sm90_backward_work``).

Usage: PYTHONPATH=src python scripts/bwd_tier_floor.py [time|profile|seed] [B,H,S,D,Hkv ...]

``time``: for each shape, causal and not, ``torch.autograd.grad`` of one forward per tier (bf16),
three rotated rounds of ``triton.testing.do_bench``, medians in us; "loop" is the wall time per
call of 200 back-to-back calls with one synchronise (the host's pace where it is the slower).
``profile``: 300 backward calls per tier at (1, 4, 256, 128) under cProfile, with the autograd
engine on the calling thread (``set_multithreading_enabled(False)``), the top 30 by own time.
``seed``: eager forward + backward (``attention`` then ``autograd.grad``) at the seed shapes, loops
of 200 calls with one synchronise, five rounds alternating the eager FLOP floor as it is and set
to 0 (the lengths alone decide), SDPA beside; medians in us.
docs/performance_backward.md ("The Hopper backward under auto") holds the results.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton
from hopper_host import per_call as loop  # scripts/: wall time per call, one synchronise
from hopper_host import profiled

import flashcore
from flashcore import tuning
from flashcore.ops import bwd
from flashcore.ops.bwd_sm90 import BLOCK_N, ROWS

TIERS = ("portable", "sm90", "auto")
SHAPES = [  # (B, H, S, D, Hkv)
    (1, 16, 1024, 128, 16), (2, 16, 1024, 128, 16), (1, 16, 2048, 128, 16),
    (2, 16, 2048, 128, 16), (4, 16, 2048, 128, 16), (1, 32, 4096, 128, 8),
    (2, 8, 2048, 64, 8), (4, 16, 2048, 64, 16), (8, 16, 2048, 64, 16),
    (1, 32, 1024, 64, 32), (4, 32, 1024, 64, 32),
]  # fmt: skip


def backward(shape: tuple, causal: bool, tier: str):
    """A function running the backward of one forward on ``tier`` (the graph kept)."""
    b, h, s, d, hkv = shape
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    with flashcore.use_tier(tier):
        out = flashcore.attention(q, k, v, causal=causal)
    dout = torch.randn_like(out)

    def run():
        with flashcore.use_tier(tier):
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    return run


def timing(shapes: list[tuple]) -> None:
    for shape in shapes:
        for causal in (False, True):
            b, h, s, d, hkv = shape
            flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
            work = tuning.sm90_backward_work(b, h, hkv, s, s, d, causal, ROWS, BLOCK_N)
            runs = {t: backward(shape, causal, t) for t in TIERS}
            times: dict[str, list[float]] = {t: [] for t in TIERS}
            for r in range(3):
                for t in TIERS[r:] + TIERS[:r]:
                    times[t].append(triton.testing.do_bench(runs[t], warmup=25, rep=100) * 1e3)
            med = {t: sorted(ts)[1] for t, ts in times.items()}
            walls = {t: loop(runs[t], 200) for t in TIERS}
            cells = " | ".join(f"{t} {med[t]:7.1f} us (loop {walls[t]:6.1f})" for t in TIERS)
            print(
                f"{shape!s:28s} causal={int(causal)} fwdflops={flops:.2e} work={work:.2e} | "
                f"{cells} | "
                f"sm90/portable {med['sm90'] / med['portable']:.2f}",
                flush=True,
            )


def profile() -> None:
    torch.autograd.set_multithreading_enabled(False)
    for tier in TIERS[:2]:
        run = backward((1, 4, 256, 128, 4), False, tier)
        for _ in range(20):
            run()
        stats = profiled(run, 300, "tottime", 30)
        print(f"===== {tier}: {loop(run, 300):.1f} us a call (unprofiled)")
        print(stats)


def seed_step(shape: tuple, causal: bool, provider: str):
    """One eager forward + backward at ``shape``: FlashCore's, or SDPA's (``provider`` "sdpa")."""
    q, k, v = (
        torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dout = torch.randn_like(q)

    def run():
        if provider == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            out = flashcore.attention(q, k, v, causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)

    return run


def seed() -> None:
    shapes = [((1, 8, 512, 64), False), ((1, 8, 512, 64), True), ((2, 8, 2048, 64), False)]
    shapes += [((2, 8, 2048, 64), True), ((2, 8, 2048, 128), False)]
    floor = tuning.SM90_BWD_MIN_FLOPS
    for shape, causal in shapes:
        runs = {name: seed_step(shape, causal, name) for name in ("floor", "nofloor", "sdpa")}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(5):
            for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
                tuning.SM90_BWD_MIN_FLOPS = 0.0 if name == "nofloor" else floor
                bwd._SM90.clear()  # the choice is kept per signature
                times[name].append(loop(runs[name], 200))
        tuning.SM90_BWD_MIN_FLOPS = floor
        cells = " | ".join(
            f"{n} {sorted(ts)[2]:.1f} [{min(ts):.0f}-{max(ts):.0f}]" for n, ts in times.items()
        )
        print(f"{shape} causal={int(causal)} us per forward + backward: {cells}", flush=True)


if __name__ == "__main__":
    mode = (sys.argv[1:] or ["time"])[0]
    picked = [tuple(map(int, a.split(","))) for a in sys.argv[2:]]
    if mode == "time":
        timing(picked or SHAPES)
    elif mode == "seed":
        seed()
    else:
        profile()
