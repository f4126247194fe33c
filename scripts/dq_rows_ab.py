"""A/B of the Hopper backward's dQ staging rows permuted (``Sm90BwdConfig.permuted_rows``) against
rows in order, on an H100:

    PYTHONPATH=src python scripts/dq_rows_ab.py [ROUNDS] [--only D128] [--seqlens 3072,4096]
        [--causal-only] [--options plain,softcap]

bf16, 32k tokens (H = 16 at D = 128, 32 at D = 64), S 2048 / 8192 / 16384, causal and not, and at
D = 128 the score options (window (256, 0) causal, softcap 30 both ways, ALiBi causal) at 2048 and
8192 (``--seqlens`` replaces every case's lengths, ``--causal-only`` drops the non-causal ones,
``--options`` keeps those named, "plain" for none):
both configs through ``attn_bwd_sm90`` (plans and compiled kernels apart: ``PERMUTED_ROWS`` is a
constexpr), the permutation forced wherever the problem is dense (``ops/bwd_sm90.py:
rows_permuted`` bypassed: this is the measurement that rule rests on), and cuDNN's backward where
it computes the same thing (no score options); ROUNDS rotated rounds of ``do_bench`` medians.
Prints TFLOP/s (2.5x the forward's FLOPs, halved causal, not counting a window's skipped work),
the ratio of the medians with the range of per-round ratios, and whether dK and dV are bit for bit
equal and dQ's largest difference (its reduce-adds' order varies between runs).
"""

import argparse
import functools
import math
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashcore.ops import bwd_sm90 as sm90
from flashcore.ops import fwd


def forced(cfg, head_dim, varlen, causal, window, softcap, alibi, seqlen_q) -> bool:
    """``rows_permuted`` without its head-dim and option conditions: dense problems."""
    return cfg.permuted_rows and not varlen


