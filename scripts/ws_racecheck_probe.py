"""Device-side: compute-sanitizer racecheck on the smallest Gluon warp-specialized kernel.

A default partition (4 warps) and one worker partition (1 warp) that each store one number to
global memory and touch no shared memory of their own: the only shared memory it uses is the
per-warp partition state that Triton's lowering of ``gl.warp_specialize`` writes from the default
warps and the worker warps read after named barrier 1. ``scripts/sanitize.sh racecheck`` with
``--tier sm90`` reports its hazards in both Hopper kernels on exactly those bytes; this probe has
the same handshake and got none (H100, compute-sanitizer 2025.3.1: 0 hazards), so the handshake
alone does not produce them (docs/maintainers.md, the sanitizer section).

    compute-sanitizer --tool racecheck --racecheck-report all python scripts/ws_racecheck_probe.py
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _default(out):
    gl.store(out + gl.program_id(0) * 2, 1.0)


@gluon.jit
def _worker(out):
    gl.store(out + gl.program_id(0) * 2 + 1, 2.0)


@gluon.jit
def ws_probe_kernel(out):
    gl.warp_specialize([(_default, (out,)), (_worker, (out,))], [1], [24])


def main() -> None:
    grid = 8
    out = torch.zeros(grid * 2, device="cuda")
    ws_probe_kernel[(grid,)](out, num_warps=4)
    torch.cuda.synchronize()
    want = torch.tensor([1.0, 2.0] * grid)
    print("ws_probe:", "right" if torch.equal(out.cpu(), want) else f"WRONG {out.tolist()}")


if __name__ == "__main__":
    main()
