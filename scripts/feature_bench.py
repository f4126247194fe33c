"""Cost of the 2026 features on the GPU: sinks against no sinks, and MLA head dims (D=192,
Dv=128) against PyTorch's SDPA, forward and backward, ``triton.testing.do_bench`` medians
("flashcore-sm90": the Hopper tier forced; ``--mla-sm90`` lets its forward take the MLA dims).

    PYTHONPATH=src python scripts/feature_bench.py [--out results.jsonl]

Sinks: the FA sweep's 4k points (batch 4, hidden 2048, bf16), causal and not. MLA: batch 2 (4k)
or 1 (8k), 16 heads. The backward is timed as ``autograd.grad`` of a forward output whose graph
is kept (``retain_graph``), so it includes the backward's host path but not the forward.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import flashcore


def tflops(flops: float, ms: float) -> float:
    return flops / ms * 1e-9


def time_fwd_bwd(fn, inputs) -> tuple[float, float]:
    fwd_ms = do_bench(lambda: fn(*inputs), return_mode="median")
    out = fn(*inputs)
    dout = torch.randn_like(out)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    bwd_ms = do_bench(
        lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True), return_mode="median"
    )
    return fwd_ms, bwd_ms


def sinks_cost(rows: list) -> None:
    for head_dim in (64, 128):
        heads = 2048 // head_dim
        for causal in (False, True):
            shape = (4, heads, 4096, head_dim)
            q, k, v = (
                torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            )
            sinks = torch.randn(heads, device="cuda", requires_grad=True)
            base = time_fwd_bwd(
                lambda q, k, v, c=causal: flashcore.attention(q, k, v, causal=c), (q, k, v)
            )
            with_sinks = time_fwd_bwd(
                lambda q, k, v, s, c=causal: flashcore.attention(q, k, v, causal=c, sinks=s),
                (q, k, v, sinks),
            )
            row = {
                "case": "sinks", "head_dim": head_dim, "causal": causal, "seqlen": 4096,
                "fwd_ms": base[0], "fwd_sinks_ms": with_sinks[0],
                "bwd_ms": base[1], "bwd_sinks_ms": with_sinks[1],
                "fwd_cost": with_sinks[0] / base[0] - 1, "bwd_cost": with_sinks[1] / base[1] - 1,
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)


def sm90_attention(q, k, v, causal):
    """``flashcore.attention`` with the Hopper tier forced (its backward stays portable at these
    head dims); with ``--mla-sm90`` the forward's MLA build runs before it is enabled."""
    with flashcore.use_tier("sm90"):
        return flashcore.attention(q, k, v, causal=causal)


def mla(rows: list) -> None:
    for seqlen, batch in ((4096, 2), (8192, 1)):
        for causal in (False, True):
            heads, d, dv = 16, 192, 128
            q = torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn_like(q)
            v = torch.randn(batch, heads, seqlen, dv, device="cuda", dtype=torch.bfloat16)
            for t in (q, k, v):
                t.requires_grad_()
            flops = 2.0 * batch * heads * seqlen * seqlen * (d + dv) / (2 if causal else 1)
            row = {"case": "mla", "seqlen": seqlen, "batch": batch, "causal": causal}
            providers = {
                "flashcore": lambda q, k, v, c=causal: flashcore.attention(q, k, v, causal=c),
                "flashcore-sm90": lambda q, k, v, c=causal: sm90_attention(q, k, v, c),
                "sdpa": lambda q, k, v, c=causal: F.scaled_dot_product_attention(
                    q, k, v, is_causal=c
                ),
            }
            for name, fn in providers.items():
                try:
                    fwd_ms, bwd_ms = time_fwd_bwd(fn, (q, k, v))
                except RuntimeError as e:
                    row[name] = f"error: {str(e)[:80]}"
                    continue
                row[f"{name}_fwd_tflops"] = tflops(flops, fwd_ms)
                row[f"{name}_bwd_tflops"] = tflops(2.5 * flops, bwd_ms)
            print(json.dumps(row), flush=True)
            rows.append(row)


