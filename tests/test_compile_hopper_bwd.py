"""The Gluon Hopper backward (``kernels/hopper/bwd.py``) compiles for sm_90a on a CPU-only machine,
and its compiled code shows what the kernel's docstring states.

As ``test_compile_hopper.py``: the variants compile in a subprocess without TRITON_INTERPRET (this
file is that subprocess's script: ``python tests/test_compile_hopper_bwd.py`` prints one JSON line
per variant, with ``PYTHONPATH=src``). What the tests hold the compiled code to:

- shared memory within the 227 KiB a Hopper block may use; no local-memory spills;
- the register split: ``setmaxnreg`` 240 for the consumer warpgroups (192 and 200 at D=64, where
  a third warpgroup computes dQ with 96) and 24 for the producer, no C7508 ("setmaxnreg ignored") or
  C7515 ("wgmma serialized") warning;
- the five products on the tensor cores: ``S^T`` and ``dP^T`` with both operands in shared memory
  (at D=64 without score options their A operands, K and V, in registers: KV_REGS), ``dV`` and
  ``dK`` with their A operand (P^T, dS^T) in registers, ``dQ`` from shared memory;
- dQ leaves by the copy engine's reduce-add (``cp.reduce.async.bulk.tensor ... .add``), dK and dV
  by TMA stores, Q / dO / K / V arrive by TMA loads;
- the orderings the schedule rests on: a dQ staging tile is rewritten only after the copy engine
  has read it for the reduce that last used it (``cp.async.bulk.wait_group.read``: 0 with a tile
  per consumer, 1 where the dQ warpgroup alternates two), and written by every thread before the
  next reduce is issued; a Q/dO slot is freed only after the products that read it have completed.
"""

from __future__ import annotations

import functools
import os
import re
import sys

import pytest

from compile_shards import emit_variants
from hopper_compile import assemble, assert_register_split, compiled_rows, step_loops

SMEM_LIMIT = 227 * 1024

# (label, head_dim, dtype, causal, even_n[, options]), each compiled with the launcher's config
# for its head dim (ops/bwd_sm90.py: CONFIGS; at D=64 the dQ warpgroup). Ragged Sq changes no
# constexpr (the copy engine clips and pads); ragged Sk turns EVEN_N off (a key mask on the block
# that crosses Sk, when not causal). options: the score flags on (HAS_WINDOW, SOFTCAP, HAS_ALIBI),
# VARLEN (packed batches: EVEN_N off, bounded loads and masked dK/dV stores at each sequence's
# edges), LONG (16k query rows, where causal D=128 permutes the dQ staging rows:
# ``rows_permuted``, and takes the dQ products beside dK; 2048 otherwise), NOFRESH (FRESH_DESC
# off where the launcher's ``fresh_desc`` takes it), NOSKIP (causal without SKIP_MASKED: for
# comparisons, no variant of the list), NOSKIPWINDOW (a window without SKIP_WINDOW, the steps at
# its edges that see none of a consumer's keys run in full: for comparisons, no variant either)
# NOBAND (causal with a window without BAND_MASK: its two masks apart; for comparisons, no
# variant either) and NOLAG (softcap or causal ALiBi at D=128 without DQ_LAG_OPTIONS: each
# step's dQ in its step; for comparisons, no variant either).
VARIANTS = [
    ("d128-bf16", 128, "bf16", False, True),
    ("d128-fp16-causal-ragged", 128, "fp16", True, False),
    ("d128-bf16-causal-long", 128, "bf16", True, True, ("LONG",)),
    ("d64-bf16-causal", 64, "bf16", True, True),
    ("d64-fp16-ragged", 64, "fp16", False, False),
    ("d128-bf16-ragged", 128, "bf16", False, False),
    ("d128-bf16-causal-window", 128, "bf16", True, True, ("HAS_WINDOW",)),
    ("d128-bf16-softcap-window", 128, "bf16", False, False, ("HAS_WINDOW", "SOFTCAP")),
    ("d128-bf16-softcap", 128, "bf16", False, True, ("SOFTCAP",)),
    ("d128-bf16-causal-softcap-long", 128, "bf16", True, True, ("SOFTCAP", "LONG")),
    ("d128-fp16-causal-alibi", 128, "fp16", True, False, ("HAS_ALIBI",)),
    ("d64-bf16-all", 64, "bf16", False, False, ("HAS_WINDOW", "SOFTCAP", "HAS_ALIBI")),
    ("d64-fp16-causal-window-ragged", 64, "fp16", True, False, ("HAS_WINDOW",)),
    # Causal with a window and softcap at D=64: ptxas 12.8 crashed (SIGSEGV) on this build when the
    # window's masks were selected in inline PTX (docs/performance_backward.md, "The windowed
    # backward beside FlashAttention-4's"), a combination the list lacked.
    ("d64-fp16-causal-window-softcap", 64, "fp16", True, True, ("HAS_WINDOW", "SOFTCAP")),
    ("d128-bf16-window", 128, "bf16", False, True, ("HAS_WINDOW",)),
    ("d128-bf16-causal-softcap", 128, "bf16", True, True, ("SOFTCAP",)),
    ("d128-bf16-causal-varlen", 128, "bf16", True, False, ("VARLEN",)),
    ("d128-fp16-varlen", 128, "fp16", False, False, ("VARLEN",)),
    ("d64-bf16-causal-varlen", 64, "bf16", True, False, ("VARLEN",)),
    ("d128-bf16-causal-window-varlen", 128, "bf16", True, False, ("HAS_WINDOW", "VARLEN")),
    ("d128-bf16-nofresh", 128, "bf16", False, True, ("NOFRESH",)),
    ("d128-bf16-causal-long-nofresh", 128, "bf16", True, True, ("LONG", "NOFRESH")),
]
SCORE_FLAGS = ("HAS_WINDOW", "SOFTCAP", "HAS_ALIBI")


