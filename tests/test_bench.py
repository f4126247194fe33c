"""The flashcore-bench CLI run end to end: the presets and providers, their rows and refusals
(argument errors and building blocks: ``test_bench_cli.py``; the report: ``test_bench_report.py``).

Without CUDA everything runs through Triton's interpreter (conftest sets it); with CUDA the smoke
run is timed with do_bench, and the assertions below hold either way.
"""

import pytest
import torch

from flashcore import reference
from flashcore.bench import cases, check, metrics, providers, report
from flashcore.bench.cli import main
from flashcore.bench.report import read_jsonl

HAS_CUDA = torch.cuda.is_available()


GRADS = ("out", *check.GRAD_NAMES)


KEYS = {
    "provider", "mode", "dtype", "shape", "batch", "heads", "kv_heads", "seqlen_q", "seqlen_k",
    "head_dim", "causal", "status", "reason", "ms_p20", "ms_p50", "ms_p80", "timer", "tflops",
    "pct_peak", "speedup_vs_sdpa", "rel_err", "errors", "device", "torch", "triton", "git_sha",
}  # fmt: skip


def measurements(path) -> list[dict]:
    return [r for r in read_jsonl(path) if r["record"] == "measurement"]


def test_smoke_preset(tmp_path, capsys):
    out = tmp_path / "smoke.jsonl"
    argv = ["--preset", "smoke", "--providers", "flashcore,sdpa,sdpa-math", "--out", str(out)]
    assert main([*argv, "--resources"]) == 0
    stdout = capsys.readouterr().out
    rows = measurements(out)
    expected = cases.select_cases(["smoke"], [], "both")
    assert len(rows) == 3 * len(expected)
    assert {(r["shape"], r["causal"]) for r in rows} == {(c.shape.spec, c.causal) for c in expected}
    for row in rows:
        assert row.keys() >= KEYS, KEYS - row.keys()
        assert row["mode"] == "fwd" and row["dtype"] == "bf16"
        assert row["status"] == "ok", row
        assert row["ms_p20"] <= row["ms_p50"] <= row["ms_p80"]
        if HAS_CUDA:
            assert row["timer"] == metrics.TIMER_GPU and row["tflops"] > 0
        else:
            assert row["timer"] == metrics.TIMER_INTERPRETER
            assert row["tflops"] is None and row["speedup_vs_sdpa"] is None
    for row in (r for r in rows if r["provider"] == "flashcore"):
        err = row["errors"]["out"]
        assert err["ok"] and err["err"] <= err["bound"]
        assert row["rel_err"] < 2e-2  # bf16: a few units of 2^-8
    if HAS_CUDA:
        assert "Compiled flashcore kernels" in stdout
    else:
        assert "NOT performance" in stdout
        assert "unavailable under the Triton interpreter" in stdout


def test_decode_preset(tmp_path):
    out = tmp_path / "decode.jsonl"
    # The CPU default providers, named so that a GPU run checks the same rows.
    names = ",".join(providers.DECODE_CPU)
    assert main(["--preset", "decode-smoke", "--providers", names, "--out", str(out)]) == 0
    rows = measurements(out)
    expected = cases.select_cases(["decode-smoke"], [], "both")
    assert len(rows) == len(providers.DECODE_CPU) * len(expected)
    assert {r["provider"] for r in rows} == set(providers.DECODE_CPU)
    for row in rows:
        assert row["status"] == "ok", row
        assert row["seqlen_q"] == 1
        case = cases.Case(cases.parse_shape(row["shape"]), row["causal"])
        assert row["bytes"] == metrics.attention_bytes(case, 2)
        if not HAS_CUDA:
            assert row["gbps"] is None and row["pct_copy_bw"] is None


