"""The head-dim-256 dQ and dK/dV kernels (``kernels/hopper/bwd256*.py``) compile for sm_90a on a
CPU-only machine, and their compiled code shows what the kernels' docstring states: shared memory
within a block's 227 KiB, no spills (one allowance), the register split (240 for each consumer, 24
for the producer) without a ptxas warning, the products on the tensor cores (the score products
with both operands in shared memory, the dQ kernel's consumer 0 product with dS from shared
memory, P and dS as register A operands elsewhere), Q, dO, K and V by TMA loads, and no atomics
(each gradient written once: deterministic) but MLA's dQ reduce-added by the copy engine where
the dK/dV kernel computes it (FUSED_DQ).

As ``test_compile_hopper_bwd.py``, the variants compile in a subprocess without
TRITON_INTERPRET: ``python tests/test_compile_hopper_bwd256.py`` prints a JSON line per variant.
"""

from __future__ import annotations

import re
import sys

import pytest

from compile_shards import emit_variants
from hopper_compile import assemble, assert_register_split, compiled_rows, step_loops

SMEM_LIMIT = 227 * 1024

# (label, kernel, dtype, causal, window, even_n, softcap, alibi): the dK/dV kernel ("dkdv") and
# the dQ kernel ("dq", which has no EVEN_N: its masked key tiles are a run-time range).
VARIANTS = [
    ("dkdv-bf16", "dkdv", "bf16", False, False, True, False, False),
    ("dkdv-fp16-causal-ragged", "dkdv", "fp16", True, False, False, False, False),
    ("dkdv-bf16-window-ragged", "dkdv", "bf16", False, True, False, False, False),
    ("dkdv-bf16-causal-softcap", "dkdv", "bf16", True, False, True, True, False),
    ("dkdv-fp16-softcap-alibi-window", "dkdv", "fp16", False, True, False, True, True),
    ("dq-bf16", "dq", "bf16", False, False, None, False, False),
    ("dq-fp16-causal", "dq", "fp16", True, False, None, False, False),
    ("dq-bf16-window", "dq", "bf16", False, True, None, False, False),
    ("dq-bf16-causal-softcap-alibi", "dq", "bf16", True, False, None, True, True),
    # Packed sequences (VARLEN: a label with "varlen").
    ("dkdv-bf16-causal-varlen", "dkdv", "bf16", True, False, False, False, False),
    ("dkdv-fp16-window-softcap-varlen", "dkdv", "fp16", False, True, False, True, False),
    ("dq-bf16-causal-varlen", "dq", "bf16", True, False, None, False, False),
    ("dq-fp16-softcap-alibi-varlen", "dq", "fp16", False, False, None, True, True),
    # MLA's head dims (q and k 192, v 128: a label starting "mla"), three ring slots.
    ("mla-dkdv-bf16-causal-ragged", "dkdv", "bf16", True, False, False, False, False),
    ("mla-dkdv-fp16", "dkdv", "fp16", False, False, True, False, False),
    ("mla-dkdv-bf16-window-softcap-alibi-varlen", "dkdv", "bf16", False, True, False, True, True),
    ("mla-dq-bf16-causal", "dq", "bf16", True, False, None, False, False),
    ("mla-dq-fp16-window-softcap-varlen", "dq", "fp16", False, True, None, True, False),
    # MLA with dQ in the dK/dV kernel (FUSED_DQ: a label with "fused"), two ring slots.
    ("mla-fused-dkdv-bf16-causal-ragged", "dkdv", "bf16", True, False, False, False, False),
    ("mla-fused-dkdv-fp16", "dkdv", "fp16", False, False, True, False, False),
    ("mla-fused-dkdv-bf16-window-softcap-alibi-varlen", "dkdv", "bf16", False, True, False, True,
     True),
    # dK and dV by TMA stores (TMA_EPILOGUE: a label with "tma").
    ("dkdv-tma-bf16-causal", "dkdv", "bf16", True, False, True, False, False),
    ("dkdv-tma-fp16-window-softcap-varlen", "dkdv", "fp16", False, True, False, True, False),
    ("mla-fused-tma-dkdv-bf16-causal-ragged", "dkdv", "bf16", True, False, False, False, False),
    ("mla-tma-dkdv-fp16-softcap-alibi-varlen", "dkdv", "fp16", False, False, False, True, True),
    # MLA's 128-key kernel (kernels/hopper/bwd_mla.py: a label with "wide"); no score options.
    ("mla-wide-fused-bf16", "wide", "bf16", False, False, True, False, False),
    ("mla-wide-fused-fp16-causal-ragged", "wide", "fp16", True, False, False, False, False),
    ("mla-wide-fused-bf16-ragged", "wide", "bf16", False, False, False, False, False),
    ("mla-wide-fused-bf16-causal-varlen", "wide", "bf16", True, False, False, False, False),
    ("mla-wide-fused-fp16-varlen", "wide", "fp16", False, False, False, False, False),
    # Causal, consumer 1's steps that see none of its keys without products (SKIP_MASKED, as
    # shipped: a label with "skip").
    ("mla-wide-skip-fused-fp16-causal-varlen", "wide", "fp16", True, False, False, False, False),
    # dK and dV through the K and V tiles by TMA stores (TMA_EPILOGUE: a label with "tma").
    ("mla-wide-tma-fused-bf16", "wide", "bf16", False, False, True, False, False),
    # The exponent formed before the masks' run-time branches (MASK_EXPONENT, as shipped: "mexp"):
    # the shipped causal, ragged and packed builds.
    ("mla-wide-tma-skip-mexp-fused-bf16-causal", "wide", "bf16", True, False, True, False, False),
    ("mla-wide-tma-skip-mexp-fused-fp16-causal-ragged", "wide", "fp16", True, False, False, False,
     False),
    ("mla-wide-tma-mexp-fused-bf16-ragged", "wide", "bf16", False, False, False, False, False),
    ("mla-wide-tma-skip-mexp-fused-bf16-causal-varlen", "wide", "bf16", True, False, False, False,
     False),
    # The fixed tiles' wgmma descriptors formed before the step loop (FRESH_DESC off: "nofresh";
    # every other label forms them in it, as shipped), beside two of the builds above.
    ("mla-wide-tma-nofresh-fused-bf16", "wide", "bf16", False, False, True, False, False),
    ("mla-wide-tma-skip-mexp-nofresh-fused-bf16-causal", "wide", "bf16", True, False, True, False,
     False),
    # Causal, every head's steps that the diagonal crosses in the same loop as the others
    # (SPLIT_DIAG off: "nosplit"; every other causal label runs them in a loop of their own, as
    # shipped), beside the shipped causal build.
    ("mla-wide-tma-skip-mexp-nosplit-fused-bf16-causal", "wide", "bf16", True, False, True, False,
     False),
]  # fmt: skip


