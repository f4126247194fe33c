"""flashcore.integrations.transformers on real transformers model classes (tiny random configs).

For each model: logits and one training step's gradients on a left-padded batch against the
model's own attention (``sdpa``, or ``eager`` where the class has no SDPA path) under
FlashAttention's rule (``tests/numerics.py``: ours vs the float64 run of their attention, bound
by twice their own error), and greedy ``generate`` with the KV cache giving identical tokens.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashcore  # noqa: E402
from flashcore.integrations import transformers as fc_hf  # noqa: E402
from numerics import assert_fa_rule  # noqa: E402

NAME = fc_hf.register()
REFERENCE64 = "reference64"


def reference64_attention(module, query, key, value, attention_mask, scaling=None, softcap=None,
                          s_aux=None, dropout=0.0, **kwargs):  # fmt: skip
    """The textbook attention in the inputs' dtype throughout (float64 here), on transformers'
    own boolean mask: the truth the float32 runs are measured against. (transformers' ``eager``
    takes the softmax in float32 even for float64 inputs.)"""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = query @ key.transpose(2, 3) * (scaling or query.shape[-1] ** -0.5)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    if s_aux is not None:
        sinks = s_aux.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat((scores, sinks), dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows that see no key: 0
    if s_aux is not None:
        probs = probs[..., :-1]
    return (probs @ value).transpose(1, 2), None


def reference64_mask(*args, **kwargs):
    """transformers' own boolean mask, always materialised."""
    kwargs["allow_is_causal_skip"] = False
    return transformers.masking_utils.sdpa_mask(*args, **kwargs)


transformers.AttentionInterface.register(REFERENCE64, reference64_attention)
transformers.AttentionMaskInterface.register(REFERENCE64, reference64_mask)
HAS_SINKS = "sinks" in inspect.signature(flashcore.attention).parameters