def test_varlen_preset(tmp_path, capsys):
    out = tmp_path / "varlen.jsonl"
    assert main(["--preset", "varlen-smoke", "--mode", "fwd,bwd", "--out", str(out)]) == 0
    assert "sdpa-padded uses no mask" in capsys.readouterr().out
    rows = measurements(out)
    expected = cases.select_cases(["varlen-smoke"], [], "both")
    assert len(rows) == 2 * len(providers.VARLEN_CPU) * len(expected)
    for row in rows:
        case = next(
            c for c in expected if [list(c.seqlens), c.causal] == [row["seqlens"], row["causal"]]
        )
        assert row["padding"] == pytest.approx(case.padding) and 0.3 < row["padding"] < 0.5
        assert row["flops"] == metrics.attention_flops(case, row["mode"])
        name, causal = row["provider"], row["causal"]
        if name == "flashcore-varlen" or name == "sdpa-padded-mask" or causal:
            assert row["status"] == "ok", row
            assert set(row["errors"]) == ({"out"} if row["mode"] == "fwd" else set(GRADS))
        elif name == "sdpa-padded":
            # No mask, non-causal: the real queries also attend to the padding keys.
            assert row["status"] == "wrong" and row["ms_p50"] is not None, row
        else:
            assert row["status"] == "refused" and "key-padding mask" in row["reason"], row


def test_varlen_building_blocks():
    for case in cases.preset_cases("varlen"):
        assert 0.4 < case.padding < 0.5 and max(case.seqlens) == case.shape.seqlen_q
    # FLOPs of the real tokens only: sum of 4 * H * S_b^2 * D, halved for causal.
    case = cases.Case(cases.shape(3, 2, 10, 16), True, (10, 4, 7))
    assert metrics.attention_flops(case, "fwd") == 4 * 2 * (100 + 16 + 49) / 2 * 16
    assert metrics.attention_bytes(case, 2) == 2 * 2 * 21 * (2 + 2) * 16
    assert case.padding == 1 - 21 / 30
    packed = torch.randn(21, 2, 16, dtype=torch.float64)
    padded = providers.unpack(packed, case.seqlens, 10)
    assert padded.shape == (3, 2, 10, 16) and torch.all(padded[1, :, 4:] == 0)
    assert torch.equal(providers.pack(padded, case.seqlens), packed)
    # The chunked per-sequence reference is reference.attention_varlen.
    q, k, v = (torch.randn(21, 2, 16, dtype=torch.float16) for _ in range(3))
    got = check.compute_reference_varlen(
        q, k, v, None, case.seqlens, causal=True, ref_dtype=torch.float64, budget_bytes=1
    )
    cu = providers.cu_seqlens(case.seqlens, torch.device("cpu"))
    want = reference.attention_varlen(q, k, v, cu, cu, causal=True)
    torch.testing.assert_close(got.out, want.out)