def compile_variant(variant) -> dict:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from flashcore.kernels.hopper import bwd256 as kernels
    from flashcore.kernels.hopper import bwd256_dq, bwd_mla
    from flashcore.ops import bwd256, bwd_sm90

    label, which, dtype, causal, window, even_n, softcap, alibi = variant
    gdtype = gl.bfloat16 if dtype == "bf16" else gl.float16
    signature = {}
    mla = label.startswith("mla")
    qk_a, qk_b, qk_box, v_tile = bwd256._tiles(*((192, 128) if mla else (256, 256)))
    for names, width in ((("q_desc", "k_desc"), qk_box), (("v_desc", "do_desc"), v_tile)):
        block = [1, 1, bwd256.ROWS, width]
        layout = gl.NVMMASharedLayout.get_default_for(block, gdtype)
        for name in names:
            signature[name] = f"tensordesc<{dtype}{block},{layout!r}>"
    fused = "fused" in label
    for name, width in (("dqa_desc", qk_a), ("dqb_desc", qk_b)):
        if fused:
            block = [1, 1, bwd256.ROWS, width]
            layout = bwd_sm90.dq_layout(bwd256.HEAD_DIM)
            signature[name] = f"tensordesc<fp32{block},{layout!r}>"
        else:
            signature[name] = signature["q_desc"]  # stand-ins, never touched
    stages = bwd256.NUM_STAGES
    if mla:
        stages = bwd256.FUSED_STAGES if fused else bwd256.MLA_STAGES
    consts = dict(
        QK_A=qk_a, QK_B=qk_b, NUM_STAGES=stages,
        CONSUMER_REGS=bwd256.CONSUMER_REGS, IS_CAUSAL=causal,
        HAS_WINDOW=window, SOFTCAP=softcap, HAS_ALIBI=alibi, VARLEN="varlen" in label,
    )  # fmt: skip
    if which in ("dkdv", "wide"):
        consts["EVEN_N"] = even_n
        consts["FUSED_DQ"] = fused
        # dK and dV by TMA stores (TMA_EPILOGUE: a label with "tma"): dK's first QK_A columns in
        # a box of V's shape, its last QK_B in K's box.
        consts["TMA_EPILOGUE"] = "tma" in label
        signature["dka_desc"] = signature["dv_desc"] = signature["v_desc"]
        signature["dkb_desc"] = signature["k_desc"]
        fn = kernels.attn_bwd_dkdv_sm90_d256_kernel
        if which == "wide":
            fn = bwd_mla.attn_bwd_mla_sm90_kernel
            consts["SKIP_MASKED"] = "skip" in label
            consts["MASK_EXPONENT"] = "mexp" in label
            consts["FRESH_DESC"] = "nofresh" not in label
            consts["SPLIT_DIAG"] = "nosplit" not in label
    else:
        fn = bwd256_dq.attn_bwd_dq_sm90_d256_kernel
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in ("qk_scale", "scale", "softcap"):
            signature[name] = "fp32"
        elif name in ("LSE2", "DELTA", "ALIBI"):
            signature[name] = "*fp32"
        elif name in ("CU_Q", "CU_K"):
            signature[name] = "*i32"
        elif name in ("DQ", "DK", "DV"):
            signature[name] = f"*{dtype}"
        elif name not in signature:
            signature[name] = "i32"
    signature = {name: signature[name] for name in fn.arg_names}
    ptx, sass, report = assemble(GluonASTSource(fn, signature, consts, {}), bwd256.MAXNREG)
    return {
        "variant": label,
        # The 128-key kernel's consumer 0 (two dQ panels a step) takes 248, consumer 1 232.
        "consumer_regs": bwd_mla.HEAVY_REGS.value if which == "wide" else bwd256.CONSUMER_REGS,
        **report,
        "wgmma_ptx": len(re.findall(r"wgmma\.mma_async", ptx)),
        "tma_load": len(
            re.findall(r"cp\.async\.bulk\.tensor\.\S*shared::(?:cluster|cta)\.global", ptx)
        ),
        "atomics": len(re.findall(r"\b(red|atom)\.global", ptx)),
        "bulk_reduce": len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", ptx)),
        # Each step loop's instructions (the 128-key kernel's: one a consumer, two causal).
        "loop_len": [len(body) for body in step_loops(sass)],
        # Local loads and stores in each step loop.
        "loop_local": [
            sum(bool(re.match(r"(@!?U?P\w+\s+)?(LDL|STL)", t)) for t in body)
            for body in step_loops(sass)
        ],
    }


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return compiled_rows(__file__, len(VARIANTS))


