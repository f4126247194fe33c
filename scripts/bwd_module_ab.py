"""A/B of two versions of the Hopper backward's kernel module in one process, on an H100:

    mkdir /tmp/base && for f in bwd bwd_load bwd_steps bwd_rows; do
        git show HEAD:src/flashcore/kernels/hopper/$f.py > /tmp/base/$f.py; done
    PYTHONPATH=src python scripts/bwd_module_ab.py /tmp/base [--rounds 5] [--cases causal,packed]

``BASE`` is a directory with another version of ``src/flashcore/kernels/hopper/bwd.py`` and of
any of the modules it draws on (``MODULES``: those present stand in for the tree's in its
imports, the others are the tree's), or one file, a ``bwd.py`` of its own (as the kernel was
before its producer, consumers and row kernels moved to ``bwd_load.py``, ``bwd_steps.py`` and
``bwd_rows.py``). It is imported as a package of its own and the tree's modules are the other
side. Both run through ``ops.bwd_sm90.attn_bwd_sm90`` with the same plans (its ``kernels()``
swapped per side), so only the kernels differ. bf16, 32k
tokens, 16 heads at D = 128 and 32 at D = 64. Case groups (``--cases``):

- ``causal``, ``full``: dense causal and non-causal D = 128 at S 1024 ... 16384, one ragged
  length (3000);
- ``window``, ``softcap``, ``alibi``: causal with a (256, 0) window, softcap 30 or ALiBi slopes
  (2048, 8192); ``window`` also causal (128, 0) at D = 64 and non-causal (256, 256) at D = 128
  (FLOPs of the pairs a window leaves visible); ``widewindow``: causal (4095, 0) at 16384 (D = 128
  and 64) and non-causal (1024, 1024) at 8192 (D = 128);
- ``packed``: packed causal and non-causal batches at D = 128 (lengths drawn in 500..4000);
  ``packedwindow``: one causal with gpt-oss's (127, 0) window, one non-causal with (256, 256);
- ``windowoptions``: causal windows with a score option: (4095, 0) with softcap 50 at 8192 (D =
  128), (256, 0) with ALiBi at 2048 (D = 128), (127, 0) with softcap 30 at 8192 (D = 64);
- ``fulloptions``: non-causal softcap 30 and ALiBi at 2048 and 8192, and softcap 30 with a
  (256, 256) window at 8192 (D = 128);
- ``controls``: non-causal D = 128 and causal D = 64 at 8192;
- ``short``: dense D = 128 and D = 64, causal and not, at 512, 1024 and 2048;
- ``gqa``: GQA (four query heads a kv head; eight with gpt-oss's 128-key window at D = 64) on
  grouped programs: causal D = 128 and 64 at 512 ... 4096, windows, non-causal 4096.

Prints TFLOP/s of each side (2.5x the forward's FLOPs, halved causal; packed from the sequences'
own lengths), the ratio of the medians (tree / base, > 1: the tree is faster) with the range of the
per-round ratios, whether dK and dV are bit for bit equal and dQ's largest difference (its
reduce-adds' order varies between runs).
"""

import argparse
import functools
import importlib
import sys

import torch
from dq_rows_ab import problem, rates_and_ratio, rotated
from fwd_module_ab import base_package

from flashcore.bench.metrics import visible_pairs
from flashcore.ops import bwd_sm90 as sm90
from flashcore.ops import fwd
from flashcore.ops import problem as pb
from flashcore.ops.launch import Launcher

TOKENS = 32768
MODULES = ("bwd", "bwd_load", "bwd_steps", "bwd_rows", "bwd_dq", "common")


def base_modules(path: str):
    """``(kernel module, row-kernel module)`` of the other side (see the docstring), imported as
    the package ``bwd_ab_base``."""
    present = base_package(path, MODULES, ("bwd",), "bwd_ab_base")
    kernel = importlib.import_module("bwd_ab_base.bwd")
    if "bwd_rows" in present:
        return kernel, importlib.import_module("bwd_ab_base.bwd_rows")
    if hasattr(kernel, "bwd_prep_kernel"):  # a bwd.py from before the split
        return kernel, kernel
    from flashcore.kernels.hopper import bwd_rows

    return kernel, bwd_rows


def launchers(module, rows):
    main = Launcher(module.attn_bwd_sm90_kernel, 16)
    known = set(module.attn_bwd_sm90_kernel.arg_names)

    def launch(grid, args, meta, planned=False):
        # An older module lacks the newer flags (constexprs the tree's plans set): it runs
        # without them, as it always did, through the full key (the filtered dict is new).
        kept = {k: v for k, v in meta.items() if k in known or not k.isupper()}
        if len(kept) == len(meta):
            main(grid, args, meta, planned=planned)
        else:
            main(grid, args, kept)

    return Launcher(rows.bwd_prep_kernel, 7), launch


