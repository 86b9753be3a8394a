"""Attention: weights whatever the kernel, packed (padding-free) rows, caches without a mask, custom 4D masks and
kernels registered with transformers."""
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, TRANSFORMERS, Version

try:  # the attention-kernel registry of transformers >= 4.48
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError:
    ALL_ATTENTION_FUNCTIONS = None
needs_registry = pytest.mark.skipif(ALL_ATTENTION_FUNCTIONS is None, reason="no attention registry before 4.48")


def random_ids(batch, length, seed):
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def register_kernel(name, function):
    """Register an attention function as a user or an inference backend does."""
    registry = type(ALL_ATTENTION_FUNCTIONS)
    if hasattr(registry, "register"):  # AttentionInterface
        registry.register(name, function)
    else:  # 4.48, 4.49: a dict
        ALL_ATTENTION_FUNCTIONS[name] = function


def expand_kv(module, key, value):
    groups = module.num_key_value_groups
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def flash_semantics(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None,
                    max_length_q=None, **kwargs):
    """What transformers' flash kernels compute, in plain torch (no GPU here): causal attention aligned to the end of
    the keys; a 2D mask [batch, keys] drops padded keys; cu_seq_lens (packed rows) split the flattened batch into
    sequences that attend only within themselves. Returns [batch, queries, heads, dim] like the flash kernels."""
    key, value = expand_kv(module, key, value)
    batch, heads, queries, dim = query.shape
    if cu_seq_lens_q is not None:
        assert attention_mask is None and isinstance(max_length_q, int)
        flat = [t.transpose(1, 2).reshape(-1, heads, dim) for t in (query, key, value)]
        out = torch.empty_like(flat[0])
        bounds = cu_seq_lens_q.tolist()
        assert max(b - a for a, b in zip(bounds, bounds[1:])) == max_length_q
        for start, end in zip(bounds, bounds[1:]):
            q, k, v = (t[start:end].transpose(0, 1) for t in flat)
            out[start:end] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling).transpose(0, 1)
        return out.reshape(batch, queries, heads, dim), None
    out = torch.zeros(batch, queries, heads, dim, dtype=query.dtype)
    for row in range(batch):
        keep = attention_mask[row].bool() if attention_mask is not None else torch.ones(key.shape[2], dtype=torch.bool)
        assert attention_mask is None or attention_mask.shape[-1] == key.shape[2]
        k, v = key[row][:, keep], value[row][:, keep]
        allowed = torch.ones(queries, k.shape[1], dtype=torch.bool).tril(k.shape[1] - queries)
        out[row] = F.scaled_dot_product_attention(query[row], k, v, attn_mask=allowed, scale=scaling).transpose(0, 1)
    return out, None


@pytest.fixture(scope="module")
def flash_kernel():
    """A registered kernel whose name starts with "flash": the model hands it what it hands the flash kernels."""
    register_kernel("flash_semantics", flash_semantics)
    return "flash_semantics"


def kernel_under_test(attn, request) -> str:
    """A test's kernel parameter: "flash" stands for the flash_semantics kernel (the registry is needed)."""
    if attn != "flash":
        return attn
    if ALL_ATTENTION_FUNCTIONS is None:
        pytest.skip("no flash kernels before transformers 4.48")
    return request.getfixturevalue("flash_kernel")


def use_kernel(model, name):
    model.config._attn_implementation = name
    return model


# ---------------------------------------------------------------------------------------------------------------------
# output_attentions
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flash"])
def test_output_attentions_returns_the_weights_whatever_the_kernel(tiny_model, attn, request, caplog):
    attn = kernel_under_test(attn, request)
    reference = tiny_model("glm4", attn_implementation="eager")
    model = use_kernel(tiny_model("glm4"), attn)
    ids = random_ids(2, 6, seed=1)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    logging.Logger.warning_once.cache_clear()
    with torch.no_grad(), caplog.at_level(logging.WARNING):
        expected = reference(input_ids=ids, attention_mask=mask, output_attentions=True)
        for _ in range(2):
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        plain = model(input_ids=ids, attention_mask=mask)
    assert len(out.attentions) == model.config.num_layers
    for weights, truth in zip(out.attentions, expected.attentions):
        assert isinstance(weights, torch.Tensor)
        torch.testing.assert_close(weights, truth)
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], plain.logits[real], atol=1e-5, rtol=1e-5)
    notices = [r for r in caplog.records if "output_attentions=True" in r.getMessage()]
    assert len(notices) == (0 if attn == "eager" else 1)


# ---------------------------------------------------------------------------------------------------------------------
# Padding-free packed rows
# ---------------------------------------------------------------------------------------------------------------------


