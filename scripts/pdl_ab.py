"""A/B of programmatic dependent launch in the Hopper backward (``ops/bwd_sm90.PDL``), in one
process on the GPU machine:

    PYTHONPATH=src python scripts/pdl_ab.py [--rounds 5] [--cases short,causal,full,controls]

The same kernel module and plans either way; with ``PDL`` on, the main kernel launches after the
prep kernel and the dQ conversion after the main kernel with ``launch_pdl`` (each waits with
``griddepcontrol.wait`` before reading what the grid before it wrote). The cases are those of
``bwd_module_ab.py``. Prints TFLOP/s of each side (``attn_bwd_sm90`` alone, ``do_bench``
medians of rotated rounds), the ratio (pdl / plain: > 1, PDL is faster) with the range of the
per-round ratios, and whether dK and dV are bit for bit equal and dQ's largest difference.
"""

import argparse
import sys

import torch
from bwd_module_ab import CASES
from dq_rows_ab import rotated

from flashcore.ops import bwd_sm90 as sm90


def select(side: str) -> None:
    """PDL on or off; the plans (which hold the launch options) built again."""
    sm90.PDL = side == "pdl"
    sm90._PLANS.clear()


def compare(name, flops, call, rounds) -> str:
    results = {}
    for side in ("plain", "pdl"):
        select(side)
        results[side] = [t.clone() for t in call()[:3]]
    plain, pdl = results["plain"], results["pdl"]
    same_kv = all(torch.equal(a, b) for a, b in zip(plain[1:], pdl[1:], strict=True))
    dq_diff = (plain[0].float() - pdl[0].float()).abs().max().item()
    times, med = rotated(dict.fromkeys(("plain", "pdl"), call), rounds, select)
    ratios = sorted(a / b for a, b in zip(times["plain"], times["pdl"], strict=True))
    rates = " ".join(f"{side} {flops / ms / 1e9:.1f}" for side, ms in med.items())
    return (
        f"{name}: {rates} pdl/plain {med['plain'] / med['pdl']:.3f}"
        f" (rounds {ratios[0]:.3f}-{ratios[-1]:.3f}) dk,dv equal {same_kv} dq maxdiff {dq_diff:.2e}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="short,causal,full,controls")
    args = parser.parse_args()
    torch.manual_seed(0)
    for group in args.cases.split(","):
        for name, flops, call in CASES[group]():
            print(compare(name, flops, call, args.rounds), flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
