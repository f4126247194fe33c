"""Clock stamps of one CTA's consumers in the Hopper forward's key loop (a diagnostic build).

    PYTHONPATH=src python scripts/hopper_fwd_trace.py --seqlen 8192 --head-dim 128

The script builds one module from ``kernels/hopper/fwd.py`` and ``kernels/hopper/fwd_steps.py``
with four stamps added to the key loop of ``_steps`` (``%clock64`` of the SM, stored by CTA 0 for
steps 1..63 of each consumer; ``--three``: the three-consumer D=64 config):

    e0  top of step t            e1  K_t landed (after the ``k_ready`` wait)
    e2  turn taken (the products are issued next)
    e6  ``P_{t-1} V_{t-1}`` done (after ``wait_group 0``; in SASS also after the softmax)

and, on request, two more: ``--qk-stamp`` e3 after ``wait_group 1`` (``Q K_t^T`` done), and
``--softmax-stamp`` e4 after the softmax, before ``wait_group 0``. A stamp is a branch, and ptxas
moves the ``wait_group 0`` only within a basic block: with e3 alone the tree's schedule stays
(the wait is still hoisted above the softmax, so e3-e6 is ``P V`` plus the softmax); with e4 the
softmax runs under ``P V``, the intra-warpgroup overlap, so e3-e4 is the softmax's own time.

and launches it through the tier's own launcher (same flags, same grid), the stamps going to a
spare region past the LSE. It prints the medians over steps 8..59 of each gap and of the step
period, and the lag between the two consumers' issues. No stamp sits between the two
``wait_group`` calls: a branch there would change how ptxas schedules them (each stamp is a
branch on the program id), so this build keeps the tree's SASS schedule around the waits.
The stamps cost about 15% of the throughput; read the gaps, not the TFLOP/s.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
import statistics
import tempfile
from pathlib import Path

import torch

from flashcore.ops import fwd_sm90, fwd_sm90_configs

KERNELS = Path(__file__).resolve().parents[1] / "src" / "flashcore" / "kernels" / "hopper"
STEPS, EVENTS = 64, 8
CONSUMERS = 3  # stamp slots per CTA
LOG2E = 1.4426950408889634
IMPORT_STEPS = "from flashcore.kernels.hopper.fwd_steps import attend, skips, turn_pass\n"


def _thread_args(steps_src: str, fwd_src: str) -> tuple[str, str]:
    """Add ``LSE, IT`` (the stamps' base and the program's tile number) as the first parameters
    of the key-loop functions (``attend``, ``_steps``) and their calls."""
    names = ("attend", "_steps")
    for name in names:
        steps_src = steps_src.replace(f"def {name}(\n", f"def {name}(\n    LSE,\n    IT,\n")
    call = re.compile(r"\b(" + "|".join(names) + r")\(\n(\s+)q_smem,")
    steps_src, n_steps = call.subn(r"\1(\n\2LSE, IT, q_smem,", steps_src)
    fwd_src, n_fwd = call.subn(r"\1(\n\2LSE, it, q_smem,", fwd_src)
    if n_steps != 2 or n_fwd < 1 or any(f"def {n}(\n    LSE," not in steps_src for n in names):
        raise SystemExit("kernels/hopper/fwd_steps.py changed; update _thread_args")
    return steps_src, fwd_src


def _build(steps_src: str, steps_edits: list, fwd_edits: list) -> str:
    """One module: ``fwd.py`` with ``fwd_edits`` (and without its import of the key loop), then
    ``steps_src`` with ``steps_edits``, the stamps' arguments threaded through both. Each edit
    ``(old, new[, count])`` must match exactly ``count`` (default 1) times."""
    src = (KERNELS / "fwd.py").read_text()
    for name, edits in (("fwd_steps", steps_edits), ("fwd", [*fwd_edits, (IMPORT_STEPS, "")])):
        for old, new, *count in edits:
            text = steps_src if name == "fwd_steps" else src
            if text.count(old) != (count[0] if count else 1):
                raise SystemExit(f"kernels/hopper/{name}.py changed; update this edit: {old!r}")
            if name == "fwd_steps":
                steps_src = steps_src.replace(old, new)
            else:
                src = src.replace(old, new)
    steps_src, src = _thread_args(steps_src, src)
    return src + "\n\n" + steps_src


def trace_source(offset: int, qk_stamp: bool = False, softmax_stamp: bool = False) -> str:
    """The kernel's source with the stamps; they go to ``LSE + offset`` (fp32 elements). The key
    loop (``fwd_steps.py``, edited) is appended to ``fwd.py`` in place of its import."""
    steps_src = (KERNELS / "fwd_steps.py").read_text()
    steps_src = steps_src[steps_src.index('"""', 3) + 3 :]  # without its docstring
    edits = [
        (
            "@gluon.jit\ndef _sit_out(",
            f"""@gluon.jit
def _stamp(LSE, t, e: gl.constexpr, CONSUMER: gl.constexpr, x):
    if (gl.program_id(0) == 0) & (t < {STEPS}):
        ptr = (LSE + {offset}).to(gl.pointer_type(gl.int64), bitcast=True)
        clock = gl.inline_asm_elementwise(
            "mov.u64 $0, %clock64;", "=l,r", [x], dtype=gl.int64, is_pure=False, pack=1
        )
        gl.store(ptr + (CONSUMER * {STEPS} + t) * {EVENTS} + e, clock)


@gluon.jit
def _sit_out(""",
        ),
        (
            "            mbarrier.wait(k_ready.index(slot), (g // NUM_STAGES) & 1)\n"
            "            turn_take(turn, turn0 + t, CONSUMER, PINGPONG)\n",
            "            _stamp(LSE, t, 0, CONSUMER, g)\n"
            "            mbarrier.wait(k_ready.index(slot), (g // NUM_STAGES) & 1)\n"
            "            _stamp(LSE, t, 1, CONSUMER, g)\n"
            "            turn_take(turn, turn0 + t, CONSUMER, PINGPONG)\n"
            "            _stamp(LSE, t, 2, CONSUMER, g)\n",
        ),
        (
            "            acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])\n"
            "            mbarrier.arrive(kv_empty.index(NUM_STAGES + prev), count=1)",
            "            acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])\n"
            "            _stamp(LSE, t, 6, CONSUMER, g)\n"
            "            mbarrier.arrive(kv_empty.index(NUM_STAGES + prev), count=1)",
        ),
    ]
    if qk_stamp:
        edits.append((
            "            s = warpgroup_mma_wait(1, deps=[s_tok])\n",
            "            s = warpgroup_mma_wait(1, deps=[s_tok])\n"
            "            _stamp(LSE, t, 3, CONSUMER, g)\n",
        ))  # fmt: skip
    if softmax_stamp:
        edits.append((
            "            p, alpha, m_i, l_i = softmax(s, m_i, l_i, qk_scale, RAW_MAX, LAZY)\n"
            "            if OWN_PV:",
            "            p, alpha, m_i, l_i = softmax(s, m_i, l_i, qk_scale, RAW_MAX, LAZY)\n"
            "            _stamp(LSE, t, 4, CONSUMER, g)\n"
            "            if OWN_PV:",
        ))  # fmt: skip
    return _build(steps_src, edits, [])