def portable(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under ``flashcore.use_tier("portable")``."""
    with flashcore.use_tier("portable"):
        return fn(*args, **kwargs)


def prefill(rows: list) -> None:
    """Chunked prefill: 1024 new queries per sequence against 8k keys (4 sequences, 32 query
    heads on 8 kv heads, D=128, causal): dense packed varlen, paged varlen (block_table) and
    attention_with_kvcache on the same paged cache."""
    batch, chunk, length, heads, kv_heads, d = 4, 1024, 8192, 32, 8, 128
    dt = torch.bfloat16
    q = torch.randn(batch * chunk, heads, d, device="cuda", dtype=dt)
    k = torch.randn(batch * length, kv_heads, d, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    cu_q = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * chunk
    cu_k = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * length
    flops = 4.0 * batch * heads * chunk * (length - chunk / 2) * d
    lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    q4 = q.view(batch, chunk, heads, d).transpose(1, 2)
    for block_size in (16, 32, 64, 256):
        per_seq = length // block_size
        pages = k.view(batch * per_seq, block_size, kv_heads, d).transpose(1, 2).contiguous()
        vpages = v.view(batch * per_seq, block_size, kv_heads, d).transpose(1, 2).contiguous()
        perm = torch.randperm(batch * per_seq, device="cuda")
        k_cache, v_cache = torch.empty_like(pages), torch.empty_like(vpages)
        k_cache[perm], v_cache[perm] = pages, vpages
        table = perm.view(batch, per_seq).to(torch.int32)
        runs = {
            "varlen_dense": lambda: flashcore.attention_varlen(
                q, k, v, cu_q, cu_k, chunk, length, causal=True
            ),
            "varlen_paged": lambda t=table, kc=k_cache, vc=v_cache: flashcore.attention_varlen(
                q, kc, vc, cu_q, cu_k, chunk, length, causal=True, block_table=t
            ),
            # The same call on the portable forward (the Hopper one takes power-of-two pages).
            "varlen_paged_portable": lambda t=table, kc=k_cache, vc=v_cache: portable(
                flashcore.attention_varlen,
                q,
                kc,
                vc,
                cu_q,
                cu_k,
                chunk,
                length,
                causal=True,
                block_table=t,
            ),
            "kvcache_paged": lambda t=table, kc=k_cache, vc=v_cache: (
                flashcore.attention_with_kvcache(
                    q4, kc, vc, cache_seqlens=lens, block_table=t, causal=True
                )
            ),
        }
        row = {"case": "prefill", "block_size": block_size, "chunk": chunk, "keys": length}
        for name, fn in runs.items():
            ms = do_bench(fn, return_mode="median")
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = tflops(flops, ms)
        row["paged_vs_dense"] = row["varlen_paged_ms"] / row["varlen_dense_ms"]
        row["portable_vs_paged"] = row["varlen_paged_portable_ms"] / row["varlen_paged_ms"]
        row["kvcache_vs_dense"] = row["kvcache_paged_ms"] / row["varlen_dense_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--cases", default="sinks,mla,prefill")
    parser.add_argument(
        "--mla-sm90",
        action="store_true",
        help="let the Hopper forward take the MLA head dims (ops/fwd_sm90.py: MLA_VERIFIED) for "
        "the flashcore-sm90 provider, before it is enabled by default",
    )
    args = parser.parse_args()
    if args.mla_sm90:
        from flashcore.ops import fwd_sm90

        fwd_sm90.MLA_VERIFIED = True
    rows: list = []
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    parser_cases = args.cases.split(",")
    if "sinks" in parser_cases:
        sinks_cost(rows)
    if "mla" in parser_cases:
        mla(rows)
    if "prefill" in parser_cases:
        prefill(rows)
    if args.out:
        with open(args.out, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
