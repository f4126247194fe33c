"""MLA's backward (q and k 192, v 128) on Hopper, its paths side by side in one process:

    PYTHONPATH=src python scripts/mla_bwd_ab.py [--paths 64key,wide] [--rounds 2]
    PYTHONPATH=src python scripts/mla_bwd_ab.py --short [--paths hopper,portable]
    PYTHONPATH=src python scripts/mla_bwd_ab.py --d256 [--short]   # head dim 256
    PYTHONPATH=src python scripts/mla_bwd_ab.py --paths wide,wide-nosplit --rotate 4 --kernel-time

Paths (``ops/bwd256.py``'s switches, set per side; plans and kept backwards dropped in between):

- ``64key``: the 64-key fused dK/dV kernel (``kernels/hopper/bwd256.py``, FUSED_DQ);
- ``wide``: the 128-key kernel (``kernels/hopper/bwd_mla.py``, ``WIDE_MLA``);
- ``wide-skip`` / ``wide-noskip``: the 128-key kernel with (as every other path) and without
  consumer 1's products skipped on causal steps that see none of its keys
  (``WIDE_SKIP_MASKED``);
- ``wide-nomexp``: the 128-key kernel with its exponent formed after the masks' branches
  (``WIDE_MASK_EXPONENT`` off; every other path forms it before them, as shipped);
- ``wide-nofresh``: the 128-key kernel with its fixed tiles' wgmma descriptors formed before the
  step loop (``WIDE_FRESH_DESC`` off; every other path forms them in it, as shipped);
- ``wide-nosplit``: the 128-key kernel with the causal diagonal's steps in the same loop as the
  others (``WIDE_SPLIT_DIAG`` off; every other path runs them in a loop of their own, as shipped);
- ``wide-regs``, ``64key-regs``, ``dqkernel-regs``: those with dK and dV stored from
  registers (``WIDE_TMA_EPILOGUE``, ``DKDV_TMA_EPILOGUE`` off; every other path stores them by
  TMA, as shipped);
- with ``--d256`` (q, k and v of head dim 256): ``d256`` and ``d256-regs``;
- ``dqkernel``: the dQ kernel beside the 64-key dK/dV kernel (``FUSED_MLA`` off);
- ``portable``: the portable backward (``VERIFIED`` off).

Each point times ``torch.autograd.grad`` of one forward (``triton.testing.do_bench`` median, bf16,
16 heads) for every path, rounds interleaved, and prints ms and TFLOP/s (2 B H Sq Sk (3 D + 2
Dv), halved causal), each path's time ratio to the first path (> 1: faster) and the largest
difference of its gradients from the first path's (dQ's reduce-adds vary its last bits).
``--short`` runs the taking rule's lengths (512-2048), by default with ``hopper`` (the kernels
``takes`` would pick, forced at every length) against ``portable``. ``--rotate N``: instead, N
rounds at each point, each starting one path later (so that no path always runs first after the
problem's allocation), and each path's median with the range of its per-round ratios to the first
path; ``--causal 0`` or ``1``: only those points. ``--kernel-time`` (with ``--rotate``): each
round times the main kernels instead of the call (``torch.profiler``'s device time of the
kernels named ``attn_bwd*`` over 20 backwards; the row stats, the dQ conversion and the host are
out of it, and they are the same on every path): at 512-1024 tokens a backward is 0.3 ms and the
host disturbs whole ``do_bench`` rounds.
"""

import argparse

import torch
import triton
from bwd_kernel_times import device_times
from dq_rows_ab import rotated

import flashcore
from flashcore.ops import bwd, bwd256

LONG = [(2, 16, 4096), (1, 16, 8192), (4, 16, 2048)]
SHORT = [(16, 16, 512), (8, 16, 1024), (4, 16, 2048)]


def use(path: str) -> None:
    """Set ``ops/bwd256.py``'s switches for ``path`` and drop every plan."""
    bwd256.VERIFIED = path != "portable"
    bwd256.MLA_NON_CAUSAL = path != "portable"
    bwd256.FUSED_MLA = not path.startswith("dqkernel")
    bwd256.WIDE_MLA = path.startswith("wide") or path == "hopper"
    bwd256.WIDE_SKIP_MASKED = path != "wide-noskip"
    bwd256.WIDE_MASK_EXPONENT = path != "wide-nomexp"
    bwd256.WIDE_FRESH_DESC = path != "wide-nofresh"
    bwd256.WIDE_SPLIT_DIAG = path != "wide-nosplit"
    bwd256.WIDE_TMA_EPILOGUE = bwd256.DKDV_TMA_EPILOGUE = not path.endswith("-regs")
    bwd256._PLANS.clear()
    bwd.forget()