def packed_batch(lengths_per_row, seed):
    """Rows of several sequences each, position_ids restarting at 0 for each sequence (as DataCollatorWithFlattening
    and TRL packing make them); the sequences alone."""
    g = torch.Generator().manual_seed(seed)
    rows = [[torch.randint(3, 256, (n,), generator=g) for n in lengths] for lengths in lengths_per_row]
    ids = torch.stack([torch.cat(row) for row in rows])
    positions = torch.stack([torch.cat([torch.arange(len(s)) for s in row]) for row in rows])
    return ids, positions, rows


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["eager", "sdpa", "flash"])
def test_packed_rows_attend_only_within_each_sequence(tiny_model, family, attn, request):
    attn = kernel_under_test(attn, request)
    model = use_kernel(tiny_model(family), attn)
    ids, positions, rows = packed_batch([[5, 9, 3], [4, 4, 9]], seed=2)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits
        for row, sequences in enumerate(rows):
            start = 0
            for seq in sequences:
                alone = model(input_ids=seq[None]).logits[0]
                torch.testing.assert_close(packed[row, start:start + len(seq)], alone, atol=1e-5, rtol=1e-5)
                start += len(seq)
        # A single packed row, as DataCollatorWithFlattening makes it.
        flat = model(input_ids=ids[:1], position_ids=positions[:1]).logits
    torch.testing.assert_close(flat[0], packed[0], atol=1e-5, rtol=1e-5)