def trace_tiles_source(offset: int) -> str:
    """The kernel's source with per-tile stamps in persistent program 0 (``--tiles``), to
    ``LSE + offset``: for each of its first STEPS tiles and each consumer,

        e0  tile entered            e1  its Q landed (``q_ready``)
        e2  K_0 landed              e3  the prologue's softmax done
        e4  the key loop returned (the last ``P V`` done)
        e5  O in shared memory, its TMA store issued
        e6  the store read (``store_wait``)   e7  the tile's key-tile count (a value)
    """
    steps_src = (KERNELS / "fwd_steps.py").read_text()
    steps_src = steps_src[steps_src.index('"""', 3) + 3 :]
    stamp = f"""@gluon.jit
def _tstamp(LSE, it, e: gl.constexpr, CONSUMER: gl.constexpr, x, VALUE: gl.constexpr = False):
    if (gl.program_id(0) == 0) & (it < {STEPS}):
        ptr = (LSE + {offset}).to(gl.pointer_type(gl.int64), bitcast=True)
        if VALUE:
            clock = x.to(gl.int64)
        else:
            clock = gl.inline_asm_elementwise(
                "mov.u64 $0, %clock64;", "=l,r", [x], dtype=gl.int64, is_pure=False, pack=1
            )
        gl.store(ptr + (CONSUMER * {STEPS} + it) * {EVENTS} + e, clock)


"""
    edits = [
        ("@gluon.jit\ndef _sit_out(", stamp + "@gluon.jit\ndef _sit_out("),
        (
            "    mbarrier.wait(k_ready.index(kv0 % NUM_STAGES), (kv0 // NUM_STAGES) & 1)\n",
            "    mbarrier.wait(k_ready.index(kv0 % NUM_STAGES), (kv0 // NUM_STAGES) & 1)\n"
            "    _tstamp(LSE, IT, 2, CONSUMER, kv0)\n",
        ),
        (
            "    p, alpha, m_i, l_i = softmax(s, m_i, l_i, qk_scale, RAW_MAX, LAZY)\n"
            "    if P_EARLY:",
            "    p, alpha, m_i, l_i = softmax(s, m_i, l_i, qk_scale, RAW_MAX, LAZY)\n"
            "    _tstamp(LSE, IT, 3, CONSUMER, kv0)\n    if P_EARLY:",
        ),
    ]
    fwd_edits = [
        (
            "    tile_m, off_b, off_h = work_item(\n",
            "    _tstamp(LSE, it, 0, CONSUMER, w)\n    tile_m, off_b, off_h = work_item(\n",
        ),
        (
            "        mbarrier.wait(q_ready.index(qi), (it // Q_BUFS) & 1)\n",
            "        mbarrier.wait(q_ready.index(qi), (it // Q_BUFS) & 1)\n"
            "        _tstamp(LSE, it, 1, CONSUMER, w)\n"
            "        _tstamp(LSE, it, 7, CONSUMER, n_tiles, True)\n",
        ),
        (
            "    empty = l_i == 0.0\n",
            "    _tstamp(LSE, it, 4, CONSUMER, w)\n    empty = l_i == 0.0\n",
        ),
        (
            "        _store_o(o_desc, o_tile, acc, off_b, off_h, row0)\n",
            "        _store_o(o_desc, o_tile, acc, off_b, off_h, row0)\n"
            "        _tstamp(LSE, it, 5, CONSUMER, w)\n",
        ),
        (
            "        if it > 0:\n            prev = ",
            "        _tstamp(LSE, it, 6, CONSUMER, w)\n        if it > 0:\n            prev = ",
        ),
    ]
    return _build(steps_src, edits, fwd_edits)


