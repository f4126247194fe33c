"""Packed (varlen) forward or backward on the GPU: FlashCore's tiers side by side, and
FlashAttention-4's varlen function when ``flash_attn.cute`` imports.

Each batch is a list of sequence lengths (queries = keys), packed ``(total, H, D)`` bf16; every
provider runs in this process, timed with ``triton.testing.do_bench`` (median of its repetitions)
over ``--rounds`` rotated rounds. FLOPs count each sequence's visible (query, key) pairs: ``4 H D
L^2`` non-causal, ``4 H D L (L + 1) / 2`` causal. As a yardstick without varlen, "dense" runs
the same token count as one ``(B, H, L, D)`` batch of equal lengths (``--dense-len``) through
"auto" and through cuDNN's SDPA.

``--mode bwd`` times the backward alone (``torch.autograd.grad`` of out, from one forward kept
for the repetitions), for the tiers ("portable", "sm90", "auto") and FA4, at 2.5 times the
forward's FLOPs.

Usage: PYTHONPATH=src python scripts/varlen_bench.py [--rounds 2] [--mode bwd] [--set short]
[--providers portable,sm90]
"""

from __future__ import annotations

import argparse
import random

import torch
import triton

import flashcore


def batches() -> dict[str, list[int]]:
    rng = random.Random(0)
    return {
        "mixed256-4k": [rng.randint(256, 4096) for _ in range(16)],
        "equal2k": [2048] * 16,
        "short16-512": [rng.randint(16, 512) for _ in range(192)],
        "long8k+tail": [8192, 8192, 1000, 77, 3],
    }


def short_batches() -> dict[str, list[int]]:
    """Lengths uniform in [m/2, 3m/2] for a mean m of 64..1024, about 32k tokens each, and two
    smaller batches of 4k tokens: where "auto" should start taking the Hopper backward for a
    packed batch (``--set short``)."""
    rng = random.Random(1)
    out = {}
    for mean, tokens in ((64, 32768), (128, 32768), (256, 32768), (512, 32768), (1024, 32768),
                         (128, 4096), (512, 4096)):  # fmt: skip
        lengths: list[int] = []
        while sum(lengths) < tokens:
            lengths.append(rng.randint(mean // 2, 3 * mean // 2))
        out[f"u{mean}x{len(lengths)}"] = lengths
    return out


def flops(lengths: list[int], heads: int, head_dim: int, causal: bool) -> float:
    pairs = sum(n * (n + 1) / 2 if causal else n * n for n in lengths)
    return 4.0 * heads * head_dim * pairs


def direct(q, k, v, cu, top, causal, persistent, use_work_list=True):
    """The Hopper forward's launch with the launcher's config for these lengths, its schedule
    forced (``persistent``), over the work list or, with ``use_work_list`` off, sized by the
    longest sequence; planned once: the kernel alone, no dispatch (the work list is built at
    every call, as the API's calls do)."""
    from flashcore.ops import fwd_sm90, fwd_sm90_configs
    from flashcore.ops import problem as pb

    varlen = pb.Varlen(cu, cu, top, top)
    batch, heads, head_dim = cu.shape[0] - 1, q.shape[1], q.shape[2]
    sc = pb.scores(causal, (-1, -1), 0.0, head_dim**-0.5, False, top, top)
    lse = torch.empty(heads, q.shape[0], device=q.device)
    out = torch.empty_like(q)
    grid = (batch * heads, fwd_sm90.num_sms(q.device.index))
    cfg = fwd_sm90_configs.pick_config(head_dim, top, top, causal, False, grid=grid)
    cfg = cfg._replace(persistent=persistent)
    p = fwd_sm90.plan(
        q, k, v, lse, causal=sc.is_causal, qk_scale=sc.qk_scale, window_left=sc.window_left,
        window_right=sc.window_right, has_window=sc.has_window, softcap=sc.softcap, alibi=False,
        sinks=False, stride_ab=0, config=cfg, varlen=varlen, out_strides=out.stride()[:2],
        use_work_list=use_work_list,
    )  # fmt: skip
    return lambda: fwd_sm90.launch(p, q, k, v, out, lse, None, None, varlen)


def fa4_varlen():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # FA4 absent or broken: skip the provider
        return None
    return flash_attn_varlen_func


def backward(forward, q, k, v):
    """The backward of one ``forward()`` call (each tier's under its own ``use_tier``, which the
    graph does not keep, so the tier is held around each backward too)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    tier = getattr(forward, "tier", None)
    with flashcore.use_tier(tier or "auto"):
        out = forward(q, k, v)
    out = out[0] if isinstance(out, tuple) else out
    dout = torch.randn_like(out)

    def run():
        with flashcore.use_tier(tier or "auto"):
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--mode", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument("--set", choices=("main", "short"), default="main")
    parser.add_argument("--providers", default=None, help="comma-separated subset")
    args = parser.parse_args()
    fa4 = fa4_varlen()
    dev = "cuda"
    for head_dim in map(int, args.head_dims.split(",")):
        sets = batches() if args.set == "main" else short_batches()
        for name, lengths in sets.items():
            for causal in (False, True):
                total = sum(lengths)
                q, k, v = (
                    torch.randn(total, args.heads, head_dim, dtype=torch.bfloat16, device=dev)
                    for _ in range(3)
                )
                cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
                cu = cu.to(torch.int32)
                top = max(lengths)

                def tier(t, q=q, k=k, v=v, cu=cu, top=top, causal=causal):
                    def run(q=q, k=k, v=v):
                        with flashcore.use_tier(t):
                            return flashcore.attention_varlen(
                                q, k, v, cu, cu, top, top, causal=causal
                            )

                    run.tier = t
                    return run

                providers = {t: tier(t) for t in ("portable", "sm90", "auto")}
                if fa4 is not None:
                    providers["fa4"] = lambda q=q, k=k, v=v, cu=cu, top=top, causal=causal: fa4(
                        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=top,
                        max_seqlen_k=top, causal=causal,
                    )  # fmt: skip
                keep = args.providers.split(",") if args.providers else None
                if keep:
                    providers = {p: f for p, f in providers.items() if p in keep}
                fl = flops(lengths, args.heads, head_dim, causal)
                if args.mode == "bwd":
                    providers = {p: backward(f, q, k, v) for p, f in providers.items()}
                    fl *= 2.5
                else:
                    providers["sm90-flat"] = direct(q, k, v, cu, top, causal, False)
                    providers["sm90-longest"] = direct(q, k, v, cu, top, causal, False, False)
                    providers["sm90-persistent"] = direct(q, k, v, cu, top, causal, True)
                    if keep:
                        providers = {p: f for p, f in providers.items() if p in keep}
                times: dict[str, list[float]] = {p: [] for p in providers}
                for r in range(args.rounds):
                    order = list(providers)
                    order = order[r % len(order) :] + order[: r % len(order)]
                    for p in order:
                        times[p].append(triton.testing.do_bench(providers[p], warmup=25, rep=100))
                cells = []
                for p, ts in times.items():
                    best = sorted(ts)[len(ts) // 2]
                    cells.append(f"{p} {best * 1e3:8.1f} us {fl / best / 1e9:6.1f} TF/s")
                label = f"D={head_dim} {name:12s} {'causal' if causal else 'full  '} tokens={total}"
                print(label, " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
