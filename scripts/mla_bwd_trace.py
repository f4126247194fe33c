"""Clock stamps of MLA's 128-key backward kernel (``kernels/hopper/bwd_mla.py``): a diagnostic.

    PYTHONPATH=src python scripts/mla_bwd_trace.py [--shape 2,16,4096] [--causal both]
    PYTHONPATH=src python scripts/mla_bwd_trace.py --steps [--fake-full] [--no-skip]

The script builds a copy of the kernel with stamps added to both consumers and runs it through
the tier's launcher (same plan, same grid; the stamps go to the ALiBi pointer's place, unused
without ALiBi). Two modes:

- by program (default): every program's consumers stamp their entry, K and V landed, the end of
  their step loop and of their epilogue (``%clock64`` of the SM), their entry and end in
  ``%globaltimer`` (nanoseconds, one clock for all SMs), the SM and the step count. Printed: the
  span of the kernel, the SMs' mean busy time and when the first and last SM finished, the gap
  between programs on an SM, and by step count each consumer's clocks before, in (and a step)
  and after the loop.
- ``--steps``: program ``--pid`` (0, the heaviest causal block with the default order) stamps
  every step of its first 64: the top of the step, Q/dO landed, S^T done, dV done, dP^T done,
  the dS^T tile free, dK done, the other consumer's dS^T there (before and after its wait), the
  staging tiles read, the dQ panels reduced. Printed: medians over steps 4..59 of each segment,
  the step period and how far consumer 1 runs ahead of consumer 0.

``--fake-full`` (with causal) builds the causal kernel with every query block walked, the mask
never applied and no step skipped: the causal build on non-causal work (wrong gradients, timing
only). ``--no-skip`` turns ``WIDE_SKIP_MASKED`` off. Each case also prints the backward's time
(``do_bench``) with the stamps in; the stamps cost a little throughput, so read the gaps.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

KERNEL = Path(__file__).resolve().parents[1] / "src" / "flashcore" / "kernels" / "hopper"
EVENTS, STEPS = 8, 64
STEP_NAMES = (
    "top", "Q/dO", "S^T", "dV", "dP^T", "dS^T free", "dK", "to ds_ready", "ds_ready",
    "tiles read", "dQ panels",
)  # fmt: skip

PROGRAM_STAMP = """

@gluon.jit
def _stamp(BUF, e: gl.constexpr, CONSUMER: gl.constexpr, x, KIND: gl.constexpr = 0):
    # KIND 0: %clock64, 1: %globaltimer, 2: the SM, 3: x itself.
    ptr = BUF.to(gl.pointer_type(gl.int64), bitcast=True)
    if KIND == 0:
        v = gl.inline_asm_elementwise(
            "mov.u64 $0, %clock64;", "=l,r", [x], dtype=gl.int64, is_pure=False, pack=1
        )
    elif KIND == 1:
        v = gl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=gl.int64, is_pure=False, pack=1
        )
    elif KIND == 2:
        v = gl.inline_asm_elementwise(
            "mov.u32 $0, %smid;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1
        ).to(gl.int64)
    else:
        v = x.to(gl.int64)
    gl.store(ptr + (gl.program_id(0).to(gl.int64) * 2 + CONSUMER) * EVENTS_ + e, v)


@gluon.jit
def _consumer("""

STEP_STAMP = """

@gluon.jit
def _stamp(BUF, t, e: gl.constexpr, CONSUMER: gl.constexpr, x):
    # A predicated store (no branch in the loop): program PID_, steps below STEPS_.
    ptr = BUF.to(gl.pointer_type(gl.int64), bitcast=True)
    v = gl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l,r", [x], dtype=gl.int64, is_pure=False, pack=1
    )
    slot = (CONSUMER * STEPS_ + gl.minimum(t, STEPS_ - 1)) * 12 + e
    gl.store(ptr + slot, v, mask=(gl.program_id(0) == PID_) & (t < STEPS_))