def report_tiles(stamps, num_consumers: int) -> None:
    """Medians per key-tile count of each phase of a persistent program's tiles (``--tiles``)."""
    names = ["Q wait (e0-e1)", "K_0 wait (e1-e2)", "prologue QK+softmax (e2-e3)",
             "key loop (e3-e4)", "O to smem + store issue (e4-e5)", "store read (e5-e6)",
             "to next tile (e6-e0')", "tile period (e0-e0')"]  # fmt: skip
    for c in range(num_consumers):
        t = stamps[c]
        tiles = [i for i in range(1, STEPS - 1) if t[i, 0] > 0 and t[i + 1, 0] > 0]
        by_n: dict[int, list[int]] = {}
        for i in tiles:
            by_n.setdefault(int(t[i, 7]), []).append(i)
        for n, idx in sorted(by_n.items()):
            gaps = [
                [t[i, 1] - t[i, 0] for i in idx], [t[i, 2] - t[i, 1] for i in idx],
                [t[i, 3] - t[i, 2] for i in idx], [t[i, 4] - t[i, 3] for i in idx],
                [t[i, 5] - t[i, 4] for i in idx], [t[i, 6] - t[i, 5] for i in idx],
                [t[i + 1, 0] - t[i, 6] for i in idx], [t[i + 1, 0] - t[i, 0] for i in idx],
            ]  # fmt: skip
            medians = (statistics.median(g) for g in gaps)
            row = ", ".join(f"{nm} {m:.0f}" for nm, m in zip(names, medians, strict=True))
            print(f"  consumer {c}, {n} key tiles ({len(idx)} tiles): {row}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--three", action="store_true", help="three consumers (D=64)")
    parser.add_argument("--qk-stamp", action="store_true", help="e3: Q K^T done")
    parser.add_argument("--softmax-stamp", action="store_true", help="e4: softmax done (pins)")
    parser.add_argument("--tiles", action="store_true", help="per-tile stamps, persistent")
    parser.add_argument("--mbarrier-turns", action="store_true", help="turns by mbarriers")
    args = parser.parse_args()
    fwd_sm90.NAMED_TURNS = not args.mbarrier_turns
    d, s = args.head_dim, args.seqlen
    b, h = max(1, args.tokens // s), 16 if d == 128 else 32
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    rows = b * h * s + (b * h * s) % 2  # the stamps' int64s start 8-byte aligned
    lse_buf = torch.zeros(rows + CONSUMERS * STEPS * EVENTS * 2, device="cuda")
    lse = lse_buf[: b * h * s].view(b, h, s)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fwd_trace.py"
        if args.tiles:
            path.write_text(trace_tiles_source(rows))
        else:
            path.write_text(trace_source(rows, args.qk_stamp, args.softmax_stamp))
        spec = importlib.util.spec_from_file_location("flashcore_fwd_trace", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fwd_sm90.kernels.cache_clear()
        fwd_sm90.launcher.cache_clear()
        fwd_sm90.kernels = lambda: module  # the tier's launcher, on the trace build
        config = (
            fwd_sm90_configs.D64_THREE if args.three else fwd_sm90_configs.CONFIGS[d]
        )._replace(persistent=args.tiles)
        if args.stages:
            config = config._replace(num_stages=args.stages)
        unbounded = 2 * s
        for _ in range(2):  # the first call compiles
            fwd_sm90.attn_fwd_sm90(
                q, k, v, out, lse, causal=args.causal, qk_scale=LOG2E / math.sqrt(d),
                window_left=unbounded, window_right=unbounded, has_window=False, softcap=0.0,
                alibi=None, stride_ab=0, config=config,
            )  # fmt: skip
        torch.cuda.synchronize()
    stamps = lse_buf[rows:].view(torch.int64).view(CONSUMERS, STEPS, EVENTS).cpu().double()
    if args.tiles:
        print(f"B={b} H={h} S={s} D={d} causal={args.causal} persistent, program 0: clocks")
        report_tiles(stamps, config.num_consumers)
        return
    steps = range(8, min(60, -(-s // config.block_n) - 1))
    if len(steps) < 4:
        raise SystemExit("too few key tiles per CTA to trace (use a longer --seqlen)")
    print(f"B={b} H={h} S={s} D={d} causal={args.causal} stages={config.num_stages}: clocks")
    for c in range(config.num_consumers):
        t = stamps[c]
        med = {
            "period": statistics.median(t[i + 1, 2] - t[i, 2] for i in steps),
            "wait K (e0-e1)": statistics.median(t[i, 1] - t[i, 0] for i in steps),
            "wait turn (e1-e2)": statistics.median(t[i, 2] - t[i, 1] for i in steps),
            "products + softmax (e2-e6)": statistics.median(t[i, 6] - t[i, 2] for i in steps),
            "to next step (e6-e0')": statistics.median(t[i + 1, 0] - t[i, 6] for i in steps),
        }
        if args.qk_stamp:
            med["Q K^T (e2-e3)"] = statistics.median(t[i, 3] - t[i, 2] for i in steps)
            end = 4 if args.softmax_stamp else 6
            name = "softmax (e3-e4)" if args.softmax_stamp else "P V + softmax (e3-e6)"
            med[name] = statistics.median(t[i, end] - t[i, 3] for i in steps)
        if args.softmax_stamp:
            med["rest of P V (e4-e6)"] = statistics.median(t[i, 6] - t[i, 4] for i in steps)
        print(f"  consumer {c}: " + ", ".join(f"{n} {x:.0f}" for n, x in med.items()))
    for c in range(1, config.num_consumers):
        lag = statistics.median(stamps[c, i, 2] - stamps[0, i, 2] for i in steps)
        print(f"  consumer {c} issues {lag:.0f} clocks after consumer 0")


if __name__ == "__main__":
    main()
