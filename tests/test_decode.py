"""``flashcore.attention_with_kvcache``: split-KV decoding from a contiguous or paged KV cache.

Cache slots past each sequence's length (and cache blocks no sequence owns) hold NaN, and the
block-table entries past a sequence's length are -1: a kernel that reads or uses any of them
fails the NaN check of the error rule.
"""

import pytest
import torch

import flashcore
from flashcore import reference, tuning
from numerics import assert_fa_rule
from shapes import DECODE, DECODE_GPU, DTYPES, DecodeCase


def make_kvcache(case: DecodeCase, dtype: torch.dtype, device: str, *, layout: str = "bhsd"):
    """``(q, k_cache, v_cache, cache_seqlens, block_table)`` for a case (block_table None when
    dense). ``layout='bshd'`` gives q and a dense cache as ``(B, S, H, D)`` storage viewed as
    ``(B, H, S, D)``."""
    b, h, hkv, sq, s_max, d, seqlens, block_size = case
    if layout == "bshd":
        q = torch.randn(b, sq, h, d, dtype=dtype, device=device).transpose(1, 2)
    else:
        q = torch.randn(b, h, sq, d, dtype=dtype, device=device)
    n_blocks = -(-s_max // block_size) if block_size else 1
    capacity = n_blocks * block_size if block_size else s_max
    lens = torch.tensor(seqlens, dtype=torch.int32, device=device)

    def dense() -> torch.Tensor:
        t = torch.randn(b, capacity, hkv, d, dtype=dtype, device=device).transpose(1, 2)
        t = t if layout == "bshd" else t.contiguous()
        for i, n in enumerate(seqlens):
            t[i, :, n:] = float("nan")
        return t

    k, v = dense(), dense()
    if not block_size:
        return q, k, v, lens, None
    # Blocks in a random order, two of them owned by nobody.
    perm = torch.randperm(b * n_blocks + 2, device=device).to(torch.int32)
    table = torch.full((b, n_blocks), -1, dtype=torch.int32, device=device)
    shape = (b * n_blocks + 2, hkv, block_size, d)
    k_paged = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_paged = torch.full(shape, float("nan"), dtype=dtype, device=device)
    for i, n in enumerate(seqlens):
        for j in range(-(-n // block_size)):
            blk = int(perm[i * n_blocks + j])
            table[i, j] = blk
            rows = slice(j * block_size, (j + 1) * block_size)
            k_paged[blk] = k[i, :, rows]
            v_paged[blk] = v[i, :, rows]
    return q, k_paged, v_paged, lens, table


def check_decode(q, k_cache, v_cache, lens, table, **options):
    out, lse = flashcore.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, block_table=table, return_lse=True, **options
    )
    options.pop("num_splits", None)
    args = (q, k_cache, v_cache)
    ref = reference.attention_with_kvcache(*args, cache_seqlens=lens, block_table=table, **options)
    pt = reference.attention_with_kvcache(
        *args, cache_seqlens=lens, block_table=table, dtype=q.dtype, **options
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32
    assert_fa_rule("out", out, pt.out, ref.out)
    assert_fa_rule("lse", lse, pt.lse, ref.lse)
    return out, lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", DECODE, ids=[c.id for c in DECODE])
def test_decode(case, dtype, causal, device):
    # Three splits: more than some sequences have tiles, so empty splits reach the combine.
    check_decode(*make_kvcache(case, dtype, device), causal=causal, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 2, None, 64], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", DECODE[:2], ids=[c.id for c in DECODE[:2]])
def test_decode_num_splits(case, num_splits, device):
    check_decode(*make_kvcache(case, torch.float16, device), causal=True, num_splits=num_splits)


@pytest.mark.parametrize("case", DECODE[:2], ids=["dense", "paged"])
def test_decode_plans_follow_the_problem(case, device):
    """``ops.decode`` builds its launch once per problem signature: a repeat (other lengths in
    cache_seqlens, other cache contents) reuses the plan and is still right; another layout of
    the same shape, another split count or a window gets its own."""
    from flashcore.ops import decode

    q, k, v, lens, table = make_kvcache(case, torch.float16, device)
    decode.forget()
    check_decode(q, k, v, lens, table, causal=True, num_splits=2)
    assert len(decode._PLANS) == 1
    shorter = torch.clamp(lens - 5, min=0)
    check_decode(q, k.clone(), v.clone(), shorter, table, causal=True, num_splits=2)
    assert len(decode._PLANS) == 1
    for options in ({"num_splits": 1}, {"num_splits": 2, "window": (7, 0)}):
        check_decode(q, k, v, lens, table, causal=True, **options)
    assert len(decode._PLANS) == 3
    if table is None:  # the dense cache as (B, S, Hkv, D) storage: other strides
        k_t, v_t = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
        check_decode(q, k_t, v_t, lens, table, causal=True, num_splits=2)
        assert len(decode._PLANS) == 4


@pytest.mark.parametrize("case", DECODE[:2], ids=["dense", "paged"])
def test_decode_strided_index_tensors(case, device):
    """cache_seqlens as a strided view and a block table stored column-major (same values):
    the same numbers as contiguous ones (the kernel reads length b at base + b and a table row
    as base + j)."""
    q, k, v, lens, table = make_kvcache(case, torch.float16, device)
    wide = torch.full((2 * lens.shape[0],), 10**6, dtype=torch.int32, device=device)
    wide[::2] = lens
    strided = wide[::2]
    assert strided.stride(0) == 2
    odd_table = None if table is None else table.t().contiguous().t()
    if odd_table is not None:
        assert odd_table.stride(1) != 1
    want = flashcore.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table)
    got = flashcore.attention_with_kvcache(q, k, v, cache_seqlens=strided, block_table=odd_table)
    assert torch.equal(want, got)


@pytest.mark.parametrize(("block_size", "mode"), [(16, 3), (32, 3), (48, 1), (64, 2)])
def test_decode_paged_modes(block_size, mode, device, monkeypatch):
    """Pages smaller than the key tile are looked up a key row at a time, by a shift and a mask
    for a power-of-two page (PAGED 3) and a division otherwise (1); a page the tile's size, once
    a tile (2). 64-key tiles here (the interpreter's default is the page's smallest, 16)."""
    from flashcore.ops import decode, fwd

    if device == "cpu":
        monkeypatch.setattr(tuning, "INTERPRETER_DECODE", tuning.DecodeConfig(64, 4, 1))
    case = DecodeCase(2, 4, 2, 2, 150, 32, (150, 61), block_size)
    decode.forget()
    check_decode(*make_kvcache(case, torch.float16, device), causal=True, num_splits=2)
    (plan,) = decode._PLANS.values()
    if device == "cpu" or plan.split_meta["BLOCK_N"] == 64:
        assert plan.split_meta["PAGED"] == mode
    cache = torch.empty(1, 1, block_size, 32)
    assert fwd.paged_mode(cache, cache, 64, int32_offsets=False) == mode


@pytest.mark.parametrize(("block_size", "mode"), [(16, 3), (48, 1), (64, 2)])
def test_decode_table_entries_outside_the_cache(block_size, mode, device, monkeypatch):
    """A block-table entry outside ``[0, num_blocks)`` reads a page of the cache, never memory
    outside it: each key row's lookup (PAGED 1 and 3) and each tile's (2) takes the entry as
    unsigned and clamps it to the last page, so a negative entry and one past the pool read the
    last page. The numbers are the reference's on the table clamped the same way."""
    from flashcore.ops import decode

    if device == "cpu":
        monkeypatch.setattr(tuning, "INTERPRETER_DECODE", tuning.DecodeConfig(64, 4, 1))
    case = DecodeCase(2, 4, 2, 1, 150, 32, (150, 61), block_size)
    q, k, v, lens, table = make_kvcache(case, torch.float16, device)
    last = k.shape[0] - 1
    k[last], v[last] = torch.randn_like(k[last]), torch.randn_like(v[last])
    bad = table.clone()
    # Past the pool: by 1000 pages for the lookups a key row, the largest int32 for a tile's.
    bad[0, 0], bad[1, 0] = -3, last + 1000 if mode != 2 else 2**31 - 1
    clamped = torch.where((bad < 0) | (bad > last), last, bad)
    decode.forget()
    out = flashcore.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=bad)
    (plan,) = decode._PLANS.values()
    if device == "cpu" or plan.split_meta["BLOCK_N"] == 64:
        assert plan.split_meta["PAGED"] == mode
    ref = reference.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=clamped)
    pt = reference.attention_with_kvcache(
        q, k, v, cache_seqlens=lens, block_table=clamped, dtype=q.dtype
    )
    assert_fa_rule("out", out, pt.out, ref.out)