# Sharp attention (initializer_range 0.2) so that masks, windows and caps change the logits.
COMMON = dict(
    vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
WINDOW = 5


@dataclasses.dataclass(frozen=True)
class Case:
    config: str
    model: str
    reference: str  # transformers' own attention to compare with
    options: dict


CASES = {
    "llama": Case("LlamaConfig", "LlamaForCausalLM", "sdpa", {}),
    "qwen2_sliding": Case(
        "Qwen2Config", "Qwen2ForCausalLM", "sdpa",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "mistral_sliding": Case("MistralConfig", "MistralForCausalLM", "sdpa",
                            {"sliding_window": WINDOW}),
    "gemma2_softcap_sliding": Case(
        "Gemma2Config", "Gemma2ForCausalLM", "eager",
        {"sliding_window": WINDOW, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 30.0,
         "query_pre_attn_scalar": 8, "hidden_activation": "gelu_pytorch_tanh"},
    ),
    "gpt_oss_sinks_sliding": Case(
        "GptOssConfig", "GptOssForCausalLM", "eager",
        {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2,
         "layer_types": ["sliding_attention", "full_attention"],
         # grouped_mm (the default experts kernel) has no float64
         "experts_implementation": "eager",
         # YaRN's factor 32 over a 4096-token original context: a consistent maximum
         "max_position_embeddings": 131072},
    ),
}  # fmt: skip


def build(case: Case, **extra) -> torch.nn.Module:
    config = getattr(transformers, case.config)(**{**COMMON, **case.options, **extra})
    model = getattr(transformers, case.model)(config)
    return model.float().eval()


def skip_without_sinks(name: str) -> None:
    if "sinks" in name and not HAS_SINKS:
        pytest.skip("gpt-oss needs attention sinks: flashcore.attention has no sinks= argument yet")


def batch(device: str, lengths=(14, 20), seqlen: int = 20):
    """Left-padded token ids, their 0/1 mask and labels (-100 on padding); by default a padded
    row, then a full one."""
    ids = torch.randint(3, COMMON["vocab_size"], (len(lengths), seqlen), device=device)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, seqlen - length :] = 1
    ids = ids.masked_fill(mask == 0, COMMON["pad_token_id"])
    return ids, mask, ids.masked_fill(mask == 0, -100)


def train_step(model, impl: str, ids, mask, labels):
    """Logits and parameter gradients of one forward/backward with attention ``impl``."""
    model.set_attn_implementation(impl)
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    model.eval()
    return out.logits.detach(), grads


def check_against_reference(
    case: Case, device: str, dtype: torch.dtype, autocast: torch.dtype | None = None
) -> None:
    """One training step through FlashCore and through transformers' own attention, in
    ``dtype`` (and under ``torch.autocast(dtype=autocast)`` where given), against float64."""
    model = build(case).to(device)
    ids, mask, labels = batch(device)
    model64 = copy.deepcopy(model).double()
    logits64, grads64 = train_step(model64, REFERENCE64, ids, mask, labels)
    model = model.to(dtype)
    amp = torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()
    with amp:
        theirs, their_grads = train_step(model, case.reference, ids, mask, labels)
        ours, our_grads = train_step(model, NAME, ids, mask, labels)
    valid = mask.bool()
    assert_fa_rule("logits", ours[valid], theirs[valid], logits64[valid])
    for name, ref in grads64.items():
        assert our_grads[name] is not None, f"{name}: no gradient through FlashCore"
        assert_fa_rule(f"grad {name}", our_grads[name], their_grads[name], ref)


def check_generate(case: Case, device: str, ids, mask, **generate_options) -> None:
    """Greedy tokens identical to theirs, and the logits of every step under the rule."""
    model = build(case).to(device)
    runs = {}
    for impl, run_model in ((REFERENCE64, copy.deepcopy(model).double()), (case.reference, model),
                            (NAME, model)):  # fmt: skip
        run_model.set_attn_implementation(impl)
        runs[impl] = run_model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
            pad_token_id=COMMON["pad_token_id"], output_logits=True, return_dict_in_generate=True,
            **generate_options,
        )  # fmt: skip
    ours, theirs, ref64 = runs[NAME], runs[case.reference], runs[REFERENCE64]
    assert torch.equal(ours.sequences, theirs.sequences), (
        f"greedy tokens differ:\n{ours.sequences.tolist()}\n{theirs.sequences.tolist()}"
    )
    assert torch.equal(theirs.sequences, ref64.sequences), "float64 tokens differ (a near tie)"
    for step, logits in enumerate(ours.logits):
        assert_fa_rule(f"step {step} logits", logits, theirs.logits[step], ref64.logits[step])


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_gradients(name, device):
    skip_without_sinks(name)
    check_against_reference(CASES[name], device, torch.float32)


def test_autocast_training_step(device):
    """An fp32 Llama under ``torch.autocast(dtype=torch.bfloat16)`` (how ``Trainer(bf16=True)``
    trains): its rotary embedding hands attention q and k in fp32 and v in bf16, which SDPA's
    autocast casts alike; FlashCore's entry points take them so too (tests/test_autocast.py)."""
    check_against_reference(CASES["llama"], device, torch.float32, autocast=torch.bfloat16)


def test_per_sample_gradients(device):
    """Per-sample gradients of a Llama's parameters by ``torch.func`` (``functional_call``, then
    ``vmap(grad(loss))`` over the samples): FlashCore folds the samples into one batch
    (tests/test_transforms.py); against the model's own attention and float64."""
    model = build(CASES["llama"]).to(device)
    ids = batch(device, lengths=(12, 12, 12), seqlen=12)[0].unsqueeze(1)  # 3 samples of 1 row
    grads = {}
    for impl, run_model in ((REFERENCE64, copy.deepcopy(model).double()), ("sdpa", model),
                            (NAME, model)):  # fmt: skip
        run_model.set_attn_implementation(impl)
        params = {n: p.detach() for n, p in run_model.named_parameters()}

        def loss(params, ids, run_model=run_model):
            kwargs = {"labels": ids, "use_cache": False}
            return torch.func.functional_call(run_model, params, (ids,), kwargs).loss

        grads[impl] = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, ids)
    for name, ref in grads[REFERENCE64].items():
        assert ref.shape[0] == 3
        assert_fa_rule(f"grad {name}", grads[NAME][name], grads["sdpa"][name], ref)


