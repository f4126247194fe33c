"""Device-side: the dK/dV and dQ kernels' configs timed one kernel at a time.

The two kernels are independent launches, so the fastest pair is the fastest dK/dV config with the
fastest dQ config. For each shape this times, with ``do_bench`` medians:

- ``ops.bwd.launch`` with the dQ launch left out, for each dK/dV candidate
  (``block_m1, block_n1, warps, stages``);
- the same with the dK/dV launch left out, for each dQ candidate (``block_m2, block_n2, warps,
  stages``);
- the default config, the best pair and SDPA's backward (``torch.autograd.grad``), whole.

Every candidate's full gradients are checked against SDPA's first (relative max error); a
candidate that fails to compile (shared memory) is listed as such. Registers and local memory
(spills) per thread come from the driver through the compiled kernels: ``255r/64B`` is 255
registers and 64 bytes of local memory (Triton's ``n_spills`` counts 4-byte words).

Usage: python scripts/bwd_kernel_sweep.py [--shape B,H,S,D[:Dv] ...] [--causal on|off|both]
       [--compile-only [--part I/N]]
``--compile-only`` runs each candidate once: several such processes in parallel (``--part``
splits the candidates) fill Triton's cache before the timed run (one process, alone on the GPU).
"""

from __future__ import annotations

import argparse

import torch
from bwd_sweep import problems, tflops  # scripts/ is on sys.path when run as a script
from triton.testing import do_bench

from flashcore.ops import bwd as bwd_mod
from flashcore.ops.fwd import launch as attn_fwd
from flashcore.tuning import BwdConfig, bwd_config

# (block_m1, block_n1, num_warps, num_stages) and (block_m2, block_n2, num_warps, num_stages).
DKDV = {
    128: [
        (64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 3), (64, 64, 8, 2),
        (64, 64, 8, 3), (32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 2), (16, 128, 8, 3),
        (16, 64, 4, 3),
    ],
    256: [
        (16, 64, 8, 2), (32, 64, 8, 2), (16, 64, 4, 2), (32, 64, 8, 1), (16, 32, 4, 2),
        (64, 64, 8, 1), (32, 32, 4, 2),
    ],
}  # fmt: skip
DQ = {
    128: [
        (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2),
        (128, 64, 8, 3), (128, 32, 8, 3), (64, 128, 4, 2), (128, 128, 8, 2), (64, 64, 8, 2),
    ],
    256: [
        (64, 32, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2),
        (32, 32, 4, 2), (64, 32, 8, 1),
    ],
}  # fmt: skip
# MLA head dims (Q/K 192 padded to 256 in the kernels, V 128): the D=256 lists' accumulators are
# a third smaller here (dV and dO 128 wide), so larger key/query tiles may fit.
DKDV["mla"] = DKDV[256] + [
    (16, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 8, 2),
]  # fmt: skip
DQ["mla"] = DQ[256] + [(128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 8, 2)]
# ... and with Q and K in 128 + 64 column panels (``ops/bwd.py: d_panels``), whose smaller tiles
# leave room for a third stage: these lists where the panels apply.
DKDV["panels"] = [
    (32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3),
    (64, 64, 8, 3), (64, 128, 8, 2), (32, 64, 8, 3), (16, 64, 4, 3), (64, 64, 4, 2),
]  # fmt: skip
DQ["panels"] = [
    (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 64, 8, 3), (128, 32, 8, 3),
    (64, 128, 8, 2), (64, 32, 4, 3), (128, 32, 8, 4), (64, 64, 4, 4),
]  # fmt: skip


def noop(*args, **kwargs) -> None:
    pass


def only(kernel: str):
    """``ops.bwd.kernels()`` with one of the two launches replaced by nothing. Without the dQ
    launch delta is left unwritten (its values do not change the dK/dV kernel's time); the dQ
    launch includes writing delta."""
    dq, dkdv = bwd_mod.kernels()
    return (dq, noop) if kernel == "dq" else (noop, dkdv)


