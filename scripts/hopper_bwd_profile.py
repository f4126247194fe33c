"""Two launches of the Hopper backward for a profiler or compute-sanitizer.

    PYTHONPATH=src ncu --launch-skip 1 -c 1 -k regex:attn_bwd_sm90_kernel --section SpeedOfLight \\
        python scripts/hopper_bwd_profile.py --seqlen 4096 --head-dim 128
    PYTHONPATH=src compute-sanitizer --tool racecheck python scripts/hopper_bwd_profile.py \\
        --seqlen 300 --tokens 600 --causal [--window 100,0]
"""

from __future__ import annotations

import argparse
import math

import torch

from flashcore.ops import bwd_sm90, fwd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", default=None, help="a local window 'LEFT,RIGHT' (-1: none)")
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--ablate", type=int, default=0)
    parser.add_argument(
        "--dq-in-consumers",
        action="store_true",
        help="D=64: the consumers compute dQ (the config before the dQ warpgroup)",
    )
    parser.add_argument(
        "--rows-in-order",
        action="store_true",
        help="stage dQ with its rows in order (the config before the permuted rows)",
    )
    args = parser.parse_args()
    heads = 16 if args.head_dim == 128 else 32
    shape = (max(1, args.tokens // args.seqlen), heads, args.seqlen, args.head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1.0 / math.sqrt(args.head_dim)
    opts = {}
    if args.window:
        opts["window"] = tuple(int(x) for x in args.window.split(","))
    out, lse = fwd.launch(q, k, v, args.causal, scale, **opts)[:2]
    cfg = bwd_sm90.CONFIGS[args.head_dim]._replace(ablate=args.ablate)
    if args.stages:
        cfg = cfg._replace(num_stages=args.stages)
    if args.dq_in_consumers:
        cfg = cfg._replace(dq_warpgroup=False, consumer_regs=240, maxnreg=168)
    if args.rows_in_order:
        cfg = cfg._replace(permuted_rows=False)
    for _ in range(2):  # the first launch compiles; a profiler's -c 1 after --launch-skip 1
        bwd_sm90.attn_bwd_sm90(dout, q, k, v, out, lse, args.causal, scale, config=cfg, **opts)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
