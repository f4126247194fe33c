"""Device-side: compute-sanitizer racecheck on the smallest Gluon warp-specialized kernels.

``scripts/sanitize.sh racecheck`` with ``--tier sm90`` reports RAW hazards in both Hopper kernels on
the partition state that Triton's lowering of ``gl.warp_specialize`` keeps in shared memory: the
default warps store a byte per worker warp (``STS.64``) and pass named barrier 1 (every thread of
the CTA); each worker warp passes barrier 1, loads its byte (``LDS.U8``) and branches to its
partition. The accesses are ordered by that barrier. This probe builds the handshake alone and
then with one feature of the real kernels at a time, to find which one racecheck reports:

- ``plain``: a default partition (4 warps) and one worker (1 warp); each stores one number to
  global memory and uses no shared memory of its own.
- ``regs``: the real kernels' partition shape: workers of 4 and 1 warps with 240 and 24
  registers (``setmaxnreg``; Triton pads the CTA to whole warpgroups, the padding warps idle).
- ``init``: ``plain`` with an mbarrier initialised by the default warps before
  ``gl.warp_specialize``, as every Hopper kernel here does (here Triton adds no barrier after it;
  in the real kernels barriers of the default warps alone, ``BAR.SYNC 0x0, 0x80``, sit between
  the initialisations while the worker warps wait at barrier 1).
- ``init-regs``: both.
- ``arrive``: ``init`` with the worker arriving on the mbarrier and the default partition waiting
  on it (a shared-memory handshake between partitions, as the kernels' pipelines do).
- ``thread-barrier``: ``plain`` with a ``gl.thread_barrier()`` inside the default partition
  (barrier 0 with 128 threads while the worker runs).
- ``init-sync``: ``init`` with a ``gl.thread_barrier()`` after the initialisation, before
  ``gl.warp_specialize``: barrier 0 with the default's 128 threads while the workers wait at
  barrier 1 before their first read of the state (the real kernels' SASS has such barriers there).
- ``pingpong``: ``regs`` with the forward's ping-pong turns between the two 4-warp partitions
  (``bar.arrive`` / ``bar.sync`` of named barrier 9 with 256 threads).
- ``default-bar5``: ``thread-barrier`` with the default partition's barrier taken as named
  barrier 5 with 128 threads (inline ``bar.sync 5, 128``) instead of barrier 0.
- ``worker-barrier``: ``regs`` with a ``gl.thread_barrier()`` in the 4-warp worker partition
  (Triton gives a worker partition its own barrier id, not 0).
- ``handoff``: data through shared memory ordered by mbarriers alone, as the MLA backward's
  producer hands its consumers the row statistics: the worker warp stores 64 floats
  (``st.shared``), ``bar.warp.sync`` and arrives on ``full``; the default partition waits on
  ``full``, loads them, and arrives on ``empty`` (after Triton's barrier of its 128 threads); the
  worker waits on ``empty`` and stores the next 64, which the default reads after ``full``'s
  second phase. A RAW and a WAR pair, each ordered by an mbarrier's release and acquire.
  Reported (the buffer's second store against both loads, past the default partition's barrier
  of its 128 threads): the MLA backward's reports on its row statistics are racecheck's
  (docs/maintainers.md).

    compute-sanitizer --tool racecheck --racecheck-report hazard \\
        python scripts/ws_racecheck_probe.py plain

With no argument every variant runs (each its own launch; racecheck reports them together).
``--sass`` prints each variant's partition-state accesses and barriers from its sm_90a SASS (no GPU
needed: Triton's ptxas and cuobjdump).

Found (H200, compute-sanitizer 2025.3.1; docs/maintainers.md, "What racecheck reports in the Gluon
kernels"): ``thread-barrier``, ``default-bar5``, ``arrive``, ``init-sync`` and ``handoff`` are
reported, the others run clean: racecheck reports the state once the default partition's warps
pass a barrier of their own 128 threads, though a barrier of the whole CTA orders every access to
it, and from then on also data handed over through mbarriers alone (``handoff``).
``scripts/racecheck_triage.py`` sets both apart: the state's by where it is, the hand-overs by the
marks on their stores and loads (``# racecheck hand-over: NAME``; docs/maintainers.md).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

VARIANTS = (
    "plain",
    "regs",
    "init",
    "init-regs",
    "arrive",
    "thread-barrier",
    "init-sync",
    "pingpong",
    "default-bar5",
    "worker-barrier",
    "handoff",
)


# racecheck's reports per variant (H200, compute-sanitizer 2025.3.1, ``--racecheck-report hazard
# --print-limit 0``, every one on the partition state but ``handoff``'s, 5 of whose 3789 are and
# the rest on the buffer it hands over).
# tests/test_racecheck_triage.py holds them against the compiled code: a variant is reported
# exactly when its default partition passes a barrier of its own 128 threads.
REPORTS_H200 = {
    "plain": 0, "regs": 0, "init": 0, "init-regs": 0, "arrive": 7, "thread-barrier": 5,
    "init-sync": 29, "pingpong": 0, "default-bar5": 12, "worker-barrier": 0, "handoff": 3789,
}  # fmt: skip


@gluon.constexpr_function
def _bar_asm(op, barrier, threads):
    return f"bar.{op} {barrier}, {threads};\nmov.b32 $0, $1;"


@gluon.jit
def _bar(OP: gl.constexpr, BARRIER: gl.constexpr, THREADS: gl.constexpr):
    gl.inline_asm_elementwise(
        _bar_asm(OP, BARRIER, THREADS), "=r,r", [gl.program_id(0)], dtype=gl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _default(
    out, bar, INIT: gl.constexpr, ARRIVE: gl.constexpr, TB: gl.constexpr, PP: gl.constexpr
):
    if TB == 1:
        gl.thread_barrier()
    if TB == 5:
        _bar("sync", 5, 128)
    if PP:
        _bar("arrive", 9, 256)
    if ARRIVE:
        mbarrier.wait(bar.index(0), 0)
    gl.store(out + gl.program_id(0) * 3, 1.0)


@gluon.jit
def _worker(out, bar, SLOT: gl.constexpr, ARRIVE: gl.constexpr, PP: gl.constexpr, TB: gl.constexpr):
    if TB:
        gl.thread_barrier()
    if PP:
        _bar("sync", 9, 256)
    if ARRIVE:
        mbarrier.arrive(bar.index(0), count=1)
    gl.store(out + gl.program_id(0) * 3 + SLOT, 2.0 * SLOT)


@gluon.jit
def _handoff_default(out, buf, full, empty):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mbarrier.wait(full.index(0), 0)
    # racecheck hand-over: handoff buffer
    first = buf.load(layout)
    mbarrier.arrive(empty.index(0), count=1)
    mbarrier.wait(full.index(0), 1)
    # racecheck hand-over: handoff buffer
    second = buf.load(layout)
    offs = gl.arange(0, 64, layout=layout)
    gl.store(out + gl.program_id(0) * 128 + offs, first)
    gl.store(out + gl.program_id(0) * 128 + 64 + offs, second)


@gluon.jit
def _handoff_worker(buf, full, empty):
    offs = gl.arange(0, 64, layout=gl.BlockedLayout([2], [32], [1], [0]))
    # racecheck hand-over: handoff buffer
    buf.store(offs.to(gl.float32))
    mbarrier.arrive(full.index(0), count=1)
    mbarrier.wait(empty.index(0), 0)
    # racecheck hand-over: handoff buffer
    buf.store((offs + 64).to(gl.float32))
    mbarrier.arrive(full.index(0), count=1)


@gluon.jit
def ws_handoff_kernel(out):
    buf = gl.allocate_shared_memory(gl.float32, [64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    full = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(full.index(0), count=1)
    mbarrier.init(empty.index(0), count=1)
    gl.warp_specialize(
        [(_handoff_default, (out, buf, full, empty)), (_handoff_worker, (buf, full, empty))],
        [1],
        [24],
    )


@gluon.jit
def ws_probe_kernel(
    out,
    INIT: gl.constexpr,
    REGS: gl.constexpr,
    ARRIVE: gl.constexpr,
    TB: gl.constexpr,
    SYNC: gl.constexpr,
    PP: gl.constexpr,
    WTB: gl.constexpr,
):
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    if INIT:
        mbarrier.init(bar.index(0), count=1)
    if SYNC:
        gl.thread_barrier()
    if REGS:
        gl.warp_specialize(
            [
                (_default, (out, bar, INIT, ARRIVE, TB, PP)),
                (_worker, (out, bar, 1, ARRIVE, PP, WTB)),
                (_worker, (out, bar, 2, False, False, False)),
            ],
            [4, 1],
            [240, 24],
        )
    else:
        gl.warp_specialize(
            [
                (_default, (out, bar, INIT, ARRIVE, TB, PP)),
                (_worker, (out, bar, 1, ARRIVE, PP, False)),
            ],
            [1],
            [24],
        )


def flags(variant: str) -> dict:
    return {
        "INIT": variant in ("init", "init-regs", "arrive", "init-sync"),
        "REGS": variant in ("regs", "init-regs", "pingpong", "worker-barrier"),
        "ARRIVE": variant == "arrive",
        "TB": {"thread-barrier": 1, "default-bar5": 5}.get(variant, 0),
        "SYNC": variant == "init-sync",
        "PP": variant == "pingpong",
        "WTB": variant == "worker-barrier",
    }


def run(variant: str) -> bool:
    import torch

    grid = 8
    if variant == "handoff":
        out = torch.zeros(grid * 128, device="cuda")
        ws_handoff_kernel[(grid,)](out, num_warps=4)
        torch.cuda.synchronize()
        ok = torch.equal(out.cpu(), torch.arange(128, dtype=torch.float32).repeat(grid))
        print(f"ws_probe {variant}:", "right" if ok else "WRONG", flush=True)
        return ok
    out = torch.zeros(grid * 3, device="cuda")
    ws_probe_kernel[(grid,)](out, **flags(variant), num_warps=4)
    torch.cuda.synchronize()
    slots = 3 if flags(variant)["REGS"] else 2
    want = torch.tensor([1.0, 2.0, 4.0][:slots] + [0.0] * (3 - slots)).repeat(grid)
    ok = torch.equal(out.cpu(), want)
    print(f"ws_probe {variant}:", "right" if ok else f"WRONG {out.tolist()}", flush=True)
    return ok


def sass(variant: str) -> str:
    """The variant's sm_90a SASS lines that touch the partition state or synchronise."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from compile_shards import ptxas_sm90a

    if variant == "handoff":
        src = GluonASTSource(ws_handoff_kernel, {"out": "*fp32"}, {})
    else:
        signature = {"out": "*fp32", **dict.fromkeys(flags(variant), "constexpr")}
        src = GluonASTSource(ws_probe_kernel, signature, flags(variant))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    _, code = ptxas_sm90a(compiled.asm["ptx"])
    keep = re.compile(r"BAR\.|STS|LDS|SYNCS|USETMAXREG|EXIT|BRX")
    return "\n".join(
        " ".join(line.split()[:6])
        for line in code.splitlines()
        if keep.search(line) and line.strip().startswith("/*")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="*", help=f"some of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--sass", action="store_true", help="print the SASS facts, run nothing")
    args = parser.parse_args()
    variants = args.variants or list(VARIANTS)
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if args.sass:
        for variant in variants:
            print(f"== {variant}\n{sass(variant)}")
        return 0
    return 0 if all([run(variant) for variant in variants]) else 1


if __name__ == "__main__":
    sys.exit(main())
