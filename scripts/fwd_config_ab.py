"""The Hopper forward's configs side by side at D = 64 (or the MLA head dims), in one process:

    PYTHONPATH=src python scripts/fwd_config_ab.py [--rounds 3] [--cases 1024:full,2048:causal]
    PYTHONPATH=src python scripts/fwd_config_ab.py --mla [--cases 4096:causal,8192:full]
    PYTHONPATH=src python scripts/fwd_config_ab.py --d256 [--cases 2048:causal,4096:full]

Each config of ``ops/fwd_sm90.py`` that D = 64 can take (two consumers persistent or flat, three
consumers persistent or flat, one consumer with two or three CTAs an SM, two consumers with
64-key tiles) and the launcher's own choice ("auto") run through ``flashcore.attention`` under
``use_tier("sm90")`` (``pick_config`` replaced, the kept plans dropped at each switch), beside
cuDNN; bf16, the FA sweep's batch (16k tokens, 32 heads). ``--mla``: head dims (192, 128), 8k
tokens of 16 heads (issue 19's shapes), the configs D = 192 can take (128-key tiles flat or
persistent with one Q buffer a consumer; 64-key tiles with three slots flat or two persistent),
beside SDPA's own pick for unequal head dims. ``--d256``: head dim 256, 8k tokens of 16 heads,
flat or persistent with one Q buffer. A config that fails to launch or whose output is off
cuDNN's by more than 2e-2 is reported and left out. Rotated rounds of ``do_bench``, medians;
prints TFLOP/s (``4 B H S^2 D``, halved causal) and the fastest config.
"""

import argparse
import functools
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashcore
from flashcore.ops import fwd, fwd_sm90_configs

CHOSEN = fwd_sm90_configs.pick_config
CONFIGS = {
    "auto": None,
    "two-p": fwd_sm90_configs.CONFIGS[64]._replace(persistent=True),
    "two-f": fwd_sm90_configs.CONFIGS[64]._replace(persistent=False),
    "three-p": fwd_sm90_configs.D64_THREE._replace(persistent=True),
    "three-f": fwd_sm90_configs.D64_THREE._replace(persistent=False),
    "one2": fwd_sm90_configs.ONE_D64,
    "one3": fwd_sm90_configs.ONE_D64_THREE_CTAS,
    "two64-p": fwd_sm90_configs.CONFIGS[64]._replace(block_n=64, num_stages=4, persistent=True),
}
MLA = fwd_sm90_configs.CONFIGS[192]
MLA_CONFIGS = {
    "auto": None,
    "n128-f": MLA._replace(persistent=False),
    "n128-p1": MLA._replace(persistent=True, q_buffers=1),
    "n64s3-f": MLA._replace(block_n=64, num_stages=3, persistent=False),
    "n64s2-p": MLA._replace(block_n=64, num_stages=2, persistent=True, q_buffers=3),
}
D256 = fwd_sm90_configs.CONFIGS[256]
D256_CONFIGS = {
    "auto": None,
    "n64-f": D256._replace(persistent=False),
    "n64-p1": D256._replace(persistent=True, q_buffers=1),
}


def configs(mla: bool) -> dict:
    return {True: MLA_CONFIGS, False: CONFIGS, 256: D256_CONFIGS}[mla]


def use(name: str, mla: bool = False) -> None:
    cfg = configs(mla)[name]
    fwd_sm90_configs.pick_config = CHOSEN if cfg is None else (lambda *args, **kwargs: cfg)
    fwd.forget()  # the plans and ops.express's kept launches


def call(name: str, q, k, v, causal: bool):
    if name == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if name == "cudnn":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with flashcore.use_tier("sm90"):
        return flashcore.attention(q, k, v, causal=causal)


def case(seqlen: int, causal: bool, rounds: int, mla: bool = False) -> str:
    batch, heads, head_dim, head_dim_v = max(1, 16384 // seqlen), 32, 64, 64
    base = "cudnn"
    if mla is True:
        batch, heads, head_dim, head_dim_v, base = max(1, 8192 // seqlen), 16, 192, 128, "sdpa"
    elif mla == 256:
        batch, heads, head_dim, head_dim_v, base = max(1, 8192 // seqlen), 16, 256, 256, "sdpa"
    q, k = (
        torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    v = torch.randn(batch, heads, seqlen, head_dim_v, device="cuda", dtype=torch.bfloat16)
    ref = call(base, q, k, v, causal).float()
    names = []
    for name in configs(mla):
        use(name, mla)
        try:
            out = call(name, q, k, v, causal)
            torch.cuda.synchronize()
        except Exception as exc:  # a config the kernel cannot build here: report, leave out
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        err = (out.float() - ref).abs().max().item()
        if err > 2e-2:
            print(f"  {name}: off {base} by {err:.3g}", flush=True)
            continue
        names.append(name)
    every = [*names, base]
    times = {name: [] for name in every}
    for r in range(rounds):
        for name in every[r % len(every) :] + every[: r % len(every)]:
            if name != base:
                use(name, mla)
            run = functools.partial(call, name, q, k, v, causal)
            run()
            times[name].append(do_bench(run, warmup=25, rep=100))
    use("auto")
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    flops = 2 * batch * heads * seqlen * seqlen * (head_dim + head_dim_v) / (2 if causal else 1)
    rates = " ".join(f"{name} {flops / med[name] / 1e9:.0f}" for name in every)
    best = min(names, key=med.get)
    dims = f"D{head_dim}" + (f":{head_dim_v}" if head_dim_v != head_dim else "")
    return f"{dims} S{seqlen} {'causal' if causal else 'full'} B{batch}: {rates}  fastest {best}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cases",
        default="1024:full,512:full,2048:causal,4096:causal,1024:causal,2048:full",
        help="comma-separated SEQLEN:full or SEQLEN:causal",
    )
    parser.add_argument("--mla", action="store_true", help="head dims (192, 128)")
    parser.add_argument("--d256", action="store_true", help="head dim 256")
    args = parser.parse_args()
    torch.manual_seed(0)
    mode = 256 if args.d256 else args.mla
    for item in args.cases.split(","):
        seqlen, mask = item.split(":")
        print(case(int(seqlen), mask == "causal", args.rounds, mode), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
