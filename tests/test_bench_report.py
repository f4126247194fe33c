"""The flashcore-bench report: rows as strict JSON, the plot, the CUDA-graph columns, the summaries
of variants, providers and earlier runs, and noisy timings marked."""

import json

import pytest
import torch

from flashcore.bench import cases, check, metrics, report, runner
from flashcore.bench.cli import main


def _synthetic_rows():
    rows = []
    for provider, rate in [("flashcore", 300.0), ("sdpa", 250.0)]:
        for causal in (False, True):
            for s in (512, 1024, 2048):
                rows.append(
                    {"record": "measurement", "provider": provider, "mode": "fwd",
                     "dtype": "bf16", "head_dim": 64, "causal": causal, "seqlen_q": s,
                     "tflops": rate * (1 + s / 4096), "status": "ok", "device": "test",
                     "torch": "x", "triton": "y", "git_sha": None}
                )  # fmt: skip
    rows[-1]["status"] = "wrong"
    return rows


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from flashcore.bench.report import plot

    path = tmp_path / "plot.png"
    plot(_synthetic_rows(), path)
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="nothing to plot"):
        plot([{**r, "tflops": None} for r in _synthetic_rows()], path)


def test_rows_are_strict_json(tmp_path):
    # NaN/inf never reach the file: json.loads with strict constants must accept every row.
    out = tmp_path / "rows.jsonl"
    assert (
        main(["--shape", "1,1,16,16", "--causal", "off", "--providers", "sdpa", "--out", str(out)])
        == 0
    )
    for line in out.read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def _graph_measurement(provider: str, loop_ms: float, graph_ms: float) -> runner.Measurement:
    case = cases.Case(cases.shape(1, 8, 512, 64), True)
    timing = metrics.Timing(0.0105, 0.011, 0.0115, metrics.TIMER_GPU)  # steady: 9% spread
    graph = metrics.GraphTiming(
        metrics.Timing(loop_ms * 0.9, loop_ms, loop_ms * 1.1, metrics.TIMER_LOOP),
        metrics.Timing(graph_ms * 0.9, graph_ms, graph_ms * 1.1, metrics.TIMER_GRAPH),
        calls=20,
    )
    error = check.TensorError(1e-3, 1e-3, 1.0, 1e-3)
    return runner.Measurement(
        provider, case, torch.bfloat16, "fwd", "ok", None, timing, {"out": error}, graph=graph
    )


def test_cuda_graph_report():
    # Rows and table of a --cuda-graph run, from synthetic timings: host ms is loop - graph, the
    # graph speed-up compares graph times, and the columns line up under the header.
    env = {"device": "test", "git_sha": None}
    flash = _graph_measurement("flashcore", loop_ms=0.050, graph_ms=0.009)
    sdpa = _graph_measurement("sdpa", loop_ms=0.030, graph_ms=0.010)
    assert flash.graph.host_ms == pytest.approx(0.041)
    row = report.measurement_row(
        flash, env=env, peak=None, speedup=1.0, graph_speedup=0.010 / 0.009
    )
    assert row["loop_ms_p50"] == 0.050 and row["graph_ms_p50"] == 0.009
    assert row["host_ms"] == pytest.approx(0.041) and row["graph_calls"] == 20
    assert row["graph_speedup_vs_sdpa"] == pytest.approx(1.111, abs=1e-3)
    assert row["graph_reason"] is None
    json.dumps(row)

    header = report.table_header(False, graph=True)
    for name in ("loop ms", "graph ms", "host ms", "g vs sdpa"):
        assert name in header
    line = report.table_row(row, graph=True)
    assert len(line.split("  ok")[0]) == len(header.splitlines()[0].split("  status")[0])
    assert line.split()[-5:] == ["0.05", "0.009", "0.041", "1.11", "ok"]
    base = report.measurement_row(sdpa, env=env, peak=None, speedup=1.0, graph_speedup=1.0)
    assert report.table_row(base, graph=True).split()[-3:] == ["0.02", "1.00", "ok"]

    # Without --cuda-graph the table is the one it always was.
    assert report.table_header(False) == report.table_header(False, graph=False)
    assert "loop ms" not in report.table_header(False)
    assert report.table_row(row).split()[-1] == "ok" and "0.041" not in report.table_row(row)
    footer = report.table_footer(False, None, graph_calls=20)
    assert "host ms = loop - graph" in footer and "20 calls back to back" in footer
    assert "host ms" not in report.table_footer(False, None)

    # A provider that cannot be captured keeps its other numbers; the reason is shown.
    failed = _graph_measurement("flex", 0.05, 0.01)
    failed.graph, failed.graph_reason = None, "cuda graph: RuntimeError: capture failed"
    row = report.measurement_row(failed, env=env, peak=None, speedup=None)
    assert row["host_ms"] is None and row["ms_p50"] == 0.011
    assert "(cuda graph: RuntimeError: capture failed)" in report.table_row(row, graph=True)


