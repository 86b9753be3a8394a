"""Numbers: the original code's golden outputs, transformers' own GlmForCausalLM, and a plain reference forward."""
import pytest
import torch
from conftest import TRANSFORMERS, Version
from chatglm_tools.native_glm import glm_reads_rope_scaling, native_glm
from reference_glm import reference_logits

# FORMAT.md: the original reproduces itself bit for bit; thread count and SDPA vs eager move logits by ~2e-5.
LOGITS_ATOL = 1e-4
LOSS_ATOL = 1e-5


def relative_max_error(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def assert_logits_close(actual, expected):
    assert relative_max_error(actual, expected) < 1e-5
    torch.testing.assert_close(actual, expected, atol=LOGITS_ATOL, rtol=1e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_single_sequences_match_golden(golden, attn):
    model = golden.load(attn_implementation=attn)
    e = golden.expected
    with torch.no_grad():
        for i in range(3):
            ids, labels = e[f"seq_{i}_input_ids"][None], e[f"seq_{i}_labels"][None]
            out = model(input_ids=ids, labels=labels, use_cache=False)
            assert_logits_close(out.logits[0], e[f"seq_{i}_logits"])
            assert out.loss.dtype == torch.float32
            torch.testing.assert_close(out.loss, e[f"seq_{i}_loss"], atol=LOSS_ATOL, rtol=0)


def assert_padded_batch_matches_golden(model, e):
    """The golden left-padded batch with its position_ids and labels: logits of the real tokens and the loss."""
    real = e["attention_mask"].bool()
    with torch.no_grad():
        out = model(input_ids=e["input_ids"], attention_mask=e["attention_mask"], position_ids=e["position_ids"],
                    labels=e["labels"], use_cache=False)
    assert_logits_close(out.logits[real], e["batch_logits"][real])
    torch.testing.assert_close(out.loss, e["batch_loss"], atol=LOSS_ATOL, rtol=0)


def test_padded_batch_matches_golden(golden, golden_model):
    e = golden.expected
    real = e["attention_mask"].bool()
    assert_padded_batch_matches_golden(golden_model, e)
    with torch.no_grad():
        # Without position_ids they come from the mask: the same numbers, padding or not.
        out = golden_model(input_ids=e["input_ids"], attention_mask=e["attention_mask"], use_cache=False)
        assert_logits_close(out.logits[real], e["batch_logits"][real])
        assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("explicit_positions", [True, False], ids=["position_ids", "no_position_ids"])
def test_cached_step_matches_golden(golden, golden_model, explicit_positions):
    """The original put the new token at position 0 when position_ids were not given; we count from the cache."""
    e = golden.expected
    with torch.no_grad():
        for i in range(3):
            seq = e[f"seq_{i}_input_ids"][None]
            n = seq.shape[1]
            prefill = golden_model(input_ids=seq[:, : n - 1], use_cache=True)
            kwargs = {"position_ids": torch.tensor([[n - 1]])} if explicit_positions else {}
            step = golden_model(input_ids=seq[:, n - 1:], past_key_values=prefill.past_key_values, use_cache=True,
                                **kwargs)
            assert_logits_close(step.logits[0, -1], e[f"seq_{i}_incr_logits"])


def test_greedy_generation_matches_golden(golden, golden_model):
    e = golden.expected
    gen_kwargs = golden.gen_kwargs
    with torch.no_grad():
        for i in range(3):
            seq = e[f"seq_{i}_input_ids"][None]
            out = golden_model.generate(input_ids=seq, attention_mask=torch.ones_like(seq),
                                        position_ids=torch.arange(seq.shape[1])[None], **gen_kwargs)
            assert out.sequences[0, seq.shape[1]:].tolist() == e[f"seq_{i}_gen_tokens"].tolist()
            assert_logits_close(torch.stack(out.logits, 1)[0], e[f"seq_{i}_gen_logits"])
            plain = golden_model.generate(input_ids=seq, **gen_kwargs)  # no mask, no positions
            assert plain.sequences[0, seq.shape[1]:].tolist() == e[f"seq_{i}_gen_tokens"].tolist()


def test_padded_batch_generation_matches_golden(golden, golden_model):
    e = golden.expected
    with torch.no_grad():
        for kwargs in ({"position_ids": e["position_ids"]}, {}):
            out = golden_model.generate(input_ids=e["input_ids"], attention_mask=e["attention_mask"],
                                        **kwargs, **golden.gen_kwargs)
            assert out.sequences[:, e["input_ids"].shape[1]:].tolist() == e["batch_gen_tokens"].tolist()
            assert_logits_close(torch.stack(out.logits, 1), e["batch_gen_logits"])


# --- transformers' own GlmForCausalLM --------------------------------------------------------------------------------

needs_native_glm = pytest.mark.skipif(TRANSFORMERS < Version("4.46"), reason="GlmForCausalLM arrived in 4.46")


@needs_native_glm
def test_golden_checkpoint_matches_native_glm(golden, golden_model):
    """chatglm2-6b-32k divides the positions by rope_ratio: Glm's linear RoPE scaling, which Glm reads from 4.48 on
    (before, the conversion refuses rather than give other logits)."""
    if golden.cases.get("variant") == "chatglm2-6b-32k" and not glm_reads_rope_scaling():
        with pytest.raises(ValueError, match="ignores rope_scaling"):
            native_glm(golden_model)
        return
    native = native_glm(golden_model)
    ids = golden.expected["seq_2_input_ids"][None]
    with torch.no_grad():
        ours, theirs = golden_model(input_ids=ids, use_cache=False).logits, native(input_ids=ids).logits
    assert relative_max_error(ours, theirs) < 1e-5


@needs_native_glm
@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_native_glm_parity_and_rope_ratio_sensitivity(tiny_model, family):
    """Parity with GlmForCausalLM, and proof that it is sensitive: a converter that forgets rope_ratio (base 10000
    instead of 10000 * rope_ratio) is far off."""
    model = tiny_model(family, rope_ratio=500)
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(input_ids=ids, use_cache=False).logits
        right = native_glm(model)(input_ids=ids).logits
        forgot_rope_ratio = native_glm(model, rope_theta=10000)(input_ids=ids).logits
    assert relative_max_error(ours, right) < 1e-5
    assert (ours - forgot_rope_ratio).abs().max() > 100 * LOGITS_ATOL


@needs_native_glm
def test_native_glm_greedy_generation_identical(tiny_model):
    model = tiny_model("glm4")
    native = native_glm(model)
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    kwargs = dict(do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        assert model.generate(ids, **kwargs).tolist() == native.generate(ids, **kwargs).tolist()


# --- every config flag against a plain reference forward -------------------------------------------------------------

FLAG_CASES = {
    "defaults": {},
    "full_multi_head": {"multi_query_attention": False},
    "layernorm": {"rmsnorm": False},
    "linear_biases": {"add_bias_linear": True},
    "no_qkv_bias": {"add_qkv_bias": False},
    "no_post_layer_norm": {"post_layer_norm": False},
    "residual_after_layernorm": {"apply_residual_connection_post_layernorm": True},
    "no_layer_scaling_no_fp32_softmax": {"apply_query_key_layer_scaling": False, "attention_softmax_in_fp32": False},
    "rope_ratio": {"rope_ratio": 50},
    "fp32_residual": {"fp32_residual_connection": True},
    "one_group": {"multi_query_group_num": 1},
}


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
@pytest.mark.parametrize("flags", list(FLAG_CASES), ids=list(FLAG_CASES))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_config_flags_match_reference(tiny_model, family, flags, attn):
    model = tiny_model(family, attn_implementation=attn, **FLAG_CASES[flags])
    ids = torch.randint(3, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(input_ids=ids, use_cache=False).logits
    expected = reference_logits(model.state_dict(), model.config, ids)
    assert relative_max_error(ours, expected) < 1e-5


def test_fp32_residual_connection_keeps_the_residual_stream_fp32_in_bf16(tiny_model):
    """In half precision the flag matters (the original crashed with it): the stream between blocks stays fp32,
    each sublayer computes in bf16, and the logits land closer to the fp32 model's than without the flag."""
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        reference = tiny_model("glm4")(input_ids=ids).logits
        errors = {}
        for flag in (False, True):
            model = tiny_model("glm4", fp32_residual_connection=flag).to(torch.bfloat16)
            out = model(input_ids=ids, output_hidden_states=True)
            assert out.logits.dtype == torch.bfloat16
            assert {h.dtype for h in out.hidden_states[1:-1]} == {torch.float32 if flag else torch.bfloat16}
            errors[flag] = (out.logits.float() - reference).abs().mean().item()
    assert errors[True] < errors[False]


# ---- the pieces a decode step runs in fewer operators (issue 38), against the original's formulas in every dtype ----

def original_rms_norm(weight, x, eps):
    """chatglm2/3 and GLM-4's RMSNorm: variance in fp32, x times its rsqrt, times the weight, cast back once."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (weight * (x * torch.rsqrt(variance + eps))).to(x.dtype)


def original_rotary(x, positions, rotary_dim, base=10000.0):
    """The original's apply_rotary_pos_emb on x [batch, heads, seq, head_dim]: the first rotary_dim channels as
    interleaved pairs, its cos/sin cache cast to x's dtype, products and sums in x's dtype."""
    theta = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = positions.float()[:, None] * theta
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x0, x1 = x_rot[..., 0::2], x_rot[..., 1::2]
    turned = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)
    return torch.cat((turned, x_pass), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_and_rotary_give_the_originals_numbers(tiny_model, dtype):
    import sys

    model = tiny_model("glm4").to(dtype)
    modeling = sys.modules[type(model).__module__]
    generator = torch.Generator().manual_seed(3)
    norm = model.transformer.encoder.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=generator) + 0.5)
        x = (torch.randn(2, 7, norm.weight.shape[0], generator=generator) * 3).to(dtype)
        expected = original_rms_norm(norm.weight, x, norm.eps)
        # fp32: torch's rms_norm sums in its own order; a half type: at most one rounding step apart
        tolerance = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else {}
        torch.testing.assert_close(norm(x), expected, **tolerance)
        if dtype != torch.float32 and modeling.rms_norm_rounds_once(x.device, dtype):  # then in one call, bit for bit
            assert torch.equal(norm(x), expected)

        rotary = model.transformer.rotary_pos_emb
        head_dim = model.config.kv_channels
        positions = torch.tensor([[0, 1, 5, 17, 300, 4095]])
        cos, sin = rotary.cos_sin(positions, dtype)
        q = torch.randn(1, 3, positions.shape[1], head_dim, generator=generator).to(dtype)
        expected = original_rotary(q, positions[0], head_dim // 2, rotary.base)  # GLM-4: 10000 * rope_ratio
        assert torch.equal(modeling.apply_rotary(q, cos, sin), expected)
