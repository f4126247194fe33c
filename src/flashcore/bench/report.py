"""Output: JSONL rows, the fixed-width table, the plot, and the run's environment."""

from __future__ import annotations

import datetime
import json
import math
import platform
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import IO

import torch

from flashcore.bench import metrics
from flashcore.bench.runner import Measurement

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def git_sha() -> str | None:
    """HEAD of the checkout flashcore is imported from (``-dirty`` with local changes), if any."""
    where = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha or None


def environment(on_gpu: bool, command: str) -> dict:
    """What every row records about where and how it was measured."""
    import triton

    import flashcore

    return {
        "device": torch.cuda.get_device_name() if on_gpu else "CPU (Triton interpreter)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "flashcore": flashcore.__version__,
        "python": platform.python_version(),
        "git_sha": git_sha(),
        "command": command,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _num(x: float | None) -> float | None:
    """JSON has no inf/NaN: those become null (the status and reason say what happened)."""
    return None if x is None or not math.isfinite(x) else x


def measurement_row(
    m: Measurement,
    *,
    env: dict,
    peak: float | None,
    speedup: float | None,
    copy_gbps: float | None = None,
    graph_speedup: float | None = None,
    base: Measurement | None = None,
) -> dict:
    """One JSON row; ``graph_speedup`` is sdpa's CUDA-graph time over this row's; ``base`` is the
    measurement of the provider this one is a variant of (``Provider.base``), if any."""
    s = m.case.shape
    g = m.graph
    flops = metrics.attention_flops(m.case, m.mode)
    t = m.timing
    gpu_time = t is not None and t.timer == metrics.TIMER_GPU
    rate = metrics.tflops(flops, t.p50) if gpu_time else None
    nbytes = metrics.attention_bytes(m.case, m.dtype.itemsize) if m.mode == "fwd" else None
    bandwidth = metrics.gbps(nbytes, t.p50) if gpu_time and nbytes else None
    errors = m.errors or {}
    base_timed = gpu_time and base is not None and base.timing is not None
    return {
        "record": "measurement",
        "provider": m.provider,
        "mode": m.mode,
        "dtype": DTYPE_NAMES[m.dtype],
        "shape": s.spec,
        "batch": s.batch,
        "heads": s.heads,
        "kv_heads": s.kv_heads,
        "seqlen_q": s.seqlen_q,
        "seqlen_k": s.seqlen_k,
        "head_dim": s.head_dim,
        "value_dim": s.value_dim,
        "causal": m.case.causal,
        "window": list(m.case.window) if m.case.window is not None else None,
        "seqlens": list(m.case.seqlens) if m.case.seqlens is not None else None,
        "padding": m.case.padding,
        "status": m.status,
        "reason": m.reason,
        "ms_p20": t.p20 if t else None,
        "ms_p50": t.p50 if t else None,
        "ms_p80": t.p80 if t else None,
        "timer": t.timer if t else None,
        "flops": flops,
        "tflops": rate,
        "pct_peak": 100 * rate / peak if rate and peak else None,
        "bytes": nbytes,
        "gbps": bandwidth,
        "pct_copy_bw": 100 * bandwidth / copy_gbps if bandwidth and copy_gbps else None,
        "copy_gbps": copy_gbps,
        "speedup_vs_sdpa": speedup if gpu_time else None,
        "base_provider": base.provider if base is not None else None,
        "time_vs_base": t.p50 / base.timing.p50 if base_timed else None,
        "graph_calls": g.calls if g else None,
        "loop_ms_p20": g.loop.p20 if g else None,
        "loop_ms_p50": g.loop.p50 if g else None,
        "loop_ms_p80": g.loop.p80 if g else None,
        "graph_ms_p20": g.graph.p20 if g else None,
        "graph_ms_p50": g.graph.p50 if g else None,
        "graph_ms_p80": g.graph.p80 if g else None,
        "host_ms": g.host_ms if g else None,
        "graph_speedup_vs_sdpa": graph_speedup if g else None,
        "graph_reason": m.graph_reason,
        "rel_err": _num(m.rel_err),
        "max_abs_err": _num(max(e.err for e in errors.values())) if errors else None,
        "errors": {
            name: {
                "err": _num(e.err),
                "pt_err": _num(e.pt_err),
                "ref_max": _num(e.ref_max),
                "bound": _num(e.bound),
                "ok": e.ok,
            }
            for name, e in errors.items()
        },
        "warnings": list(m.warnings),
        "peak_bf16_tflops": peak,
        **env,
    }


def write_jsonl(stream: IO[str], rows: Iterable[dict]) -> None:
    for row in rows:
        stream.write(json.dumps(row) + "\n")
    stream.flush()


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# name, width, alignment
_COLUMNS = [
    ("provider", 25, "<"),  # flashcore-varlen-paged256
    ("shape", 17, "<"),
    ("pad", 4, ">"),
    ("causal", 7, "<"),
    ("mode", 7, "<"),
    ("dtype", 5, "<"),
    ("p50 ms", 10, ">"),
    ("p20-p80 ms", 18, ">"),
    ("TFLOP/s", 8, ">"),
    ("%peak", 6, ">"),
    ("GB/s", 7, ">"),
    ("%copy", 6, ">"),
    ("vs sdpa", 8, ">"),
    ("rel err", 9, ">"),
]
# With --cuda-graph, after the columns above (metrics.time_graph).
_GRAPH_COLUMNS = [
    ("loop ms", 9, ">"),
    ("graph ms", 9, ">"),
    ("host ms", 8, ">"),
    ("g vs sdpa", 9, ">"),
]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _columns(graph: bool) -> list[tuple[str, int, str]]:
    return _COLUMNS + _GRAPH_COLUMNS if graph else _COLUMNS


def table_header(interpreted: bool, graph: bool = False) -> str:
    """The table's header; ``graph`` adds the ``--cuda-graph`` columns."""
    columns = _columns(graph)
    names = [("wall ms*" if interpreted and n == "p50 ms" else n) for n, _, _ in columns]
    cells = [f"{n:{a}{w}}" for n, (_, w, a) in zip(names, columns, strict=True)]
    head = " ".join(cells) + "  status"
    return head + "\n" + "-" * len(head)


def table_row(row: dict, graph: bool = False) -> str:
    """One line of the table; ``graph`` adds the ``--cuda-graph`` columns (as the header)."""
    p20, p50, p80 = row["ms_p20"], row["ms_p50"], row["ms_p80"]
    single = p50 is None or row["timer"] != metrics.TIMER_GPU
    spread = "-" if single else f"{p20:.4g}-{p80:.4g}"
    values = [
        row["provider"],
        row["shape"],
        f"{row['padding']:.0%}" if row.get("seqlens") else "-",
        _masking(row),
        row["mode"],
        row["dtype"],
        _fmt(p50, ".4g"),
        spread,
        _fmt(row["tflops"], ".1f"),
        _fmt(row["pct_peak"], ".0f"),
        _fmt(row.get("gbps"), ".0f"),
        _fmt(row.get("pct_copy_bw"), ".0f"),
        _fmt(row["speedup_vs_sdpa"], ".2f"),
        _fmt(row["rel_err"], ".1e"),
    ]
    if graph:
        values += [
            _fmt(row.get("loop_ms_p50"), ".4g"),
            _fmt(row.get("graph_ms_p50"), ".4g"),
            _fmt(row.get("host_ms"), ".4g"),
            _fmt(row.get("graph_speedup_vs_sdpa"), ".2f"),
        ]
    columns = _columns(graph)
    cells = [f"{v!s:{a}{w}}" for v, (_, w, a) in zip(values, columns, strict=True)]
    status = {"ok": "ok", "wrong": "WRONG", "refused": "refused"}[row["status"]]
    text = " ".join(cells) + f"  {status}"
    if noisy(row):
        text += f" (noisy: p20-p80 {_spread(row):.0f}% of the median)"
    reasons = [row["reason"]] + ([row.get("graph_reason")] if graph else [])
    for reason in filter(None, reasons):
        text += f" ({reason[:97] + '...' if len(reason) > 100 else reason})"
    return text


VARLEN_NOTE = (
    "Varlen (pad = padding share of the padded (B, S_max) batch): flashcore-varlen runs the packed "
    "tokens (flashcore-varlen-paged16/256: the same against a paged copy of K and V, blocks of "
    "16/256 keys in shuffled order); the other providers the zero-padded (B, H, S_max, D) batch, "
    "checked on the real tokens only. sdpa-padded uses no mask: the most favourable case for SDPA "
    "(no masking; its extra work is on padding), exact when causal; non-causal its real queries "
    "also attend to the padding keys, so it is WRONG by construction and its time a lower bound "
    "for padded SDPA. sdpa-padded-mask: with a key-padding mask (correct). TFLOP/s count the real "
    "tokens only; vs sdpa compares with sdpa-padded."
)


GRAPH_NOTE = (
    "CUDA graphs (--cuda-graph, {calls} calls back to back, {repeats} repeats, medians, no L2 "
    "flush): "
    "loop ms = per call of the eager loop (the host's pace or the GPU's, the slower); graph ms = "
    "per call of the same calls replayed from one CUDA graph (the GPU's pace: kernels and the "
    "gaps between them); host ms = loop - graph, what the host adds per call (about 0 when the "
    "GPU sets the pace); g vs sdpa = sdpa's graph ms / this row's."
)


def table_footer(
    interpreted: bool,
    peak: float | None,
    copy_gbps: float | None = None,
    *,
    varlen: bool = False,
    graph_calls: int | None = None,
) -> str:
    """Notes under the table; ``graph_calls`` (with ``--cuda-graph``) adds the graph columns'."""
    lines = [
        "rel err = max|x - ref| / max|ref| over out (and dq, dk, dv, dsinks with sinks, in "
        "backward modes); WRONG = outside FlashAttention's rule max|x - ref| <= 2 max|pt - ref| "
        "+ eps."
    ]
    if varlen:
        lines.append(VARLEN_NOTE)
    if interpreted:
        lines.append(
            "* Triton interpreter on the CPU: wall time (time.perf_counter) of one call, "
            "recorded only to show how long the interpreter took. NOT performance."
        )
    else:
        lines.append(
            "Times: triton.testing.do_bench, median and 20th-80th percentiles. TFLOP/s: fwd "
            "4*B*H*Sq*Sk*D (causal: half), bwd 2.5x, fwd+bwd 3.5x; with Dv != D (shape D:Dv), "
            "fwd 2*B*H*Sq*Sk*(D+Dv), bwd 2*B*H*Sq*Sk*(3D+2Dv). noisy: a p20-p80 spread over "
            f"{NOISY_SPREAD:.0f}% of the median (the GPU was disturbed while timing; re-run it)."
        )
        if peak:
            lines.append(
                f"%peak: of the bf16 matmul rate measured in this run "
                f"(cuBLAS {metrics.PEAK_N}^3, torch.matmul): {peak:.0f} TFLOP/s."
            )
        lines.append(
            "GB/s (fwd): least bytes moved (q, out, K and V once) per second; %copy: of the "
            "device-to-device copy bandwidth measured in this run"
            + (f" ({copy_gbps:.0f} GB/s)." if copy_gbps else ".")
        )
        if graph_calls:
            lines.append(GRAPH_NOTE.format(calls=graph_calls, repeats=metrics.GRAPH_REPEATS))
    return "\n".join(lines)


def variant_summary(rows: list[dict]) -> str | None:
    """Each variant's time over its base's (``time_vs_base``), beside both spreads; None when no
    row has one (a CPU run, or no variant with its base)."""
    index = {_key(r, r["provider"]): r for r in rows}
    lines = []
    for r in rows:
        base = index.get(_key(r, r.get("base_provider")))
        if r.get("time_vs_base") is None or base is None:
            continue
        causal = _masking(r)
        lines.append(
            f"  {r['provider']} over {r['base_provider']}, {r['shape']} {causal} {r['mode']} "
            f"{r['dtype']}: {100 * (r['time_vs_base'] - 1):+.1f}% (p20-p80 spread "
            f"{_spread(r):.1f}% and {_spread(base):.1f}% of the medians)"
        )
    if not lines:
        return None
    head = (
        "Variants over their base provider (median time / the base's median - 1, same case, "
        "dtype and mode; a difference inside the spreads is noise):"
    )
    return "\n".join([head, *lines])


def provider_summary(rows: list[dict]) -> str | None:
    """Each FlashCore provider against each other provider timed beside it: per mode and dtype,
    the geometric mean over the cases both timed on the GPU (``ok``, same case, mode and dtype)
    of the other's median time over FlashCore's (> 1: FlashCore faster), with the lowest and
    highest case. Rows marked noisy count (the table marks them); None without such pairs (a
    CPU run, or no other provider)."""
    timed = [
        r for r in rows
        if r.get("record", "measurement") == "measurement" and r.get("status") == "ok"
        and r.get("timer") == metrics.TIMER_GPU
        and isinstance(r.get("ms_p50"), (int, float)) and r["ms_p50"] > 0
    ]  # fmt: skip
    index = {_key(r, r["provider"]): r for r in timed}
    providers = list(dict.fromkeys(r["provider"] for r in timed))
    subjects = [p for p in providers if p.startswith("flashcore")]
    others = [p for p in providers if not p.startswith("flashcore")]
    lines = []
    for subject in subjects:
        groups: dict[tuple, dict[str, list]] = {}
        for r in timed:
            if r["provider"] != subject:
                continue
            for other in others:
                base = index.get(_key(r, other))
                if base is None:
                    continue
                ratio = base["ms_p50"] / r["ms_p50"]
                group = groups.setdefault((r["mode"], r["dtype"]), {})
                group.setdefault(other, []).append((ratio, r))
        for (mode, dtype), by_other in groups.items():
            for other, pairs in by_other.items():
                ratios = [x for x, _ in pairs]
                mean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
                low, low_row = min(pairs, key=lambda pair: pair[0])
                high, high_row = max(pairs, key=lambda pair: pair[0])
                lines.append(
                    f"  {subject} vs {other}, {mode} {dtype}: {mean:.3f} over {len(pairs)} "
                    f"case{'s' if len(pairs) > 1 else ''} (lowest {low:.2f} at "
                    f"{low_row['shape']} {_masking(low_row)}, highest {high:.2f} at "
                    f"{high_row['shape']} {_masking(high_row)})"
                )
    if not lines:
        return None
    head = (
        "Against the other providers (their median time / FlashCore's, geometric mean over the "
        "cases both timed; > 1: FlashCore faster):"
    )
    return "\n".join([head, *lines])


def _masking(row: dict) -> str:
    """The causal column: causal or full, and a window's sides (``w128,0``)."""
    text = "causal" if row["causal"] else "full"
    window = row.get("window")
    return text if not window else f"{text} w{window[0]},{window[1]}"


def _key(row: dict, provider: str | None) -> tuple:
    """``provider``'s row in ``row``'s group (case, mode, dtype)."""
    seqlens = tuple(row["seqlens"]) if row.get("seqlens") else None
    window = tuple(row["window"]) if row.get("window") else None
    return (row["shape"], seqlens, row["causal"], window, row["mode"], row["dtype"], provider)


def _spread(row: dict) -> float:
    return 100 * (row["ms_p80"] - row["ms_p20"]) / row["ms_p50"]


# A GPU timing whose 20th-80th percentile spread exceeds this share of its median (in percent)
# is marked noisy: something else shared the GPU or its clocks moved during the timing, and its
# median is not to be compared. On an H200 steady backward timings spread 1-9% and the disturbed
# ones seen 14-57% (docs/performance_backward.md, "`FRESH_DESC` run").
NOISY_SPREAD = 10.0


def noisy(row: dict) -> bool:
    """Whether ``row``'s GPU timing spread more than ``NOISY_SPREAD`` percent of its median."""
    if row.get("timer") != metrics.TIMER_GPU or not row.get("ms_p50"):
        return False
    return _spread(row) > NOISY_SPREAD


def _seq_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot(rows: list[dict], path: str | Path) -> None:
    """TFLOP/s against sequence length (Sq) per provider, one panel per (D, Dv, causal, mode).

    Points outside the error rule are circled in red. Only rows timed on a GPU have TFLOP/s.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.get("record") == "measurement" and r.get("tflops") is not None]
    if not timed:
        raise ValueError(
            "nothing to plot: no row has TFLOP/s (only GPU runs timed with do_bench have them)"
        )
    panels = sorted({_panel(r) for r in timed})
    providers = list(dict.fromkeys(r["provider"] for r in timed))
    dtypes = sorted({r["dtype"] for r in timed})
    # The sweep's four panels (D 64/128 x causal or not) read best as 2 x 2: a row per D.
    ncols = 2 if len(panels) in (2, 4) else min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.8 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (head_dim, value_dim, causal, mode) in zip(axes.flat, panels, strict=False):
        panel = [r for r in timed if _panel(r) == (head_dim, value_dim, causal, mode)]
        for provider in providers:
            for dtype in dtypes:
                pts = sorted(
                    (r["seqlen_q"], r["tflops"], r["status"])
                    for r in panel
                    if r["provider"] == provider and r["dtype"] == dtype
                )
                if not pts:
                    continue
                label = provider if len(dtypes) == 1 else f"{provider} {dtype}"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
                bad = [p for p in pts if p[2] != "ok"]
                if bad:
                    ax.scatter(
                        [p[0] for p in bad], [p[1] for p in bad],
                        s=150, facecolors="none", edgecolors="red", zorder=3,
                        label=f"{label}: WRONG",
                    )  # fmt: skip
        seqlens = sorted({r["seqlen_q"] for r in panel})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, [_seq_label(n) for n in seqlens])
        dims = f"D={head_dim}" if value_dim == head_dim else f"D={head_dim}, Dv={value_dim}"
        ax.set_title(f"{dims}, {'causal' if causal else 'non-causal'}, {mode}")
        ax.set_xlabel("sequence length (Sq)")
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    first = timed[0]
    sha = first.get("git_sha") or "no git sha"
    fig.suptitle(
        f"flashcore-bench on {first.get('device')}, {', '.join(dtypes)} "
        f"(torch {first.get('torch')}, triton {first.get('triton')}, {sha})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _panel(row: dict) -> tuple:
    """A row's plot panel: (D, Dv, causal, mode); rows written before Dv existed have Dv = D."""
    return (row["head_dim"], row.get("value_dim") or row["head_dim"], row["causal"], row["mode"])
