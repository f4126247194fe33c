"""Clock stamps of one CTA's consumers in the Hopper backward's query loop (a diagnostic build).

    PYTHONPATH=src python scripts/hopper_bwd_trace.py --seqlen 8192 --head-dim 128

The script builds a copy of ``kernels/hopper/bwd.py`` with stamps added to the consumers' loop
(``%clock64`` of the SM, stored by CTA 0 for steps 0..63 of each consumer):

    e0  top of step t                     e1  Q, dO, lse2, delta landed (``qd_ready``)
    e3  S^T, the softmax and dP^T done (after ``wait_group 0`` of dP^T)
    e4  dS^T buffer free (after ``ds_free``)

then, with the dQ products after dK (the kernel's default order where ``DQ_BESIDE_DK`` is off):
e5 dV and dK done (``wait_group 0``), e6 the previous step's dQ products done, its staging tile
written and its reduce issued; with ``DQ_BESIDE_DK``: e5 dV done (dQ in flight), e6 dQ staged
and its reduce issued (dK in flight), e7 dK done.

and ``--s-stamp`` e2 after ``wait_group 1`` (S^T done; a branch between the two waits, which may
change how ptxas orders them). It launches the build through the tier's launcher (same plan,
same grid), the stamps going to the ALiBi pointer's place (unused without ALiBi), and prints the
medians over steps 4..59 of each gap, the step period and the lag between the two consumers.
The stamps cost throughput; read the gaps, not the time.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import tempfile
from pathlib import Path

import torch

from flashcore.ops import bwd_sm90, fwd
from flashcore.ops import problem as pb
from flashcore.ops.launch import Launcher

KERNELS = Path(__file__).resolve().parents[1] / "src" / "flashcore" / "kernels" / "hopper"
STEPS, EVENTS = 64, 8
WAIT_DV_DK = (
    "            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_op, ds_op])\n"
)
LAGGED_DQ_DONE = (
    "\n                prev_h = off_h\n"
    "                prev_m = dq_row(dq_base, dq_per_head, t // n_m, q_start + start_m)\n"
)
WAIT_DV = "            dv, p_op = warpgroup_mma_wait(2, deps=[dv_tok, p_op])\n"
BESIDE_DQ_DONE = (
    "\n            prev_h = off_h\n"
    "            prev_m = dq_row(dq_base, dq_per_head, t // n_m, q_start + start_m)\n"
)
WAIT_DK = "            dk, ds_op = warpgroup_mma_wait(0, deps=[dk_tok, ds_op])\n"


def trace_source(s_stamp: bool) -> str:
    """``kernels/hopper/bwd.py`` with the stamps, which go to ``ALIBI`` (as int64s)."""
    src = (KERNELS / "bwd.py").read_text()
    stamp_fn = f"""

@gluon.jit
def _stamp(BUF, t, e: gl.constexpr, CONSUMER: gl.constexpr, x):
    # A predicated store, not a branch: a branch in this loop can crash Triton 3.6's ptxas.
    ptr = BUF.to(gl.pointer_type(gl.int64), bitcast=True)
    clock = gl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l,r", [x], dtype=gl.int64, is_pure=False, pack=1
    )
    slot = (CONSUMER * {STEPS} + gl.minimum(t, {STEPS} - 1)) * {EVENTS} + e
    gl.store(ptr + slot, clock, mask=(gl.program_id(0) == 0) & (t < {STEPS}))


