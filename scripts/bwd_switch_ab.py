"""A/B of one boolean switch of the Hopper backward (``ops/bwd_sm90.py``), in one process on the
GPU machine:

    PYTHONPATH=src python scripts/bwd_switch_ab.py PDL [--rounds 5] [--cases causal,full]

Both sides run the same kernel module; the switch (a module attribute read when a plan is built)
is set off or on and the plans are built again. The cases are those of ``bwd_module_ab.py``
(``short``, ``causal``, ``full``, ``window``, ``softcap``, ``alibi``, ``packed``, ``controls``).
Prints TFLOP/s of each side (``attn_bwd_sm90`` alone, ``do_bench`` medians of rotated rounds),
the ratio (off / on time: > 1, the switch on is faster) with the range of the per-round ratios,
and the largest difference of each gradient between the sides.
"""

import argparse
import sys

import torch
from bwd_module_ab import CASES
from dq_rows_ab import rates_and_ratio, rotated

from flashcore.ops import bwd_sm90 as sm90

SIDES = ("off", "on")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("switch", help="a boolean attribute of ops/bwd_sm90.py")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="short,causal,full,controls")
    args = parser.parse_args()
    if not isinstance(getattr(sm90, args.switch, None), bool):
        parser.error(f"switch: ops/bwd_sm90.py has no boolean {args.switch!r}")

    def select(side: str) -> None:
        setattr(sm90, args.switch, side == "on")
        sm90._PLANS.clear()

    torch.manual_seed(0)
    for group in args.cases.split(","):
        for name, flops, call in CASES[group]():
            grads = {}
            for side in SIDES:
                select(side)
                grads[side] = [t.float().clone() for t in call()[:3]]
            diffs = " ".join(
                f"{g} {(a - b).abs().max().item():.1e}"
                for g, a, b in zip(("dq", "dk", "dv"), grads["off"], grads["on"], strict=True)
            )
            times, med = rotated(dict.fromkeys(SIDES, call), args.rounds, select)
            rates, ratio = rates_and_ratio(times, med, flops, "on", "off")
            print(f"{name}: {rates} off/on {ratio} maxdiff {diffs}", flush=True)
            torch.cuda.empty_cache()
    select("off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