def test_variant_summary():
    # A variant's time over its base's (GPU rows only), and the summary printed after the table.
    env = {"device": "test", "git_sha": None}
    base = _graph_measurement("flashcore", 0.05, 0.01)
    sinks = _graph_measurement("flashcore-sinks", 0.05, 0.01)
    sinks.timing = metrics.Timing(0.0105, 0.0112, 0.0115, metrics.TIMER_GPU)
    rows = [
        report.measurement_row(base, env=env, peak=None, speedup=None),
        report.measurement_row(sinks, env=env, peak=None, speedup=None, base=base),
    ]
    assert rows[0]["base_provider"] is None and rows[0]["time_vs_base"] is None
    assert rows[1]["base_provider"] == "flashcore"
    assert rows[1]["time_vs_base"] == pytest.approx(0.0112 / 0.011)
    text = report.variant_summary(rows)
    assert text.startswith("Variants over their base provider")
    line = text.splitlines()[1]
    assert "flashcore-sinks over flashcore, 1,8,512,64 causal fwd bf16: +1.8%" in line
    assert "spread 8.9% and 9.1% of the medians" in line
    assert "flashcore-sinks" in report.table_row(rows[1])  # the wider provider column
    # Interpreter rows have no time ratio, and then no summary.
    sinks.timing = metrics.Timing(1.0, 1.0, 1.0, metrics.TIMER_INTERPRETER)
    row = report.measurement_row(sinks, env=env, peak=None, speedup=None, base=base)
    assert row["time_vs_base"] is None
    assert report.variant_summary([rows[0], row]) is None


def _timed_row(provider, shape, causal, ms, *, mode="fwd", dtype="bf16", status="ok"):
    return {
        "record": "measurement", "provider": provider, "shape": shape, "causal": causal,
        "mode": mode, "dtype": dtype, "status": status, "ms_p50": ms,
        "timer": metrics.TIMER_GPU, "window": None, "seqlens": None,
    }  # fmt: skip


