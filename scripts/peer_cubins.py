"""FlashAttention-4's compiled kernels for a few problems, kept for reading (on the GPU machine).

    source .peers/b/fa4-env.sh install          # FA4 there: docs/benchmarks.md
    python scripts/peer_cubins.py OUT_DIR [--case fwd:2,8192,16,128 --case bwd:2,4096,16,128:causal]

Each case (``fwd`` or ``bwd``, then ``B,S,H,D`` and optionally ``:causal``; bf16) runs once in a
process of its own with CuTe DSL's ``CUTE_DSL_KEEP_PTX`` and ``CUTE_DSL_KEEP_CUBIN`` set, so that
the cases' files do not overwrite each other (the DSL names them by a prefix of the kernel's
signature, the same for most cases); the files land in ``OUT_DIR/<case>/`` renamed by kernel
(``flash_fwd_sm90.sm_90a.cubin``, ``flash_bwd_sm90.sm_90a.ptx``, ...). Read them on the CPU with
``python scripts/step_loop_mix.py --cubin OUT_DIR/*/flash_fwd_sm90.sm_90a.cubin --skeleton``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

DEFAULT_CASES = (
    "fwd:2,8192,16,128",
    "fwd:1,16384,32,64:causal",
    "bwd:2,4096,16,128:causal",
    "bwd:2,4096,16,128",
    "bwd:2,4096,32,64",
)

RUN = """
import sys, torch
from flash_attn.cute import flash_attn_func
mode, b, s, h, d, causal = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6] == "1"
bwd = mode == "bwd"
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=bwd)
           for _ in range(3))
out = flash_attn_func(q, k, v, causal=causal)
out = out[0] if isinstance(out, tuple) else out
if bwd:
    out.backward(torch.randn_like(out))
torch.cuda.synchronize()
"""


def run_case(spec: str, out_dir: Path) -> Path:
    """Compile and run one case with the DSL keeping its files; returns the case's directory."""
    mode, shape, *flags = spec.split(":")
    if mode not in ("fwd", "bwd") or flags not in ([], ["causal"]):
        raise SystemExit(f"bad case {spec!r}: want fwd|bwd:B,S,H,D[:causal]")
    b, s, h, d = (int(x) for x in shape.split(","))
    where = out_dir / spec.replace(":", "-").replace(",", "x")
    where.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CUTE_DSL_KEEP_PTX="1", CUTE_DSL_KEEP_CUBIN="1")
    env["CUTE_DSL_DUMP_DIR"] = str(where)
    args = [mode, b, s, h, d, "1" if flags else "0"]
    subprocess.run([sys.executable, "-c", RUN, *map(str, args)], env=env, check=True)
    for f in where.iterdir():
        # ``cutlass___call___flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_...sm_90a.ptx``
        m = re.search(r"flash_attncute(flash_[a-z0-9_]+?)(?:Flash\w*)?(\.sm_\d+a?\.\w+)$", f.name)
        if m:
            f.rename(where / (m.group(1) + m.group(2)))
    return where


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--case", action="append", help="fwd|bwd:B,S,H,D[:causal] (repeatable)")
    args = parser.parse_args()
    for spec in args.case or DEFAULT_CASES:
        where = run_case(spec, args.out_dir)
        print(spec, "->", ", ".join(sorted(f.name for f in where.iterdir())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
