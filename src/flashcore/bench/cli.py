"""``flashcore-bench``: flashcore against PyTorch's attention backends, checked, then timed.

Every provider's result is checked against ``flashcore.reference`` before it is timed (relative
error printed beside the time; a result outside FlashAttention's error rule is marked WRONG but
kept). On a GPU, times come from ``triton.testing.do_bench``, TFLOP/s follow the FlashAttention
papers' FLOP count, and each row gives the speed-up over ``sdpa`` and the share of the bf16 matmul
rate measured in the same run. Without a GPU the kernels run through Triton's interpreter on the
smoke preset: the correctness check is real, the times are not performance.

``--preset decode`` benchmarks KV-cache decoding (``flashcore.attention_with_kvcache`` on a dense
and a paged cache against SDPA and FlexAttention on the dense cache) and reports GB/s beside the
device-to-device copy bandwidth measured in the same run.

``--preset varlen`` benchmarks packed variable-length batches (about 45% padding):
``flashcore.attention_varlen`` on the packed tokens against flashcore and SDPA on the zero-padded
batch; TFLOP/s count the real tokens only and ``vs sdpa`` compares with ``sdpa-padded`` (no mask).

``--preset paged-prefill`` benchmarks prefill from a paged KV cache: ``attention_varlen`` with a
``block_table`` (pages of 16 and 256 keys in shuffled order) beside the same lengths on dense
packed k/v (``flashcore-varlen``); forward only.

``--providers flashcore,flashcore-sinks`` measures attention sinks (float32 ``(H,)``, learnable:
they require grad in the backward modes) against flashcore without them on the same inputs; the
check uses the reference with the same sinks. A value head dim other than D goes in the D field
of ``--shape``: ``192:128`` is D=192 for q and k, Dv=128 for v (MLA). A provider that is a
variant of another (flashcore-sinks of flashcore, the paged ones of their dense one) gets its
time over its base's, printed after the table on a GPU.

``--window LEFT,RIGHT`` gives every case a local window (``window=`` of ``flashcore.attention``:
query i sees keys i + Sk - Sq - LEFT to i + Sk - Sq + RIGHT, -1 for a side without a bound, RIGHT
0 when causal), as sliding-window models run it (gpt-oss: ``--window 127,0 --causal on``); TFLOP/s
count the pairs it leaves visible, SDPA gets the window as a boolean mask, FlexAttention as a
block mask, FlashAttention-4 as ``window_size``.

``--cuda-graph`` also times every measurement as back-to-back eager calls and as the same calls
replayed from one CUDA graph, and reports the host's cost per call (eager minus graph) beside the
graph's time, the GPU's.

Exit status: 0, or 1 when a flashcore result is outside the error rule; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Callable

import torch

from flashcore.bench import cases as cases_mod
from flashcore.bench.metrics import GRAPH_CALLS
from flashcore.bench.providers import (
    DECODE_CPU,
    DECODE_GPU,
    DEFAULT_CPU,
    DEFAULT_GPU,
    PAGED_PREFILL_CPU,
    PAGED_PREFILL_GPU,
    PROVIDERS,
    VARLEN_CPU,
    VARLEN_GPU,
    baseline,
)
from flashcore.bench.runner import MODES

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

EPILOG = """\
examples (GPU):
  flashcore-bench --preset seed --out seed.jsonl
  flashcore-bench --preset sweep --mode fwd --out sweep.jsonl --plot sweep.png
  flashcore-bench --shape 4,32,4096,128,8 --causal on --mode fwd,bwd --providers flashcore,sdpa
  flashcore-bench --preset seed --resources
  flashcore-bench --preset decode --out decode.jsonl
  flashcore-bench --preset varlen --mode fwd,bwd,fwdbwd --dtype fp16,bf16 --out varlen.jsonl
  flashcore-bench --preset paged-prefill --out paged-prefill.jsonl
  flashcore-bench --shape 4,16,4096,128 --mode fwd,bwd --providers flashcore,flashcore-sinks
  flashcore-bench --shape 1,128,4096,192:128 --mode fwd,bwd --providers flashcore,sdpa,sdpa-cudnn
  flashcore-bench --preset sweep --causal on --window 127,0 --mode bwd --providers flashcore,flex
  flashcore-bench --preset seed --providers flashcore,sdpa --mode fwd,fwdbwd --cuda-graph
  flashcore-bench --preset decode --providers flashcore-kvcache,flashcore-paged256,sdpa --cuda-graph
earlier runs' rows (no GPU needed):
  flashcore-bench --summarize sweep.jsonl --summarize sweep-2.jsonl
