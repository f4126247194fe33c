"""The Hopper forward's configs side by side at D = 64, in one process, on an H100:

    PYTHONPATH=src python scripts/fwd_config_ab.py [--rounds 3] [--cases 1024:full,2048:causal]

Each config of ``ops/fwd_sm90.py`` that D = 64 can take (two consumers persistent or flat, three
consumers persistent or flat, one consumer with two or three CTAs an SM, two consumers with
64-key tiles) and the launcher's own choice ("auto") run through ``flashcore.attention`` under
``use_tier("sm90")`` (``pick_config`` replaced, the kept plans dropped at each switch), beside
cuDNN; bf16, the FA sweep's batch (16k tokens, 32 heads). A config that fails to launch or whose
output is off cuDNN's by more than 2e-2 is reported and left out. Rotated rounds of ``do_bench``,
medians; prints TFLOP/s (``4 B H S^2 D``, halved causal) and the fastest config.
"""

import argparse
import functools
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashcore
from flashcore.ops import fwd
from flashcore.ops import fwd_sm90 as sm90

CHOSEN = sm90.pick_config
CONFIGS = {
    "auto": None,
    "two-p": sm90.CONFIGS[64]._replace(persistent=True),
    "two-f": sm90.CONFIGS[64]._replace(persistent=False),
    "three-p": sm90.D64_THREE._replace(persistent=True),
    "three-f": sm90.D64_THREE._replace(persistent=False),
    "one2": sm90.ONE_D64,
    "one3": sm90.ONE_D64_THREE_CTAS,
    "two64-p": sm90.CONFIGS[64]._replace(block_n=64, num_stages=4, persistent=True),
}


def use(name: str) -> None:
    cfg = CONFIGS[name]
    sm90.pick_config = CHOSEN if cfg is None else (lambda *args, **kwargs: cfg)
    fwd._SM90_PLANS.clear()


def call(name: str, q, k, v, causal: bool):
    if name == "cudnn":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with flashcore.use_tier("sm90"):
        return flashcore.attention(q, k, v, causal=causal)


def case(seqlen: int, causal: bool, rounds: int) -> str:
    batch, heads, head_dim = max(1, 16384 // seqlen), 32, 64
    q, k, v = (
        torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(3)
    )
    ref = call("cudnn", q, k, v, causal).float()
    names = []
    for name in CONFIGS:
        use(name)
        try:
            out = call(name, q, k, v, causal)
            torch.cuda.synchronize()
        except Exception as exc:  # a config the kernel cannot build here: report, leave out
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        err = (out.float() - ref).abs().max().item()
        if err > 2e-2:
            print(f"  {name}: off cuDNN by {err:.3g}", flush=True)
            continue
        names.append(name)
    every = [*names, "cudnn"]
    times = {name: [] for name in every}
    for r in range(rounds):
        for name in every[r % len(every) :] + every[: r % len(every)]:
            if name != "cudnn":
                use(name)
            run = functools.partial(call, name, q, k, v, causal)
            run()
            times[name].append(do_bench(run, warmup=25, rep=100))
    use("auto")
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    rates = " ".join(f"{name} {flops / med[name] / 1e9:.0f}" for name in every)
    best = min(names, key=med.get)
    return f"D64 S{seqlen} {'causal' if causal else 'full'} B{batch}: {rates}  fastest {best}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cases",
        default="1024:full,512:full,2048:causal,4096:causal,1024:causal,2048:full",
        help="comma-separated SEQLEN:full or SEQLEN:causal",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    for item in args.cases.split(","):
        seqlen, mask = item.split(":")
        print(case(int(seqlen), mask == "causal", args.rounds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
