"""Clock stamps of one CTA's consumers in the Hopper backward's query loop (a diagnostic build).

    PYTHONPATH=src python scripts/hopper_bwd_trace.py --seqlen 8192 --head-dim 128

The script builds a copy of ``kernels/hopper/bwd.py`` and ``bwd_steps.py`` (one module) with
stamps added to the consumers' loop
(``%clock64`` of the SM, stored by CTA 0 for steps 0..63 of each consumer; ``--window LEFT,RIGHT``
with ``--all-programs``):

    e0  top of step t                     e1  Q, dO, lse2, delta landed (``qd_ready``)
    e3  S^T, the softmax and dP^T done (after ``wait_group 0`` of dP^T)
    e4  dS^T buffer free (after ``ds_free``)

then, with the dQ products after dK (the kernel's default order where ``DQ_BESIDE_DK`` is off):
e5 dV and dK done (``wait_group 0``), e6 the previous step's dQ products done, its staging tile
written and its reduce issued; with ``DQ_BESIDE_DK``: e5 dV done (dQ in flight), e6 dQ staged
and its reduce issued (dK in flight), e7 dK done.

and ``--s-stamp`` e2 after ``wait_group 1`` (S^T done; a branch between the two waits, which may
change how ptxas orders them). ``--all-programs`` stamps every program instead (and its entry,
K/V wait, last dQ, stores and end) and prints, by a program's number of steps, where its time
goes outside the steps and the gap between programs on an SM.

It launches the build through the tier's launcher (same plan, same grid), the stamps going to the
ALiBi pointer's place (unused without ALiBi), and prints the medians over steps 4..59 of each gap,
the step period and the lag between the two consumers.
The stamps cost throughput; read the gaps, not the time.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import statistics
import tempfile
from pathlib import Path

import torch

from flashcore.bench.cases import parse_window
from flashcore.ops import bwd_sm90, fwd
from flashcore.ops import problem as pb
from flashcore.ops.launch import Launcher

KERNELS = Path(__file__).resolve().parents[1] / "src" / "flashcore" / "kernels" / "hopper"
STEPS, EVENTS = 64, 8
IMPORT_STEPS = "from flashcore.kernels.hopper.bwd_steps import consumer, dq_warpgroup\n"
WAIT_DV_DK = (
    "            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_op, ds_op])\n"
)
LAGGED_DQ_DONE = "                    VARLEN,\n                )  # fmt: skip\n            else:\n"
WAIT_DV = "            dv, p_op = warpgroup_mma_wait(2, deps=[dv_tok, p_op])\n"
BESIDE_DQ_DONE = (
    "                CONSUMER, ABLATE, q_start + seqlen_q, VARLEN,\n            )  # fmt: skip\n"
)
WAIT_DK = "            dk, ds_op = warpgroup_mma_wait(0, deps=[dk_tok, ds_op])\n"


def trace_source(s_stamp: bool, all_programs: bool = False) -> str:
    """``kernels/hopper/bwd.py`` (without its import of the consumers) followed by
    ``bwd_steps.py`` with the stamps, which go to ``ALIBI`` (as int64s): of program 0, or with
    ``all_programs`` of every program (each its own ``2 * STEPS * EVENTS`` block, and e2 of step
    0 stamped at the end of the epilogue instead of ``--s-stamp``'s)."""
    src = (KERNELS / "bwd_steps.py").read_text()
    who = "gl.program_id(0) >= 0" if all_programs else "gl.program_id(0) == 0"
    stamp_fn = f"""

@gluon.jit
def _stamp(BUF, t, e: gl.constexpr, CONSUMER: gl.constexpr, x):
    # A predicated store, not a branch: a branch in this loop can crash Triton 3.6's ptxas.
    ptr = BUF.to(gl.pointer_type(gl.int64), bitcast=True)
    clock = gl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l,r", [x], dtype=gl.int64, is_pure=False, pack=1
    )
    slot = (CONSUMER * {STEPS} + gl.minimum(t, {STEPS} - 1)) * {EVENTS} + e
    block = {"gl.program_id(0).to(gl.int64) * " + str(2 * STEPS * EVENTS) if all_programs else 0}
    gl.store(ptr + block + slot, clock, mask=({who}) & (t < {STEPS}))


@gluon.jit
def consumer("""
    edits = [
        ("\n\n@gluon.jit\ndef consumer(", stamp_fn),
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
        (
            LAGGED_DQ_DONE,
            LAGGED_DQ_DONE.replace(
                "else:", "    _stamp(ALIBI, t, 6, CONSUMER, t)\n            else:"
            ),
        ),
        (WAIT_DV, WAIT_DV + "            _stamp(ALIBI, t, 5, CONSUMER, t)\n"),
        (BESIDE_DQ_DONE, BESIDE_DQ_DONE + "            _stamp(ALIBI, t, 6, CONSUMER, t)\n"),
        (WAIT_DK, WAIT_DK + "            _stamp(ALIBI, t, 7, CONSUMER, t)\n"),
    ]
    if all_programs:
        end = (
            "        _store_dk_dv(dk_desc, dv_desc, k_tile, v_tile, dk * scale, dv, desc_b, off_hk,"
            " key)\n    tma.store_wait(0)\n"
        )
        edits.append((end, end + "    _stamp(ALIBI, 0, 2, CONSUMER, off_hk)\n"))
        # The rest of a program's overhead, in e2 of steps 1..7 (unused in this mode): the
        # consumer's entry (6) and its SM (7, the id in place of a clock), the K/V wait's start
        # and end (4, 5), the last lagged dQ done (1, before the wait for the other consumer's),
        # the dK and dV stores issued (3); the end (0, above).
        entry = "    dtype: gl.constexpr = k_smem.dtype\n"
        smid = (
            "    _stamp(ALIBI, 6, 2, CONSUMER, seqlen_q)\n"
            "    _sm = gl.inline_asm_elementwise('mov.u32 $0, %smid;', '=r,r', [seqlen_q],"
            " dtype=gl.int32, is_pure=False, pack=1)\n"
            "    gl.store(ALIBI.to(gl.pointer_type(gl.int64), bitcast=True)"
            f" + gl.program_id(0).to(gl.int64) * {2 * STEPS * EVENTS}"
            f" + (CONSUMER * {STEPS} + 7) * {EVENTS} + 2, _sm.to(gl.int64))\n"
        )
        kv = "    mbarrier.wait(kv_ready, 0)\n    if KV_REGS:\n"
        wait = "        mbarrier.wait(ds_free.index((n_steps + 1) % 2), (n_steps // 2) & 1)\n"
        stores = end.replace("    tma.store_wait(0)\n", "")
        edits += [
            (entry, entry + smid),
            (
                kv,
                "    _stamp(ALIBI, 4, 2, CONSUMER, seqlen_q)\n"
                + kv.replace(
                    "    if KV_REGS:",
                    "    _stamp(ALIBI, 5, 2, CONSUMER, seqlen_q)\n    if KV_REGS:",
                ),
            ),
            (wait, "        _stamp(ALIBI, 1, 2, CONSUMER, seqlen_q)\n" + wait),
            (end, stores + "    _stamp(ALIBI, 3, 2, CONSUMER, off_hk)\n    tma.store_wait(0)\n"),
        ]
    elif s_stamp:
        edits.append((
            "        s = warpgroup_mma_wait(1, deps=[s_tok])\n",
            "        s = warpgroup_mma_wait(1, deps=[s_tok])\n"
            "        _stamp(ALIBI, t, 2, CONSUMER, t)\n",
        ))  # fmt: skip
    for old, new in edits:
        if src.count(old) != 1:
            raise SystemExit(
                f"kernels/hopper/bwd_steps.py changed; update this script's edit: {old!r}"
            )
        src = src.replace(old, new)
    kernel = (KERNELS / "bwd.py").read_text()
    if kernel.count(IMPORT_STEPS) != 1:
        raise SystemExit("kernels/hopper/bwd.py changed; update this script's IMPORT_STEPS")
    return kernel.replace(IMPORT_STEPS, "") + "\n\n" + src


def program_times(t_all: torch.Tensor, args) -> None:
    """Per program (``--all-programs``): its steps (those with Q/dO landed, up to STEPS) and its
    phases, consumer 0's (clocks of its SM): from the consumer's entry to the wait for K and V,
    that wait, to the first step, the steps, the last lagged dQ, the wait for the other
    consumer's and the epilogue's stores issued, the wait for their reads; medians over the
    programs of each step count. Then the gap on each SM between a program's end and the next
    program's entry (the CTA's exit, launch and setup), and how much later consumer 1 ends than
    consumer 0 (at a window's edges their steps are offset by one)."""
    phases = ("setup", "K/V wait", "to step 0", "steps", "last dQ", "ds wait+stores", "store read")
    groups: dict[int, list[list[float]]] = {}
    by_sm: dict[int, list[tuple[float, float]]] = {}
    lags: dict[int, list[float]] = {}
    for t in t_all:
        steps = int((t[0, :, 1] > 0).sum())
        if steps == 0 or steps >= STEPS:
            continue
        c = t[0]
        last = c[steps - 1, [1, 3, 4, 5, 6, 7]].max()
        marks = [c[6, 2], c[4, 2], c[5, 2], c[0, 0], last, c[1, 2], c[3, 2], c[0, 2]]
        groups.setdefault(steps, []).append([float(b - a) for a, b in itertools.pairwise(marks)])
        lags.setdefault(steps, []).append(float(t[1, 0, 2] - c[0, 2]))
        by_sm.setdefault(int(c[7, 2]), []).append((float(c[6, 2]), float(c[0, 2])))
    window = f" window={args.window}" if args.window else ""
    print(
        f"S={args.seqlen} D={args.head_dim} causal={args.causal}{window}: per program, consumer 0,"
        " clocks"
    )
    print("  steps programs total | " + " | ".join(phases) + " | consumer 1 ends later by")
    for steps in sorted(groups):
        rows = groups[steps]
        med = [statistics.median(r[i] for r in rows) for i in range(len(phases))]
        total = statistics.median(sum(r) for r in rows)
        cells = " | ".join(f"{m:6.0f}" for m in med)
        lag = statistics.median(lags[steps])
        print(f"  {steps:5d} {len(rows):8d} {total:6.0f} | {cells} | {lag:6.0f}")
    gaps = []
    for runs in by_sm.values():
        runs.sort()
        gaps += [b[0] - a[1] for a, b in itertools.pairwise(runs)]
    if gaps:
        print(f"  between programs on an SM: median {statistics.median(gaps):.0f} clocks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument(
        "--window", type=parse_window, help="LEFT,RIGHT: a local window (with --all-programs)"
    )
    parser.add_argument("--s-stamp", action="store_true", help="e2: S^T done")
    parser.add_argument(
        "--all-programs",
        action="store_true",
        help="stamp every program and print program times by their number of steps",
    )
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
    opts = {}
    if args.window:
        opts["window"] = args.window
        if not args.all_programs:
            raise SystemExit("--window: with --all-programs (program 0's steps are not the rule)")
    out, lse = fwd.launch(q, k, v, args.causal, scale, **opts)[:2]
    if args.dq_order != "rule":
        forced = args.dq_order == "beside"
        bwd_sm90.dq_beside_dk = lambda *_: forced  # this process only
    programs = -(-s // 128) * b * h if args.all_programs else 1
    stamps = torch.zeros(programs * 2 * STEPS * EVENTS, device="cuda", dtype=torch.int64)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bwd_trace.py"
        path.write_text(trace_source(args.s_stamp, args.all_programs))
        spec = importlib.util.spec_from_file_location("flashcore_bwd_trace", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        prep, tier_main = bwd_sm90.kernels()
        main_kernel = Launcher(module.attn_bwd_sm90_kernel, tier_main.num_pointers)
        bwd_sm90.kernels = lambda: (prep, main_kernel)  # the tier's launcher, on the trace build
        real_alibi_arg = pb.alibi_arg
        pb.alibi_arg = lambda alibi, like: (stamps, 0)  # the stamps in ALIBI's place
        try:
            for _ in range(3):  # the first call compiles
                bwd_sm90.attn_bwd_sm90(dout, q, k, v, out, lse, args.causal, scale, **opts)
            torch.cuda.synchronize()
        finally:
            pb.alibi_arg = real_alibi_arg
    if args.all_programs:
        program_times(stamps.view(programs, 2, STEPS, EVENTS).cpu().double(), args)
        return
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