# Softcap, ALiBi and a two-sided window at once: consumer 0 of the dK/dV kernel holds tanh's values
# (until P (1 - t^2) is stored), the query-row index vector and dV's 128 registers at once, and
# ptxas 12.8 spills 56 B there (no other dense combination spills; Gemma 2's causal window with
# softcap does not). VARLEN carries each program's sequence (its first rows and lengths) and the
# producer's zeroing path: 16-48 B.
SPILL_ALLOWANCE = {
    "dkdv-fp16-softcap-alibi-window": 56,
    "dkdv-bf16-causal-varlen": 44,
    "dkdv-fp16-window-softcap-varlen": 48,
    "dq-bf16-causal-varlen": 16,
    "dq-fp16-softcap-alibi-varlen": 24,
    # With dQ in the kernel consumer 1 also holds its dQ columns and the next step's dP^T.
    "mla-fused-dkdv-bf16-window-softcap-alibi-varlen": 248,
    # The 128-key kernel's consumers hold dK and dV of their 64 keys (160 registers) through the
    # step: ptxas keeps some of the step's scalars in local memory, a few reloaded in the loop.
    # Causal builds run their steps in two loops (SPLIT_DIAG), each with its own copies of the
    # step's scalars: 100-212 B more, outside the loops (0-10 local accesses a loop's step).
    "mla-wide-fused-bf16": 32,
    "mla-wide-fused-fp16-causal-ragged": 132,
    "mla-wide-fused-bf16-ragged": 28,
    # VARLEN adds each program's sequence bounds and the producer's zeroing path.
    "mla-wide-fused-bf16-causal-varlen": 340,
    "mla-wide-fused-fp16-varlen": 68,
    "mla-wide-skip-fused-fp16-causal-varlen": 324,
    # The TMA epilogue's wait, tiles and coordinates beside the step's scalars.
    "dkdv-tma-fp16-window-softcap-varlen": 28,
    "mla-wide-tma-fused-bf16": 36,
    "mla-wide-tma-skip-mexp-fused-bf16-causal": 344,
    "mla-wide-tma-skip-mexp-fused-fp16-causal-ragged": 184,
    "mla-wide-tma-mexp-fused-bf16-ragged": 36,
    "mla-wide-tma-skip-mexp-fused-bf16-causal-varlen": 384,
    # Without FRESH_DESC LLVM forms the fixed tiles' wgmma descriptors before the step loop and
    # ptxas keeps them in local memory, reloaded every step.
    "mla-wide-tma-nofresh-fused-bf16": 488,
    "mla-wide-tma-skip-mexp-nofresh-fused-bf16-causal": 924,
    "mla-wide-tma-skip-mexp-nosplit-fused-bf16-causal": 132,
}


