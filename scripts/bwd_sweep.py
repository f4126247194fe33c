"""Device-side: backward configs and SDPA's backward side by side (medians of do_bench).

Times the two backward kernels (``ops.bwd.launch``: dQ with delta, then dK/dV) for each
candidate ``BwdConfig`` against ``out.backward`` through PyTorch's SDPA on the same inputs. Each
config's gradients are checked against SDPA's before it is timed.

Usage: python scripts/bwd_sweep.py [--quick] [--causal on|off|both] [--compile-only]
       [--shape B,H,S,D ...]
``--compile-only`` runs each config once without timing: several such processes in parallel fill
Triton's cache, so the timed run (one process, alone on the GPU) does not wait on compiles.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from flashcore.ops.bwd import launch as attn_bwd
from flashcore.ops.fwd import launch as attn_fwd
from flashcore.tuning import BwdConfig, bwd_config

CANDIDATES = [
    BwdConfig(*c)
    for c in [
        (16, 64, 128, 32, 8, 2),
        (32, 128, 128, 64, 8, 3),
        (32, 128, 128, 32, 4, 5),
        (32, 128, 128, 32, 8, 3),
        (64, 128, 128, 64, 8, 2),
        (64, 128, 128, 32, 8, 2),
        (32, 64, 64, 32, 4, 3),
        (64, 64, 64, 64, 4, 2),
        (32, 128, 64, 32, 4, 3),
        (64, 128, 64, 64, 8, 2),
    ]
]


def tflops(b, h, s, d, causal, ms, dv=None):
    """Backward TFLOP/s: ``2 B H S^2 (3 D + 2 Dv)`` (2.5x the forward's ``4 B H S^2 D`` when
    ``Dv == D``), halved when causal."""
    dv = d if dv is None else dv
    return 2 * b * h * s * s * (3 * d + 2 * dv) / (2 if causal else 1) / ms / 1e9


def problems(args: argparse.Namespace, default_shapes: list[tuple[int, ...]]):
    """For each ``--shape`` (or default) and ``--causal`` choice: ``(shape, causal, (q, k, v,
    do, out))`` with fp16 leaves that need gradients and SDPA's output on them."""
    # B,H,S,D or B,H,S,D:Dv (v and the output with their own head dim, as MLA's 192:128).
    shapes = [tuple(s.split(",")) for s in args.shape] or default_shapes
    causals = {"on": (True,), "off": (False,), "both": (False, True)}[args.causal]
    for shape, causal in itertools.product(shapes, causals):
        b, h, s = map(int, shape[:3])
        d, _, dv = str(shape[3]).partition(":")
        d = int(d)
        dv = int(dv) if dv else d
        q, k = (
            torch.randn(b, h, s, d, device="cuda", dtype=torch.float16, requires_grad=True)
            for _ in range(2)
        )
        v = torch.randn(b, h, s, dv, device="cuda", dtype=torch.float16, requires_grad=True)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        do = torch.randn_like(out)
        yield (b, h, s, d), causal, (q, k, v, do, out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", action="append", default=[])
    ap.add_argument("--causal", choices=["on", "off", "both"], default="both")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    default_shapes = [(4, 16, 4096, 128), (4, 32, 4096, 64)]
    for (b, h, s, d), causal, (q, k, v, do, out) in problems(args, default_shapes):
        scale = d**-0.5
        ms_sdpa = do_bench(
            functools.partial(out.backward, do, retain_graph=True), return_mode="median"
        )
        ref = torch.autograd.grad(out, (q, k, v), do)
        o, lse = attn_fwd(q.detach(), k.detach(), v.detach(), causal, scale)
        default = bwd_config(d, 2, interpreted=False)
        rows = []
        for cfg in [default] if args.quick else dict.fromkeys([default, *CANDIDATES]):
            try:
                grads = attn_bwd(do, q, k, v, o, lse, None, causal, scale, config=cfg)
                if args.compile_only:
                    continue
                err = max(
                    ((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
                    for g, r in zip(grads[:3], ref, strict=True)
                )
                run = functools.partial(
                    attn_bwd, do, q, k, v, o, lse, None, causal, scale, config=cfg
                )
                ms = do_bench(run, return_mode="median")
            except Exception as e:  # out of shared memory etc.
                rows.append((float("inf"), cfg, type(e).__name__))
                continue
            rows.append((ms, cfg, f"rel err vs sdpa {err:.1e}"))
        if args.compile_only:
            continue
        rows.sort(key=lambda r: r[0])
        print_resources()
        tag = f"B{b} H{h} S{s} D{d} causal={causal}"
        print(f"{tag}: sdpa bwd {ms_sdpa:.3f} ms {tflops(b, h, s, d, causal, ms_sdpa):.0f} TF/s")
        for ms, cfg, note in rows[:6] + [r for r in rows[6:] if r[1] == default]:
            mark = "*" if cfg == default else " "
            print(
                f"  {mark}{cfg.block_m1}x{cfg.block_n1}/{cfg.block_m2}x{cfg.block_n2} "
                f"w{cfg.num_warps} s{cfg.num_stages}: "
                f"{ms:.3f} ms "
                f"{tflops(b, h, s, d, causal, ms):.0f} TF/s ({ms_sdpa / ms:.2f}x sdpa) {note}"
            )


def print_resources() -> None:
    """Registers and local memory (spills) per thread of every dK/dV and dQ kernel compiled so far,
    as the driver reports them (Triton's ``n_spills`` is the local memory in 4-byte words)."""
    from flashcore.ops.bwd import kernels

    for launcher in kernels():
        for key, (kernel, _) in launcher.compiled.items():
            # key[2]: the constexprs in parameter order, then num_warps and num_stages.
            name, regs, local = launcher.fn.__name__, kernel.n_regs, 4 * kernel.n_spills
            print(f"    {name} {key[2]}: {regs} regs, {local} B local memory")
    for launcher in kernels():
        launcher.compiled.clear()


if __name__ == "__main__":
    main()