def test_provider_summary():
    # FlashCore against each other provider: the geometric mean of their time over FlashCore's
    # across the cases both timed, per mode and dtype, with the lowest and highest case.
    rows = [
        _timed_row("flashcore", "1,8,512,64", False, 1.0),
        _timed_row("sdpa", "1,8,512,64", False, 2.0),
        _timed_row("fa4", "1,8,512,64", False, 0.5),
        _timed_row("flashcore", "1,8,512,64", True, 1.0),
        _timed_row("sdpa", "1,8,512,64", True, 8.0),
        # Not paired: fa4 did not time this case, and a wrong row does not count.
        _timed_row("fa4", "1,8,512,64", True, 9.0, status="wrong"),
        _timed_row("flashcore", "1,8,512,64", False, 3.0, mode="bwd"),
        _timed_row("sdpa", "1,8,512,64", False, 3.0, mode="bwd"),
        _timed_row("sdpa", "2,8,512,64", False, 1.0),  # no flashcore row
        # Hand-edited or failed timings are left out, not divided by.
        _timed_row("flashcore", "4,8,512,64", False, "1.0"),
        _timed_row("sdpa", "4,8,512,64", False, 2.0),
        _timed_row("flashcore", "8,8,512,64", False, 1.0),
        _timed_row("sdpa", "8,8,512,64", False, 0.0),
    ]
    text = report.provider_summary(rows)
    lines = text.splitlines()
    assert lines[0].startswith("Against the other providers")
    assert lines[1:] == [
        "  flashcore vs sdpa, fwd bf16: 4.000 over 2 cases (lowest 2.00 at 1,8,512,64 full, "
        "highest 8.00 at 1,8,512,64 causal)",
        "  flashcore vs fa4, fwd bf16: 0.500 over 1 case (lowest 0.50 at 1,8,512,64 full, "
        "highest 0.50 at 1,8,512,64 full)",
        "  flashcore vs sdpa, bwd bf16: 1.000 over 1 case (lowest 1.00 at 1,8,512,64 full, "
        "highest 1.00 at 1,8,512,64 full)",
    ]
    # Interpreter wall times are not performance: no summary from them.
    cpu = [{**r, "timer": metrics.TIMER_INTERPRETER} for r in rows]
    assert report.provider_summary(cpu) is None
    assert report.provider_summary(rows[:1]) is None  # nothing beside it


def test_summarize_earlier_runs(tmp_path, capsys):
    # --summarize reads --out's rows (environment records and all) and runs nothing.
    path = tmp_path / "run.jsonl"
    rows = [
        {"record": "environment", "device": "test"},
        _timed_row("flashcore", "1,8,512,64", False, 1.0),
        _timed_row("sdpa-cudnn", "1,8,512,64", False, 1.5),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--summarize", str(path), "--summarize", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count(f"{path}: 2 rows") == 2
    assert out.count("flashcore vs sdpa-cudnn, fwd bf16: 1.500 over 1 case") == 2
    # Rows with nothing to compare say so.
    lone = tmp_path / "lone.jsonl"
    lone.write_text(json.dumps(rows[1]) + "\n")
    assert main(["--summarize", str(lone)]) == 0
    assert "no FlashCore row timed on a GPU beside another provider's" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content, extra, message",
    [
        (None, [], "--summarize: cannot read"),
        ("{not json\n", [], "is not JSON lines as --out writes them"),
        ("[1, 2]\n", [], "holds lines that are not JSON objects"),
        ('{"provider": "flashcore"}\n', [], "holds rows without provider, shape, causal"),
        ("", ["--preset", "smoke"], "--summarize reads earlier runs and runs nothing"),
    ],
)
def test_summarize_bad_input(tmp_path, capsys, content, extra, message):
    path = tmp_path / "rows.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["--summarize", str(path), *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_noisy_timings_marked():
    # A GPU timing whose p20-p80 spread exceeds NOISY_SPREAD of its median is marked in its row
    # of the table (the status stays); a steady one, a CPU timing and a refused row are not.
    env = {"device": "test", "git_sha": None}
    steady = _graph_measurement("flashcore", loop_ms=0.050, graph_ms=0.009)
    row = report.measurement_row(steady, env=env, peak=None, speedup=1.0)
    assert not report.noisy(row) and report.table_row(row).split()[-1] == "ok"
    disturbed = _graph_measurement("flashcore", loop_ms=0.050, graph_ms=0.009)
    disturbed.timing = metrics.Timing(0.49, 0.55, 0.62, metrics.TIMER_GPU)
    row = report.measurement_row(disturbed, env=env, peak=None, speedup=1.0)
    assert report.noisy(row)
    assert report.table_row(row).endswith("ok (noisy: p20-p80 24% of the median)")
    assert not report.noisy({**row, "timer": metrics.TIMER_INTERPRETER})
    assert not report.noisy({**row, "ms_p20": None, "ms_p50": None, "ms_p80": None})
    assert "noisy: a p20-p80 spread over 10%" in report.table_footer(False, None)
