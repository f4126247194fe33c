"""The flashcore-bench CLI's arguments and building blocks: shapes and presets as written, the
refusals with their messages, the FLOP rule, the chunked reference, the comparison's flags."""

import math
import subprocess
import sys

import pytest
import torch

from flashcore import reference
from flashcore.bench import cases, check, metrics
from flashcore.bench.cli import build_parser, main


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


def test_cuda_graph_arguments():
    args = build_parser().parse_args(["--preset", "seed"])
    assert not args.cuda_graph and args.graph_calls == metrics.GRAPH_CALLS
    args = build_parser().parse_args(["--cuda-graph", "--graph-calls", "7"])
    assert args.cuda_graph and args.graph_calls == 7


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
