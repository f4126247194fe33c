"""Two forward calls of one provider at one shape, for a profiler (the first call compiles).

    PYTHONPATH=src ncu --launch-skip 1 -c 1 -k regex:attn_fwd_sm90_kernel --section SpeedOfLight \\
        python scripts/hopper_fwd_profile.py --provider sm90 --seqlen 8192 --head-dim 128
    PYTHONPATH=src ncu --launch-skip 1 -c 1 -k regex:fprop --section SpeedOfLight \\
        python scripts/hopper_fwd_profile.py --provider sdpa --seqlen 8192 --head-dim 128

``sm90``: the Gluon forward (``use_tier("sm90")``); ``portable``: the ``tl`` forward; ``sdpa``:
PyTorch's SDPA restricted to its cuDNN backend.
"""

from __future__ import annotations

import argparse

import torch

import flashcore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=["sm90", "portable", "sdpa"], default="sm90")
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    heads = 16 if args.head_dim == 128 else 32
    shape = (max(1, args.tokens // args.seqlen), heads, args.seqlen, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(2):
        if args.provider == "sdpa":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        else:
            with flashcore.use_tier(args.provider):
                flashcore.attention(q, k, v, causal=args.causal)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
