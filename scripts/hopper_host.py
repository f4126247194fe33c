"""Host cost per call of the Hopper launchers, backward and forward, on a tiny problem (the GPU
work is a few microseconds, so a loop of calls with one synchronisation measures the host).

    PYTHONPATH=src python scripts/hopper_host.py

"sm90" is ``bwd_sm90.attn_bwd_sm90`` through its ``Launcher``s, "sm90 binding" the same with
every launch through Triton's ``JITFunction`` (argument binding each call, as before the
launchers), "portable" the two-kernel backward (``deterministic=True``).
"""

from __future__ import annotations

import functools
import math
import time

import torch

import flashcore
from flashcore.ops import bwd, bwd_sm90, fwd, fwd_sm90


def per_call(fn, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    for head_dim in (64, 128):
        shape = (1, 2, 128, head_dim)
        q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        scale = 1.0 / math.sqrt(head_dim)
        out, lse = fwd.launch(q, k, v, True, scale)[:2]
        args = (dout, q, k, v, out, lse)
        sm90 = functools.partial(bwd_sm90.attn_bwd_sm90, *args, True, scale)
        portable = functools.partial(bwd.launch, *args, None, True, scale, deterministic=True)
        times = {"sm90": per_call(sm90)}
        for launcher in bwd_sm90.kernels():
            launcher.interpreted = True  # Triton's own launch path every call
        times["sm90 binding"] = per_call(sm90)
        for launcher in bwd_sm90.kernels():
            launcher.interpreted = False
        times["portable"] = per_call(portable)
        print(f"D={head_dim}: " + ", ".join(f"{n} {t:.1f} us/call" for n, t in times.items()))
        # The forward through the public API (attention's whole host path) on each tier.
        fwd_times = {}
        call = functools.partial(flashcore.attention, q, k, v, causal=True)
        for tier in ("sm90", "portable"):
            with flashcore.use_tier(tier):
                fwd_times[tier] = per_call(call)
        fwd_sm90.launcher().interpreted = True
        with flashcore.use_tier("sm90"):
            fwd_times["sm90 binding"] = per_call(call)
        fwd_sm90.launcher().interpreted = False
        print(
            f"D={head_dim} forward: "
            + ", ".join(f"{n} {t:.1f} us/call" for n, t in fwd_times.items())
        )


if __name__ == "__main__":
    main()
