"""A/B of two versions of the Hopper forward's kernel modules in one process, on a GPU machine:

    mkdir /tmp/base && for f in fwd fwd_steps fwd_load common; do
        git show HEAD:src/flashcore/kernels/hopper/$f.py > /tmp/base/$f.py; done
    PYTHONPATH=src python scripts/fwd_module_ab.py /tmp/base [--rounds 3] [--cases 128:8192:0,...]

``BASE`` is a directory with another version of ``src/flashcore/kernels/hopper``'s ``fwd.py``,
``fwd_steps.py``, ``fwd_load.py`` and ``common.py``; it is imported as a package of its own (its
imports of ``flashcore.kernels.hopper`` pointed at it) and the tree's modules are the other side.
Both run through ``flashcore.attention`` under ``use_tier("sm90")`` with the same plans, only
``ops.fwd_sm90.launcher`` switched per side, so only the kernels differ. A case is
``D:S:causal[:Dv[:B[:H]]]`` (causal 0 or 1), bf16, by default 16k tokens of 2048 / D heads (16
heads past 128); ``--window L,R`` gives every case that local window (FLOPs of the pairs it leaves
visible).
Prints TFLOP/s of each side (``2 B H S^2 (D + Dv)``, halved causal), the ratio of the medians
(tree / base, > 1: the tree is faster) with the range of the per-round ratios, and whether the
outputs are bit for bit equal. Rotated rounds of ``do_bench``, medians (``dq_rows_ab.rotated``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
import tempfile
from pathlib import Path

import torch
from dq_rows_ab import rates_and_ratio, rotated

import flashcore
from flashcore.bench import cases as bench_cases
from flashcore.bench.metrics import visible_pairs
from flashcore.ops import fwd, fwd_sm90
from flashcore.ops.launch import Launcher

CASES = "128:2048:0,128:8192:0,128:16384:0,128:2048:1,128:8192:1,64:8192:0,64:16384:1"
MODULES = ("fwd", "fwd_steps", "fwd_load", "common")


def base_package(source: str, modules: tuple[str, ...], required: tuple[str, ...], name: str):
    """Other versions of ``kernels/hopper`` modules imported as the package ``name``: ``source``
    a directory holding some of ``modules`` (each ``.py``), or one file standing for
    ``modules[0]``; every one of ``required`` must be there. Imports of a module present point at
    the package's copy, the others stay the tree's. Returns the names present."""
    path = Path(source)
    files = {m: path / f"{m}.py" for m in modules} if path.is_dir() else {modules[0]: path}
    files = {m: file for m, file in files.items() if file.is_file()}
    missing = [m for m in required if m not in files]
    if missing:
        raise SystemExit(f"{source}: no {', '.join(m + '.py' for m in missing)}")
    package = Path(tempfile.mkdtemp()) / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    ours = re.compile(r"\bflashcore\.kernels\.hopper\.(" + "|".join(files) + r")\b")
    for module, file in files.items():
        (package / f"{module}.py").write_text(ours.sub(name + r".\1", file.read_text()))
    sys.path.insert(0, str(package.parent))
    return list(files)


def base_launcher(directory: str) -> Launcher:
    """The forward kernel of the modules in ``directory``, as a package named ``ab_base``."""
    base_package(directory, MODULES, MODULES, "ab_base")
    return Launcher(importlib.import_module("ab_base.fwd").attn_fwd_sm90_kernel, 12)


def ab(case: str, old: str, new: str, select, rounds: int, label: str, window=None) -> str:
    """Case ``D:S:causal[:Dv[:B[:H]]]`` (bf16; by default 16k tokens of 2048 / D heads, 16 past
    128) through ``flashcore.attention`` under ``use_tier("sm90")`` (with ``window``, a local
    window), timed on sides ``old`` and ``new`` (``select(side)`` switches, and leaves ``new``
    on); its line of results, the ratio (old / new time) printed as ``label``."""
    head_dim, seqlen, causal, *rest = (int(x) for x in case.split(":"))
    head_dim_v = rest[0] if rest else head_dim
    batch = rest[1] if len(rest) > 1 else max(1, 16384 // seqlen)
    heads = rest[2] if len(rest) > 2 else 2048 // head_dim if head_dim <= 128 else 16
    q, k = (
        torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    v = torch.randn(batch, heads, seqlen, head_dim_v, device="cuda", dtype=torch.bfloat16)

    def call():
        with flashcore.use_tier("sm90"):
            return flashcore.attention(q, k, v, causal=bool(causal), window=window)

    outs = {}
    for side in (old, new):
        select(side)
        outs[side] = call()
    timed = rotated(dict.fromkeys((old, new), call), rounds, select)
    select(new)
    pairs = visible_pairs(seqlen, seqlen, bool(causal), window)
    flops = 2 * batch * heads * pairs * (head_dim + head_dim_v)
    rates, ratio = rates_and_ratio(*timed, flops, new, old)
    kind = ("causal" if causal else "full") + (f" window {window}" if window else "")
    return (
        f"D{head_dim}:{head_dim_v} S{seqlen} {kind} B{batch} H{heads}:"
        f" {rates} {label} {ratio} equal {torch.equal(outs[old], outs[new])}"
    )


def compare(case: str, sides: dict[str, Launcher], rounds: int, window=None) -> str:
    def select(side):
        fwd_sm90.launcher = functools.partial(lambda s: sides[s], side)
        # The plans and the express path's kept launches (``fwd.Quick`` binds the launcher it
        # was learned with): dropped, so that the next call launches this side's kernel.
        fwd.forget()

    return ab(case, "base", "tree", select, rounds, "tree/base", window)


def case_options(parser: argparse.ArgumentParser, rounds: int, cases: str) -> None:
    """The ``--rounds`` and ``--cases`` options of this script and ``fwd_switch_ab.py``."""
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--cases", default=cases, help="comma-separated D:S:causal[:Dv[:B[:H]]]")
    parser.add_argument(
        "--window",
        type=bench_cases.parse_window,
        default=None,
        help="a local window LEFT,RIGHT on every case (--window=-1,64 for a side without bound)",
    )


def run_cases(cases: str, line) -> None:
    """The device's name, then ``line(case)`` for each of the comma-separated ``cases``."""
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)
    for case in cases.split(","):
        print(line(case), flush=True)
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="directory with the other fwd.py, fwd_steps.py, ...")
    case_options(parser, 3, CASES)
    args = parser.parse_args()
    sides = {"base": base_launcher(args.base), "tree": fwd_sm90.launcher()}
    run_cases(args.cases, lambda case: compare(case, sides, args.rounds, args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
