"""What each Hopper compile variant's step loops are made of, on the CPU.

    python scripts/step_loop_mix.py [--suite fwd,bwd] [--variants NAME,NAME]

For each variant of ``tests/test_compile_hopper.py`` (fwd) and ``tests/test_compile_hopper_bwd.py``
(bwd), compiles the Gluon kernel for sm_90a as its test builds it and prints, for each step loop
of the SASS (the innermost loops holding tensor-core products: one per consumer warpgroup, and
the dQ warpgroup's at D = 64), its instruction count and the mix that matters for the issue
slots a step costs: tensor-core products (HGMMA), the multi-function unit (MUFU), instructions
on the uniform datapath (``U*``: scalars shared by the warp, beside the vector pipes), integer
and move instructions on the vector pipes (IMAD, IADD3, LOP3, LEA, SHF, VIADD, MOV, SGXT), and
local loads and stores (spills). A loop whose slot and phase arithmetic left the uniform datapath
shows tens of vector integer instructions more a step (docs/performance_backward.md, "Where a
program's time goes outside its steps"). Needs Triton with Gluon (the wheel's ptxas and
cuobjdump); no GPU.

    python scripts/step_loop_mix.py --cubin FILE.cubin [FILE.cubin ...] [--skeleton]

does the same for cubins built elsewhere (FlashAttention-4's, kept by ``scripts/peer_cubins.py``
on the GPU machine), and ``--skeleton`` prints each step loop in order as its synchronisation and
products (mbarrier waits and arrives, named and warpgroup barriers, ``WARPGROUP.ARRIVE`` /
``DEPBAR``, HGMMAs, bulk copies, shuffles) with the runs of other instructions between them
counted by opcode: where two kernels' steps do the same work, this is where they differ
(docs/hopper_fwd_configs.md, "Turns by named barriers").
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITES = {"fwd": "test_compile_hopper", "bwd": "test_compile_hopper_bwd"}


# Instructions a skeleton shows one by one; the others are counted by opcode between them.
SKELETON_OPS = (
    "HGMMA", "WARPGROUP", "BAR", "SYNCS", "DEPBAR", "ARRIVES", "MEMBAR", "FENCE", "UTMALDG",
    "UTMASTG", "UTMAREDG", "UBLKCP", "UBLKRED", "ELECT", "SHFL", "BRA",
)  # fmt: skip


def skeleton(body: list[str]) -> list[str]:
    """A step loop's body (``step_loops``) as its synchronisation and products, one line each,
    with each run of other instructions between them as ``.. OPxN ...`` (opcodes in order of
    first appearance)."""
    lines: list[str] = []
    run: dict[str, int] = {}
    for text in body:
        op = (text.split()[1] if text.startswith("@") else text.split()[0]).split(".")[0]
        if op in SKELETON_OPS:
            if run:
                lines.append("    .. " + " ".join(f"{k}x{n}" for k, n in run.items()))
                run = {}
            lines.append(text)
        else:
            run[op] = run.get(op, 0) + 1
    if run:
        lines.append("    .. " + " ".join(f"{k}x{n}" for k, n in run.items()))
    return lines


def _report(label: str, sass: str, show_skeleton: bool) -> None:
    from hopper_compile import step_loops
    from test_compile_hopper_bwd import loop_mix

    for i, body in enumerate(step_loops(sass)):
        counts = loop_mix(body)
        cells = " ".join(f"{counts[c]:12d}" for c in COLUMNS)
        print(f"{label:52s} {i:4d} {cells}", flush=True)
        if show_skeleton:
            print("\n".join(skeleton(body)))


COLUMNS = ("instructions", "HGMMA", "MUFU", "uniform", "vector int", "local")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="fwd,bwd")
    parser.add_argument("--variants", default="", help="comma-separated names (default: all)")
    parser.add_argument("--cubin", nargs="+", default=[], help="cubins to read instead")
    parser.add_argument("--skeleton", action="store_true", help="print each loop's skeleton")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
    print(f"{'variant':52s} loop " + " ".join(f"{c:>12s}" for c in COLUMNS))
    if args.cubin:
        import subprocess

        from triton.backends.nvidia.compiler import get_ptxas

        cuobjdump = str(Path(get_ptxas(90).path).with_name("cuobjdump"))
        for cubin in args.cubin:
            sass = subprocess.run(
                [cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True
            ).stdout
            _report(Path(cubin).name[-52:], sass, args.skeleton)
        return 0
    wanted = set(filter(None, args.variants.split(",")))
    for suite in args.suite.split(","):
        module = __import__(SUITES[suite])
        real = module.assemble
        listing = {}

        def spy(src, maxnreg, real=real, listing=listing):
            ptx, sass, report = real(src, maxnreg)
            listing["sass"] = sass
            return ptx, sass, report

        module.assemble = spy
        for variant in module.VARIANTS:
            if wanted and variant[0] not in wanted:
                continue
            module.compile_variant(variant)
            _report(f"{suite} {variant[0]}", listing["sass"], args.skeleton)
    return 0


if __name__ == "__main__":
    sys.exit(main())