@pytest.mark.parametrize("name", list(CASES))
def test_generate_left_padded(name, device):
    skip_without_sinks(name)
    ids, mask, _ = batch(device, lengths=(9, 6), seqlen=9)
    check_generate(CASES[name], device, ids, mask)


def test_generate_unpadded_decodes_from_cache(device):
    # No padding: prefill through flashcore.attention, each new token through
    # flashcore.attention_with_kvcache (one query against the cache).
    ids, mask, _ = batch(device, lengths=(9, 9), seqlen=9)
    check_generate(CASES["mistral_sliding"], device, ids, mask)


def test_generate_static_cache(device):
    # A static cache: the queries sit before unused cache slots (a tensor q_offset).
    ids, mask, _ = batch(device, lengths=(7, 4), seqlen=7)
    check_generate(CASES["llama"], device, ids, mask, cache_implementation="static")


def test_generate_static_cache_unpadded_decodes_from_cache(device, monkeypatch):
    # A static cache of an unpadded batch: the decoding steps read each row's valid prefix of
    # the cache through flashcore.attention_with_kvcache (split-KV), not through varlen.
    import functools

    calls = {"kvcache": 0, "varlen": 0}

    def counted(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(flashcore, "attention_with_kvcache",
                        counted("kvcache", flashcore.attention_with_kvcache))  # fmt: skip
    monkeypatch.setattr(
        flashcore, "attention_varlen", counted("varlen", flashcore.attention_varlen)
    )
    ids, mask, _ = batch(device, lengths=(7, 7), seqlen=7)
    check_generate(CASES["llama"], device, ids, mask, cache_implementation="static")
    assert calls["kvcache"] > 0 and calls["varlen"] == 0, calls


def test_mask_prefix():
    # PaddingMask.prefix: valid keys from 0 to where the queries end (the decoding kernels' case).
    ones = torch.ones(2, 10, dtype=torch.long)
    static = fc_hf.mask_forward(2, 1, 16, q_offset=torch.tensor(9), attention_mask=ones)
    assert static.prefix and static.bounds[1].tolist() == [10, 10]
    left = ones.clone()
    left[1, :3] = 0
    assert not fc_hf.mask_forward(2, 1, 16, q_offset=torch.tensor(9), attention_mask=left).prefix
    short = ones.clone()
    short[1, 8:] = 0  # right padding: row 1's queries are past its valid keys
    assert not fc_hf.mask_forward(2, 1, 16, q_offset=9, attention_mask=short).prefix
    no_mask = fc_hf.mask_forward(2, 1, 16, q_offset=torch.tensor(9))
    assert no_mask.prefix and no_mask.bounds[1].tolist() == [10, 10]
    assert no_mask.bounds[1].is_contiguous()

    class Config:
        sliding_window = 4

    sliding = fc_hf.mask_forward(2, 1, 16, q_offset=torch.tensor(9), local_size=4, config=Config())
    assert sliding.sliding_window == 4 and not sliding.prefix


def test_packed_sequences_with_flash_kwargs(device):
    # DataCollatorWithFlattening's FlashAttention options: one row, sequences back to back.
    model = build(CASES["qwen2_sliding"]).to(device)
    lengths = (7, 9, 4)
    ids = torch.randint(3, COMMON["vocab_size"], (1, sum(lengths)), device=device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    cu = torch.tensor([0, 7, 16, 20], dtype=torch.int32, device=device)
    model.set_attn_implementation(NAME)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=9, max_length_k=9).logits  # fmt: skip
        model.set_attn_implementation(CASES["qwen2_sliding"].reference)
        model64 = copy.deepcopy(model).double()
        model64.set_attn_implementation(REFERENCE64)
        for b, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
            alone = model(input_ids=ids[:, lo:hi]).logits
            alone64 = model64(input_ids=ids[:, lo:hi]).logits
            assert_fa_rule(f"sequence {b}", packed[:, lo:hi], alone, alone64)


# Errors: what FlashCore cannot honour is refused, never computed differently.


def test_dropout_in_training_raises(device):
    model = build(CASES["llama"], attention_dropout=0.1).to(device)
    model.set_attn_implementation(NAME)
    ids, mask, _ = batch(device, lengths=(5, 5), seqlen=5)
    model.eval()
    model(input_ids=ids, attention_mask=mask)  # eval: no dropout, fine
    model.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        model(input_ids=ids, attention_mask=mask)


def test_4d_mask_raises(device):
    model = build(CASES["llama"]).to(device)
    model.set_attn_implementation(NAME)
    ids, _, _ = batch(device, lengths=(5, 5), seqlen=5)
    custom = torch.zeros(2, 1, 5, 5).masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
    custom = custom.to(device)
    with pytest.raises(NotImplementedError, match="attention_mask"):
        model(input_ids=ids, attention_mask=custom)


def test_mask_with_holes_raises(device):
    model = build(CASES["llama"]).to(device)
    model.set_attn_implementation(NAME)
    ids, mask, _ = batch(device, lengths=(6, 6), seqlen=6)
    mask[0, 2] = 0
    with pytest.raises(NotImplementedError, match="holes"):
        model(input_ids=ids, attention_mask=mask)


def test_packed_position_ids_without_flash_kwargs_raises(device):
    model = build(CASES["llama"]).to(device)
    model.set_attn_implementation(NAME)
    ids = torch.randint(3, COMMON["vocab_size"], (1, 8), device=device)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]], device=device)
    with pytest.raises(NotImplementedError, match="packed sequences"):
        model(input_ids=ids, position_ids=positions, use_cache=False)


