"""Host cost per call of the Hopper launchers, backward and forward, on a tiny problem (the GPU
work is a few microseconds, so a loop of calls with one synchronisation measures the host).

    PYTHONPATH=src python scripts/hopper_host.py

"sm90" is ``bwd_sm90.attn_bwd_sm90`` through its ``Launcher``s, "sm90 binding" the same with
every launch through Triton's ``JITFunction`` (argument binding each call, as before the
launchers), "sm90 gluon descs" with Gluon's own ``TensorDescriptor`` built (and validated) for
every launch instead of the light ``ops.launch.Descriptor``, "portable" the two-kernel backward
(``deterministic=True``). Then the forward, and forward + ``.backward()``, through the public API
on each tier. ``--profile`` adds cProfile's top entries for the Hopper backward's launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import math
import pstats
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


def profiled(fn, calls: int, sort: str, lines: int) -> str:
    """cProfile's top ``lines`` entries (by ``sort``) over ``calls`` calls of ``fn``, the GPU
    synchronised before and after."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats(sort).print_stats(lines)
    return text.getvalue()


@contextlib.contextmanager
def gluon_descriptors():
    """Within the block the Hopper launchers build Gluon's validating ``TensorDescriptor``."""
    real = fwd_sm90.descriptor

    def full(t, block):
        return real(t, block).full()

    fwd_sm90.descriptor = bwd_sm90.descriptor = full
    try:
        yield
    finally:
        fwd_sm90.descriptor = bwd_sm90.descriptor = real


def fwd_bwd(attention, q, k, v, dout) -> None:
    """One forward and its backward into the leaves' ``.grad``."""
    attention(q, k, v).backward(dout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true")
    profile = parser.parse_args().profile
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
        with gluon_descriptors():
            times["sm90 gluon descs"] = per_call(sm90)
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
        with flashcore.use_tier("sm90"), gluon_descriptors():
            fwd_times["sm90 gluon descs"] = per_call(call)
        print(
            f"D={head_dim} forward: "
            + ", ".join(f"{n} {t:.1f} us/call" for n, t in fwd_times.items())
        )
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        ours = functools.partial(flashcore.attention, causal=True)
        both = {}
        for tier in ("sm90", "portable"):
            with flashcore.use_tier(tier):
                both[tier] = per_call(functools.partial(fwd_bwd, ours, qg, kg, vg, dout))
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, is_causal=True)
        both["sdpa"] = per_call(functools.partial(fwd_bwd, sdpa, qg, kg, vg, dout))
        print(
            f"D={head_dim} forward+backward: "
            + ", ".join(f"{n} {t:.1f} us/call" for n, t in both.items())
        )
        if profile:
            print(f"D={head_dim}: cProfile of 200 Hopper backward launches (cumulative)")
            print(profiled(sm90, 200, "cumulative", 25))


if __name__ == "__main__":
    main()