without a GPU (Triton interpreter, correctness only):
  flashcore-bench --preset smoke --out smoke.jsonl
  flashcore-bench --preset decode-smoke
  flashcore-bench --preset varlen-smoke --mode fwd,bwd
  flashcore-bench --preset paged-prefill-smoke
  flashcore-bench --shape 1,4,40,32:16,2,56 --mode fwd,bwd --providers flashcore,flashcore-sinks
"""


def _csv(choices: list[str] | tuple[str, ...], *, extra: tuple[str, ...] = ()) -> Callable:
    """argparse type: a comma-separated list of choices, duplicates dropped, order kept."""

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices and t not in extra]
        if bad or not items:
            allowed = ", ".join([*choices, *extra])
            raise argparse.ArgumentTypeError(
                f"{', '.join(bad) or 'nothing'} not in {{{allowed}}} (got {text!r})"
            )
        return list(dict.fromkeys(items))

    return parse


def _shape(text: str) -> cases_mod.Shape:
    try:
        return cases_mod.parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _window(text: str) -> tuple[int, int]:
    try:
        return cases_mod.parse_window(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _plain(text: str) -> str:
    """Docstring text for a terminal: ``literal`` markup dropped."""
    return re.sub(r"``([^`]+)``", r"\1", text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashcore-bench",
        description=_plain("\n\n".join(__doc__.split("\n\n")[:2])),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_argument_group("what to run")
    what.add_argument(
        "--preset",
        choices=list(cases_mod.PRESETS),
        help="shape set: "
        + "; ".join(f"{k}: {v[1]}" for k, v in cases_mod.PRESETS.items())
        + ". Default: seed on a GPU, smoke without one (none when --shape is given).",
    )
    what.add_argument(
        "--shape",
        action="append",
        type=_shape,
        default=[],
        metavar=cases_mod.SHAPE_SYNTAX,
        help="a one-off shape (repeatable): q (B,H,S,D), k (B,Hkv,Sk,D), v (B,Hkv,Sk,Dv); Hkv "
        "defaults to H, Sk to S, Dv to D (D:Dv sets it, as 192:128)",
    )
    what.add_argument(
        "--providers",
        type=_csv(list(PROVIDERS), extra=("all",)),
        metavar="LIST",
        help=f"comma-separated, from {', '.join(PROVIDERS)} or 'all'. Default on a GPU: "
        f"{','.join(DEFAULT_GPU)}; without one: {','.join(DEFAULT_CPU)}. With a decode preset: "
        f"{','.join(DECODE_GPU)}; without a GPU: {','.join(DECODE_CPU)}. With a varlen preset: "
        f"{','.join(VARLEN_GPU)}; without a GPU: {','.join(VARLEN_CPU)}. With a paged-prefill "
        f"preset: {','.join(PAGED_PREFILL_GPU)}; without a GPU: {','.join(PAGED_PREFILL_CPU)}",
    )
    what.add_argument(
        "--mode",
        type=_csv(MODES),
        default=["fwd"],
        metavar="LIST",
        help="comma-separated from fwd, bwd (backward alone), fwdbwd (default: fwd)",
    )
    what.add_argument(
        "--dtype",
        type=_csv(list(DTYPES)),
        default=["bf16"],
        metavar="LIST",
        help="comma-separated from fp16, bf16 (default: bf16)",
    )
    what.add_argument("--causal", choices=["both", "on", "off"], default="both")
    what.add_argument(
        "--window",
        type=_window,
        metavar=cases_mod.WINDOW_SYNTAX,
        help="a local window on every case: LEFT and RIGHT keys either side of the diagonal "
        "(-1: no bound on that side, as --window=-1,64; RIGHT is 0 when causal)",
    )
    what.add_argument(
        "--cpu",
        action="store_true",
        help="run on the CPU through Triton's interpreter even with a GPU",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--out", metavar="FILE.jsonl", help="write one JSON row per measurement")
    out.add_argument(
        "--summarize",
        action="append",
        default=[],
        metavar="FILE.jsonl",
        help="read the rows an earlier run wrote with --out (repeatable, one run a file) and print "
        "FlashCore's geometric-mean speed against each other provider in them, per mode and "
        "dtype (the summary every GPU run prints at its end); runs nothing",
    )
    out.add_argument(
        "--plot",
        metavar="FILE.png",
        help="TFLOP/s vs sequence length per provider, one panel per (D, causal, mode); "
        "needs matplotlib and a GPU run",
    )
    out.add_argument(
        "--resources",
        action="store_true",
        help="after the run, list each compiled flashcore kernel variant: block sizes, warps, "
        "stages, registers, spills, shared memory",
    )
    timing = parser.add_argument_group("timing")
    timing.add_argument(
        "--warmup", type=_positive_int, default=25, metavar="MS", help="do_bench warm-up (ms)"
    )
    timing.add_argument(
        "--rep", type=_positive_int, default=100, metavar="MS", help="do_bench repetition (ms)"
    )
    timing.add_argument(
        "--cuda-graph",
        action="store_true",
        help="also time each measurement as --graph-calls back-to-back eager calls and as the "
        "same calls replayed from one CUDA graph (after a warm-up; no L2 flush), adding the "
        "columns loop ms, graph ms, host ms (= loop - graph, the host's cost per call beyond "
        "the GPU's) and g vs sdpa; GPU only",
    )
    timing.add_argument(
        "--graph-calls",
        type=_positive_int,
        default=GRAPH_CALLS,
        metavar="N",
        help=f"calls per CUDA graph and per eager loop with --cuda-graph (default {GRAPH_CALLS})",
    )
    return parser


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace, on_gpu: bool) -> None:
    if not on_gpu and args.preset in cases_mod.GPU_PRESETS:
        why = "--cpu was given" if args.cpu else "no CUDA device is available"
        small = [p for p in cases_mod.PRESETS if p not in cases_mod.GPU_PRESETS]
        parser.error(
            f"--preset {args.preset} needs a GPU ({why}); the Triton interpreter runs "
            f"--preset {', '.join(small)} or small --shape cases"
        )
    if args.cuda_graph and not on_gpu:
        parser.error("--cuda-graph times CUDA graphs, which only a GPU run has; drop --cuda-graph")
    if args.plot:
        if not on_gpu:
            parser.error("--plot draws TFLOP/s, which only a GPU run measures; drop --plot")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'flashcore[bench]'")


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: no bar when stderr is not a terminal (CI logs, redirected runs).
    return tqdm(total=total, file=sys.stderr, disable=None, leave=False, unit="run")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.summarize:
        return _summarize(parser, args)
    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu:
        # Read when flashcore defines its kernels, at its first call: early enough here.
        os.environ["TRITON_INTERPRET"] = "1"
    _validate(parser, args, on_gpu)

    presets = (
        [args.preset] if args.preset else [] if args.shape else ["seed" if on_gpu else "smoke"]
    )
    cases = cases_mod.select_cases(presets, args.shape, args.causal)
    if args.window is not None:
        cases = [c._replace(window=args.window) for c in cases]
    if not cases:
        parser.error("no case left to run (check --causal against the preset)")
    if args.preset in cases_mod.DECODE_PRESETS:
        defaults = DECODE_GPU if on_gpu else DECODE_CPU
    elif args.preset in cases_mod.VARLEN_PRESETS:
        defaults = VARLEN_GPU if on_gpu else VARLEN_CPU
    elif args.preset in cases_mod.PAGED_PREFILL_PRESETS:
        defaults = PAGED_PREFILL_GPU if on_gpu else PAGED_PREFILL_CPU
    else:
        defaults = DEFAULT_GPU if on_gpu else DEFAULT_CPU
    names = args.providers or defaults
    if "all" in names:
        names = list(PROVIDERS)
    providers = [PROVIDERS[n] for n in names]
    argv_text = shlex.join(sys.argv[1:] if argv is None else argv)
    return _run(args, on_gpu, cases, providers, command=f"flashcore-bench {argv_text}".strip())


def _summarize(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--summarize``: each file's provider summary; nothing runs."""
    if args.preset or args.shape or args.out or args.plot or args.resources:
        parser.error(
            "--summarize reads earlier runs and runs nothing: drop --preset, --shape, --out, "
            "--plot and --resources"
        )
    from flashcore.bench import report

    for path in args.summarize:
        try:
            rows = report.read_jsonl(path)
        except OSError as e:
            parser.error(f"--summarize: cannot read {path!r} ({e.strerror or e})")
        except ValueError as e:
            parser.error(f"--summarize: {path!r} is not JSON lines as --out writes them ({e})")
        needed = ("provider", "shape", "causal", "mode", "dtype")
        if not all(isinstance(r, dict) for r in rows):
            parser.error(f"--summarize: {path!r} holds lines that are not JSON objects")
        measured = [r for r in rows if r.get("record", "measurement") == "measurement"]
        if not all(all(k in r for k in needed) for r in measured):
            parser.error(
                f"--summarize: {path!r} holds rows without {', '.join(needed)}: not --out's rows"
            )
        text = report.provider_summary(measured)
        print(f"{path}: {len(measured)} rows")
        print(text or "  no FlashCore row timed on a GPU beside another provider's")
    return 0


