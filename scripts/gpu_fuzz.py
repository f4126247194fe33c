"""Random problems on a GPU against the float64 reference, FlashAttention's rule, per tier.

    PYTHONPATH=src python scripts/gpu_fuzz.py [--seconds 240] [--seed 0] [--tiers sm90,portable]
    PYTHONPATH=src python scripts/gpu_fuzz.py --replay "<a problem line it printed>"
    PYTHONPATH=src python scripts/gpu_fuzz.py --tiers sm90 --kinds attention --dims 192:128

The test files hold every option to a grid of cases; this draws problems off that grid: batch,
heads and a GQA group, Sq and Sk from 1 to about 4600 (equal half the time, so that the Hopper
tiers' length floors are crossed both ways), head dims 32 to 256 with the value head dim
sometimes its own, fp16 or bf16 (fp32 on the portable tier now and then), causal, a window,
softcap, ALiBi, sinks (from four heads on), a (B, S, H, D) layout, a gradient through the LSE,
and packed batches (``attention_varlen``) a quarter of the time. Each problem runs forward and
backward under ``use_tier(t)`` for each tier given ("sm90" falls back to the portable kernels
wherever it does not cover the problem; the line says which forward and backward ran) and is
checked as the tests check: out, lse, dq, dk, dv (and dsinks) by ``max|x - ref64| <= 2 max|pt -
ref64| + floor``, ``pt`` the reference in the inputs' dtype. The problems are a function of the
seed and their index, so a failing line can be replayed. Exit status 1 if any problem failed.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import random
import re
import sys
import time
from pathlib import Path

# --device cpu runs the interpreter, which must be chosen before triton is first imported.
os.environ["TRITON_INTERPRET"] = (
    "1"
    if re.search(r"--device[ =]cpu\b", " ".join(sys.argv))
    else os.environ.get("TRITON_INTERPRET", "0")
)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import flashcore
from flashcore import reference
from flashcore.ops import bwd256, bwd_sm90, fwd_sm90
from helpers import alibi_slopes, paged_pools
from numerics import assert_fa_rule

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Scores (batch x heads x Sq x Sk) a problem may have: the float64 reference holds a few
# tensors of that size, and its autograd a few more.
MAX_SCORES = 6e7


MAX_LEN = [4600]
# --dims: the (head dim, value head dim) pairs to draw from instead (empty: the mix above).
DIMS: list[tuple[int, int]] = []


def length(rng: random.Random) -> int:
    if rng.random() < 0.3:
        return rng.randint(1, min(300, MAX_LEN[0]))
    return int(math.exp(rng.uniform(0.0, math.log(MAX_LEN[0]))))


def draw(seed: int, index: int, tier: str) -> dict:
    """Problem ``index`` of a run: a dict of plain values (printed, and read back by --replay)."""
    rng = random.Random(seed * 1_000_003 + index)
    dtype = rng.choice(["fp16", "bf16"] * 6 + ["fp32"] * (tier != "sm90"))
    kv_heads = rng.choice([1, 1, 2, 2, 4])
    group = rng.choice([1, 1, 2, 4, 8])
    head_dim = rng.choice([64, 64, 64, 128, 128, 128, 128, 32, 80, 96, 192, 256])
    head_dim_v = head_dim
    if rng.random() < 0.15:
        head_dim_v = rng.choice([64, 128, 32, head_dim // 2 or 1])
    elif head_dim == 192 and rng.random() < 0.6:
        head_dim_v = 128  # MLA's pair, which has kernels of its own on the Hopper tier
    if DIMS:
        head_dim, head_dim_v = rng.choice(DIMS)
    p = {
        "dtype": dtype,
        "varlen": rng.random() < 0.25,
        "heads": kv_heads * group,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "head_dim_v": head_dim_v,
        "causal": rng.random() < 0.5,
        "window": None,
        "softcap": rng.choice([None] * 6 + [20.0, 50.0]),
        "alibi": rng.random() < 0.15,
        # Sinks from four heads on: dsinks has one value a head, and the rule's max over one or
        # two values compares two single roundings (a replayed failure at one head: the kernel's
        # dsinks equalled, to fp32, the one computed in float64 from its own rounded out; the
        # fp16 reference's own error happened to be smaller).
        "sinks": kv_heads * group >= 4 and rng.random() < 0.2,
        "dlse": rng.random() < 0.25,
        "bshd": rng.random() < 0.3,
        "scale": rng.choice([None] * 4 + [0.05, 0.3]),
    }
    if p["varlen"]:
        n = rng.randint(1, 6)
        sq = [length(rng) // 2 for _ in range(n)]
        sk = sq if rng.random() < 0.6 else [length(rng) // 2 for _ in range(n)]
        p["seqlens_q"], p["seqlens_k"] = sq, sk
        longest = max(max(sq), max(sk), 1)
    else:
        p["batch"] = rng.randint(1, 3)
        p["seqlen_q"] = length(rng)
        p["seqlen_k"] = p["seqlen_q"] if rng.random() < 0.5 else length(rng)
        longest = max(p["seqlen_q"], p["seqlen_k"])
    if rng.random() < 0.2:
        p["window"] = (rng.randint(-1, longest), rng.randint(-1, longest))
    return p


def draw_cache(seed: int, index: int, tier: str) -> dict:
    """A forward-only problem against a KV cache: ``attention_with_kvcache`` (dense or paged,
    decode-sized or chunk-sized queries, any split count) or ``attention_varlen`` with a block
    table (paged prefill)."""
    rng = random.Random(seed * 1_000_003 + index)
    kv_heads = rng.choice([1, 1, 2, 2, 4, 8])
    group = rng.choice([1, 2, 4, 8])
    head_dim = rng.choice([64, 64, 128, 128, 128, 32, 80, 96, 192, 256])
    p = {
        "kind": rng.choice(["kvcache", "kvcache", "paged_varlen"]),
        "dtype": rng.choice(["fp16", "bf16"] * 6 + ["fp32"] * (tier != "sm90")),
        "heads": kv_heads * group,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "head_dim_v": head_dim if rng.random() < 0.85 else rng.choice([64, 128, 32]),
        "causal": rng.random() < 0.7,
        "window": None,
        "softcap": rng.choice([None] * 6 + [20.0, 50.0]),
        "alibi": rng.random() < 0.15,
        "sinks": kv_heads * group >= 4 and rng.random() < 0.2,
        "scale": rng.choice([None] * 4 + [0.05, 0.3]),
        "block_size": rng.choice([16, 32, 64, 128, 256]),
    }
    batch = rng.randint(1, 4)
    if p["kind"] == "kvcache":
        p["paged"] = rng.random() < 0.5
        p["num_splits"] = rng.choice([None] * 3 + [1, 2, 5, 64])
        p["seqlen_q"] = rng.choice([1] * 5 + [2, 4, 7, length(rng) // 4 + 1])
        p["capacity"] = max(1, length(rng))
        p["cache_seqlens"] = [rng.randint(0, p["capacity"]) for _ in range(batch)]
        longest = p["capacity"]
    else:
        sk = [length(rng) // 2 for _ in range(batch)]
        p["seqlens_k"] = sk
        p["seqlens_q"] = [min(s, length(rng) // 4) if rng.random() < 0.8 else length(rng) // 4
                          for s in sk]  # fmt: skip
        longest = max([*sk, 1])
    if rng.random() < 0.2:
        p["window"] = (rng.randint(-1, longest), rng.randint(-1, longest))
    return p


def scores_of(p: dict) -> int:
    if p.get("kind") == "kvcache":
        return len(p["cache_seqlens"]) * p["heads"] * p["seqlen_q"] * p["capacity"]
    if p.get("kind") == "paged_varlen" or p["varlen"]:
        return p["heads"] * sum(a * b for a, b in zip(p["seqlens_q"], p["seqlens_k"], strict=True))
    return p["batch"] * p["heads"] * p["seqlen_q"] * p["seqlen_k"]


def shrink(p: dict) -> dict:
    """Halve the lengths until the reference fits MAX_SCORES."""
    while scores_of(p) > MAX_SCORES:
        if p.get("kind") == "kvcache":
            p["seqlen_q"] = max(1, p["seqlen_q"] // 2)
            p["capacity"] = max(1, p["capacity"] // 2)
            p["cache_seqlens"] = [min(s, p["capacity"]) for s in p["cache_seqlens"]]
        elif p.get("kind") == "paged_varlen" or p["varlen"]:
            p["seqlens_q"] = [s // 2 for s in p["seqlens_q"]]
            p["seqlens_k"] = [s // 2 for s in p["seqlens_k"]]
        else:
            p["seqlen_q"], p["seqlen_k"] = max(1, p["seqlen_q"] // 2), max(1, p["seqlen_k"] // 2)
    return p


def tensors(p: dict, device: str):
    """q, k, v, the cu_seqlens of a packed batch (else ()), the sinks and the ALiBi slopes."""
    dtype = DTYPES[p["dtype"]]
    h, hkv, d, dv = p["heads"], p["kv_heads"], p["head_dim"], p["head_dim_v"]

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    if p["varlen"]:
        cu_q = torch.tensor([0, *p["seqlens_q"]], device=device).cumsum(0).int()
        cu_k = torch.tensor([0, *p["seqlens_k"]], device=device).cumsum(0).int()
        tq, tk = int(cu_q[-1]), int(cu_k[-1])
        q, k, v = rand(tq, h, d), rand(tk, hkv, d), rand(tk, hkv, dv)
        extra = (cu_q, cu_k)
        batch = len(p["seqlens_q"])
    elif p["bshd"]:
        b, sq, sk = p["batch"], p["seqlen_q"], p["seqlen_k"]
        q = rand(b, sq, h, d).transpose(1, 2)
        k, v = rand(b, sk, hkv, d).transpose(1, 2), rand(b, sk, hkv, dv).transpose(1, 2)
        extra, batch = (), b
    else:
        b, sq, sk = p["batch"], p["seqlen_q"], p["seqlen_k"]
        q, k, v = rand(b, h, sq, d), rand(b, hkv, sk, d), rand(b, hkv, sk, dv)
        extra, batch = (), b
    sinks = torch.randn(h, device=device) * 2 if p["sinks"] else None
    slopes = alibi_slopes(h, batch, device) if p["alibi"] else None
    return q, k, v, extra, sinks, slopes


class Ran:
    """Which forward and backward the last call ran: counts of the Hopper launchers' calls (the
    backward's: head dims up to 128, ``bwd_sm90``; head dim 256 and MLA's, ``bwd256``)."""

    def __init__(self) -> None:
        self.fwd = self.bwd = 0
        real_fwd = fwd_sm90.launch
        real_bwd, real_bwd256 = bwd_sm90.attn_bwd_sm90, bwd256.backward

        def fwd_hook(*a, **kw):
            self.fwd += 1
            return real_fwd(*a, **kw)

        def bwd_hook(*a, **kw):
            self.bwd += 1
            return real_bwd(*a, **kw)

        def bwd256_hook(*a, **kw):
            self.bwd += 1
            return real_bwd256(*a, **kw)

        fwd_sm90.launch, bwd_sm90.attn_bwd_sm90 = fwd_hook, bwd_hook
        bwd256.backward = bwd256_hook

    def since(self, before: tuple[int, int]) -> str:
        f = "sm90" if self.fwd > before[0] else "portable"
        b = "sm90" if self.bwd > before[1] else "portable"
        return f"fwd {f} bwd {b}"


def run(p: dict, tier: str, ran: Ran, device: str = "cuda") -> str:
    """Run and check one problem; returns which kernels ran; raises AssertionError if wrong."""
    q, k, v, extra, sinks, slopes = tensors(p, device)
    opts = {"causal": p["causal"], "scale": p["scale"], "window": p["window"],
            "softcap": p["softcap"], "alibi_slopes": slopes}  # fmt: skip
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    leaves = [t.detach().requires_grad_() for t in leaves]
    sk = leaves[3] if sinks is not None else None
    before = (ran.fwd, ran.bwd)
    with flashcore.use_tier(tier):
        if p["varlen"]:
            mq, mk = max(p["seqlens_q"]), max(p["seqlens_k"])
            out, lse = flashcore.attention_varlen(
                *leaves[:3], *extra, mq, mk, sinks=sk, return_lse=True, **opts
            )
        else:
            out, lse = flashcore.attention(*leaves[:3], sinks=sk, return_lse=True, **opts)
        dout = torch.randn_like(out)
        dlse = torch.randn_like(lse) if p["dlse"] else torch.zeros_like(lse)
        got = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    which = ran.since(before)

    def ref(dtype):
        ls = [t.detach().to(dtype).requires_grad_() for t in leaves]
        s = ls[3] if sk is not None else None
        if p["varlen"]:
            r = reference.attention_varlen(*ls[:3], *extra, sinks=s, dtype=dtype, **opts)
        else:
            r = reference.attention(*ls[:3], sinks=s, dtype=dtype, **opts)
        g = torch.autograd.grad((r.out, r.lse), ls, (dout.to(dtype), dlse.to(dtype)))
        return r, g

    ref64, want64 = ref(torch.float64)
    pt, want_pt = ref(q.dtype)
    assert_fa_rule("out", out, pt.out, ref64.out)
    assert_fa_rule("lse", lse, pt.lse, ref64.lse)
    for name, g, w, r in zip(("dq", "dk", "dv", "dsinks"), got, want_pt, want64, strict=False):
        assert_fa_rule(name, g, w, r)
    return which


def run_cache(p: dict, device: str) -> str:
    """Run and check one cache problem (``draw_cache``): out and lse, forward only."""
    dtype = DTYPES[p["dtype"]]
    h, hkv, d, dv, bs = p["heads"], p["kv_heads"], p["head_dim"], p["head_dim_v"], p["block_size"]
    gen = torch.Generator().manual_seed(torch.initial_seed() % 2**31)

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    opts = {"causal": p["causal"], "scale": p["scale"], "window": p["window"],
            "softcap": p["softcap"]}  # fmt: skip
    kvcache = p["kind"] == "kvcache"
    batch = len(p["cache_seqlens"] if kvcache else p["seqlens_k"])
    opts["sinks"] = torch.randn(h, device=device) * 2 if p["sinks"] else None
    if p["alibi"]:
        opts["alibi_slopes"] = alibi_slopes(h, batch, device)
    if kvcache:
        cap = p["capacity"]
        q = rand(batch, h, p["seqlen_q"], d)
        lens = torch.tensor(p["cache_seqlens"], dtype=torch.int32, device=device)
        table = None
        if p["paged"]:
            ks = [rand(cap, hkv, d) for _ in range(batch)]
            vs = [rand(cap, hkv, dv) for _ in range(batch)]
            kc, vc, table = paged_pools(ks, vs, bs, gen)
        else:
            kc, vc = rand(batch, hkv, cap, d), rand(batch, hkv, cap, dv)
            for b, n in enumerate(p["cache_seqlens"]):  # past the valid keys: never read
                kc[b, :, n:], vc[b, :, n:] = float("nan"), float("nan")
        out, lse = flashcore.attention_with_kvcache(
            q, kc, vc, cache_seqlens=lens, block_table=table, num_splits=p["num_splits"],
            return_lse=True, **opts,
        )  # fmt: skip

        def ref(dt):
            return reference.attention_with_kvcache(
                q, kc, vc, cache_seqlens=lens, block_table=table, dtype=dt, **opts
            )
    else:
        sq, sk = p["seqlens_q"], p["seqlens_k"]
        cu_q = torch.tensor([0, *sq], device=device).cumsum(0).int()
        cu_k = torch.tensor([0, *sk], device=device).cumsum(0).int()
        q = rand(int(cu_q[-1]), h, d)
        k, v = rand(int(cu_k[-1]), hkv, d), rand(int(cu_k[-1]), hkv, dv)
        bounds = list(zip(cu_k[:-1].tolist(), cu_k[1:].tolist(), strict=True))
        kc, vc, table = paged_pools(
            [k[a:b] for a, b in bounds], [v[a:b] for a, b in bounds], bs, gen
        )
        out, lse = flashcore.attention_varlen(
            q, kc, vc, cu_q, cu_k, max(sq), max(sk), block_table=table, return_lse=True, **opts
        )

        def ref(dt):
            return reference.attention_varlen(q, k, v, cu_q, cu_k, dtype=dt, **opts)

    ref64, pt = ref(torch.float64), ref(dtype)
    assert_fa_rule("out", out, pt.out, ref64.out)
    assert_fa_rule("lse", lse, pt.lse, ref64.lse)
    return p["kind"] + (" paged" if p.get("paged") else "")


def check(p: dict, tier: str, ran: Ran, device: str) -> str:
    """One problem of either kind on ``tier``; raises if it is wrong."""
    if "kind" in p:
        with flashcore.use_tier(tier):
            return run_cache(p, device)
    return run(p, tier, ran, device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiers", default="sm90,portable")
    ap.add_argument(
        "--kinds",
        default="attention,cache",
        help="attention: attention and attention_varlen, forward and backward; "
        "cache: attention_with_kvcache and paged attention_varlen, forward",
    )
    ap.add_argument("--replay", help="a problem line this script printed (its dict and tier)")
    ap.add_argument("--max-len", type=int, default=4600)
    ap.add_argument(
        "--dims",
        default="",
        help="attention problems' head dims only from these, e.g. 192:128,256 (D or D:Dv)",
    )
    ap.add_argument("--device", default="cuda", help="cpu: the interpreter")
    args = ap.parse_args()
    ran = Ran()
    MAX_LEN[0] = args.max_len
    for item in filter(None, args.dims.split(",")):
        d, _, dv = item.partition(":")
        DIMS.append((int(d), int(dv or d)))
    if args.replay:
        # "<tier> #<index> seed <seed> {...}": the same tensors as in the run that printed it.
        tier, index, _, seed, problem = args.replay.split(" ", 4)
        torch.manual_seed(int(seed) * 1_000_003 + int(index[1:]))
        problem = ast.literal_eval(problem[: problem.rindex("}") + 1])
        print(check(problem, tier, ran, args.device))
        return 0
    tiers, kinds = args.tiers.split(","), args.kinds.split(",")
    start, failed, done, index = time.monotonic(), 0, 0, 0
    while time.monotonic() - start < args.seconds:
        tier = tiers[index % len(tiers)]
        kind = kinds[index // len(tiers) % len(kinds)]
        p = shrink((draw_cache if kind == "cache" else draw)(args.seed, index, tier))
        torch.manual_seed(args.seed * 1_000_003 + index)
        index += 1
        try:
            which = check(p, tier, ran, args.device)
            verdict = f"ok ({which})"
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            verdict = "skipped (out of memory in the reference)"
        except Exception as e:  # a valid problem that raises is as wrong as a wrong number
            failed += 1
            verdict = f"FAILED: {type(e).__name__}: {e}"
        done += 1
        print(f"{tier} #{index - 1} seed {args.seed} {p} -> {verdict}", flush=True)
    print(f"{done} problems, {failed} failed, seed {args.seed}, {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