def dense(seqlen, head_dim, causal, option, group=1):
    heads = 2048 // head_dim
    batch = max(1, TOKENS // seqlen)
    args, opts = problem(batch, heads, seqlen, head_dim, causal, option, group)
    pairs = visible_pairs(seqlen, seqlen, causal, opts.get("window"))
    flops = 2.5 * 4 * batch * heads * pairs * head_dim
    name = f"D{head_dim} {'causal' if causal else 'full'} {option or 'plain'} S{seqlen} B{batch}"
    name = name if group == 1 else f"GQA{group} {name}"
    return name, flops, functools.partial(sm90.attn_bwd_sm90, *args, **opts)


def packed(causal, seed, window=None):
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < TOKENS - 4000:
        lengths.append(int(torch.randint(500, 4001, (1,), generator=gen)))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda").int()
    total, heads, head_dim = int(cu[-1]), 16, 128
    q, k, v, dout = (
        torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    varlen = pb.Varlen(cu, cu, max(lengths), max(lengths))
    scale = head_dim**-0.5
    opts = {} if window is None else {"window": window}
    out, lse = fwd.launch(q, k, v, causal, scale, varlen=varlen, **opts)[:2]
    flops = sum(2.5 * 4 * heads * visible_pairs(n, n, causal, window) * head_dim for n in lengths)
    name = f"D128 {'causal' if causal else 'full'} packed {len(lengths)} seqs {total} tokens"
    name = name if window is None else f"{name} window {window}"
    return (
        name,
        flops,
        functools.partial(
            sm90.attn_bwd_sm90, dout, q, k, v, out, lse, causal, scale, varlen=varlen, **opts
        ),
    )


CASES = {
    "causal": lambda: [dense(s, 128, True, "") for s in (1024, 2048, 3000, 4096, 8192, 16384)],
    "full": lambda: [dense(s, 128, False, "") for s in (1024, 2048, 3000, 4096, 8192, 16384)],
    **{
        option: functools.partial(lambda o: [dense(s, 128, True, o) for s in (2048, 8192)], option)
        for option in ("softcap", "alibi")
    },
    "window": lambda: [
        dense(s, d, c, o)
        for d, c, o in ((128, True, "window"), (64, True, "window128"), (128, False, "window2"))
        for s in (2048, 8192)
    ],
    "widewindow": lambda: [
        dense(16384, 128, True, "window4k"),
        dense(16384, 64, True, "window4k"),
        dense(8192, 128, False, "window1k2"),
    ],
    "packed": lambda: [packed(True, 0), packed(True, 1), packed(False, 0)],
    "packedwindow": lambda: [packed(True, 0, (127, 0)), packed(False, 1, (256, 256))],
    "windowoptions": lambda: [
        dense(8192, 128, True, "window4k-softcap"),
        dense(2048, 128, True, "window-alibi"),
        dense(8192, 64, True, "window128-softcap"),
    ],
    "fulloptions": lambda: [
        *(dense(s, 128, False, o) for o in ("softcap", "alibi") for s in (2048, 8192)),
        dense(8192, 128, False, "window2-softcap"),
    ],
    "gqa": lambda: [
        *(dense(s, d, True, "", 4) for d in (128, 64) for s in (512, 1024, 2048, 4096)),
        dense(2048, 128, True, "window", 4),
        dense(2048, 64, True, "window128", 8),
        dense(2048, 128, False, "window2", 4),
        dense(4096, 128, False, "", 4),
    ],
    "controls": lambda: [dense(8192, 128, False, ""), dense(8192, 64, True, "")],
    "short": lambda: [
        dense(s, d, c, "") for d in (128, 64) for c in (True, False) for s in (512, 1024, 2048)
    ],
}


def compare(name, flops, call, sides, rounds) -> str:
    results = {}
    for side, kern in sides.items():
        sm90.kernels = kern
        results[side] = [t.clone() for t in call()[:3]]
    base, tree = results["base"], results["tree"]
    same_kv = all(torch.equal(a, b) for a, b in zip(base[1:], tree[1:], strict=True))
    dq_diff = (base[0].float() - tree[0].float()).abs().max().item()
    timed = rotated(
        dict.fromkeys(sides, call), rounds, lambda side: setattr(sm90, "kernels", sides[side])
    )
    rates, ratio = rates_and_ratio(*timed, flops, "tree", "base")
    return f"{name}: {rates} tree/base {ratio} dk,dv equal {same_kv} dq maxdiff {dq_diff:.2e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="a directory of other versions of MODULES, or a bwd.py")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="causal,full,window,softcap,alibi,packed,controls")
    args = parser.parse_args()
    base = base_modules(args.base)
    from flashcore.kernels.hopper import bwd, bwd_rows

    sides = {
        "base": functools.cache(lambda: launchers(*base)),
        "tree": functools.cache(lambda: launchers(bwd, bwd_rows)),
    }
    torch.manual_seed(0)
    for group in args.cases.split(","):
        for name, flops, call in CASES[group]():
            print(compare(name, flops, call, sides, args.rounds), flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