@gluon.jit
def _step("""

# The ALiBi pointer (unused by this kernel) into the consumers, and with --steps into _step.
CONSUMER_ARGS = (
    ("ds_ready, ds_free, DK, DV, CU_Q,\n", "ds_ready, ds_free, DK, DV, ALIBI, CU_Q,\n", 1),
    (
        "ds_free, DK, DV,\n                CU_Q,",
        "ds_free, DK, DV,\n                ALIBI, CU_Q,",
        2,
    ),
)
LOOP_END = "    # No bulk reduce may still read this consumer's staging tile when the block exits"
ENTRY = "    key0 = start_n + CONSUMER * ROWS\n"
KV_WAIT = "    mbarrier.wait(kv_ready, 0)\n"
EPILOGUE_END = "    if TMA_EPILOGUE:\n        tma.store_wait(0)\n\n\n@gluon.jit\ndef attn_bwd_mla"


def _edit(src: str, old: str, new: str, count: int = 1) -> str:
    if src.count(old) != count:
        raise SystemExit(f"kernels/hopper/bwd_mla.py changed; update this script's edit: {old!r}")
    return src.replace(old, new)


def trace_source(steps: bool, pid: int = 0, fake_full: bool = False) -> str:
    """``kernels/hopper/bwd_mla.py`` with the stamps (``steps``: those of one program's steps,
    ``pid``'s; else every program's), which go to ``ALIBI`` as int64s; ``fake_full``: the causal
    build walking every query block with no mask and no skip (timing only)."""
    src = (KERNEL / "bwd_mla.py").read_text()
    if fake_full:
        causal_walk = "q_blocks(start_n, seqlen_q, seqlen_k, 0, 0, IS_CAUSAL, False, KEYS)"
        src = _edit(src, causal_walk, causal_walk.replace("IS_CAUSAL", "False"), 2)
        src = _edit(src, "    full_m = key0 + ROWS - 1 - diag\n",
                    "    full_m = key0 + ROWS - 1 - diag - 2 * seqlen_k - 1000000\n")  # fmt: skip
        masked = "masked = start_m + ROWS - 1 + diag"
        src = _edit(src, masked + " < key0", masked + " + 2 * seqlen_k + 1000000 < key0")
    for old, new, count in CONSUMER_ARGS:
        src = _edit(src, old, new, count)
    if not steps:
        stamp = PROGRAM_STAMP.replace("EVENTS_", str(EVENTS))
        src = _edit(src, "\n\n@gluon.jit\ndef _consumer(", stamp)
        src = _edit(src, ENTRY, (
            "    _stamp(ALIBI, 0, CONSUMER, n_m)\n    _stamp(ALIBI, 4, CONSUMER, n_m, 1)\n"
            "    _stamp(ALIBI, 6, CONSUMER, n_m, 2)\n"
            "    _stamp(ALIBI, 7, CONSUMER, n_m * kv_group, 3)\n" + ENTRY
        ))  # fmt: skip
        src = _edit(src, KV_WAIT, KV_WAIT + "    _stamp(ALIBI, 1, CONSUMER, n_m)\n")
        src = _edit(src, LOOP_END, "    _stamp(ALIBI, 2, CONSUMER, n_m)\n" + LOOP_END)
        return _edit(src, EPILOGUE_END, EPILOGUE_END.replace(
            "tma.store_wait(0)\n",
            "tma.store_wait(0)\n    _stamp(ALIBI, 3, CONSUMER, n_m)\n"
            "    _stamp(ALIBI, 5, CONSUMER, n_m, 1)\n",
        ))  # fmt: skip
    stamp = STEP_STAMP.replace("PID_", str(pid)).replace("STEPS_", str(STEPS))
    src = _edit(src, "\n\n@gluon.jit\ndef _step(", stamp)
    src = _edit(src, "          dk_b, zero_s, t, slot,", "          dk_b, zero_s, ALIBI, t, slot,")
    step_args = "ds_free, dv, dk_a, dk_b, zero_s, t, slot, start_m, key0, diag,"
    src = _edit(src, step_args, step_args.replace("zero_s, t,", "zero_s, ALIBI, t,"))
    # The pointer into the step function (``_full_step``) and its three calls.
    src = _edit(src, "def _full_step(ka_smem,", "def _full_step(ALIBI, ka_smem,")
    src = _edit(src, "_full_step(\n                    ka_smem,",
                "_full_step(\n                    ALIBI, ka_smem,", 2)  # fmt: skip
    src = _edit(
        src, "_full_step(\n                ka_smem,", "_full_step(\n                ALIBI, ka_smem,"
    )
    inside = (
        "    s = warpgroup_mma_wait(0, deps=[s_tok])\n",
        "    dv, p_op = warpgroup_mma_wait(0, deps=[dv_tok, p_op])\n",
        "    dp = warpgroup_mma_wait(0, deps=[dp_tok])\n",
        "    mbarrier.wait(ds_free, (t & 1) ^ 1)\n    ds_smem.index(CONSUMER).store(ds)\n",
        "    dk_a, dk_b, ds_op = warpgroup_mma_wait(0, deps=[dka_tok, dkb_tok, ds_op])\n",
    )
    for e, line in enumerate(inside, start=2):
        head, _, tail = line.partition("\n")
        src = _edit(src, line, f"{head}\n    _stamp(ALIBI, t, {e}, CONSUMER, t)\n{tail}")
    wait = "    mbarrier.wait(qd_ready.index(slot), (t // NUM_STAGES) & 1)\n"
    src = _edit(src, wait, "    _stamp(ALIBI, t, 0, CONSUMER, t)\n" + wait
                + "    _stamp(ALIBI, t, 1, CONSUMER, t)\n")  # fmt: skip
    ready = "    mbarrier.wait(ds_ready, t & 1)\n"
    read = "    tma.store_wait(0)\n    row = q_start + start_m\n"
    src = _edit(src, ready, "    _stamp(ALIBI, t, 7, CONSUMER, t)\n" + ready
                + "    _stamp(ALIBI, t, 8, CONSUMER, t)\n")  # fmt: skip
    stamp9 = "    _stamp(ALIBI, t, 9, CONSUMER, t)\n"
    src = _edit(src, read, read.replace("    row", stamp9 + "    row"))
    return _edit(src, "                  i == N_PANELS - 1, VARLEN)  # fmt: skip\n",
                 "                  i == N_PANELS - 1, VARLEN)  # fmt: skip\n"
                 "    _stamp(ALIBI, t, 10, CONSUMER, t)\n")  # fmt: skip


def _use(source: str, tmp: str) -> None:
    """Make ``source`` the kernel ``ops/bwd256.wide_kernel`` launches (this process only)."""
    from flashcore.ops import bwd256

    path = Path(tmp) / "bwd_mla_trace.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("flashcore.kernels.hopper.bwd_mla", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["flashcore.kernels.hopper.bwd_mla"] = module
    spec.loader.exec_module(module)
    import flashcore.kernels.hopper as hopper

    hopper.bwd_mla = module
    bwd256.wide_kernel.cache_clear()


def _by_program(st, shape, causal) -> None:
    """The by-program summary of one case's stamps ``st`` (programs, 2, EVENTS)."""
    steps = st[:, 0, 7].long()
    start = st[:, :, 4].min(1).values
    end = st[:, :, 5].max(1).values
    t0 = start.min()
    start, end = start - t0, end - t0
    sm = st[:, 0, 6].long()
    busy: dict[int, float] = {}
    last: dict[int, float] = {}
    gaps = []
    for i in start.argsort().tolist():
        m = int(sm[i])
        if m in last:
            gaps.append(float(start[i]) - last[m])
        last[m] = max(last.get(m, 0.0), float(end[i]))
        busy[m] = busy.get(m, 0.0) + float(end[i] - start[i])
    ends = sorted(last.values())
    print(f"{shape} causal={causal}: span {float(end.max()) / 1e3:.1f} us on {len(busy)} SMs, "
          f"mean busy {statistics.mean(busy.values()) / 1e3:.1f} us, SMs done "
          f"{ends[0] / 1e3:.1f}-{ends[-1] / 1e3:.1f} us, between programs "
          f"{statistics.median(gaps) / 1e3:.2f} us (median)")  # fmt: skip
    counts = sorted(set(steps.tolist()))
    for c in range(2):
        for n in sorted({counts[0], counts[len(counts) // 2], counts[-1]}):
            rows = st[steps == n, c]
            pre, loop, post = (
                statistics.median((rows[:, b] - rows[:, a]).tolist())
                for a, b in ((0, 1), (1, 2), (2, 3))
            )
            per = loop / max(n, 1)
            print(f"  consumer {c}, {n:3d} steps ({len(rows)} programs): before {pre:.0f}, loop "
                  f"{loop:.0f} ({per:.0f} a step), after {post:.0f} clocks")  # fmt: skip


def _by_step(st, shape, causal) -> None:
    """The by-step summary of program ``--pid``'s stamps ``st`` (2, STEPS, 12)."""
    print(f"{shape} causal={causal}: clocks, medians over steps 4..59")
    for c in range(2):
        x = st[c]
        period = statistics.median((x[5:60, 0] - x[4:59, 0]).tolist())
        cells = [
            f"{STEP_NAMES[e]} {statistics.median((x[4:60, e] - x[4:60, e - 1]).tolist()):.0f}"
            for e in range(1, 11)
        ]
        nxt = statistics.median((x[5:60, 0] - x[4:59, 10]).tolist())
        print(f"  consumer {c}: period {period:.0f} | " + ", ".join(cells) + f", to next {nxt:.0f}")
    lead = statistics.median((st[0, 4:60, 0] - st[1, 4:60, 0]).tolist())
    print(f"  consumer 1 starts its steps {lead:.0f} clocks before consumer 0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="B,H,S (q and k 192, v 128; bf16)")
    parser.add_argument("--causal", choices=("0", "1", "both"), default="both")
    parser.add_argument("--steps", action="store_true", help="stamp one program's steps")
    parser.add_argument("--pid", type=int, default=0)
    parser.add_argument("--fake-full", action="store_true")
    parser.add_argument("--no-skip", action="store_true")
    args = parser.parse_args()
    import torch
    import triton

    import flashcore
    from flashcore.ops import bwd, bwd256
    from flashcore.ops import problem as pb

    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape or ["2,16,4096"]]
    stamps = [None]
    real_alibi_arg = pb.alibi_arg
    # The stamps in the ALiBi pointer's place (the kernel takes no ALiBi).
    pb.alibi_arg = lambda slopes, dummy: (
        (stamps[0], 0) if slopes is None else real_alibi_arg(slopes, dummy)
    )
    bwd256.WIDE_SKIP_MASKED = not args.no_skip
    with tempfile.TemporaryDirectory() as tmp:
        _use(trace_source(args.steps, args.pid, args.fake_full), tmp)
        for b, h, s in shapes:
            for causal in {"0": (False,), "1": (True,), "both": (False, True)}[args.causal]:
                torch.manual_seed(0)
                q = torch.randn(b, h, s, 192, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(b, h, s, 192, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16)
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                out = flashcore.attention(q, k, v, causal=causal)
                dout = torch.randn_like(out)
                programs = -(-s // 128) * b * h
                size = 2 * STEPS * 12 if args.steps else programs * 2 * EVENTS
                stamps[0] = torch.zeros(size, device="cuda", dtype=torch.int64)
                bwd256._PLANS.clear()
                bwd.forget()

                def grads(out=out, q=q, k=k, v=v, dout=dout):
                    return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                for _ in range(3):  # the first call compiles
                    grads()
                torch.cuda.synchronize()
                st = stamps[0].cpu().double()
                ms = triton.testing.do_bench(grads, warmup=20, rep=100)
                shape = f"({b}, {h}, {s})"
                if args.steps:
                    _by_step(st.view(2, STEPS, 12), shape, causal)
                else:
                    _by_program(st.view(programs, 2, EVENTS), shape, causal)
                print(f"  backward with the stamps: {ms:.3f} ms")


if __name__ == "__main__":
    main()
