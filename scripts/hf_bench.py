"""Device-side: FlashCore's transformers backend against transformers' own attention, one run.

Usage: PYTHONPATH=src python scripts/hf_bench.py [--batch 8 --seqlen 2048 --pad 0.25 ...]

A Llama-shaped model with random weights (no download): prefill forward, one training step
(forward + backward, no cache) and greedy decoding with a KV cache, on a left-padded batch (the
first ``--pad`` of rows' tokens are padding, in a ramp from 0 to that fraction) and on the same
batch unpadded. Times are medians of ``triton.testing.do_bench`` (quantiles 0.2 and 0.8 for the
spread); decoding is timed as whole ``generate`` calls. Every provider runs in this one process on
the same weights and inputs; a provider that raises is reported with its error.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from triton.testing import do_bench

import flashcore
from flashcore.integrations.transformers import register


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--pad", type=float, default=0.25, help="largest fraction of a row padded")
    p.add_argument("--new-tokens", type=int, default=64, help="0: no generate timing")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sliding-window", type=int, default=None, help="Mistral-style window")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--providers", default="fcore,sdpa,flash_attention_2")
    p.add_argument(
        "--static", action="store_true",
        help="also time generate with a static cache (transformers compiles its decoding step "
        "with torch.compile(mode='reduce-overhead'))",
    )  # fmt: skip
    p.add_argument("--masks", default="padded,unpadded", help="which of the two masks to run")
    p.add_argument(
        "--tier", choices=["auto", "portable", "sm90"], default="auto",
        help="flashcore.use_tier for FlashCore's rows",
    )  # fmt: skip
    return p.parse_args()


def main() -> None:
    args = parse()
    name = register()
    dtype = getattr(torch, args.dtype)
    config = transformers.MistralConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.seqlen + args.new_tokens,
        sliding_window=args.sliding_window, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).to("cuda", dtype).eval()
    ids = torch.randint(3, config.vocab_size, (args.batch, args.seqlen), device="cuda")
    padded = torch.ones_like(ids)
    for row in range(args.batch):
        padded[row, : int(args.pad * args.seqlen * row / max(args.batch - 1, 1))] = 0
    masks = {"padded": padded, "unpadded": torch.ones_like(ids)}
    masks = {label: masks[label] for label in args.masks.split(",")}
    providers = [name if p == "fcore" else p for p in args.providers.split(",")]
    print(f"# {torch.cuda.get_device_name()}, transformers {transformers.__version__}, {args}")
    header = "provider           mask      prefill ms        train step ms     generate ms"
    print(header + ("       static+compile generate ms" if args.static else ""))
    for provider in providers:
        for label, mask in masks.items():
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            try:
                model.set_attn_implementation(provider)
                with flashcore.use_tier(args.tier):
                    cells = [bench_prefill(model, ids, mask), bench_train(model, ids, mask)]
                if args.new_tokens:
                    cells.append(bench_generate(model, ids, mask, args.new_tokens))
                if args.static:
                    cells.append(bench_generate(model, ids, mask, args.new_tokens, static=True))
            except Exception as e:  # a provider that cannot run here: say why, go on
                print(f"{provider:18} {label:9} {type(e).__name__}: {str(e)[:120]}")
                continue
            # Allocations that had to free cached blocks first (each synchronises the device).
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
            print(f"{provider:18} {label:9} " + " ".join(f"{c:17}" for c in cells), end="")
            print(f"  alloc retries {retries}")


# do_bench's default 100 ms window holds one or two training steps of the default model (about
# 64 ms each at 12 layers, 4k tokens): 2 s gives about 30.
REP_MS = 2000


def fmt(times: tuple[float, float, float]) -> str:
    median, low, high = times
    return f"{median:.2f} [{low:.2f}, {high:.2f}]"


def bench_prefill(model, ids, mask) -> str:
    def run():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)

    return fmt(do_bench(run, rep=REP_MS, quantiles=[0.5, 0.2, 0.8]))


def bench_train(model, ids, mask) -> str:
    labels = ids.masked_fill(mask == 0, -100)

    def run():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()

    return fmt(do_bench(run, rep=REP_MS, quantiles=[0.5, 0.2, 0.8]))


def bench_generate(model, ids, mask, new_tokens: int, static: bool = False) -> str:
    """Whole greedy ``generate`` calls; ``static``: with a static cache, which transformers
    compiles (reduce-overhead: CUDA graphs); one untimed call first compiles it."""
    extra = {"cache_implementation": "static"} if static else {}

    def run():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **extra,
        )  # fmt: skip

    if static:
        torch._dynamo.reset()
        run()
    return fmt(do_bench(run, warmup=1, rep=5000, quantiles=[0.5, 0.2, 0.8]))


if __name__ == "__main__":
    main()