def test_decode_bytes_and_paged_copy():
    decode = cases.Case(cases.shape(2, 8, 1, 64, 2, 100), False)
    # q and out: 2 * 8 * 1 rows; K and V: 2 * 2 * 100 rows; 64 fp16 values each.
    assert metrics.attention_bytes(decode, 2) == 2 * 2 * (2 * 8 * 1 + 2 * 2 * 100) * 64
    k = torch.randn(2, 3, 40, 16)
    v = torch.randn(2, 3, 40, 16)
    k_paged, v_paged, table = providers.to_paged(k, v, 16)
    assert table.dtype == torch.int32 and table.shape == (2, 3)
    assert sorted(table.flatten().tolist()) == list(range(6))
    for b in range(2):
        for j in range(40):
            blk, row = table[b, j // 16], j % 16
            assert torch.equal(k_paged[blk, :, row], k[b, :, j])
            assert torch.equal(v_paged[blk, :, row], v[b, :, j])


def test_sinks_provider(tmp_path, monkeypatch):
    # flashcore with sinks beside flashcore without, backward included; Sq > Sk so that causal
    # rows that see no key (out 0, the whole row's mass on the sink) are checked too. SDPA's
    # CUDA kernels give such rows an output other than the reference's 0 (on the H200 machine,
    # torch 2.11: out err 1.13 against a bound of 7e-3), its CPU math backend gives 0: the check
    # marks SDPA wrong there on a GPU, as it should.
    sdpa = providers.PROVIDERS["sdpa"].prepare

    def sinks_ignored(case, device):
        fn = sdpa(case, device)
        return lambda q, k, v, sinks: fn(q, k, v)

    monkeypatch.setitem(
        providers.PROVIDERS,
        "sinks-ignored",
        providers.Provider("sinks-ignored", "test", sinks_ignored, sinks=True, base="sdpa"),
    )
    out = tmp_path / "sinks.jsonl"
    argv = ["--shape", "1,4,24,32,2,16", "--mode", "fwd,bwd", "--dtype", "fp16"]
    names = "flashcore,flashcore-sinks,sdpa,sinks-ignored"
    assert main([*argv, "--providers", names, "--out", str(out)]) == 0
    rows = measurements(out)
    assert len(rows) == 2 * 2 * 4  # causal x mode x provider
    for row in rows:
        name, grads = row["provider"], row["mode"] == "bwd"
        if name == "sinks-ignored" or (name == "sdpa" and HAS_CUDA and row["causal"]):
            # The check uses the reference with the sinks: leaving them out is caught.
            assert row["status"] == "wrong" and "out: err" in row["reason"], row
            continue
        assert row["status"] == "ok", row
        expected = ({"out"} | (set(GRADS[1:]) if grads else set())) | (
            {check.SINKS_GRAD} if name == "flashcore-sinks" and grads else set()
        )
        assert set(row["errors"]) == expected, row
        assert row["base_provider"] == ("flashcore" if name == "flashcore-sinks" else None)
        assert (row["time_vs_base"] is not None) == (HAS_CUDA and name == "flashcore-sinks")
    varlen = cases.Case(cases.shape(2, 2, 16, 16), True, (16, 9))
    with pytest.raises(providers.Refused, match="dense cases only"):
        providers.PROVIDERS["flashcore-sinks"].prepare(varlen, torch.device("cpu"))


def test_sinks_reference():
    # The chunked reference with sinks (GQA chunks smaller than a group, dsinks summed over the
    # batch and the chunks) is flashcore.reference's, differentiated whole.
    q = torch.randn(2, 6, 33, 16, dtype=torch.float16)
    k = torch.randn(2, 2, 40, 16, dtype=torch.float16)
    v = torch.randn(2, 2, 40, 8, dtype=torch.float16)
    do = torch.randn(2, 6, 33, 8, dtype=torch.float16)
    sinks = torch.randn(6) + 3
    got = check.compute_reference(
        q, k, v, do, causal=True, ref_dtype=torch.float64, budget_bytes=33 * 40 * 8, sinks=sinks
    )
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    want = reference.attention(*leaves[:3], causal=True, sinks=leaves[3]).out
    want.backward(do.double())
    assert got.out.shape == (2, 6, 33, 8) and len(got.grads) == len(got.pt_grads) == 4
    torch.testing.assert_close(got.out, want.detach())
    for a, leaf in zip(got.grads, leaves, strict=True):
        torch.testing.assert_close(a, leaf.grad)
    without = check.compute_reference(q, k, v, None, causal=True, ref_dtype=torch.float64)
    assert not torch.allclose(without.out, got.out)


def test_value_head_dim(tmp_path):
    # Dv != D end to end: flashcore (fwd and bwd), SDPA's math backend, SDPA's flash backend
    # refusing up front; then the decode providers on a dense and a paged cache.
    out = tmp_path / "dv.jsonl"
    argv = ["--shape", "1,4,20,32:16,2,28", "--mode", "fwd,bwd", "--dtype", "fp16"]
    names = "flashcore,sdpa,sdpa-flash,sdpa-math"
    assert main([*argv, "--providers", names, "--out", str(out)]) == 0
    rows = measurements(out)
    assert len(rows) == 2 * 2 * 4  # causal x mode x provider
    for row in rows:
        assert (row["shape"], row["head_dim"], row["value_dim"]) == ("1,4,20,32:16,2,28", 32, 16)
        case = cases.Case(cases.parse_shape(row["shape"]), row["causal"])
        assert row["flops"] == metrics.attention_flops(case, row["mode"])
        if row["provider"] == "sdpa-flash":
            assert row["status"] == "refused", row
            assert "needs one head dim for q, k and v (got D=32, Dv=16)" in row["reason"]
        else:
            assert row["status"] == "ok", row
            assert set(row["errors"]) == ({"out"} if row["mode"] == "fwd" else set(GRADS))
    decode = ["--shape", "2,4,1,32:16,2,80", "--causal", "off", "--out", str(out)]
    assert main([*decode, "--providers", "flashcore-kvcache,flashcore-paged16"]) == 0
    rows = measurements(out)
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    assert rows[1]["base_provider"] == "flashcore-kvcache"


def test_paged_prefill_preset(tmp_path):
    out = tmp_path / "paged.jsonl"
    assert main(["--preset", "paged-prefill-smoke", "--out", str(out)]) == 0
    rows = measurements(out)
    expected = cases.select_cases(["paged-prefill-smoke"], [], "both")
    assert len(rows) == len(providers.PAGED_PREFILL_CPU) * len(expected)
    assert {r["provider"] for r in rows} == set(providers.PAGED_PREFILL_CPU)
    for row in rows:
        assert row["status"] == "ok", row
        assert row["causal"] and row["mode"] == "fwd"
        case = next(c for c in expected if list(c.seqlens) == row["seqlens"])
        assert row["flops"] == metrics.attention_flops(case, "fwd")
        paged = row["provider"].startswith("flashcore-varlen-paged")
        assert row["base_provider"] == ("flashcore-varlen" if paged else None)
    # Forward only: a backward mode is refused with attention_varlen's reason.
    argv = ["--preset", "paged-prefill-smoke", "--providers", "flashcore-varlen-paged16"]
    assert main([*argv, "--mode", "bwd", "--out", str(out)]) == 0
    for row in measurements(out):
        assert row["status"] == "refused" and "forward-only" in row["reason"], row


def test_paged_prefill_building_blocks():
    for case in cases.preset_cases("paged-prefill"):
        s = case.shape
        assert case.causal and max(case.seqlens) == s.seqlen_q and len(case.seqlens) == s.batch
        assert (s.heads, s.kv_heads, s.head_dim) == (32, 8, 128)
    # A paged copy of a packed batch: sequence b gets ceil(S_b / 16) blocks, shuffled; v has its
    # own head dim; the unused table entries are 0.
    seqlens = (40, 5, 17)
    k = torch.randn(62, 2, 16)
    v = torch.randn(62, 2, 8)
    padded = [providers.unpack(t, seqlens, 40) for t in (k, v)]
    k_paged, v_paged, table = providers.to_paged(*padded, 16, seqlens=seqlens)
    assert k_paged.shape == (6, 2, 16, 16) and v_paged.shape == (6, 2, 16, 8)
    assert table.dtype == torch.int32 and table.shape == (3, 3)
    used = [table[0, :3], table[1, :1], table[2, :2]]
    assert sorted(torch.cat(used).tolist()) == list(range(6))
    assert table[1, 1:].tolist() == [0, 0] and table[2, 2].item() == 0
    assert table.flatten().tolist() != sorted(table.flatten().tolist())  # shuffled
    packed_k, packed_v = k.split(seqlens), v.split(seqlens)
    for b, n in enumerate(seqlens):
        for j in range(n):
            blk, row = table[b, j // 16], j % 16
            assert torch.equal(k_paged[blk, :, row], packed_k[b][j])
            assert torch.equal(v_paged[blk, :, row], packed_v[b][j])


def test_backward_modes(tmp_path):
    out = tmp_path / "bwd.jsonl"
    argv = ["--shape", "1,4,20,32,2,28", "--mode", "bwd,fwdbwd", "--dtype", "fp16"]
    assert main([*argv, "--providers", "flashcore,sdpa", "--out", str(out)]) == 0
    rows = measurements(out)
    assert len(rows) == 2 * 2 * 2  # causal x mode x provider
    for row in rows:
        if row["provider"] == "sdpa":
            assert row["status"] == "ok", row
            assert set(row["errors"]) == {"out", "dq", "dk", "dv"}
            assert row["flops"] == metrics.attention_flops(
                cases.Case(cases.parse_shape(row["shape"]), row["causal"]), row["mode"]
            )
        else:
            # Differentiable once flashcore registers autograd; until then refused, never a crash.
            assert row["status"] in ("ok", "refused"), row
            if row["status"] == "refused":
                assert row["reason"].startswith("backward:")


def _register(monkeypatch, name, prepare):
    monkeypatch.setitem(providers.PROVIDERS, name, providers.Provider(name, "test", prepare))


def test_wrong_and_refusing_providers(tmp_path, monkeypatch):
    sdpa = providers.PROVIDERS["sdpa"].prepare

    def off_by_5_percent(case, device):
        fn = sdpa(case, device)
        return lambda q, k, v: fn(q, k, v) * 1.05

    def refuses(case, device):
        raise providers.Refused("no such kernel here")

    _register(monkeypatch, "broken", off_by_5_percent)
    _register(monkeypatch, "refuses", refuses)
    out = tmp_path / "rows.jsonl"
    argv = ["--shape", "1,2,32,16", "--causal", "off", "--providers", "sdpa,broken,refuses"]
    assert main([*argv, "--out", str(out)]) == 0  # only a wrong flashcore fails the run
    rows = {r["provider"]: r for r in measurements(out)}
    assert rows["sdpa"]["status"] == "ok"
    assert rows["broken"]["status"] == "wrong"
    assert rows["broken"]["ms_p50"] is not None  # still timed, but marked
    assert "out: err" in rows["broken"]["reason"]
    assert rows["refuses"]["status"] == "refused"
    assert rows["refuses"]["reason"] == "prepare: Refused: no such kernel here"
    assert rows["refuses"]["ms_p50"] is None

    _register(monkeypatch, "flashcore", off_by_5_percent)
    assert main([*argv[:-1], "flashcore", "--out", str(out)]) == 1


@pytest.mark.skipif(HAS_CUDA, reason="the GPU-only errors need a machine without CUDA")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "seed"], "--preset seed needs a GPU"),
        (["--preset", "decode"], "--preset decode needs a GPU"),
        (["--preset", "varlen"], "--preset varlen needs a GPU"),
        (["--preset", "paged-prefill"], "runs --preset smoke, decode-smoke, varlen-smoke, "),
        (["--preset", "smoke", "--plot", "x.png"], "--plot draws TFLOP/s"),
        (["--preset", "smoke", "--cuda-graph"], "--cuda-graph times CUDA graphs"),
    ],
)
def test_gpu_only_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_graph_run(tmp_path, capsys):
    out = tmp_path / "graph.jsonl"
    argv = ["--shape", "1,4,200,64,2", "--mode", "fwd,bwd,fwdbwd", "--providers", "flashcore,sdpa"]
    assert main([*argv, "--cuda-graph", "--graph-calls", "5", "--out", str(out)]) == 0
    assert "host ms" in capsys.readouterr().out
    rows = measurements(out)
    assert len(rows) == 2 * 3 * 2  # causal x mode x provider
    for row in rows:
        assert row["status"] == "ok" and row["graph_reason"] is None, row
        assert row["graph_calls"] == 5
        assert 0 < row["graph_ms_p20"] <= row["graph_ms_p50"] <= row["graph_ms_p80"]
        assert row["loop_ms_p50"] > 0
        assert row["host_ms"] == pytest.approx(row["loop_ms_p50"] - row["graph_ms_p50"])
        if row["provider"] == "sdpa":
            assert row["graph_speedup_vs_sdpa"] == 1.0


