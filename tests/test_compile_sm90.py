"""The kernels compile for the H100 (sm_90) on a CPU-only machine.

The interpreter runs kernels as numpy, so it cannot catch what only the compiler rejects
(non-constexpr globals, type errors in dead-on-CPU branches, shared memory over the 227 KiB a
Hopper block may use) or a dot that fell off the tensor cores. This compiles every kernel variant
for sm_90 in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import pytest

import compile_shards

SMEM_LIMIT = 227 * 1024


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    # Split over the CPUs (compile_shards): minutes on one core with a cold Triton cache.
    rows = compile_shards.run(Path(__file__).with_name("sm90_compile.py"), env, timeout=600)
    assert rows, "no kernel variant compiled"
    return rows


def test_kept_assembly_is_what_the_tools_give(tmp_path, monkeypatch):
    """``compile_shards.ptxas_sm90a`` keeps ptxas's report and the SASS per PTX: a repeat reads
    the kept pair, which is what the tools give with the cache off, and other PTX is kept apart."""
    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kept = tmp_path / "flashcore-ptxas"

    def ptx(name: str) -> str:
        return (
            ".version 8.0\n.target sm_90a\n.address_size 64\n"
            f".visible .entry {name}(.param .u64 p)\n{{\n.reg .b64 %rd<2>;\n"
            "ld.param.u64 %rd1, [p];\nst.global.u32 [%rd1], 7;\nret;\n}\n"
        )

    def untimed(log: str) -> list[str]:
        return [line for line in log.splitlines() if "Compile time" not in line]

    first = compile_shards.ptxas_sm90a(ptx("k_one"))
    assert "Used" in first[0] and "k_one" in first[0] and "STG" in first[1]
    assert len(list(kept.iterdir())) == 1
    assert compile_shards.ptxas_sm90a(ptx("k_one")) == first
    monkeypatch.setenv(compile_shards.TOOL_CACHE_ENV, "0")
    log, sass = compile_shards.ptxas_sm90a(ptx("k_one"))
    # All but ptxas's own timing, which differs run to run.
    assert untimed(log) == untimed(first[0]) and sass == first[1]
    monkeypatch.delenv(compile_shards.TOOL_CACHE_ENV)
    other = compile_shards.ptxas_sm90a(ptx("k_two"))
    assert "k_two" in other[0] and len(list(kept.iterdir())) == 2
    log, sass = compile_shards.ptxas_sm90a(ptx("k_two"), sass=False)
    assert untimed(log) == untimed(other[0])
    assert sass is None and len(list(kept.iterdir())) == 3


def test_all_variants_compile_within_shared_memory(compiled):
    for row in compiled:
        assert row["shared"] <= SMEM_LIMIT, f"{row['kernel']} {row['variant']}: {row['shared']} B"


# Kernels with no product to put on tensor cores: the decode combine (a weighted sum over splits).
NO_DOTS = {"attn_decode_combine"}


def test_half_precision_dots_use_wgmma(compiled):
    for row in compiled:
        if row["dtype"] == "fp32" or row["kernel"] in NO_DOTS:
            continue
        if row["kernel"] == "attn_decode" or row.get("tile_rows", 64) < 64:
            # The decode tile has 16-32 rows (one kv head's query heads x Sq), the D=256 dK/dV
            # tile 32 keys (faster than 64, docs/performance_backward.md): under wgmma's 64 per
            # warpgroup, Triton emits mma.sync, still the tensor cores.
            assert row["has_mma"], f"{row['kernel']} {row['variant']}: no mma in the PTX"
        else:
            assert row["has_wgmma"], f"{row['kernel']} {row['variant']}: no wgmma in the PTX"


def test_tiles_load_through_async_copies(compiled):
    # Scalar loads here once cost 3x on the H100 (docs/performance.md). fp32 tiles run with
    # num_stages=1 (no pipelining), so only the half-precision variants are held to this.
    for row in compiled:
        if row["dtype"] != "fp32" and row["kernel"] in ("attn_fwd", "attn_decode"):
            copies = row["bulk_tensor_copies"] if row["tma"] else row["async_copies"]
            assert copies, f"{row['kernel']} {row['variant']}: no cp.async in the PTX"


def test_half_precision_kernels_do_not_spill(compiled):
    # Loop-carried pointer tensors once pushed the forward to 255 registers and 504 spill bytes.
    # The backward's dK/dV kernel holds two fp32 accumulators and spills at every head dim here
    # (0.5-2.7 KB of spill traffic in these masked, ragged variants;
    # docs/performance_backward.md): only the forward and the decode kernel are held to this.
    # The paged decode variants with every score flag take 4 warps and 2 stages: no spills with
    # Triton 3.6.0's wheel ptxas nor with the H200 machine's (docs/performance_features.md,
    # "Paged decoding: four warps"); at 4 warps and 3 stages the H100 machine's Triton 3.6 build
    # once spilled 36 bytes there.
    versions = f"triton {metadata.version('triton')}"
    for row in compiled:
        if row["dtype"] != "fp32" and row["kernel"] in ("attn_fwd", "attn_decode"):
            assert row["spill_bytes"] == 0, (
                f"{row['kernel']} {row['variant']}: {row['spill_bytes']} spill bytes at "
                f"{row['registers']} registers ({versions})"
            )


def test_paged_forward_pipelines_as_dense(compiled):
    # Pages are looked up a tile ahead of the loads that use them (kernels/fwd.py): each paged
    # build keeps as many K/V buffers, and as many copies in flight across a step, as the dense
    # varlen build of the same flags (3 and 2 at num_stages=3, Triton 3.6.0); looked up in the
    # step itself they kept 2 buffers and waited for every copy at the top of each step. PAGED
    # 3 (power-of-two pages) divides no more than the dense build: PAGED 1's division a key row
    # made its key loop 789 SASS instructions a step against 400 dense (64x64 tiles, 16-key
    # pages; PAGED 3: 477).
    rows = [row for row in compiled if "paged" in row]
    dense = {row["case"]: row for row in rows if row["paged"] == 0}
    assert len(dense) == 3 and len(rows) == 12, [row["variant"] for row in rows]
    for row in rows:
        base = dense[row["case"]]
        for key in ("kv_buffers", "copies_in_flight"):
            assert row[key] == base[key], f"{row['variant']}: {key} {row[key]}, dense {base[key]}"
        if row["paged"] == 3:
            assert row["divisions"] <= base["divisions"], (row["variant"], row["divisions"])


def test_varlen_variants_compile(compiled):
    # IS_VARLEN adds a prologue and an early exit to every kernel; each must still compile.
    kernels = {row["kernel"] for row in compiled if row["varlen"]}
    assert kernels == {
        "attn_fwd",
        "attn_bwd_dkdv_kernel",
        "attn_bwd_dq_kernel",
    }


def test_mla_backward_variants_compile(compiled):
    # MLA head dims (Q/K 192 in 128 + 64 column panels for 16-bit inputs, ops/bwd.py: d_panels;
    # V 128) take the backward tiles of their own (tuning.bwd_config, head_dim_v, panels): both
    # kernels compile within shared memory (checked above for every row) and run their products
    # on wgmma. In one 256-wide tile (Triton 3.6.0) dK/dV took 255 registers with 164-760 B of
    # spills and dQ 252-255 with 0-56 B and 192 KB of shared memory; in panels with the same
    # tiles 255 with 24-424 B and 219-249 with none in 160 KB (two stages), which leaves room
    # for the third stage the launcher takes.
    rows = [row for row in compiled if row.get("head_dim_v") == 128]
    assert {(row["kernel"], row["varlen"]) for row in rows} == {
        ("attn_bwd_dkdv_kernel", False),
        ("attn_bwd_dq_kernel", False),
        ("attn_bwd_dkdv_kernel", True),
        ("attn_bwd_dq_kernel", True),
    }
    assert all(row["has_wgmma"] for row in rows), rows