def problem(batch: int, heads: int, seqlen: int, causal: bool, dims: tuple[int, int]):
    """``(flops, grads)``: the backward's FLOPs (2 B H Sq Sk (3 D + 2 Dv), halved causal) and a
    function giving the gradients of one (batch, heads, seqlen) forward, bf16, q and k of head dim
    ``dims[0]``, v of ``dims[1]``."""
    torch.manual_seed(0)
    shape = (batch, heads, seqlen)
    d, dv = dims
    q = torch.randn(*shape, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(*shape, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(*shape, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flops = 2 * batch * heads * seqlen * seqlen * (3 * d + 2 * dv) * (0.5 if causal else 1.0)
    out = flashcore.attention(q, k, v, causal=causal)
    dout = torch.randn_like(out)

    def grads():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    return flops, grads


def point(
    batch: int, heads: int, seqlen: int, causal: bool, paths: list[str], dims: tuple[int, int]
) -> str:
    """One line: every path's time for the backward of one (batch, heads, seqlen) forward, q and
    k of head dim ``dims[0]``, v of ``dims[1]``."""
    flops, grads = problem(batch, heads, seqlen, causal, dims)
    cells, first = [], None
    for path in paths:
        use(path)
        got = grads()
        ms = triton.testing.do_bench(grads, warmup=50, rep=300)
        if first is None:
            first = (ms, got)
        diff = max(
            (a.float() - b.float()).abs().max().item() for a, b in zip(got, first[1], strict=True)
        )
        cells.append(f"{path} {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s x{first[0] / ms:.3f} "
                     f"d{diff:.1e}")  # fmt: skip
    return f"{batch},{heads},{seqlen} causal={int(causal)} | " + " | ".join(cells)


def rotated_point(
    batch: int, heads: int, seqlen: int, causal: bool, paths: list[str], dims: tuple[int, int],
    rounds: int, kernel_time: bool = False,
) -> str:  # fmt: skip
    """One line: each path's median time over ``rounds`` rotated rounds (``dq_rows_ab.rotated``;
    with ``kernel_time`` the main kernels' device time, ``kernel_us``, instead of ``do_bench`` of
    the call) and its speed over the first path's, the medians' ratio and the per-round ratios'
    range."""
    flops, grads = problem(batch, heads, seqlen, causal, dims)
    timer = kernel_us if kernel_time else None
    times, med = rotated(dict.fromkeys(paths, grads), rounds, use, timer)
    # ms (do_bench) or us (kernel_us)
    unit, per_s = ("us kernels", 1e6) if kernel_time else ("ms", 1e3)
    cells = []
    for path in paths:
        ratios = sorted(a / b for a, b in zip(times[paths[0]], times[path], strict=True))
        spread = f"({ratios[0]:.3f}-{ratios[-1]:.3f})"
        cells.append(f"{path} {med[path]:.3f} {unit} {flops * per_s / med[path] / 1e12:.0f} "
                     f"TF/s x{med[paths[0]] / med[path]:.3f} {spread}")  # fmt: skip
    return f"{batch},{heads},{seqlen} causal={int(causal)} | " + " | ".join(cells)


def kernel_us(grads, calls: int = 20) -> float:
    """Device time (us) per backward of the kernels named ``attn_bwd*`` (the main ones), by
    ``bwd_kernel_times.device_times`` over ``calls`` backwards."""
    total = sum(t for t, name in device_times(grads, calls) if name.startswith("attn_bwd"))
    if total <= 0:
        raise SystemExit("no attn_bwd* kernel in the profile: were the kernels renamed?")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default=None, help="default: 64key,wide")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--short", action="store_true")
    parser.add_argument(
        "--d256", action="store_true", help="head dim 256 (default paths: d256,d256-regs)"
    )
    parser.add_argument("--rotate", type=int, default=0, metavar="N")
    parser.add_argument("--causal", choices=("0", "1"), default=None)
    parser.add_argument(
        "--kernel-time", action="store_true", help="with --rotate: the main kernels' device time"
    )
    args = parser.parse_args()
    if args.kernel_time and not args.rotate:
        parser.error("--kernel-time: give --rotate N")
    default = "hopper,portable" if args.short else "64key,wide"
    paths = (args.paths or ("d256,d256-regs" if args.d256 else default)).split(",")
    dims = (256, 256) if args.d256 else (192, 128)
    causals = (False, True) if args.causal is None else (args.causal == "1",)
    if args.rotate:
        for batch, heads, seqlen in SHORT if args.short else LONG:
            for causal in causals:
                line = rotated_point(
                    batch, heads, seqlen, causal, paths, dims, args.rotate, args.kernel_time
                )
                print(line, flush=True)
        return
    for rnd in range(args.rounds):
        for batch, heads, seqlen in SHORT if args.short else LONG:
            for causal in causals:
                print(f"r{rnd} " + point(batch, heads, seqlen, causal, paths, dims), flush=True)


if __name__ == "__main__":
    main()