def test_tier_providers(tmp_path):
    # flashcore under each kernel tier, forward and backward, checked like any provider (on the
    # CPU both run the portable kernels through the interpreter).
    out = tmp_path / "tiers.jsonl"
    argv = ["--shape", "1,2,40,16,1,56", "--mode", "fwd,bwd", "--dtype", "fp16"]
    assert main([*argv, "--providers", "flashcore-portable,flashcore-sm90", "--out", str(out)]) == 0
    rows = measurements(out)
    assert {r["provider"] for r in rows} == {"flashcore-portable", "flashcore-sm90"}
    assert len(rows) == 2 * 2 * 2  # causal x mode x provider
    assert all(row["status"] == "ok" for row in rows), rows


def test_fa4_provider_refuses_clearly(tmp_path, monkeypatch):
    # Where flash_attn.cute does not import (or off CUDA) the row is refused with the reason;
    # the run goes on.
    import builtins

    real_import = builtins.__import__

    def no_flash_attn(name, *args, **kwargs):
        if name.startswith("flash_attn"):
            raise ImportError("No module named 'flash_attn'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flash_attn)
    case = cases.Case(cases.shape(1, 2, 16, 16), False)
    with pytest.raises(providers.Refused, match=r"FlashAttention-4 .* does not import"):
        providers.PROVIDERS["fa4"].prepare(case, torch.device("cpu"))
    out = tmp_path / "fa4.jsonl"
    argv = ["--shape", "1,2,16,16", "--mode", "fwd", "--dtype", "fp16", "--causal", "off"]
    assert main([*argv, "--providers", "flashcore,fa4", "--out", str(out)]) == 0
    rows = {r["provider"]: r for r in measurements(out)}
    assert rows["flashcore"]["status"] == "ok"
    assert rows["fa4"]["status"] == "refused"
    assert "does not import" in rows["fa4"]["reason"]


def test_window_option(tmp_path, monkeypatch):
    # --window on every case: flashcore and SDPA (a boolean mask) checked against the reference
    # with the window, forward and backward, GQA with Sq != Sk; a provider that drops the window
    # is caught by the check.
    sdpa = providers.PROVIDERS["sdpa"].prepare

    def window_dropped(case, device):
        return sdpa(case._replace(window=None), device)

    monkeypatch.setitem(
        providers.PROVIDERS,
        "window-dropped",
        providers.Provider("window-dropped", "test", window_dropped),
    )
    out = tmp_path / "window.jsonl"
    argv = ["--shape", "1,4,40,32,2,56", "--window", "7,3", "--mode", "fwd,bwd", "--dtype", "fp16"]
    assert main([*argv, "--providers", "flashcore,sdpa,window-dropped", "--out", str(out)]) == 0
    rows = measurements(out)
    assert len(rows) == 2 * 2 * 3  # causal x mode x provider
    for row in rows:
        assert row["window"] == [7, 3], row
        if row["provider"] == "window-dropped":
            assert row["status"] == "wrong" and "out: err" in row["reason"], row
        else:
            assert row["status"] == "ok", row
    line = report.table_row(rows[0])
    assert ("causal w7,3" if rows[0]["causal"] else "full w7,3") in line
    varlen = cases.Case(cases.shape(2, 2, 16, 16), True, (16, 9), window=(4, 0))
    with pytest.raises(providers.Refused, match="cannot take a window"):
        providers.PROVIDERS["sdpa-padded"].prepare(varlen, torch.device("cpu"))