FEATURES = {
    "window-causal": {"window": (20, -1)},
    "window-both-sides": {"window": (9, 4), "causal": False},
    "window-right-only": {"window": (-1, 2), "causal": False},
    "softcap": {"softcap": 2.0, "scale": 1.0},
    "alibi-per-head": {"alibi": (), "causal": False},
    "alibi-per-batch": {"alibi": ("batch",)},
    "all": {"window": (30, 0), "softcap": 5.0, "alibi": ()},
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("case", [DECODE[0], DECODE[1]], ids=["dense", "paged"])
def test_decode_features(case, feature, dtype, device):
    options = dict(FEATURES[feature])
    if "alibi" in options:
        shape = (case.batch, case.heads) if options.pop("alibi") else (case.heads,)
        options["alibi_slopes"] = torch.rand(shape, device=device) * 0.5
    check_decode(*make_kvcache(case, dtype, device), num_splits=2, **options)


# Chunked prefill against the cache: G * Sq rows past one 128-row tile (several row tiles, each a
# run of consecutive queries), sequences shorter than the chunk (rows that see no key), paged and
# dense, GQA.
PREFILL = [
    DecodeCase(2, 4, 2, 70, 160, 32, (150, 40), 16),  # 140 rows: 2 tiles; Sq > L for seq 1
    DecodeCase(2, 3, 1, 50, 96, 16, (96, 73), 0),  # G = 3: tiles cut a query's heads apart
]


@pytest.mark.parametrize(
    "options",
    [{"causal": True, "num_splits": 1}, {"causal": True, "num_splits": 2, "window": (33, 0)},
     {"causal": False, "num_splits": None, "softcap": 3.0}],
    ids=["causal", "window-splits", "full-softcap"],
)  # fmt: skip
@pytest.mark.parametrize("case", PREFILL, ids=[c.id for c in PREFILL])
def test_prefill_against_cache(case, options, device):
    """Any Sq: the last Sq positions of each sequence against its cache, bottom-right causal."""
    check_decode(*make_kvcache(case, torch.float16, device), **options)


@pytest.mark.parametrize(
    "options",
    [{"causal": True}, {"causal": True, "window": (33, 0), "sinks": True},
     {"causal": False, "softcap": 3.0, "alibi": True}],
    ids=["causal", "window-sinks", "full-softcap-alibi"],
)  # fmt: skip
@pytest.mark.parametrize("case", PREFILL, ids=[c.id for c in PREFILL])
def test_prefill_against_cache_packed(case, options, device, monkeypatch):
    """The packed route of a long chunk (``ops.decode.packed_prefill``, taken on an sm_90 GPU
    from ``tuning.KVCACHE_PACKED_MIN_SEQLEN_Q`` queries on; forced here at any length): the same
    results as the decode kernel's semantics, against the reference, for a paged cache and a
    dense one (one page a sequence), with sequences shorter than the chunk."""
    from flashcore.ops import decode

    calls = []
    real = decode.packed_prefill
    monkeypatch.setattr(decode, "KVCACHE_PACKED_MIN_SEQLEN_Q", 1)
    monkeypatch.setattr(decode, "packed_prefill_wanted", lambda *a: True)
    monkeypatch.setattr(
        decode, "packed_prefill", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(case.heads, device=device)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(case.batch, case.heads, device=device) * 0.5
    check_decode(*make_kvcache(case, torch.float16, device), **options)
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_prefill_against_cache_packed_gpu(paged, monkeypatch):
    """On an sm_90 GPU a chunk of 1024 queries runs as a packed batch through the Hopper forward
    (the launch recorded; a dense cache of 6144 keys is one page of whole key tiles)."""
    from helpers import record_sm90_forwards, require_sm90

    require_sm90()
    forwards = record_sm90_forwards(monkeypatch)
    case = DecodeCase(4, 32, 8, 1024, 6144, 128, (6144, 1000, 4321, 999), 256 if paged else 0)
    check_decode(*make_kvcache(case, torch.bfloat16, "cuda"), causal=True)
    assert forwards == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_prefill_against_cache_gpu(paged):
    case = DecodeCase(4, 32, 8, 1000, 6000, 128, (6000, 1000, 4321, 999), 256 if paged else 0)
    check_decode(*make_kvcache(case, torch.bfloat16, "cuda"), causal=True)


def test_decode_strided(device):
    case = DECODE[3]._replace(block_size=0)
    q, k, v, lens, _ = make_kvcache(case, torch.float16, device, layout="bshd")
    assert not q.is_contiguous() and not k.is_contiguous()
    out, _ = check_decode(q, k, v, lens, None, causal=True)
    assert out.is_contiguous()  # as documented, whatever q's layout
    out, _ = check_decode(q.contiguous(), k, v, lens, None, causal=True)
    assert out.is_contiguous()
    # A last dim without unit stride is copied.
    q2 = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert q2.stride(-1) != 1
    check_decode(q2, k, v, lens, None, causal=False, num_splits=2)


def test_decode_rows_without_keys(device):
    # Sq=3 against L=1 (causal): queries 0 and 1 sit before the cache start; L=0 sees nothing.
    case = DecodeCase(2, 2, 1, 3, 32, 16, (1, 0), 16)
    out, lse = check_decode(*make_kvcache(case, torch.float16, device), num_splits=3)
    assert torch.all(out[0, :, :2] == 0) and torch.all(lse[0, :, :2] == float("-inf"))
    assert torch.isfinite(lse[0, :, 2]).all()
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))