@gluon.jit
def _consumer("""
    edits = [
        ("\n\n@gluon.jit\ndef _consumer(", stamp_fn),
        (
            "        slot = t % NUM_STAGES\n"
            "        mbarrier.wait(qd_ready.index(slot), (t // NUM_STAGES) & 1)\n",
            "        slot = t % NUM_STAGES\n"
            "        _stamp(ALIBI, t, 0, CONSUMER, t)\n"
            "        mbarrier.wait(qd_ready.index(slot), (t // NUM_STAGES) & 1)\n"
            "        _stamp(ALIBI, t, 1, CONSUMER, t)\n",
        ),
        (
            "        dp = warpgroup_mma_wait(0, deps=[dp_tok])\n",
            "        dp = warpgroup_mma_wait(0, deps=[dp_tok])\n"
            "        _stamp(ALIBI, t, 3, CONSUMER, t)\n",
        ),
        (
            "        mbarrier.wait(ds_free.index(buf), ((t // 2) + 1 + DQ_LAG * buf) & 1)\n",
            "        mbarrier.wait(ds_free.index(buf), ((t // 2) + 1 + DQ_LAG * buf) & 1)\n"
            "        _stamp(ALIBI, t, 4, CONSUMER, t)\n",
        ),
        (WAIT_DV_DK, WAIT_DV_DK + "            _stamp(ALIBI, t, 5, CONSUMER, t)\n"),
        (LAGGED_DQ_DONE, LAGGED_DQ_DONE + "                _stamp(ALIBI, t, 6, CONSUMER, t)\n"),
        (WAIT_DV, WAIT_DV + "            _stamp(ALIBI, t, 5, CONSUMER, t)\n"),
        (BESIDE_DQ_DONE, BESIDE_DQ_DONE + "            _stamp(ALIBI, t, 6, CONSUMER, t)\n"),
        (WAIT_DK, WAIT_DK + "            _stamp(ALIBI, t, 7, CONSUMER, t)\n"),
    ]
    if s_stamp:
        edits.append((
            "        s = warpgroup_mma_wait(1, deps=[s_tok])\n",
            "        s = warpgroup_mma_wait(1, deps=[s_tok])\n"
            "        _stamp(ALIBI, t, 2, CONSUMER, t)\n",
        ))  # fmt: skip
    for old, new in edits:
        if src.count(old) != 1:
            raise SystemExit(f"kernels/hopper/bwd.py changed; update this script's edit: {old!r}")
        src = src.replace(old, new)
    return src


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--s-stamp", action="store_true", help="e2: S^T done")
    parser.add_argument(
        "--dq-order",
        choices=("rule", "beside", "after"),
        default="rule",
        help="the dQ products beside dV and dK or after dK (DQ_BESIDE_DK), or as the launcher "
        "chooses (bwd_sm90.dq_beside_dk)",
    )
    args = parser.parse_args()
    d, s = args.head_dim, args.seqlen
    b, h = max(1, args.tokens // s), 16 if d == 128 else 32
    q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    out, lse = fwd.launch(q, k, v, args.causal, scale)[:2]
    if args.dq_order != "rule":
        forced = args.dq_order == "beside"
        bwd_sm90.dq_beside_dk = lambda *_: forced  # this process only
    stamps = torch.zeros(2 * STEPS * EVENTS, device="cuda", dtype=torch.int64)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bwd_trace.py"
        path.write_text(trace_source(args.s_stamp))
        spec = importlib.util.spec_from_file_location("flashcore_bwd_trace", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        prep = bwd_sm90.kernels()[0]
        main_kernel = Launcher(module.attn_bwd_sm90_kernel, 10)
        bwd_sm90.kernels = lambda: (prep, main_kernel)  # the tier's launcher, on the trace build
        real_alibi_arg = pb.alibi_arg
        pb.alibi_arg = lambda alibi, like: (stamps, 0)  # the stamps in ALIBI's place
        try:
            for _ in range(3):  # the first call compiles
                bwd_sm90.attn_bwd_sm90(dout, q, k, v, out, lse, args.causal, scale)
            torch.cuda.synchronize()
        finally:
            pb.alibi_arg = real_alibi_arg
    t_all = stamps.view(2, STEPS, EVENTS).cpu().double()
    n_steps = -(-s // 64)  # program 0 has key block 0, which every query block sees
    steps = range(4, min(60, n_steps - 2))
    print(f"B={b} H={h} S={s} D={d} causal={args.causal}: clocks, medians over steps 4..59")
    beside = bwd_sm90.dq_beside_dk(bwd_sm90.CONFIGS[d], args.causal, False, s) and d == 128
    print(f"  (dQ products {'beside dV and dK' if beside else 'after dK'}: DQ_BESIDE_DK {beside})")
    gaps = [
        ("period", 0, 0, 1),
        ("wait Q/dO (e0-e1)", 0, 1, 0),
        ("S^T, softmax, dP^T (e1-e3)", 1, 3, 0),
        ("wait dS^T buffer (e3-e4)", 3, 4, 0),
        ("dV, dK (e4-e5)", 4, 5, 0),
        ("dQ of the previous step (e5-e6)", 5, 6, 0),
        ("to next step (e6-e0')", 6, 0, 1),
    ]
    if beside:
        gaps[4:] = [
            ("dS^T out, dQ issued, dV done (e4-e5)", 4, 5, 0),
            ("dK issued, dQ done, staged, reduced (e5-e6)", 5, 6, 0),
            ("dK done (e6-e7)", 6, 7, 0),
            ("to next step (e7-e0')", 7, 0, 1),
        ]
    if args.s_stamp:
        gaps[2:3] = [("S^T (e1-e2)", 1, 2, 0), ("softmax, dP^T (e2-e3)", 2, 3, 0)]
    for c in range(2):
        t = t_all[c]
        cells = []
        for name, a, z, nxt in gaps:
            cells.append(f"{name} {statistics.median(t[i + nxt, z] - t[i, a] for i in steps):.0f}")
        print(f"  consumer {c}: " + ", ".join(cells))
    lag = statistics.median(t_all[1, i, 1] - t_all[0, i, 1] for i in steps)
    print(f"  consumer 1 has its Q/dO {lag:.0f} clocks after consumer 0")


if __name__ == "__main__":
    main()