def _run(args, on_gpu: bool, cases, providers, *, command: str) -> int:
    # Imported here, after the interpreter switch: these pull in triton.
    from flashcore.bench import metrics, report, resources, runner

    env = report.environment(on_gpu, command)
    settings = runner.Settings(
        device=torch.device("cuda" if on_gpu else "cpu"),
        on_gpu=on_gpu,
        warmup=args.warmup,
        rep=args.rep,
        cuda_graph=args.cuda_graph,
        graph_calls=args.graph_calls,
    )
    print(
        f"flashcore-bench: {env['device']}; torch {env['torch']}, triton {env['triton']}, "
        f"flashcore {env['flashcore']} ({env['git_sha'] or 'no git sha'})"
    )
    peak = copy_bw = None
    if on_gpu:
        peak = metrics.peak_matmul_tflops(warmup=args.warmup, rep=args.rep)
        print(f"bf16 matmul peak measured now (cuBLAS {metrics.PEAK_N}^3): {peak:.0f} TFLOP/s")
        copy_bw = metrics.peak_copy_gbps(warmup=args.warmup, rep=args.rep)
        print(f"device-to-device copy measured now (1 GiB, read + write): {copy_bw:.0f} GB/s")
    else:
        print("No GPU: kernels run through Triton's interpreter. Correctness is checked for real;")
        print("times are interpreter wall times, not performance.")
    print()
    graph = settings.cuda_graph
    print(report.table_header(not on_gpu, graph))

    out_file = open(args.out, "w") if args.out else None  # noqa: SIM115 (rows stream as they come)
    total = len(cases) * len(args.dtype) * len(args.mode) * len(providers)
    bar = _progress(total)
    emit = bar.write if bar is not None else print
    rows: list[dict] = []
    try:
        for case in cases:
            for dtype_name in args.dtype:
                if bar is not None:
                    bar.set_postfix_str(f"{case.label} {dtype_name}")
                inputs = runner.Inputs(case, DTYPES[dtype_name], args.mode, settings)
                for mode in args.mode:
                    results = runner.run_group(providers, case, mode, inputs, settings)
                    base = next(
                        (
                            r
                            for r in results
                            if r.provider == baseline(case) and r.timing is not None
                        ),
                        None,
                    )
                    by_name = {r.provider: r for r in results}
                    group = []
                    for provider, r in zip(providers, results, strict=True):
                        speedup = base.timing.p50 / r.timing.p50 if base and r.timing else None
                        variant_of = by_name.get(provider.base)
                        row = report.measurement_row(
                            r, env=env, peak=peak, speedup=speedup, copy_gbps=copy_bw,
                            graph_speedup=_graph_speedup(base, r), base=variant_of,
                        )  # fmt: skip
                        group.append(row)
                    for row in group:
                        emit(report.table_row(row, graph))
                    if out_file:
                        report.write_jsonl(out_file, group)
                    rows += group
                    if bar is not None:
                        bar.update(len(results))
                del inputs
                if on_gpu:
                    torch.cuda.empty_cache()
    finally:
        if bar is not None:
            bar.close()
        if out_file:
            out_file.close()
    print()
    varlen = any(c.seqlens is not None for c in cases)
    graph_calls = settings.graph_calls if graph else None
    print(report.table_footer(not on_gpu, peak, copy_bw, varlen=varlen, graph_calls=graph_calls))
    variants = report.variant_summary(rows)
    if variants:
        print()
        print(variants)
    against = report.provider_summary(rows)
    if against:
        print()
        print(against)

    if args.resources:
        found = resources.collect() if on_gpu else None
        text, spill_warnings = resources.format_report(found)
        print()
        print(text)
        for w in spill_warnings:
            print(w, file=sys.stderr)
        if args.out and found:
            with open(args.out, "a") as f:
                report.write_jsonl(f, [{**r.as_row(), **env} for r in found])

    if args.plot:
        report.plot(rows, args.plot)
        print(f"plot: {args.plot}")
    if args.out:
        print(f"rows: {args.out}")

    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "wrong", "refused")}
    summary = f"{counts['ok']} ok, {counts['wrong']} wrong, {counts['refused']} refused"
    n_noisy = sum(report.noisy(r) for r in rows)
    if n_noisy:
        summary += f"; {n_noisy} timed noisy (marked; re-run them before comparing)"
    print(summary)
    flashcore_wrong = [
        r for r in rows if r["provider"].startswith("flashcore") and r["status"] == "wrong"
    ]
    return 1 if flashcore_wrong else 0


def _graph_speedup(base, r) -> float | None:
    """The baseline's CUDA-graph time over ``r``'s, when both were timed in a graph."""
    if base is None or base.graph is None or r.graph is None:
        return None
    return base.graph.graph.p50 / r.graph.graph.p50
