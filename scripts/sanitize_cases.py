"""Driver for scripts/sanitize.sh: FlashCore's kernels on small shapes, for compute-sanitizer.

Runs the forward and the backward (unless ``--no-backward``) on every case of
``tests/shapes.py``'s SANITIZE tier, for each dtype and both masks, cycling through the memory
layouts. Each result is checked against the float64 reference computed on the CPU, so the
sanitized process runs FlashCore's kernels and a few PyTorch fills and copies, no cuBLAS. Every
CUDA tensor is released before exit, so memcheck's leak check sees only what leaked for real.

Exits 1 when a result is wrong (the sanitizer's --error-exitcode reports memory errors).
``--device cpu`` with TRITON_INTERPRET=1 runs the same cases through the interpreter (a smoke test
of this script; slow).
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import flashcore
from helpers import check_forward, check_grads, make_qkv
from shapes import DTYPES, SANITIZE, Case

LAYOUTS = ["bhsd", "bshd", "sliced"]


def run_case(
    case: Case, dtype: torch.dtype, causal: bool, layout: str, backward: bool, device: str
) -> None:
    q, k, v = (t.requires_grad_(backward) for t in make_qkv(case, dtype, device, layout=layout))
    out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    grads = None
    if backward:
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    if device != "cpu":
        torch.cuda.synchronize(device)  # a launch error shows here, attributed to this case
    cpu = [t.detach().cpu() for t in (q, k, v)]
    check_forward(out.detach().cpu(), lse.cpu(), *cpu, causal=causal)
    if grads is not None:
        named = {name: g.cpu() for name, g in zip("qkv", grads, strict=True)}
        check_grads(named, *cpu, dout.cpu(), causal=causal)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dtypes", default=",".join(DTYPES), help="comma-separated: fp16,bf16,fp32"
    )
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument(
        "--tier",
        default="auto",
        choices=["auto", "portable", "sm90"],
        help="flashcore.use_tier for every case (sm90: the Gluon kernels wherever they run, "
        "which 'auto' leaves to longer problems than these)",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to smoke-test")
    parser.add_argument(
        "--no-tma",
        action="store_true",
        help="forward through plain pointers, not tensor descriptors (for initcheck, which does "
        "not see the bulk-copy engine's stores and reports every later read of them)",
    )
    args = parser.parse_args(argv)
    if args.no_tma:
        from flashcore.ops import runtime

        runtime.has_tma = lambda device: False
    else:
        # These shapes are small enough that the forward would take plain pointers
        # (tuning.TMA_MIN_FLOPS): force descriptors wherever the layout allows, so memcheck and
        # racecheck see the descriptor path (the "sliced" layout still takes pointers).
        from flashcore import tuning

        tuning.TMA_MIN_FLOPS = 0
    if args.device != "cpu" and not torch.cuda.is_available():
        print("sanitize_cases: needs a CUDA device", file=sys.stderr)
        return 2
    on_gpu = args.device != "cpu"
    backward = not args.no_backward
    where = torch.cuda.get_device_name(args.device) if on_gpu else "CPU (interpreter)"
    print(f"flashcore {flashcore.__version__} on {where}; "
          f"backward: {'yes' if backward else 'no (forward only)'}; tier: {args.tier}")  # fmt: skip
    failures = runs = 0
    for i, case in enumerate(SANITIZE):
        layout = LAYOUTS[i % len(LAYOUTS)]
        for dtype_name in args.dtypes.split(","):
            for causal in (False, True):
                runs += 1
                label = f"{case.id} {dtype_name} {'causal' if causal else 'full'} {layout}"
                try:
                    with flashcore.use_tier(args.tier):
                        run_case(case, DTYPES[dtype_name], causal, layout, backward, args.device)
                except Exception:  # report every case, then fail
                    failures += 1
                    print(f"FAIL {label}\n{traceback.format_exc()}", flush=True)
                else:
                    print(f"ok   {label}", flush=True)
                gc.collect()
    gc.collect()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    print(f"sanitize_cases: {runs - failures}/{runs} cases right")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