def test_positions_that_do_not_restart_are_one_sequence(tiny_model):
    """Explicit positions that only count up (an offset prompt) are not packing: every token sees the whole row."""
    model = tiny_model("glm4")
    ids = random_ids(1, 8, seed=3)
    with torch.no_grad():
        shifted = model(input_ids=ids, position_ids=torch.arange(8)[None] + 5).logits
        reference = use_kernel(tiny_model("glm4"), "eager")
        reference = reference(input_ids=ids, position_ids=torch.arange(8)[None] + 5).logits
    torch.testing.assert_close(shifted, reference, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Caches: a step without attention_mask
# ---------------------------------------------------------------------------------------------------------------------


def make_cache(model, kind, batch, length):
    from transformers import DynamicCache, StaticCache
    import inspect

    if kind in ("dynamic", "legacy"):
        return None  # the model creates it (legacy: the prefill's cache is handed back as tuples below)
    params = inspect.signature(StaticCache.__init__).parameters
    kwargs = dict(config=model.config, max_cache_len=length)
    for name, value in (("max_batch_size", batch), ("device", "cpu"), ("dtype", torch.float32)):
        if name in params:
            kwargs[name] = value
    return StaticCache(**kwargs)


def without_enable_gqa(monkeypatch, chatglm):
    """torch 2.4 as the model sees it: scaled_dot_product_attention without `enable_gqa` (torch 2.5 added it)."""
    sdpa = F.scaled_dot_product_attention

    def torch_2_4_sdpa(*args, **kwargs):
        if "enable_gqa" in kwargs:
            raise TypeError("scaled_dot_product_attention() got an unexpected keyword argument 'enable_gqa'")
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", torch_2_4_sdpa)
    monkeypatch.setattr(chatglm.modeling, "_SDPA_HAS_GQA", False, raising=False)


@pytest.mark.parametrize("query_length", [7, 1], ids=["prompt", "decode"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_grouped_sdpa_on_torch_2_4_equals_attention_over_expanded_groups(chatglm, monkeypatch, query_length,
                                                                          with_mask):
    """The grouped sdpa kernel on a torch without `enable_gqa` (2.4, GLM-4's floor, raised a TypeError on every
    unmasked prompt) gives what attention over the key/value groups expanded to every head gives."""
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, groups, keys, dim = 2, 2, 4, 7, 16
    module = SimpleNamespace(num_key_value_groups=groups)
    query = torch.randn(batch, kv_heads * groups, query_length, dim, generator=generator)
    key, value = (torch.randn(batch, kv_heads, keys, dim, generator=generator) for _ in range(2))
    allowed = torch.ones(batch, 1, query_length, keys, dtype=torch.bool).tril(keys - query_length)
    allowed[1, ..., :2] = False  # the second row's first two keys are padding
    allowed |= ~allowed.any(dim=-1, keepdim=True)  # its padding queries see every key, as the model's masks have it
    expected = F.scaled_dot_product_attention(query, *expand_kv(module, key, value),
                                              attn_mask=allowed if with_mask else allowed[:1]).transpose(1, 2)
    without_enable_gqa(monkeypatch, chatglm)
    out, _ = chatglm.modeling.sdpa_grouped_attention_forward(module, query, key, value,
                                                              allowed if with_mask else None)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


CACHE_KINDS = ["dynamic", "static"] + (["legacy"] if TRANSFORMERS < Version("5.0") else [])


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_cached_steps_equal_the_full_forward_with_or_without_a_mask(tiny_model, kind, with_mask, attn):
    model = tiny_model("glm4", attn_implementation=attn)
    ids = random_ids(2, 10, seed=4)
    mask = (lambda n: {"attention_mask": torch.ones(2, n, dtype=torch.long)}) if with_mask else (lambda n: {})
    with torch.no_grad():
        full = model(input_ids=ids).logits
        cache = make_cache(model, kind, 2, 16)
        out = model(input_ids=ids[:, :6], past_key_values=cache, use_cache=True, **mask(6))
        cache = out.past_key_values.to_legacy_cache() if kind == "legacy" else out.past_key_values
        steps = [out.logits]
        for t in range(6, 10):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True, **mask(t + 1))
            cache = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@needs_registry
@pytest.mark.parametrize("with_mask", [False, True])
def test_static_cache_step_hands_flash_kernels_the_written_slots_only(tiny_model, flash_kernel, with_mask):
    model = use_kernel(tiny_model("chatglm3"), flash_kernel)
    ids = random_ids(2, 8, seed=5)
    mask = (lambda n: {"attention_mask": torch.ones(2, n, dtype=torch.long)}) if with_mask else (lambda n: {})
    with torch.no_grad():
        full = model(input_ids=ids).logits
        cache = make_cache(model, "static", 2, 12)
        first = model(input_ids=ids[:, :7], past_key_values=cache, use_cache=True, **mask(7))
        step = model(input_ids=ids[:, 7:], past_key_values=first.past_key_values, use_cache=True, **mask(8))
    torch.testing.assert_close(torch.cat([first.logits, step.logits], 1), full, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Custom 4D masks and registered kernels (the model declares _supports_attention_backend)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("mask_kind", ["float", "bool"])
def test_custom_4d_mask_shares_a_prefix_between_three_continuations(tiny_model, attn, mask_kind):
    """transformers' common custom-4D-mask check: three sequences sharing a 3-token prefix run as one row, each
    continuation attending to the prefix and itself only, at the position it has alone."""
    model = tiny_model("glm4", attn_implementation=attn)
    prefix, ends = [10, 11, 12], [13, 14, 15]
    allowed = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                            [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 0, 1]]).bool()[None, None]
    mask = allowed if mask_kind == "bool" else (~allowed).float() * torch.finfo(torch.float32).min
    with torch.no_grad():
        separate = model(input_ids=torch.tensor([prefix + [e] for e in ends])).logits[:, -1]
        shared = model(input_ids=torch.tensor([prefix + ends]), attention_mask=mask,
                       position_ids=torch.tensor([[0, 1, 2, 3, 3, 3]])).logits[0, -3:]
    torch.testing.assert_close(shared, separate, atol=1e-5, rtol=1e-5)


@needs_registry
def test_registered_kernel_runs_in_every_layer_with_the_forward_keyword_arguments(tiny_model, chatglm):
    """An inference backend registers its kernel and passes its own arguments through forward() (vLLM's
    attention_instances, say); the kernel must get them in every layer, with the layer's index and a mask."""
    seen = []

    def recording_kernel(module, query, key, value, attention_mask, **kwargs):
        seen.append((module.layer_idx, kwargs.get("backend_state"), attention_mask is not None))
        return chatglm.modeling.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    register_kernel("recording", recording_kernel)
    model_class = chatglm.modeling.ChatGLMForConditionalGeneration
    assert model_class._supports_attention_backend
    if hasattr(model_class, "is_backend_compatible"):  # what inference backends ask (>= 4.50)
        assert model_class.is_backend_compatible()
    reference = tiny_model("chatglm3", attn_implementation="eager")
    model = use_kernel(tiny_model("chatglm3"), "recording")
    ids = random_ids(2, 7, seed=6)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, backend_state="state")
        expected = reference(input_ids=ids, attention_mask=mask)
    assert seen == [(layer, "state", True) for layer in range(model.config.num_layers)]
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], expected.logits[real], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(ALL_ATTENTION_FUNCTIONS is not None, reason="transformers >= 4.48 has the registry")
def test_unknown_kernel_before_the_registry_names_the_version(tiny_model):
    model = use_kernel(tiny_model("glm4"), "flash_attention_2")
    with pytest.raises(ValueError, match="4.48"):
        model(input_ids=random_ids(1, 4, seed=7))