def test_decode_default_returns_tensor(device):
    q, k, v, lens, _ = make_kvcache(DECODE[0], torch.float16, device)
    out = flashcore.attention_with_kvcache(q, k, v, cache_seqlens=lens)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


def test_decode_is_inference_only(device):
    q, k, v, lens, _ = make_kvcache(DecodeCase(1, 2, 1, 1, 16, 16, (16,), 0), torch.float32, device)
    q.requires_grad_()
    out = flashcore.attention_with_kvcache(q, k, v, cache_seqlens=lens)
    with pytest.raises(RuntimeError, match="autograd"):
        out.sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("case", DECODE_GPU, ids=[c.id for c in DECODE_GPU])
def test_decode_gpu(case):
    check_decode(*make_kvcache(case, torch.bfloat16, "cuda"), causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, None], ids=["one-split", "auto"])
def test_decode_gpu_fp32_long_sums(num_splits):
    """fp32 decoding over 16384 near-uniform keys with values near 3, in one split too (one
    split's P @ V sum over every key: fp64 since kernels/common.py's pv_start)."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 1, 128, device="cuda") * 0.02
    k_cache = torch.randn(2, 4, 16384, 128, device="cuda")
    v_cache = torch.randn(2, 4, 16384, 128, device="cuda") + 3.0
    lens = torch.tensor([16384, 12000], dtype=torch.int32, device="cuda")
    check_decode(q, k_cache, v_cache, lens, None, causal=False, num_splits=num_splits)


# ---- validation --------------------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    from flashcore.ops import decode

    def boom(*args, **kwargs):
        raise AssertionError("kernel launched despite invalid input")

    monkeypatch.setattr(decode, "launch", boom)


def _args(device, **overrides):
    q, k, v, lens, table = make_kvcache(
        DecodeCase(2, 4, 2, 1, 32, 16, (5, 32), 16), torch.float16, device
    )
    args = {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": lens, "block_table": table}
    args.update(overrides)
    return args


def _call(args):
    args = dict(args)
    q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    return flashcore.attention_with_kvcache(q, k, v, **args)


def _bad(device, name):
    a = _args(device)
    q, k, lens, table = a["q"], a["k_cache"], a["cache_seqlens"], a["block_table"]
    dense = torch.zeros(2, 2, 32, 16, dtype=torch.float16, device=device)
    return {
        "q-rank": ({"q": q[0]}, ValueError, r"^q must have 4 dims"),
        "q-dtype": ({"q": q.double()}, TypeError, r"^q must be float16"),
        "k-not-tensor": ({"k_cache": 1.0}, TypeError, r"^k_cache must be a torch.Tensor"),
        "v-dtype": ({"v_cache": a["v_cache"].float()}, TypeError, r"^v_cache.dtype must equal"),
        "v-shape": ({"v_cache": a["v_cache"][:, :1]}, ValueError, r"same shape"),
        "head-dim": ({"q": q[..., :8]}, ValueError, r"head_dim must equal q's"),
        "v-head-dim": (
            {"v_cache": a["v_cache"].new_zeros(*a["v_cache"].shape[:-1], 300)},
            NotImplementedError,
            r"v_cache.shape\[-1\] = 300",
        ),
        "heads": ({"q": q[:, :3]}, ValueError, r"multiple of k_cache/v_cache's heads"),
        "seqlens-dtype": ({"cache_seqlens": lens.long()}, TypeError, r"^cache_seqlens must be int"),
        "seqlens-shape": ({"cache_seqlens": lens[:1]}, ValueError, r"^cache_seqlens must have"),
        "seqlens-list": ({"cache_seqlens": [5, 32]}, TypeError, r"^cache_seqlens must be a torch"),
        "table-dtype": ({"block_table": table.long()}, TypeError, r"^block_table must be int32"),
        "table-shape": ({"block_table": table[0]}, ValueError, r"^block_table must have shape"),
        "block-size": (
            {"k_cache": k[:, :, :8], "v_cache": a["v_cache"][:, :, :8]},
            ValueError,
            r"block_size .* multiple of 16, got 8",
        ),
        "dense-batch": (
            {"k_cache": dense[:1], "v_cache": dense[:1], "block_table": None},
            ValueError,
            r"k_cache/v_cache batch size must equal q's",
        ),
        "window-type": ({"window": 3}, TypeError, r"^window must be a \(left, right\) tuple"),
        "window-value": ({"window": (-2, 0)}, ValueError, r"^window left must be >= -1"),
        "softcap": ({"softcap": -1.0}, ValueError, r"^softcap must be finite and >= 0"),
        "alibi-dtype": (
            {"alibi_slopes": torch.ones(4, dtype=torch.float16, device=device)},
            TypeError,
            r"^alibi_slopes must be float32",
        ),
        "alibi-shape": (
            {"alibi_slopes": torch.ones(2, device=device)},
            ValueError,
            r"^alibi_slopes must have shape \(heads,\) = \(4,\) or \(batch, heads\) = \(2, 4\)",
        ),
        "splits": ({"num_splits": 0}, ValueError, r"^num_splits must be >= 1"),
        "splits-type": ({"num_splits": 2.0}, TypeError, r"^num_splits must be an int"),
        "causal-type": ({"causal": 1}, TypeError, r"^causal must be a bool"),
        "scale": ({"scale": float("inf")}, ValueError, r"^scale must be finite"),
    }[name]


BAD = [
    "q-rank", "q-dtype", "k-not-tensor", "v-dtype", "v-shape", "head-dim", "heads",
    "seqlens-dtype", "seqlens-shape", "seqlens-list", "table-dtype", "table-shape", "block-size",
    "dense-batch", "v-head-dim", "window-type", "window-value", "softcap", "alibi-dtype",
    "alibi-shape", "splits", "splits-type", "causal-type", "scale",
]  # fmt: skip


@pytest.mark.parametrize("name", BAD)
def test_decode_validation(name, device, no_launch):
    overrides, error, message = _bad(device, name)
    with pytest.raises(error, match=message):
        _call(_args(device, **overrides))


def test_decode_config_and_splits_by_cache():
    """Decided on the host alone (H100: 132 SMs): a long dense cache streams 128-key tiles, a
    short one 64-key tiles unless its splits each stream 2048 keys or more; a dense cache over
    few (batch, kv head) pairs splits over a wave of programs rounded down, over more pairs half
    a wave (long) or a wave rounded up (short); a paged one over three waves (six at head dim
    64), with 4 warps and 2 stages on Triton 3.6, 3 elsewhere (8 warps and 3 stages for a prefill
    chunk's 128-row tile)."""
    long = tuning.decode_config(128, 2, interpreted=False, capacity=32768)
    short = tuning.decode_config(128, 2, interpreted=False, capacity=4096)
    paged = tuning.decode_config(
        128, 2, interpreted=False, paged=True, capacity=32768, triton_version="3.6.0"
    )
    chunk = tuning.decode_config(128, 2, interpreted=False, rows=64, capacity=32768)
    assert (long.block_n, short.block_n, paged.block_n, chunk.block_n) == (128, 64, 64, 64)
    few_splits = tuning.decode_config(128, 2, interpreted=False, capacity=4096, keys_per_split=2048)
    many_splits = tuning.decode_config(128, 2, interpreted=False, capacity=4096, keys_per_split=256)
    assert (few_splits.block_n, many_splits.block_n) == (128, 64)
    assert tuning.decode_config(
        128, 2, interpreted=False, rows=64, capacity=4096, keys_per_split=4096
    ).block_n == 64  # fmt: skip
    # The combine: as few warps as hold its (splits, Dv) tile at 64 fp32 values a thread.
    combine = tuning.decode_combine_warps
    assert (combine(2, 128), combine(16, 128), combine(16, 256), combine(64, 128)) == (1, 1, 2, 4)
    assert paged == tuning.DecodeConfig(64, 4, 2)
    assert tuning.decode_config(
        128, 2, interpreted=False, paged=True, rows=64, triton_version="3.6.0"
    ) == paged  # fmt: skip
    # Elsewhere three stages (Triton 3.8's ptxas spilled 8 bytes with two).
    other = tuning.decode_config(128, 2, interpreted=False, paged=True, triton_version="3.8.0")
    assert other == tuning.DecodeConfig(64, 4, 3)
    wide = tuning.decode_config(128, 2, interpreted=False, paged=True, rows=128)
    assert (wide.num_warps, wide.num_stages) == (8, 3)
    assert tuning.decode_num_splits(64, 32768, 128, 132) == 2
    assert tuning.decode_num_splits(8, 32768, 128, 132) == 16  # 128 programs, not 136
    assert tuning.decode_num_splits(16, 16384, 128, 132) == 8
    assert tuning.decode_num_splits(32, 16384, 128, 132) == 4
    assert tuning.decode_num_splits(8, 4096, 64, 132) == 16
    assert tuning.decode_num_splits(64, 4096, 64, 132) == 2
    assert tuning.decode_num_splits(128, 4096, 64, 132) == 2  # a wave rounded up
    assert tuning.decode_num_splits(128, 32768, 128, 132) == 1  # half a wave
    assert tuning.decode_num_splits(64, 32768, 64, 132, paged=True) == 7
    assert tuning.decode_num_splits(64, 32768, 64, 132, paged=True, head_dim=64) == 14
    assert tuning.decode_num_splits(8, 16384, 64, 132, paged=True, head_dim=64) == 64  # capped
    # Smaller head dims keep 64-key tiles (the 128-key tile spilled at D=64 with Triton 3.9).
    assert tuning.decode_config(64, 2, interpreted=False, capacity=32768).block_n == 64


@pytest.mark.parametrize(
    ("batch", "keys", "splits", "block_n", "combine_warps"),
    [(1, 4096, 16, 64, 1), (8, 4096, 2, 128, 1), (4, 4096, 4, 64, 1), (1, 32768, 16, 128, 1)],
)
def test_decode_plan_tile_by_split(batch, keys, splits, block_n, combine_warps, monkeypatch):
    """A compiled build's plan on a 132-SM GPU (32 query heads on 8 kv heads, D = 128, bf16;
    meta tensors, no GPU): the split count first, then 128-key tiles where each split streams
    2048 keys or more (or the cache is long), and the combine's warps by its tile."""
    from flashcore.ops import decode

    monkeypatch.setattr(decode.runtime, "is_interpreted", lambda: False)
    monkeypatch.setattr(decode, "_sms", lambda device: 132)
    q = torch.empty(batch, 32, 1, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(batch, 8, keys, 128, dtype=torch.bfloat16, device="meta")
    options = (True, 128**-0.5, -1, -1, 0.0, 0, False)
    p = decode._plan(q, k, k, None, None, options)
    assert (p.num_splits, p.split_meta["BLOCK_N"]) == (splits, block_n)
    assert p.combine_meta["num_warps"] == combine_warps


def test_packed_prefill_wanted(monkeypatch):
    """Which long chunks take the packed route (no GPU: the tier stood in): 16-bit inputs on a
    GPU whose forward tier is sm90, against a paged cache or a dense one of whole 128-key tiles;
    never under the interpreter, for fp32, or on the portable tier."""
    from flashcore.ops import decode, runtime

    monkeypatch.setattr(runtime, "is_interpreted", lambda: False)
    monkeypatch.setattr(runtime, "forward_tier", lambda device: "sm90")
    q = torch.empty(2, 8, 512, 64, dtype=torch.bfloat16)
    dense, odd = torch.empty(2, 2, 4096, 64), torch.empty(2, 2, 4000, 64)
    pages, table = torch.empty(9, 2, 48, 64), torch.zeros(2, 4, dtype=torch.int32)
    assert decode.packed_prefill_wanted(q, dense, None)
    assert decode.packed_prefill_wanted(q, pages, table)  # the forward picks its tier for 48
    assert not decode.packed_prefill_wanted(q, odd, None)
    assert not decode.packed_prefill_wanted(q.float(), dense, None)
    monkeypatch.setattr(runtime, "forward_tier", lambda device: "portable")
    assert not decode.packed_prefill_wanted(q, dense, None)
    monkeypatch.setattr(runtime, "forward_tier", lambda device: "sm90")
    monkeypatch.setattr(runtime, "is_interpreted", lambda: True)
    assert not decode.packed_prefill_wanted(q, dense, None)