def test_fits_and_no_spills(compiled):
    for row in compiled:
        assert row["shared"] <= SMEM_LIMIT, f"{row['variant']}: {row['shared']} B"
        allowed = SPILL_ALLOWANCE.get(row["variant"], 0)
        assert row["spill_bytes"] <= allowed, f"{row['variant']}: {row['spill_bytes']} B of spills"


def test_register_split(compiled):
    assert_register_split(compiled)


def test_products_and_copies(compiled):
    for row in compiled:
        # HGMMA instructions (m64, k16 each). dK/dV: S^T and dP^T (K = 256: 16 each) read both
        # operands from shared memory; dV and dK (K = 64: 4 each) take P^T and dS^T from
        # registers. dQ: S and dP (16 each) and consumer 0's dQ half (4, dS from shared memory);
        # consumer 1's dQ half (4) takes dS from registers.
        # MLA (K = 192 for S, 128 for dP): dK/dV 12 + 8 from shared memory, dV 4 and dK's two
        # tiles 4 + 4 from registers; dQ 12 + 8 + consumer 0's 64 columns (4) from shared memory,
        # consumer 1's 128 (4) from registers. FUSED_DQ (MLA): dQ = dS K from the dS^T tile in
        # shared memory, consumer 0's 128 columns (4, issued in the loop and after it) and
        # consumer 1's 64 (4), and consumer 1's dP^T issued a step ahead (8, before the loop and
        # in it): 12 + 16 + 8 + 4.
        # The 128-key kernel (MLA, per consumer): S^T 12 and dP^T 8 from shared memory, dQ =
        # dS K over both consumers' keys by 64-column panels (consumer 0 two, consumer 1 one; 8
        # each) with dS^T from shared memory, dV 4 and dK 4 + 4 from registers: (36 + 28, 24).
        mla = row["variant"].startswith("mla")
        fused = "fused" in row["variant"]
        if "wide" in row["variant"]:
            # Causal (SPLIT_DIAG): the step twice, in the diagonal's loop and the other.
            split = "causal" in row["variant"] and "nosplit" not in row["variant"]
            want = (128, 48) if split else (64, 24)
        elif "dkdv" in row["variant"]:
            want = (40 if fused else 20, 12) if mla else (32, 8)
        else:
            want = (24, 4) if mla else (36, 4)
        assert (row["hgmma_shared_a"], row["hgmma_register_a"]) == want, row
        assert row["tma_load"] >= 4, row  # Q, dO, and a step's K and V (or the other way)
        assert row["atomics"] == 0, row
        # dQ reduce-added by the copy engine, by both consumers (FUSED_DQ), or not at all.
        assert (row["bulk_reduce"] >= 2) if fused else (row["bulk_reduce"] == 0), row


