"""The flashcore-bench CLI: the smoke run end to end, argument errors, and its building blocks.

Without CUDA everything runs through Triton's interpreter (conftest sets it); with CUDA the smoke
run is timed with do_bench, and the assertions below hold either way.
"""

import json
import math
import subprocess
import sys

import pytest
import torch

from flashcore import reference
from flashcore.bench import cases, check, metrics, providers, report, runner
from flashcore.bench.cli import build_parser, main
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


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ("1,2,3", "expected B,H,S,D[:Dv][,Hkv[,Sk]] (4 to 6 integers)"),
        ("1,2,x,64", "with integers"),
        ("1,0,128,64", "H must be a positive integer"),
        ("1,6,128,64,4", "H (6) must be a multiple of Hkv (4)"),
        ("1,2,128,512", "D must be at most 256"),
        ("1,2,128,192:512", "Dv must be at most 256"),
        ("1,2,128,64:0", "Dv must be a positive integer, got 0"),
        ("1,2,128,64:", "with integers"),
        ("1,2,128,64:32:16", "with integers"),
        ("1,2,128:64,64", "only D takes a value head dim (D:Dv, as 192:128), got S='128:64'"),
        ("1,4,128,64,2:1", "only D takes a value head dim"),
    ],
)
def test_bad_shape(shape, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--shape", shape])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --shape" in err and message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--providers", "sdpa,nope"], "nope not in"),
        (["--mode", "fwd,back"], "back not in"),
        (["--dtype", "fp8"], "fp8 not in"),
        (["--causal", "maybe"], "invalid choice"),
        (["--preset", "smoke", "--causal", "on", "--shape", "1,1,8,16", "--warmup", "0"], "warmup"),
        (["--cuda-graph", "--graph-calls", "0"], "argument --graph-calls"),
        (["--window", "128"], "expected LEFT,RIGHT (two integers)"),
        (["--window", "128,x"], "expected LEFT,RIGHT (two integers)"),
        (["--window=-2,0"], "window sides must be >= 0, or -1"),
        (["--window=-1,-1"], "bounds neither side"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


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


def test_module_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "flashcore.bench", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0
    assert "--preset" in result.stdout and "flashcore-bench" in result.stdout


def test_shape_syntax_round_trip():
    for text in ["1,8,512,64", "2,16,1024,128,4", "1,8,1,64,8,4096", "1,8,100,64,2,300"]:
        assert cases.parse_shape(text).spec == text
        assert cases.parse_shape(text).value_dim == cases.parse_shape(text).head_dim
    assert cases.parse_shape("1,8,512,64,8,512").spec == "1,8,512,64"
    # D:Dv, the value head dim; Dv = D is the plain spec.
    for text in ["1,128,4096,192:128", "2,16,1024,64:128,4", "1,8,100,192:128,2,300"]:
        assert cases.parse_shape(text).spec == text
    mla = cases.parse_shape(" 1, 16, 512, 192:128 ")
    assert (mla.head_dim, mla.value_dim, mla.kv_heads, mla.seqlen_k) == (192, 128, 16, 512)
    assert mla == cases.shape(1, 16, 512, 192, dv=128)
    assert cases.parse_shape("1,8,512,64:64").spec == "1,8,512,64"


def test_decode_presets():
    for name in cases.DECODE_PRESETS:
        for c in cases.preset_cases(name):
            s = c.shape
            assert s.seqlen_q == 1 and s.seqlen_k > 1 and s.heads % s.kv_heads == 0
    gpu = cases.preset_cases("decode")
    assert {(c.shape.batch, c.shape.seqlen_k) for c in gpu} == {
        (b, sk) for b in (1, 8) for sk in (4096, 16384, 32768)
    }


def test_presets():
    sweep = cases.preset_cases("sweep")
    assert len(sweep) == 6 * 2 * 2
    for c in sweep:
        s = c.shape
        assert s.heads * s.head_dim == 2048 and s.batch * s.seqlen_q == 16384
        assert s.seqlen_k == s.seqlen_q and s.kv_heads == s.heads
    assert {c.shape.seqlen_q for c in sweep} == {512, 1024, 2048, 4096, 8192, 16384}
    seed = cases.select_cases(["seed"], [], "on")
    assert all(c.causal for c in seed) and len(seed) == 2
    extra = cases.parse_shape("1,2,64,32")
    assert cases.select_cases(["seed"], [extra], "off")[-1] == cases.Case(extra, False)


def test_flop_rule():
    full = cases.Case(cases.shape(2, 8, 1024, 64), False)
    causal = full._replace(causal=True)
    assert metrics.attention_flops(full, "fwd") == 4 * 2 * 8 * 1024 * 1024 * 64
    assert metrics.attention_flops(causal, "fwd") == metrics.attention_flops(full, "fwd") / 2
    assert metrics.attention_flops(full, "bwd") == 2.5 * metrics.attention_flops(full, "fwd")
    assert metrics.attention_flops(full, "fwdbwd") == 3.5 * metrics.attention_flops(full, "fwd")
    # Sq != Sk causal counts the visible pairs exactly: a single query sees every key.
    decode = cases.Case(cases.shape(1, 1, 1, 64, 1, 4096), True)
    assert metrics.attention_flops(decode, "fwd") == 4 * 4096 * 64
    # Sq > Sk: the first Sq - Sk queries see nothing, then 1, 2, ..., Sk keys.
    tall = cases.Case(cases.shape(1, 1, 10, 16, 1, 4), True)
    assert metrics.attention_flops(tall, "fwd") == 4 * (1 + 2 + 3 + 4) * 16
    # Dv != D: D for the matmuls with q or k, Dv for those with v or dout.
    mla = cases.Case(cases.shape(2, 8, 1024, 192, dv=128), False)
    pairs = 2 * 8 * 1024 * 1024
    assert metrics.attention_flops(mla, "fwd") == 2 * pairs * (192 + 128)
    assert metrics.attention_flops(mla, "bwd") == 2 * pairs * (3 * 192 + 2 * 128)
    assert metrics.attention_flops(mla, "fwdbwd") == 2 * pairs * (4 * 192 + 3 * 128)
    assert metrics.attention_flops(mla._replace(causal=True), "fwd") == pairs * (192 + 128)
    # q, k with D; v, out with Dv.
    assert metrics.attention_bytes(mla, 2) == 2 * (2 * 8 * 1024 * 2) * (192 + 128)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2), (12, 1), (6, 3)])