def problem(
    batch: int,
    heads: int,
    seqlen: int,
    head_dim: int,
    causal: bool,
    option: str = "",
    group: int = 1,
):
    """A dense bf16 backward problem: ``(dout, q, k, v, out, lse, causal, scale)`` as
    ``attn_bwd_sm90`` takes them (the forward run for out and lse) and the score option's keyword
    arguments (``option``: "", "window" (256, 0), "window128" (128, 0), "window2" (256, 256),
    "window4k" (4095, 0), "window1k2" (1024, 1024), "softcap" 30, "alibi" slopes in [0, 0.1),
    or a window with one: "window4k-softcap" 50, "window128-softcap" (127, 0) 30, "window-alibi",
    "window2-softcap" (256, 256) 30);
    ``group`` query heads a kv head (GQA)."""
    shape = (batch, heads, seqlen, head_dim)
    q, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kv_shape = (batch, heads // group, seqlen, head_dim)
    k, v = (torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scale = 1 / math.sqrt(head_dim)
    opts = {
        "": {},
        "window": {"window": (256, 0)},
        "window128": {"window": (128, 0)},
        "window2": {"window": (256, 256)},
        "window4k": {"window": (4095, 0)},
        "window1k2": {"window": (1024, 1024)},
        "softcap": {"softcap": 30.0},
        "alibi": {"alibi": torch.rand(heads, device="cuda") * 0.1},
        # Windows with a score option: Gemma 2's (4095, 0) with softcap 50, gpt-oss's (127, 0)
        # with softcap at D = 64, and a (256, 0) window with ALiBi.
        "window4k-softcap": {"window": (4095, 0), "softcap": 50.0},
        "window128-softcap": {"window": (127, 0), "softcap": 30.0},
        "window-alibi": {"window": (256, 0), "alibi": torch.rand(heads, device="cuda") * 0.1},
        "window2-softcap": {"window": (256, 256), "softcap": 30.0},
    }[option]
    fwd_opts = {("alibi_slopes" if n == "alibi" else n): x for n, x in opts.items()}
    out, lse = fwd.launch(q, k, v, causal, scale, **fwd_opts)[:2]
    return (dout, q, k, v, out, lse, causal, scale), opts


def rotated(fns: dict, rounds: int, select=lambda name: None, timer=None) -> tuple[dict, dict]:
    """``do_bench`` times (ms; or ``timer(fn)``'s) of each of ``fns`` over ``rounds`` rounds, each
    round starting one name later (``select(name)`` before each), and their medians: ``(times,
    medians)``."""
    if timer is None:
        timer = functools.partial(triton.testing.do_bench, warmup=25, rep=100)
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            select(name)
            times[name].append(timer(fns[name]))
    return times, {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def rates_and_ratio(times: dict, med: dict, flops: float, new: str, old: str) -> tuple[str, str]:
    """Of ``rotated``'s results: each name's TFLOP/s at its median (``"name 123.4 ..."``), and
    ``new``'s speed over ``old``'s, the medians' ratio with the range of the per-round ratios."""
    ratios = sorted(a / b for a, b in zip(times[old], times[new], strict=True))
    rates = " ".join(f"{name} {flops / ms / 1e9:.1f}" for name, ms in med.items())
    return rates, f"{med[old] / med[new]:.3f} (rounds {ratios[0]:.3f}-{ratios[-1]:.3f})"


def case(
    batch: int, heads: int, seqlen: int, head_dim: int, causal: bool, rounds: int, option: str = ""
) -> str:
    args, opts = problem(batch, heads, seqlen, head_dim, causal, option)
    dout, q, k, v, out, lse, causal, scale = args
    base = sm90.CONFIGS[head_dim]
    cfgs = {
        "plain": base._replace(permuted_rows=False),
        "perm": base._replace(permuted_rows=True),
    }

    def run(cfg):
        return sm90.attn_bwd_sm90(dout, q, k, v, out, lse, causal, scale, config=cfg, **opts)

    res = {name: run(cfg)[:3] for name, cfg in cfgs.items()}
    same_kv = all(torch.equal(a, b) for a, b in zip(res["plain"][1:], res["perm"][1:], strict=True))
    dq_diff = (res["plain"][0].float() - res["perm"][0].float()).abs().max().item()
    dq_mag = res["plain"][0].float().abs().max().item()
    fns = {name: functools.partial(run, cfg) for name, cfg in cfgs.items()}
    if not option:
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)
        grad = functools.partial(torch.autograd.grad, o, (qg, kg, vg), dout, retain_graph=True)
        fns["cudnn"] = grad
    flops = 2.5 * 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    tf, ratio = rates_and_ratio(*rotated(fns, rounds), flops, "perm", "plain")
    return (
        f"D{head_dim} causal{int(causal)} {option or 'plain'} S{seqlen} B{batch}: {tf}"
        f" perm/plain {ratio}"
        f" dk,dv equal {same_kv} dq maxdiff {dq_diff:.2e} (max {dq_mag:.2e})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rounds", type=int, nargs="?", default=5)
    parser.add_argument("--only", choices=["D128", "D64"], help="one head dim")
    parser.add_argument("--seqlens", help="comma-separated lengths replacing every case's")
    parser.add_argument("--causal-only", action="store_true")
    parser.add_argument("--options", help="comma-separated: plain, window, softcap, alibi")
    args = parser.parse_args()
    sm90.rows_permuted = forced
    torch.manual_seed(0)
    cases = [
        (head_dim, heads, causal, seqlen, "")
        for head_dim, heads in ((128, 16), (64, 32))
        for causal in (False, True)
        for seqlen in (2048, 8192, 16384)
    ]
    cases += [
        (128, 16, causal, seqlen, option)
        for option, causal in (
            ("window", True), ("softcap", False), ("softcap", True), ("alibi", True)
        )
        for seqlen in (2048, 8192)
    ]  # fmt: skip
    if args.seqlens:
        lengths = [int(n) for n in args.seqlens.split(",")]
        cases = list(dict.fromkeys((d, h, c, n, o) for d, h, c, _, o in cases for n in lengths))
    kept = args.options.split(",") if args.options else None
    for head_dim, heads, causal, seqlen, option in cases:
        if (
            (args.only and f"D{head_dim}" != args.only)
            or (args.causal_only and not causal)
            or (kept and (option or "plain") not in kept)
        ):
            continue
        batch = 32768 // seqlen
        print(case(batch, heads, seqlen, head_dim, causal, args.rounds, option), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
