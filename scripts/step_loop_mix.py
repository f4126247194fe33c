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
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITES = {"fwd": "test_compile_hopper", "bwd": "test_compile_hopper_bwd"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="fwd,bwd")
    parser.add_argument("--variants", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
    from test_compile_hopper_bwd import loop_mix, step_loops

    wanted = set(filter(None, args.variants.split(",")))
    columns = ("instructions", "HGMMA", "MUFU", "uniform", "vector int", "local")
    print(f"{'variant':52s} loop " + " ".join(f"{c:>12s}" for c in columns))
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
            for i, body in enumerate(step_loops(listing["sass"])):
                counts = loop_mix(body)
                cells = " ".join(f"{counts[c]:12d}" for c in columns)
                print(f"{suite + ' ' + variant[0]:52s} {i:4d} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