def compile_variant(variant) -> dict:
    """Compile one variant for sm_90a and report what the tests check."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from flashcore.kernels.hopper import bwd
    from flashcore.ops import bwd_sm90

    label, head_dim, dtype, causal, even_n, *rest = variant
    options = rest[0] if rest else ()
    cfg = bwd_sm90.CONFIGS[head_dim]
    gdtype = gl.bfloat16 if dtype == "bf16" else gl.float16
    # Signatures as a launch with Gluon TensorDescriptors specialises them (ops/bwd_sm90.py).
    signature = {}
    for name in ("q_desc", "k_desc", "v_desc", "do_desc", "dk_desc", "dv_desc"):
        block = [1, 1, 64, head_dim]
        layout = gl.NVMMASharedLayout.get_default_for(block, gdtype)
        signature[name] = f"tensordesc<{dtype}{block},{layout!r}>"
    # The launcher's dQ box: half of D per consumer, or all of it for the dQ warpgroup; (8, 4, 2,
    # cols) with the staging rows permuted (dense problems).
    # LONG: a problem long enough for the causal D=128 rule (query rows; others: 2048).
    seqlen_q = 16384 if "LONG" in options else 2048
    flags = (flag in options for flag in SCORE_FLAGS)
    permuted = bwd_sm90.rows_permuted(cfg, head_dim, "VARLEN" in options, causal, *flags, seqlen_q)
    block = bwd_sm90.dq_box(head_dim, cfg, permuted)
    dq_layout = bwd_sm90.dq_layout(head_dim, permuted)
    signature["dq_desc"] = f"tensordesc<fp32{block},{dq_layout!r}>"
    row_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    for name in ("lse_desc", "delta_desc"):
        signature[name] = f"tensordesc<fp32[64],{row_layout!r}>"
    beside = bwd_sm90.dq_beside_dk(cfg, causal, "VARLEN" in options, seqlen_q)
    kv_regs = bwd_sm90.kv_in_registers(cfg, *(flag in options for flag in SCORE_FLAGS))
    consts = dict(
        HEAD_DIM=head_dim, NUM_STAGES=cfg.num_stages, CONSUMER_REGS=cfg.consumer_regs,
        IS_CAUSAL=causal, EVEN_N=even_n, DQ_WARPGROUP=cfg.dq_warpgroup,
        DQ_REGS=bwd_sm90.dq_regs(cfg), ABLATE=0,
        KV_REGS=kv_regs,
        VARLEN="VARLEN" in options,
        PERMUTED_ROWS=permuted,
        DQ_BESIDE_DK=beside,
        PDL=bwd_sm90.PDL,
        FRESH_DESC=bwd_sm90.fresh_desc(
            beside, kv_regs, causal and any(f in options for f in (*SCORE_FLAGS, "VARLEN"))
        ) and "NOFRESH" not in options,
        SKIP_MASKED=bwd_sm90.SKIP_MASKED and causal and "NOSKIP" not in options,
        SKIP_WINDOW=bwd_sm90.SKIP_MASKED_WINDOW and "HAS_WINDOW" in options
        and "NOSKIPWINDOW" not in options,
        BAND_MASK=bwd_sm90.BAND_MASK and causal and "HAS_WINDOW" in options
        and "NOBAND" not in options,
        LAG_OPTIONS=bwd_sm90.lag_options(causal, "SOFTCAP" in options, "HAS_ALIBI" in options)
        and "NOLAG" not in options,
        **{flag: flag in options for flag in SCORE_FLAGS},
    )  # fmt: skip
    fn = bwd.attn_bwd_sm90_kernel
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in ("qk_scale", "scale", "softcap"):
            signature[name] = "fp32"
        elif name in ("ALIBI", "LSE2", "DELTA"):
            signature[name] = "*fp32"
        elif name in ("CU_Q", "CU_K"):
            signature[name] = "*i32"
        elif name in ("DK", "DV"):
            signature[name] = f"*{dtype}"
        elif name not in signature:
            signature[name] = "i32"
    signature = {name: signature[name] for name in fn.arg_names}
    src = GluonASTSource(fn, signature, consts, {})
    ptx, sass, report = assemble(src, cfg.maxnreg)
    cols = head_dim if cfg.dq_warpgroup else head_dim // 2
    # The kernel's DQ_LAG rule: softcap or ALiBi at D=128 keep each step's dQ in its step
    # (unless LAG_OPTIONS).
    dq_in_step = head_dim == 128 and ("SOFTCAP" in options or "HAS_ALIBI" in options)
    dq_in_step = dq_in_step and not consts["LAG_OPTIONS"]
    mixes = [loop_mix(body) for body in step_loops(sass)]
    return {
        "variant": label,
        "permuted_rows": permuted,
        "staging_conflicts": staging_bank_conflicts(cols, permuted, dq_layout),
        "step_loop_local": [mix["local"] for mix in mixes],
        "step_loop_r2ur": [
            sum(bool(re.match(r"(@!?U?P\w+\s+)?R2UR", t)) for t in body)
            for body in step_loops(sass)
        ],
        "step_loop_mix": mixes,
        "consumer_regs": cfg.consumer_regs,
        "dq_regs": bwd_sm90.dq_regs(cfg) if cfg.dq_warpgroup else None,
        **report,
        "wgmma_ptx": len(re.findall(r"wgmma\.mma_async", ptx)),
        "tma_reduce_add": len(re.findall(r"cp\.reduce\.async\.bulk\.tensor\.\S*add", ptx)),
        "tma_store": len(re.findall(r"cp\.async\.bulk\.tensor\.\S*global\.shared", ptx)),
        "tma_load": len(
            re.findall(r"cp\.async\.bulk\.tensor\.\S*shared::(?:cluster|cta)\.global", ptx)
        ),
        "atomics": len(re.findall(r"\b(red|atom)\.global", ptx)),
        "pdl": consts["PDL"],
        "gdc_launch": ptx.count("griddepcontrol.launch_dependents"),
        "gdc_wait": ptx.count("griddepcontrol.wait"),
        "dq_in_step": dq_in_step,
        # The kernel peels consumer 1's first step off where it runs each dQ a step late.
        # (SKIP_WINDOW peels it at a window's right edge when not causal, too.)
        "skip_masked": (consts["SKIP_MASKED"] or consts["SKIP_WINDOW"]) and not dq_in_step,
        # And consumer 0's last step after its loop (a loop of its own with dQ's products).
        "skip_last": consts["SKIP_WINDOW"] and not dq_in_step,
        "dq_warpgroup": cfg.dq_warpgroup,
        # The kernel takes DQ_BESIDE_DK where it runs each dQ a step late (not dq_in_step).
        "dq_beside_dk": consts["DQ_BESIDE_DK"] and not dq_in_step,
        "kv_regs": consts["KV_REGS"],
        "varlen": consts["VARLEN"],
        **schedule_facts(ptx),
    }


def staging_bank_conflicts(cols: int, permuted: bool, layout) -> int:
    """Gluon's count of excess shared-memory wavefronts (``gl.bank_conflicts``) of the store of a
    64 x ``cols`` fp32 wgmma accumulator into the dQ staging tile, as the kernel stores it
    (``bwd_dq.stage_dq``: ``permuted_rows_layout``, or the descriptor's layout), read from a probe
    kernel compiled for sm_90a."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from flashcore.kernels.hopper import bwd_dq

    shared = (
        bwd_dq.permuted_rows_layout(cols)
        if permuted
        else gl.NVMMASharedLayout(
            swizzle_byte_width=layout.swizzle_byte_width, element_bitwidth=32, rank=2
        )
    )
    probe, found = _staging_probe()
    src = GluonASTSource(
        probe, {"COLS": "constexpr", "SHARED": "constexpr"}, {"COLS": cols, "SHARED": shared}, {}
    )
    found.clear()
    from triton import knobs

    # The count is read while the frontend runs: not from Triton's cache.
    with knobs.compilation.scope():
        knobs.compilation.always_compile = True
        triton_compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return found["conflicts"]


@functools.cache
def _staging_probe():
    """A kernel that stores a 64 x COLS fp32 wgmma accumulator's type into a SHARED tile's and
    records ``gl.bank_conflicts`` of the pair in the returned dict while it compiles."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    found: dict[str, int] = {}

    @gluon.constexpr_function
    def record(count):
        found["conflicts"] = count
        return count

    @gluon.jit
    def probe(COLS: gl.constexpr, SHARED: gl.constexpr):
        acc: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, COLS, 16]
        )
        tile = gl.allocate_shared_memory(gl.float32, [64, COLS], SHARED)
        record(gl.bank_conflicts(gl.zeros([64, COLS], gl.float32, layout=acc).type, tile.type))

    return probe, found


# Integer and move instructions on the vector pipes: a step's slot, phase and address arithmetic
# there instead of on the uniform datapath (``U*`` instructions) costs issue slots every step.
VECTOR_INT = ("IMAD", "IADD3", "LOP3", "LEA", "SHF", "VIADD", "MOV", "SGXT")


def loop_mix(body: list[str]) -> dict[str, int]:
    """Instruction counts of one step loop (a ``step_loops`` body): all, products (HGMMA), the
    multi-function unit (MUFU), the uniform datapath, vector integer, local loads and stores."""
    ops: dict[str, int] = {}
    for text in body:
        op = (text.split()[1] if text.startswith("@") else text.split()[0]).split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    return {
        "instructions": len(body),
        "HGMMA": ops.get("HGMMA", 0),
        "MUFU": ops.get("MUFU", 0),
        "uniform": sum(n for op, n in ops.items() if op.startswith("U")),
        "vector int": sum(ops.get(op, 0) for op in VECTOR_INT),
        "local": ops.get("LDL", 0) + ops.get("STL", 0),
    }


def _instructions(ptx: str) -> list[str]:
    lines = (raw.split("//")[0].strip() for raw in ptx.splitlines())
    return [line for line in lines if line and not line.startswith(".")]


def schedule_facts(ptx: str) -> dict:
    """Orderings of the PTX that the kernel's docstring states (straight-line order; every
    sequence checked here sits in one basic block of the step).

    - ``reduces_ordered``: TMA reduce-adds preceded, since the previous reduce, by
      ``cp.async.bulk.wait_group.read`` (the staging tile's previous reduce has read it), a
      ``bar.sync`` (no thread writes the tile before that), a ``fence.proxy.async`` (the
      threads' writes visible to the copy engine) and a ``bar.sync`` (all of them), in order;
      the further messages of one tile (no shared store since the previous reduce) count with
      the first.
    - ``frees_ordered``: consumers' plain ``mbarrier.arrive`` (freeing a Q/dO slot, announcing
      a dS^T tile, freeing a step's dS^T tiles) with no wgmma group in flight: every product
      reading what the arrive hands over has completed. ``frees_beside_rs``: arrives with only
      products whose A operand is in registers in flight (dV, dK: P^T and dS^T from registers,
      Q and dO from the slot), after a ``wgmma.wait_group`` or a ``fence.proxy.async`` since
      the last product was issued; with DQ_BESIDE_DK the dS^T tile's announcement (dV in
      flight) and a step's dS^T tiles' release (its dQ products complete, dK in flight) are
      such arrives, and the slot's release is not (``test_slot_freed_after_its_products``).
    """
    code = _instructions(ptx)
    reduces = ordered = 0
    want = ("cp.async.bulk.wait_group.read", "bar.sync", "fence.proxy.async", "bar.sync")
    last_reduce = -1
    group_ordered = False
    for i, line in enumerate(code):
        if not re.search(r"cp\.reduce\.async\.bulk\.tensor", line):
            continue
        reduces += 1
        if last_reduce >= 0 and not any(
            c.startswith("st.shared") for c in code[last_reduce + 1 : i]
        ):
            # Another message of the same staging tile (the copy engine takes a tile wider
            # than its swizzle span as several): ordered with the group's first.
            ordered += group_ordered
            last_reduce = i
            continue
        found, k = len(want), i - 1
        while found and k > last_reduce:
            if code[k].startswith(want[found - 1]):
                found -= 1
            k -= 1
        group_ordered = found == 0
        ordered += group_ordered
        last_reduce = i
    # The wgmma groups in flight along the straight-line code (each group: whether every
    # product in it takes its A operand from registers), as the step's basic blocks run.
    frees = frees_ordered = frees_beside_rs = 0
    groups: list[bool] = []
    current: list[bool] = []
    since_issue: list[str] = []
    for line in code:
        if line.startswith("setmaxnreg"):
            # A partition's code starts (each sets its register count first): no wgmma group
            # of another partition's is in flight in it.
            groups, current, since_issue = [], [], []
        elif line.startswith("wgmma.mma_async"):
            current.append(line.count("{") == 2)  # accumulator and A in registers
            since_issue = []
        elif line.startswith("wgmma.commit_group"):
            groups.append(all(current))
            current = []
            since_issue = []
        elif m := re.match(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", line):
            keep = int(m.group(1))
            groups = groups[len(groups) - keep :] if keep else []
            since_issue.append("wait")
        elif line.startswith("fence.proxy.async"):
            since_issue.append("fence")
        elif re.search(r"mbarrier\.arrive\.shared::cta\.b64", line):
            frees += 1
            if not groups and not current:
                frees_ordered += 1
            elif not current and all(groups) and since_issue:
                frees_beside_rs += 1
    return {
        "reduces": reduces,
        "reduces_ordered": ordered,
        "frees": frees,
        "frees_ordered": frees_ordered,
        "frees_beside_rs": frees_beside_rs,
    }


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return compiled_rows(__file__, len(VARIANTS))


def test_shared_memory_within_limit(compiled):
    for row in compiled:
        assert row["shared"] <= SMEM_LIMIT, f"{row['variant']}: {row['shared']} B"


# Spill bytes (stores + loads, as ptxas reports them) a variant may have, all scalars. At D=128
# the consumers hold dK and dV (128 registers) and S^T, dP^T (64) at once; a masked step adds the
# mask's indices (the query-row vector is 16 registers a thread in the score layout). With ragged
# Sk ptxas spilled a few scalars before FRESH_DESC (loop invariants reloaded from L1 on masked
# steps or once per step: six 4-byte loads a step in the non-causal ragged variant since the dQ
# of each step runs a step late and carries that step's head and query block; none with it).
# Softcap and ALiBi at D=128 keep each step's dQ in its own step (DQ_LAG off): carrying the
# step's indices spilled 20-80% more.
# The score options at D=128 hold more per step (the query-row index vector for the window's
# masks on every step, tanh's values until dS for softcap, the distances for ALiBi): ptxas spills
# 120-412 B there (Triton 3.6; 16-196 B with FRESH_DESC where the launcher takes it); D=64 has
# room. Measured cost: docs/performance_backward.md.
# With the dQ staging rows permuted (``rows_permuted``: D=128 without a window, causal only on long
# problems or with ALiBi, softcap only non-causal) ptxas spills 136-224 B of scalars, at most 3
# local accesses a step inside the step loops in the plain builds
# (``test_step_loops_spill_only_where_allowed``), 5 with softcap, 10 with ALiBi (57 with its rows in
# order, before the dQ rows' head stride came from ``seqlen_pad``). Causal with softcap at D=128
# masks every step (a run-time branch around the diagonal's mask spilled 700 B there, 62-64 local
# accesses a step): 192 B and 4-7 with its rows in order (316 B and 7-20 permuted). At D=64 the
# consumers have 200 registers beside the dQ warpgroup: all three score options at once spill 16 B
# there (none with any one of them), causal with a window and softcap 56 B (none inside the step
# loops). With K and V in registers (KV_REGS) a consumer spills two
# scalars (16 B, stored and loaded once in its epilogue, outside the loop). VARLEN carries each
# program's sequence (its first query and key rows, lengths and batch coordinate) and its edge paths
# (the producer's bounded loads, the masked dK/dV stores, the dQ rows past the sequence zeroed):
# 40-404 B of scalars, most stored in the prologue and reloaded around the loops' edges. The
# consumers' step loops reload none non-causal; causal at D=128, 11 and 3 four-byte loads a step
# (none with FRESH_DESC, below).
# Consumer 1's peeled first step (SKIP_MASKED, causal) moved the causal builds' spills outside the
# loops by -20 to +24 B (the plain causal D=128 build 12 -> 0, the window one 120 -> 128, the
# packed ones 424 -> 404 and 44 -> 68 at D=64); the step loops' local accesses did not change.
# Consumer 0's skipped last step at a window's left edge (SKIP_WINDOW) took the causal window
# build to 96 B, 1 local access a step in consumer 0's loop (5 before). The causal window builds
# form the fixed tiles' descriptors in the loop (FRESH_DESC, ``fresh_desc``'s causal options):
# dense D=128 96 -> 0 B, packed 528 -> 96 B (17, 9 -> 3, 0 local accesses a step), D=128 with
# softcap (no variant) 232 -> 200 B; the D=64 builds unchanged. So do the other causal builds with
# a score option or packed rows: D=128 packed 404 -> 40 B (11, 3 -> 0, 0 a step), ALiBi 196 -> 8 B
# (10, 1 -> 0, 0), softcap at 2048 rows (no variant) 192 -> 96 B (4, 7 -> 1, 2).
# Causal windows' two masks as one comparison (BAND_MASK): packed causal window 96 -> 40 B (3 -> 0
# local accesses a step), D=64 causal window softcap 56 -> 16 B, D=128 with softcap (no variant)
# 200 -> 120 B (17, 4 -> 2, 4 a step).
# With the dQ products beside dV and dK (DQ_BESIDE_DK: non-causal, and causal from 4096 query
# rows) the plain builds formed every k-step's wgmma descriptor of K, V and the dQ products' K
# columns before the step loop and ptxas spilled 120-196 B (the long causal one 172 B, 4 local
# accesses a step: the "-nofresh" variants); those builds form them in the loop (FRESH_DESC, as
# the launcher does there: ``bwd_sm90.fresh_desc``) and spill 0-40 B, with softcap 16-136 B (at
# most 4 local accesses a step; 136-412 B and 5-29 without).
SPILL_ALLOWANCE = {
    "d128-bf16-causal-varlen": 40,
    "d128-fp16-varlen": 40,
    "d64-bf16-causal-varlen": 68,
    "d64-bf16-causal": 16,
    "d64-fp16-ragged": 16,
    "d64-bf16-all": 16,
    "d64-fp16-causal-window-softcap": 16,
    "d128-fp16-causal-ragged": 0,
    "d128-bf16-causal-long": 8,
    "d128-bf16-causal-window": 0,
    "d128-bf16-causal-window-varlen": 40,
    # Softcap at D=128 with the dQ a step late (DQ_LAG_OPTIONS): the carried head and query block
    # beside tanh's values (non-causal: none in the step loops).
    "d128-bf16-softcap-window": 68,
    "d128-bf16-softcap": 88,
    "d128-bf16-causal-softcap-long": 20,
    "d128-fp16-causal-alibi": 8,
    "d128-bf16-causal-softcap": 24,
    # Without FRESH_DESC (NOFRESH): the fixed tiles' descriptors live across the step loop.
    "d128-bf16-nofresh": 120,
    "d128-bf16-causal-long-nofresh": 172,
}


# Local loads and stores a step loop may hold (consumers' loops, and the dQ warpgroup's at D=64;
# a variant not listed: none). Ragged Sk reloads loop invariants on masked steps; the score options
# at D=128, the permuted causal build and the packed causal build are the spills above, partly
# inside the loop.
STEP_LOOP_ALLOWANCE = {
    "d128-bf16-causal-long-nofresh": 4,
    "d128-bf16-softcap-window": 6,
    "d128-bf16-causal-softcap-long": 1,
    "d128-bf16-causal-softcap": 3,
}


def test_step_loops_spill_only_where_allowed(compiled):
    for row in compiled:
        loops = row["step_loop_local"]
        # SKIP_WINDOW: consumer 0's skipped last step holds the previous step's dQ products in a
        # loop of its own (D = 128; at D = 64 the dQ warpgroup computes them).
        want = 3 if row["dq_warpgroup"] or row["skip_last"] else 2
        assert len(loops) == want, f"{row['variant']}: {loops}"
        allowed = STEP_LOOP_ALLOWANCE.get(row["variant"], 0)
        assert max(loops) <= allowed, f"{row['variant']}: {loops} local accesses, {allowed} allowed"


def test_dq_staging_rows_permuted_where_taken(compiled):
    # ops/bwd_sm90.py: rows_permuted. Dense problems, at D=128 without a window and causal only
    # on long problems (each as measured). Stored that way the staging tile takes no bank
    # conflicts; in row order the 128-byte swizzle takes one excess wavefront a store (two where
    # one would do), and D=64's 32-byte swizzle none (at four times the reduce's requests).
    in_order = (
        "d128-fp16-causal-ragged", "d128-bf16-causal-window", "d128-bf16-softcap-window",
        "d128-bf16-causal-softcap-long", "d128-bf16-window",
        "d128-bf16-causal-softcap",
    )  # fmt: skip
    for row in compiled:
        dense = not row["varlen"]
        want = dense and row["variant"] not in in_order
        assert row["permuted_rows"] == want, row["variant"]
        conflicts = 1 if row["variant"].startswith("d128") and not want else 0
        assert row["staging_conflicts"] == conflicts, (row["variant"], row["staging_conflicts"])


def test_rows_permuted_rule():
    # CPU: where the launcher permutes the dQ staging rows, as measured
    # (docs/performance_backward.md, "The dQ rows' head stride from seqlen_pad"): dense problems;
    # at D=128 not with a window, always with ALiBi, with softcap only when not causal, and
    # causal otherwise only from PERMUTED_ROWS_MIN_SEQLEN_CAUSAL query rows on.
    from flashcore.ops import bwd_sm90

    rule, cfg = bwd_sm90.rows_permuted, bwd_sm90.CONFIGS[128]
    long = bwd_sm90.PERMUTED_ROWS_MIN_SEQLEN_CAUSAL
    # (head_dim, varlen, causal, window, softcap, alibi, seqlen_q) -> permuted
    cases = {
        (128, False, False, False, False, False, 512): True,
        (128, False, True, False, False, False, long - 1): False,
        (128, False, True, False, False, False, long): True,
        (128, False, True, True, False, False, 16384): False,
        (128, False, False, False, True, False, 2048): True,
        (128, False, True, False, True, False, 16384): False,
        (128, False, True, False, True, True, 2048): True,
        (128, False, True, False, False, True, 2048): True,
        (128, False, False, True, True, False, 2048): False,
        (128, True, False, False, False, False, 16384): False,
        (64, False, True, True, True, True, 512): True,
        (64, True, False, False, False, False, 2048): False,
    }
    for (head_dim, *args), want in cases.items():
        got = rule(bwd_sm90.CONFIGS[head_dim], head_dim, *args)
        assert got == want, (head_dim, *args)
    assert not rule(cfg._replace(permuted_rows=False), 128, False, False, False, False, False, 4096)


def test_dq_beside_dk_rule():
    # CPU: where the launcher issues the dQ products beside dV and dK (DQ_BESIDE_DK), as
    # measured (docs/performance_backward.md, "dQ beside dK"): at D=128 without causal, and
    # causal dense problems from DQ_BESIDE_DK_MIN_SEQLEN_CAUSAL query rows on; never with the dQ
    # warpgroup (D=64), nor where the config turns it off.
    from flashcore.ops import bwd_sm90

    rule, cfg = bwd_sm90.dq_beside_dk, bwd_sm90.CONFIGS[128]
    long = bwd_sm90.DQ_BESIDE_DK_MIN_SEQLEN_CAUSAL
    # (causal, varlen, seqlen_q) -> beside
    cases = {
        (False, False, 512): True,
        (False, True, 512): True,
        (True, False, long - 1): False,
        (True, False, long): True,
        (True, True, 16384): False,
    }
    for args, want in cases.items():
        assert rule(cfg, *args) == want, args
    assert not rule(bwd_sm90.CONFIGS[64], False, False, 16384)
    assert not rule(cfg._replace(dq_beside_dk=False), False, False, 16384)


@pytest.mark.parametrize("cols", [32, 64])
def test_permuted_rows_land_where_they_belong(cols):
    # The store puts accumulator row r, column c at the offset ``permuted_rows_layout`` gives it;
    # the copy engine reads a 128-byte swizzled fp32 box as 32-column panels of 64 slots, slot s
    # of a panel at ``s * 32`` with its 16-byte chunks XORed by ``s % 8`` (Triton's layout for the
    # descriptor: the same PTX as a linear layout of those bases), and writes slot s to the
    # element of ``dq_view`` it walks s-th. Together they must take row r to row r.
    import torch

    from flashcore.kernels.hopper import bwd_dq
    from flashcore.ops import bwd_sm90

    rows_by_slot = bwd_sm90.dq_view(torch.arange(64.0).view(1, 1, 64, 1)).reshape(-1).tolist()
    bases = bwd_dq.permuted_rows_layout(cols).offset_bases
    seen = set()
    for offset in range(64 * cols):
        row = col = 0
        for bit, (r, c) in enumerate(bases):
            if offset >> bit & 1:
                row, col = row ^ r, col ^ c
        panel, slot, within = offset // 2048, offset % 2048 // 32, offset % 32
        assert rows_by_slot[slot] == row, (offset, slot, row)
        assert col == panel * 32 + ((within // 4) ^ (slot % 8)) * 4 + within % 4, offset
        seen.add((row, col))
    assert len(seen) == 64 * cols


def test_no_spills(compiled):
    for row in compiled:
        allowed = SPILL_ALLOWANCE.get(row["variant"], 0)
        assert row["spill_bytes"] <= allowed, (
            f"{row['variant']}: {row['spill_bytes']} B of spills, {allowed} B allowed"
        )


def test_register_split(compiled):
    assert_register_split(compiled)
    # The dQ warpgroup (D=64) sets its own count (a 64 x 64 fp32 accumulator needs 32 a thread).
    for row in compiled:
        if row["dq_regs"] is not None:
            pairs = {tuple(p) for p in row["setmaxnreg"]}
            assert ("inc", row["dq_regs"]) in pairs, f"{row['variant']}: {pairs}"


def test_products_on_tensor_cores(compiled):
    # Per consumer: S^T, dP^T and dQ take A from shared memory, dV and dK from registers; with
    # KV_REGS (D=64) S^T and dP^T take theirs (K, V) from registers too. A product with a
    # reduction of depth K is K / 16 HGMMA instructions in the SASS: at D=64 each of the two
    # consumers' four products is 4, and the dQ warpgroup's two (over both consumers' 64 keys) 8.
    for row in compiled:
        assert row["wgmma_ptx"] > 0, f"{row['variant']}: no wgmma in PTX"
        assert row["hgmma_shared_a"] > 0, f"{row['variant']}: no shared-A HGMMA"
        assert row["hgmma_register_a"] > 0, f"{row['variant']}: dV/dK do not take A from registers"
        if row["kv_regs"]:
            assert (row["hgmma_register_a"], row["hgmma_shared_a"]) == (32, 8), row["variant"]
        elif row["dq_warpgroup"]:
            assert (row["hgmma_register_a"], row["hgmma_shared_a"]) == (16, 24), row["variant"]


def test_dependent_launch(compiled):
    """With ``PDL`` (ops/bwd_sm90.py) the kernel lets the dQ conversion launch at its start
    (``griddepcontrol.launch_dependents``) and waits for the prep kernel once, in the producer
    (``griddepcontrol.wait``: the row stats and the zeroed dQ accumulator are the prep's output),
    and with packed batches also in a program that returns at entry (so that no grid completes
    before the prep); without it, neither."""
    for row in compiled:
        waits = (2 if row["varlen"] else 1) if row["pdl"] else 0
        assert (row["gdc_launch"], row["gdc_wait"]) == (int(row["pdl"]), waits), row["variant"]


def test_dq_by_tma_reduce_add(compiled):
    for row in compiled:
        assert row["tma_reduce_add"] > 0, f"{row['variant']}: no cp.reduce.async.bulk.tensor add"
        assert row["atomics"] == 0, f"{row['variant']}: {row['atomics']} global atomics"
        assert row["tma_store"] > 0 and row["tma_load"] > 0, row


def test_dq_staging_reused_only_after_the_copy_engine_read_it(compiled):
    for row in compiled:
        assert row["reduces_ordered"] == row["reduces"], (
            f"{row['variant']}: {row['reduces_ordered']} of {row['reduces']} reduces ordered"
        )


def test_slot_freed_after_its_products(compiled):
    # Per consumer in the step: the qd_empty arrive (freeing the Q/dO slot) and the ds_ready
    # arrive (its dS^T tile written), both after the wait that completes dV and dK, and the
    # ds_free arrive after the wait that completes a step's dQ products (which read both dS^T
    # tiles); with the dQ a step late (DQ_LAG), one more ds_free arrive after the loop, after the
    # last dQ products. With the dQ warpgroup (D=64) the consumers arrive qd_empty and ds_ready,
    # and the dQ warpgroup ds_free after its products of a step and dq_done after its last ones.
    # VARLEN adds the producer's three plain arrives (kv_ready after the K/V loads it bounds at a
    # sequence's end, qd_ready after the row stats it stores, on an edge step and on the others),
    # which the count takes along.
    # With DQ_BESIDE_DK a consumer's step announces its dS^T tile with dV in flight and frees
    # the previous step's dS^T tiles with dK in flight (its dQ products complete): two of its
    # four arrives (``schedule_facts``: ``frees_beside_rs``); its slot free and the ds_free
    # after the loop still wait for every product.
    # SKIP_MASKED: consumer 1's first step peeled off the loop, before any product of its own,
    # arrives qd_empty and ds_ready (and, with the dQ in the consumers, ds_free for "step -1").
    for row in compiled:
        frees = (6 if row["dq_in_step"] or row["dq_warpgroup"] else 8) + 3 * row["varlen"]
        if row["skip_masked"]:
            frees += 2 if row["dq_warpgroup"] else 3
        if row["skip_last"]:
            frees += 2 if row["dq_warpgroup"] else 3
        beside = 4 if row["dq_beside_dk"] else 0
        assert row["frees"] == frees, f"{row['variant']}: {row['frees']} mbarrier arrives"
        assert row["frees_ordered"] == frees - beside, (
            f"{row['variant']}: {row['frees_ordered']} of {row['frees']} arrives after the wait"
        )
        assert row["frees_beside_rs"] == beside, (row["variant"], row["frees_beside_rs"])


# The plain D=128 builds (no score option, dense): their step loops' scalar work on the uniform
# datapath. Now 116-127 uniform and 20-52 vector integer instructions a step; the persistent build
# tried on a branch moved it to the vector pipes (49-58 uniform, 80-277 vector integer a step)
# and measured 1-20% slower (docs/performance_backward.md, "Where a program's time goes outside
# its steps").
UNIFORM_LOOPS = (
    "d128-bf16",
    "d128-fp16-causal-ragged",
    "d128-bf16-causal-long",
    "d128-bf16-ragged",
)


def test_plain_step_loops_keep_their_scalars_uniform(compiled):
    for row in compiled:
        if row["variant"] not in UNIFORM_LOOPS:
            continue
        assert len(row["step_loop_mix"]) == 2, row["variant"]
        for mix in row["step_loop_mix"]:
            assert mix["uniform"] >= 100 and mix["vector int"] <= 60, (row["variant"], mix)


def test_trace_build_still_applies():
    """``scripts/hopper_bwd_trace.py`` edits the kernel's source as text; a change to the step
    loop, the last dQ or the epilogue that its edits no longer match fails here, not later on
    the GPU machine."""
    from helpers import load_script

    module = load_script("hopper_bwd_trace")
    # Nine stamps in the loop (e0, e1, e3, e4 and both dQ orders' e5-e7); --s-stamp one more;
    # --all-programs six more around the loop (entry, K/V wait, last dQ, stores, end).
    assert module.trace_source(False).count("_stamp(ALIBI") == 9
    assert module.trace_source(True).count("_stamp(ALIBI") == 10
    assert module.trace_source(False, all_programs=True).count("_stamp(ALIBI") == 15


def main() -> int:
    assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET"
    emit_variants(VARIANTS, compile_variant)
    return 0


def test_fresh_descriptors_stay_uniform(compiled):
    """FRESH_DESC (``kernels/hopper/bwd.py``, shipped where DQ_BESIDE_DK is): with the fixed
    tiles' wgmma descriptors formed in the step loop, the D = 128 consumers' loops move next to
    nothing from vector to uniform registers (``R2UR``: the descriptors of the builds without it,
    formed before the loop and held in vector registers, 18-27 a step)."""
    rows = {row["variant"]: row for row in compiled}
    for fresh in ("d128-bf16", "d128-bf16-causal-long"):
        ours, theirs = rows[fresh]["step_loop_r2ur"], rows[f"{fresh}-nofresh"]["step_loop_r2ur"]
        assert len(ours) == len(theirs) == 2, (fresh, ours, theirs)
        assert all(a <= 4 < b for a, b in zip(ours, theirs, strict=True)), (fresh, ours, theirs)


if __name__ == "__main__":
    sys.exit(main())