def resources(cfg: BwdConfig) -> str:
    """Registers/local memory of the dK/dV and dQ kernels last compiled for ``cfg``."""
    out = []
    dq, dkdv = bwd_mod.kernels()
    wanted = (
        (dkdv, (cfg.block_m1, cfg.block_n1), (cfg.num_warps, cfg.num_stages)),
        (dq, (cfg.block_m2, cfg.block_n2), (cfg.dq_warps, cfg.dq_stages)),
    )
    for launcher, blocks, options in wanted:
        # Newest first: the entry of the shape just run.
        # Entries are (compiled kernel, constexprs in parameter order, direct launch).
        for kernel, consts, _ in reversed(launcher.compiled.values()):
            names = launcher.fn.arg_names[len(launcher.fn.arg_names) - len(consts) :]
            meta = dict(zip(names, consts, strict=True))
            shape = (meta.get("BLOCK_M"), meta.get("BLOCK_N"))
            if (
                shape == blocks
                and (kernel.metadata.num_warps, kernel.metadata.num_stages) == options
            ):
                out.append(f"{kernel.n_regs}r/{4 * kernel.n_spills}B")
                break
    return " ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", default=[])
    ap.add_argument("--causal", choices=["on", "off", "both"], default="both")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--part", default="0/1", help="I/N: only every N-th candidate from the I-th")
    args = ap.parse_args()
    part, parts = map(int, args.part.split("/"))
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for (b, h, s, d), causal, (q, k, v, do, out) in problems(args, [(4, 16, 4096, 128)]):
        scale = d**-0.5
        ref = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

        def sdpa_bwd(out=out, q=q, k=k, v=v, do=do):
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

        ms_sdpa = 0.0 if args.compile_only else do_bench(sdpa_bwd, return_mode="median")
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        o, lse = attn_fwd(qd, kd, vd, causal, scale)
        dv = v.shape[-1]
        panels = bool(bwd_mod.d_panels(d, q.dtype)[1])
        default = bwd_config(
            max(d, dv), 2, interpreted=False, causal=causal, seqlen_q=s,
            head_dim_v=dv if dv != d else None, panels=panels,
        )  # fmt: skip
        group = "panels" if panels else "mla" if dv != d else 128 if d <= 128 else 256
        dk_list, dq_list = DKDV[group], DQ[group]

        def run(cfg, o=o, lse=lse, do=do, qd=qd, kd=kd, vd=vd, causal=causal, scale=scale):
            return bwd_mod.launch(do, qd, kd, vd, o, lse, None, causal, scale, config=cfg)

        def check(cfg, ref=ref):
            grads = run(cfg)
            return max(
                ((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
                for g, r in zip(grads[:3], ref, strict=True)
            )

        def timed(cfg, kernel=None):
            saved = bwd_mod.kernels
            if kernel is not None:
                patched = only(kernel)
                bwd_mod.kernels = lambda: patched
            try:
                return do_bench(lambda: run(cfg), return_mode="median")
            finally:
                bwd_mod.kernels = saved

        tag = f"B{b} H{h} S{s} D{d}{f':{dv}' if dv != d else ''} causal={causal}"
        results = {"dkdv": [], "dq": []}
        cands = [("dkdv", c) for c in dk_list] + [("dq", c) for c in dq_list]
        for kernel, (m, n, w, st) in cands[part::parts]:
            if kernel == "dkdv":
                cfg = BwdConfig(
                    m, n, default.block_m2, default.block_n2, w, st,
                    default.dq_warps, default.dq_stages,
                )  # fmt: skip
            else:
                cfg = BwdConfig(
                    default.block_m1, default.block_n1, m, n,
                    default.num_warps, default.num_stages, w, st,
                )  # fmt: skip
            try:
                err = check(cfg)
                if args.compile_only:
                    continue
                ms = timed(cfg, kernel)
            except Exception as e:  # out of shared memory etc.
                ms, note = float("inf"), f"{type(e).__name__}: {str(e)[:80]}"
            else:
                try:
                    note = f"err {err:.1e} {resources(cfg)}"
                except Exception as e:  # the launcher's cache changed shape: time still counts
                    note = f"err {err:.1e} resources: {type(e).__name__}"
            results[kernel].append((ms, (m, n, w, st), note))
        if args.compile_only:
            print(tag, "compiled", flush=True)
            continue
        sdpa_tf = tflops(b, h, s, d, causal, ms_sdpa, dv)
        print(f"{tag}: sdpa bwd {ms_sdpa:.3f} ms {sdpa_tf:.0f} TF/s")
        best = {}
        for kernel in ("dkdv", "dq"):
            rows = sorted(results[kernel])
            best[kernel] = rows[0][1]
            for ms, c, note in rows:
                print(f"  {kernel:4s} {c[0]}x{c[1]} w{c[2]} s{c[3]}: {ms:.3f} ms (+pre)  {note}")
        (m1, n1, w1, s1), (m2, n2, w2, s2) = best["dkdv"], best["dq"]
        pair = BwdConfig(m1, n1, m2, n2, w1, s1, w2, s2)
        for name, cfg in (("default", default), ("best pair", pair)):
            ms = timed(cfg)
            print(
                f"  {name}: {cfg}: {ms:.3f} ms {tflops(b, h, s, d, causal, ms, dv):.0f} TF/s "
                f"({ms_sdpa / ms:.2f}x sdpa) err {check(cfg):.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
