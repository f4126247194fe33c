"""Device-side: eager host cost with ``ops.launch.TensorMaps`` (tensor maps kept per tensor) on
and off, in one process, rounds alternated.

Usage: PYTHONPATH=src python scripts/tensor_maps_ab.py

"off" swaps every compiled launcher entry's ``TensorMaps`` for the plain direct launch (the same
compiled kernels, each descriptor encoded by Triton's wrapper on every launch); "on" puts them
back. Printed: the Hopper backward's launcher alone, then eager forward (no grad) and forward +
``.backward()`` per call at host-bound shapes, with SDPA's forward + backward in the same loops
and whether out, dq, dk, dv came out identical both ways (dq may not: the Hopper backward
reduce-adds it in a run-to-run order). docs/performance_host.md holds the results.
"""

from __future__ import annotations

import functools
import gc
import statistics

import torch
import torch.nn.functional as F
from hopper_host import per_call  # scripts/: wall time per call of a loop, one synchronise

import flashcore
from flashcore.ops import bwd_sm90, fwd, launch

_kept: dict = {}


def set_kept_maps(on: bool) -> None:
    for launcher in (o for o in gc.get_objects() if isinstance(o, launch.Launcher)):
        for key, (kernel, constexprs, direct) in list(launcher.compiled.items()):
            if type(direct) is launch.TensorMaps:
                _kept[(id(launcher), key)] = direct
                if not on:
                    launcher.compiled[key] = (kernel, constexprs, True)
            elif on and (id(launcher), key) in _kept:
                launcher.compiled[key] = (kernel, constexprs, _kept[(id(launcher), key)])


def alternated(fns: dict, rounds: int, calls: int) -> dict:
    """Medians per (name, on) over ``rounds`` rounds, the order of off/on swapped each round."""
    times = {(name, on): [] for name in fns for on in (False, True)}
    for r in range(rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            set_kept_maps(on)
            for name, fn in fns.items():
                times[(name, on)].append(per_call(fn, calls))
    return {k: statistics.median(v) for k, v in times.items()}


def launcher_alone() -> None:
    shape = (1, 2, 128, 128)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = fwd.launch(q, k, v, True, 0.088)[:2]
    call = functools.partial(bwd_sm90.attn_bwd_sm90, dout, q, k, v, out, lse, True, 0.088)
    call()
    med = alternated({"bwd": call}, rounds=8, calls=1000)
    print(f"bwd_sm90.attn_bwd_sm90 alone {shape} causal: off {med[('bwd', False)]:.1f} us, "
          f"on {med[('bwd', True)]:.1f} us")  # fmt: skip


def eager(b, h, s, d, hkv, causal, tier) -> None:
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    dout = torch.randn_like(q)

    def forward():
        with torch.no_grad():
            flashcore.attention(q, k, v, causal=causal)

    def fwd_bwd():
        flashcore.attention(q, k, v, causal=causal).backward(dout)

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != h).backward(
            dout
        )

    with flashcore.use_tier(tier):
        fwd_bwd()
        forward()
        results = {}
        for on in (False, True):
            set_kept_maps(on)
            for t in (q, k, v):
                t.grad = None
            out = flashcore.attention(q, k, v, causal=causal)
            out.backward(dout)
            results[on] = (out.detach(), q.grad, k.grad, v.grad)
        same = [torch.equal(x, y) for x, y in zip(*results.values(), strict=True)]
        med = alternated({"fwd": forward, "fwd+bwd": fwd_bwd, "sdpa": sdpa}, rounds=6, calls=300)
    print(
        f"({b},{h},{s},{d}) on {hkv} kv heads, causal={causal}, tier {tier}: identical "
        f"(out, dq, dk, dv) {same}; forward off {med[('fwd', False)]:.1f} on "
        f"{med[('fwd', True)]:.1f} us; forward + backward off {med[('fwd+bwd', False)]:.1f} on "
        f"{med[('fwd+bwd', True)]:.1f} us; SDPA forward + backward {med[('sdpa', True)]:.1f} us",
        flush=True,
    )


def main() -> None:
    launcher_alone()
    for case in [
        (1, 4, 256, 128, 4, False, "sm90"),
        (1, 16, 256, 128, 4, True, "sm90"),
        (2, 8, 2048, 128, 8, False, "sm90"),
        (1, 16, 2048, 128, 16, True, "auto"),
    ]:
        eager(*case)


if __name__ == "__main__":
    main()