def test_unsupported_options_raise():
    q = torch.randn(1, 4, 3, 8)
    k = v = torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="output_attentions"):
        fc_hf.attention_forward(module, q, k, v, None, output_attentions=True)
    with pytest.raises(NotImplementedError, match="position_bias"):
        fc_hf.attention_forward(module, q, k, v, None, position_bias=torch.zeros(1, 4, 3, 3))
    with pytest.raises(NotImplementedError, match="dropout"):
        fc_hf.attention_forward(module, q, k, v, None, dropout=0.1)
    module.is_causal = False
    with pytest.raises(NotImplementedError, match="sliding_window"):
        fc_hf.attention_forward(module, q, k, v, None, sliding_window=2)


def test_sinks_without_flashcore_support_raise(monkeypatch):
    monkeypatch.setattr(fc_hf, "_takes_sinks", lambda fn: False)
    q = torch.randn(1, 4, 3, 8)
    k = v = torch.randn(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match="s_aux"):
        fc_hf.attention_forward(torch.nn.Module(), q, k, v, None, s_aux=torch.zeros(4))


@pytest.mark.skipif(HAS_SINKS, reason="flashcore.attention has sinks: gpt-oss runs above")
def test_gpt_oss_without_sinks_raises(device):
    model = build(CASES["gpt_oss_sinks_sliding"]).to(device)
    model.set_attn_implementation(NAME)
    ids, mask, _ = batch(device, lengths=(5, 4), seqlen=5)
    with pytest.raises(NotImplementedError, match="s_aux"):
        model(input_ids=ids, attention_mask=mask)


def test_register_refuses_special_cased_names():
    assert fc_hf.register() == NAME == "fcore"
    for name in ("flashcore", "my_sdpa", "flex_attention", "org/repo", "paged|x", "eager"):
        with pytest.raises(ValueError, match="special-case"):
            fc_hf.register(name)


def test_import_flashcore_does_not_import_transformers():
    code = (
        "import sys, flashcore, flashcore.integrations; "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# GPU: the same checks with compiled kernels, fp32 and bf16 (tokens compared in fp32 only).


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_logits_and_gradients(name, dtype):
    skip_without_sinks(name)
    check_against_reference(CASES[name], "cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_generate(name):
    skip_without_sinks(name)
    ids, mask, _ = batch("cuda", lengths=(9, 6), seqlen=9)
    check_generate(CASES[name], "cuda", ids, mask)