def test_fresh_descriptors_stay_out_of_local_memory(compiled):
    """FRESH_DESC (``kernels/hopper/bwd_mla.py``, shipped): with the fixed tiles' descriptors
    formed in the step loop, each consumer's step loop makes fewer local-memory accesses than the
    same build's without it ("nofresh": they are reloaded there every step), and none
    non-causal."""
    rows = {row["variant"]: row for row in compiled}
    stale_builds = [label for label in rows if "-nofresh" in label]
    assert len(stale_builds) == 2
    for stale in stale_builds:
        fresh = stale.replace("-nofresh", "")
        ours, theirs = rows[fresh]["loop_local"], rows[stale]["loop_local"]
        assert len(ours) == len(theirs) == (4 if "causal" in fresh else 2), (fresh, ours, theirs)
        assert all(a < b for a, b in zip(ours, theirs, strict=True)), (fresh, ours, theirs)
        if "causal" not in fresh:
            assert ours == [0, 0], (fresh, ours)


def test_diagonal_steps_in_a_loop_of_their_own(compiled):
    """SPLIT_DIAG (``kernels/hopper/bwd_mla.py``, shipped): every causal build of the 128-key
    kernel has two step loops a consumer, and the second (the steps below the diagonal, built as
    the non-causal step) is shorter than the one loop of the same build without it
    ("nosplit"): it carries none of the masks' code."""
    rows = {row["variant"]: row for row in compiled}
    for label, row in rows.items():
        if "wide" in label:
            loops = 4 if "causal" in label and "nosplit" not in label else 2
            assert len(row["loop_len"]) == loops, (label, row["loop_len"])
    split = rows["mla-wide-tma-skip-mexp-fused-bf16-causal"]["loop_len"]
    whole = rows["mla-wide-tma-skip-mexp-nosplit-fused-bf16-causal"]["loop_len"]
    for consumer in (0, 1):
        # sm_90a, Triton 3.6: 565 against 635 (consumer 0), 516 against 613 (consumer 1).
        assert split[2 * consumer + 1] < whole[consumer] - 40, (split, whole)


def test_mla_trace_build_still_applies():
    """``scripts/mla_bwd_trace.py`` edits the 128-key kernel's source as text; a change that its
    edits no longer match fails here, not later on the GPU machine."""
    from helpers import load_script

    module = load_script("mla_bwd_trace")
    # By program: entry (clock, timer, SM, steps), K/V landed, loop end, epilogue end (clock,
    # timer). By step: eleven events. The causal build on non-causal work: the same stamps.
    for fake_full in (False, True):
        assert module.trace_source(False, fake_full=fake_full).count("_stamp(ALIBI") == 8
        assert module.trace_source(True, fake_full=fake_full).count("_stamp(ALIBI") == 11


if __name__ == "__main__":
    emit_variants(VARIANTS, compile_variant)
    sys.exit(0)