@pytest.mark.parametrize("budget_heads", [1, 2, 3, 5, 100])
def test_head_chunks_cover_every_head_once(heads, kv_heads, budget_heads):
    group = heads // kv_heads
    seen = []
    for b, hq, hkv in check.head_chunks(2, heads, kv_heads, 10, 10 * budget_heads):
        for h in range(hq.start, hq.stop):
            assert hkv.start <= h // group < hkv.stop
        assert (hq.stop - hq.start) <= max(budget_heads, 1) or hkv.stop - hkv.start == 1
        # The chunk's q heads divide evenly over its kv heads (what the reference's GQA needs).
        assert (hq.stop - hq.start) % (hkv.stop - hkv.start) == 0
        seen += [(b, h) for h in range(hq.start, hq.stop)]
    assert sorted(seen) == [(b, h) for b in range(2) for h in range(heads)]


def test_chunked_reference_matches_whole():
    q = torch.randn(2, 6, 33, 16, dtype=torch.float16)
    k = torch.randn(2, 2, 40, 16, dtype=torch.float16)
    v = torch.randn(2, 2, 40, 16, dtype=torch.float16)
    do = torch.randn(2, 6, 33, 16, dtype=torch.float16)
    whole = check.compute_reference(q, k, v, do, causal=True, ref_dtype=torch.float64)
    # A budget of one head's scores forces chunks smaller than a GQA group (group = 3).
    chunked = check.compute_reference(
        q, k, v, do, causal=True, ref_dtype=torch.float64, budget_bytes=33 * 40 * 8
    )
    torch.testing.assert_close(chunked.out, whole.out)
    for a, b in zip(chunked.grads, whole.grads, strict=True):
        torch.testing.assert_close(a, b)


def test_compare_flags_nan_and_shape():
    ref = torch.ones(2, 3, dtype=torch.float64)
    pt = ref.half()
    assert check.compare(ref.half(), ref, pt).ok
    bad = ref.half().clone()
    bad[0, 0] = float("nan")
    assert not check.compare(bad, ref, pt).ok and math.isinf(check.compare(bad, ref, pt).err)
    assert not check.compare(torch.ones(3, 2, dtype=torch.float16), ref, pt).ok


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


def test_cuda_graph_arguments():
    args = build_parser().parse_args(["--preset", "seed"])
    assert not args.cuda_graph and args.graph_calls == metrics.GRAPH_CALLS
    args = build_parser().parse_args(["--cuda-graph", "--graph-calls", "7"])
    assert args.cuda_graph and args.graph_calls == 7


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


def test_window_flops():
    # The pairs a window leaves visible, counted row by row, against the reference's mask:
    # bottom-right with Sq < Sk and Sq > Sk, causal (its right side 0) or not, one side unbounded.
    for sq, sk in ((40, 40), (17, 53), (53, 17)):
        for causal in (False, True):
            for window in ((5, 3), (0, 0), (-1, 4), (9, -1), (100, 100)):
                mask = reference.visible_mask(sq, sk, causal=causal, window=window)
                got = metrics.visible_pairs(sq, sk, causal, window)
                assert got == mask.sum().item(), (sq, sk, causal, window)
    case = cases.Case(cases.shape(2, 4, 64, 32), True, window=(15, 0))
    pairs = 2 * sum(min(i + 1, 16) for i in range(64))
    assert metrics.attention_flops(case, "fwd") == 4 * 4 * pairs * 32
    assert case.label == "2,4,64,32 causal window 15,0"


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
