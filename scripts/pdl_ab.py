"""A/B of programmatic dependent launch in the Hopper backward (``ops/bwd_sm90.PDL``), in one
process on the GPU machine:

    PYTHONPATH=src python scripts/pdl_ab.py [--rounds 5] [--cases short,causal,full,controls]
    PYTHONPATH=src python scripts/pdl_ab.py --graph [--rounds 6]

The same kernel module and plans either way; with ``PDL`` on, the main kernel launches after the
prep kernel and the dQ conversion after the main kernel with ``launch_pdl`` (each waits with
``griddepcontrol.wait`` before reading what the grid before it wrote). The cases are those of
``bwd_module_ab.py``. Prints TFLOP/s of each side (``attn_bwd_sm90`` alone, ``do_bench``
medians of rotated rounds), the ratio (pdl / plain: > 1, PDL is faster) with the range of the
per-round ratios, and whether dK and dV are bit for bit equal and dQ's largest difference.

``--graph``: small problems (``GRAPH_SHAPES``), each side's ``attn_bwd_sm90`` called 20 times
in one CUDA graph (captured after three calls on a side stream), the replays timed with
``do_bench`` in rotated rounds (``dq_rows_ab.rotated``); us per backward (medians), the ratio
(pdl / plain: < 1, PDL is faster), each side's range, and whether dK and dV are bit for bit
equal.
"""

import argparse
import sys

import torch
from bwd_module_ab import CASES
from dq_rows_ab import problem, rotated

from flashcore.ops import bwd_sm90 as sm90

SIDES = ("plain", "pdl")
# (B, H, S, D, causal): where the launches and the setup weigh against the kernels.
GRAPH_SHAPES = [
    (1, 8, 512, 64, False), (1, 8, 512, 64, True), (2, 8, 2048, 64, False),
    (2, 8, 2048, 64, True), (2, 8, 2048, 128, False), (2, 8, 2048, 128, True),
    (4, 16, 1024, 128, False), (1, 16, 1024, 128, True), (8, 16, 512, 128, True),
]  # fmt: skip
GRAPH_CALLS = 20


def select(side: str) -> None:
    """PDL on or off; the plans (which hold the launch options) built again."""
    sm90.PDL = side == "pdl"
    sm90._PLANS.clear()


def compare(name, flops, call, rounds) -> str:
    results = {}
    for side in SIDES:
        select(side)
        results[side] = [t.clone() for t in call()[:3]]
    plain, pdl = results["plain"], results["pdl"]
    same_kv = all(torch.equal(a, b) for a, b in zip(plain[1:], pdl[1:], strict=True))
    dq_diff = (plain[0].float() - pdl[0].float()).abs().max().item()
    times, med = rotated(dict.fromkeys(SIDES, call), rounds, select)
    ratios = sorted(a / b for a, b in zip(times["plain"], times["pdl"], strict=True))
    rates = " ".join(f"{side} {flops / ms / 1e9:.1f}" for side, ms in med.items())
    return (
        f"{name}: {rates} pdl/plain {med['plain'] / med['pdl']:.3f}"
        f" (rounds {ratios[0]:.3f}-{ratios[-1]:.3f}) dk,dv equal {same_kv} dq maxdiff {dq_diff:.2e}"
    )


def graph_case(batch, heads, seqlen, head_dim, causal, rounds) -> str:
    args, opts = problem(batch, heads, seqlen, head_dim, causal)
    graphs, grads = {}, {}
    for side in SIDES:
        select(side)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                out = sm90.attn_bwd_sm90(*args, **opts)
        torch.cuda.current_stream().wait_stream(stream)
        grads[side] = [t.clone() for t in out[1:3]]
        graphs[side] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[side]):
            for _ in range(GRAPH_CALLS):
                sm90.attn_bwd_sm90(*args, **opts)
    same_kv = all(torch.equal(a, b) for a, b in zip(grads["plain"], grads["pdl"], strict=True))
    ms, ms_med = rotated({side: graphs[side].replay for side in SIDES}, rounds)
    times = {side: [t * 1000 / GRAPH_CALLS for t in ts] for side, ts in ms.items()}
    med = {side: t * 1000 / GRAPH_CALLS for side, t in ms_med.items()}
    spread = " ".join(f"{side} {min(t):.2f}-{max(t):.2f}" for side, t in times.items())
    return (
        f"({batch}, {heads}, {seqlen}, {head_dim}) causal {causal}: plain {med['plain']:.2f} us"
        f" pdl {med['pdl']:.2f} us, pdl/plain {med['pdl'] / med['plain']:.3f} ({spread})"
        f" dk,dv equal {same_kv}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="short,causal,full,controls")
    parser.add_argument("--graph", action="store_true", help="small problems under CUDA graphs")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.graph:
        for shape in GRAPH_SHAPES:
            print(graph_case(*shape, args.rounds), flush=True)
        return 0
    for group in args.cases.split(","):
        for name, flops, call in CASES[group]():
            print(compare(name, flops, call, args.rounds), flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
