"""P-tuning v2 prefixes (`pre_seq_len`, `transformer.prefix_encoder`): the original's numbers from both checkpoint
layouts, the prefix in the Cache (dynamic and static caches, left padding, split devices), training, bad prefix files,
and PEFT prefix tuning on the same Cache path."""
import json
import shutil

from chatglm_tools import device_check
import pytest
import torch
import transformers
from conftest import FAMILIES, REPO, TINY_SIZES, dtype_kwarg, load_causal_lm, save_checkpoint, shared_path
from original_code import original_configuration_source
from reference_glm import reference_logits
from safetensors import safe_open
from safetensors.torch import load_file
from test_parity import LOSS_ATOL, assert_logits_close, assert_padded_batch_matches_golden, relative_max_error
from virtual_devices import virtual_devices

PREFIX = "transformer.prefix_encoder."
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def load_classic(case, attn="eager"):
    """The original README's recipe: the base checkpoint with pre_seq_len added to its config, then the prefix-only
    file into `transformer.prefix_encoder`. Loading warns that the prefix is random until then."""
    prefix = case.cases["prefix"]
    config = transformers.AutoConfig.from_pretrained(case.base_folder, trust_remote_code=True,
                                                     pre_seq_len=prefix["pre_seq_len"],
                                                     prefix_projection=prefix["prefix_projection"])
    with pytest.warns(UserWarning, match="prefix of pre_seq_len=.* is random"):
        model = transformers.AutoModel.from_pretrained(case.base_folder, config=config, trust_remote_code=True,
                                                       attn_implementation=attn, **dtype_kwarg(torch.float32))
    state = load_file(str(case.prefix_only / "model.safetensors"))
    model.transformer.prefix_encoder.load_state_dict(
        {name[len(PREFIX):]: tensor for name, tensor in state.items() if name.startswith(PREFIX)})
    return model.eval()


@pytest.fixture(scope="module", params=["checkpoint", "classic"])
def layout_model(request, ptuning):
    """The P-tuning golden model from each layout (eager attention, as the goldens were made)."""
    return ptuning.load() if request.param == "checkpoint" else load_classic(ptuning)


def seqs(case):
    return [case.expected[f"seq_{i}_input_ids"][None] for i in range(len(case.cases["inputs"]["seq_lengths"]))]


# --- loading ---------------------------------------------------------------------------------------------------------


def test_checkpoint_loads_with_original_keys_and_only_the_prefix_trainable(ptuning):
    model, info = load_causal_lm(ptuning.folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == ptuning.cases["checkpoint_keys"]
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable == ptuning.cases["training_use_cache_false"]["trainable_parameters_after_from_pretrained"]
    slots = ptuning.cases["prefix"]["pre_seq_len"]
    with torch.no_grad():
        encoded = model.transformer.prefix_encoder(torch.arange(slots)[None])[0]
    torch.testing.assert_close(encoded, ptuning.expected["prefix_encoder_output"], atol=1e-6, rtol=1e-6)


def test_classic_layout_equals_the_whole_checkpoint(ptuning, tmp_path):
    """Bit-identical, as in the original; load_prefix_encoder reads the prefix-only folder (or a file) the same way,
    and save_prefix_encoder writes what the original ptuning trainer wrote."""
    whole, classic = ptuning.load(), load_classic(ptuning)
    ids = seqs(ptuning)[1]
    with torch.no_grad():
        expected = whole(input_ids=ids).logits
        assert torch.equal(classic(input_ids=ids).logits, expected)
    config = transformers.AutoConfig.from_pretrained(ptuning.base_folder, trust_remote_code=True,
                                                     **{k: ptuning.cases["prefix"][k]
                                                        for k in ("pre_seq_len", "prefix_projection")})
    with pytest.warns(UserWarning, match="is random"):
        helper = load_causal_lm(ptuning.base_folder, config=config, attn_implementation="eager")
    assert helper.load_prefix_encoder(ptuning.prefix_only).endswith("model.safetensors")
    written = whole.save_prefix_encoder(tmp_path / "prefix_only")
    with safe_open(written, "pt") as f:
        assert {k: list(f.get_slice(k).get_shape()) for k in f.keys()} == ptuning.cases["prefix_only_keys"]
    with torch.no_grad():
        assert torch.equal(helper(input_ids=ids).logits, expected)
        helper.load_prefix_encoder(written)
        assert torch.equal(helper(input_ids=ids).logits, expected)


def test_checkpoint_read_without_pre_seq_len_warns_and_runs_the_base_model(ptuning, tmp_path):
    """The original ignored the prefix silently; here it is said (and the base model's numbers come out)."""
    folder = tmp_path / "ptuning_no_prefix_config"
    shutil.copytree(ptuning.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["pre_seq_len"], config["prefix_projection"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="prefix is ignored"):
        model = load_causal_lm(folder, attn_implementation="eager")
    with torch.no_grad():
        assert_logits_close(model(input_ids=seqs(ptuning)[0]).logits[0], ptuning.expected["seq_0_logits_base"])


@pytest.mark.parametrize("original_class", FAMILIES)
def test_modeling_and_ptuning_files_copied_over_a_ptuning_checkpoint(ptuning, tmp_path, original_class):
    """The original configuration class kept beside our modeling_chatglm.py and ptuning_chatglm.py: ChatGLM3's
    declares pre_seq_len and prefix_projection, GLM-4's does not (config.json's values become plain attributes). Both
    give the prefix; the modeling file alone names the file the prefix needs."""
    folder = tmp_path / f"ptuning_two_files_{original_class}"
    shutil.copytree(ptuning.folder, folder, ignore=shutil.ignore_patterns("*.py"))
    (folder / "configuration_chatglm.py").write_text(original_configuration_source(original_class))
    shutil.copy(REPO / "modeling_chatglm.py", folder / "modeling_chatglm.py")
    with pytest.raises(ImportError, match=r"needs ptuning_chatglm\.py beside modeling_chatglm\.py"):
        load_causal_lm(folder, attn_implementation="eager")
    shutil.copy(REPO / "ptuning_chatglm.py", folder / "ptuning_chatglm.py")
    model = load_causal_lm(folder, attn_implementation="eager")
    assert not hasattr(type(model.config), "validate_chatglm")
    with torch.no_grad():
        assert_logits_close(model(input_ids=seqs(ptuning)[2]).logits[0], ptuning.expected["seq_2_logits"])


# --- the original's numbers -------------------------------------------------------------------------------------------


def assert_single_sequences_match_golden(case, model):
    e = case.expected
    with torch.no_grad():
        for i, ids in enumerate(seqs(case)):
            out = model(input_ids=ids, labels=e[f"seq_{i}_labels"][None], use_cache=False)
            assert out.past_key_values is None
            assert_logits_close(out.logits[0], e[f"seq_{i}_logits"])
            torch.testing.assert_close(out.loss, e[f"seq_{i}_loss"], atol=LOSS_ATOL, rtol=0)


def test_single_sequences_match_golden(ptuning, layout_model):
    assert_single_sequences_match_golden(ptuning, layout_model)


def test_sdpa_matches_golden(ptuning):
    assert_single_sequences_match_golden(ptuning, ptuning.load(attn_implementation="sdpa"))


def test_padded_batch_matches_golden_and_without_positions_the_per_sequence_truth(ptuning, layout_model):
    """With the prefix, positions are absolute (its keys carry no rotation): the original was off by several units
    for a left-padded batch without position_ids. Here positions come from the mask: each row equals its sequence."""
    e = ptuning.expected
    assert_padded_batch_matches_golden(layout_model, e)
    with torch.no_grad():
        out = layout_model(input_ids=e["input_ids"], attention_mask=e["attention_mask"], use_cache=False)
    for i, ids in enumerate(seqs(ptuning)):
        assert_logits_close(out.logits[i, -ids.shape[1]:], e[f"seq_{i}_logits"])
    original_error = ptuning.cases["metrics"]["batch_without_position_ids_vs_single_max_abs_diff_per_seq"]
    assert max(original_error) > 1  # what this test would catch


@pytest.mark.parametrize("explicit_positions", [True, False], ids=["position_ids", "no_position_ids"])
def test_cached_step_matches_golden(ptuning, layout_model, explicit_positions):
    """The prefill returns pre_seq_len + n cached positions, and the step passes them back."""
    slots = ptuning.cases["prefix"]["pre_seq_len"]
    with torch.no_grad():
        for i, ids in enumerate(seqs(ptuning)):
            n = ids.shape[1]
            prefill = layout_model(input_ids=ids[:, :-1], use_cache=True)
            assert prefill.past_key_values.get_seq_length() == slots + n - 1
            kwargs = {"position_ids": torch.tensor([[n - 1]])} if explicit_positions else {}
            step = layout_model(input_ids=ids[:, -1:], past_key_values=prefill.past_key_values, use_cache=True,
                                attention_mask=torch.ones_like(ids), **kwargs)
            assert_logits_close(step.logits[0, -1], ptuning.expected[f"seq_{i}_incr_logits"])


def test_greedy_generation_matches_golden(ptuning, layout_model):
    e = ptuning.expected
    kwargs = ptuning.cases["generation"]["kwargs"]
    with torch.no_grad():
        for i, ids in enumerate(seqs(ptuning)):
            n = ids.shape[1]
            out = layout_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                        position_ids=torch.arange(n)[None], **kwargs)
            assert out.sequences[0, n:].tolist() == e[f"seq_{i}_gen_tokens"].tolist()
            assert_logits_close(torch.stack(out.logits, 1)[0], e[f"seq_{i}_gen_logits"])
        for positions in ({"position_ids": e["position_ids"]}, {}):
            out = layout_model.generate(input_ids=e["input_ids"], attention_mask=e["attention_mask"], **positions,
                                        **kwargs)
            assert out.sequences[:, e["input_ids"].shape[1]:].tolist() == e["batch_gen_tokens"].tolist()
            assert_logits_close(torch.stack(out.logits, 1), e["batch_gen_logits"])


def test_static_cache_generation_matches_golden(ptuning):
    """generate() sizes a static cache for the prompt and new tokens; the model makes room for the prefix, and masks
    the unwritten slots when generate gives no mask."""
    e = ptuning.expected
    model = ptuning.load()
    kwargs = dict(ptuning.cases["generation"]["kwargs"], cache_implementation="static")
    with torch.no_grad():
        out = model.generate(input_ids=e["input_ids"], attention_mask=e["attention_mask"], **kwargs)
        assert out.sequences[:, e["input_ids"].shape[1]:].tolist() == e["batch_gen_tokens"].tolist()
        assert_logits_close(torch.stack(out.logits, 1), e["batch_gen_logits"])
        ids = seqs(ptuning)[0]
        plain = model.generate(input_ids=ids, **kwargs)
    assert plain.sequences[0, ids.shape[1]:].tolist() == e["seq_0_gen_tokens"].tolist()


@pytest.mark.matrix_ends
def test_split_over_devices_matches_golden(ptuning):
    """The checkpoint over three devices, the prefix encoder on its own: golden logits and generations, and each
    layer's cache (its prefix slots first) on its layer's device. The classic recipe takes the same device map (its
    config, with pre_seq_len, is the one the map is checked against)."""
    e = ptuning.expected
    prefix = {k: ptuning.cases["prefix"][k] for k in ("pre_seq_len", "prefix_projection")}
    with virtual_devices(3) as devices:
        device_map = device_check.spread_device_map(ptuning.cases["config"]["num_layers"], devices)
        device_map["transformer.prefix_encoder"] = str(devices[1])
        model = load_causal_lm(ptuning.folder, attn_implementation="eager", device_map=device_map)
        with torch.no_grad():
            out = model(input_ids=e["input_ids"], attention_mask=e["attention_mask"], labels=e["labels"],
                        use_cache=True)
            generated = model.generate(input_ids=e["input_ids"], attention_mask=e["attention_mask"],
                                       **ptuning.cases["generation"]["kwargs"])
        layers = device_check.layer_devices(model)
        assert device_check.cache_devices(out.past_key_values) == [(d, d) for d in layers]
        assert len(set(layers)) > 1
        config = transformers.AutoConfig.from_pretrained(ptuning.base_folder, trust_remote_code=True, **prefix)
        with pytest.warns(UserWarning, match="is random"):
            classic = load_causal_lm(ptuning.base_folder, config=config, attn_implementation="eager",
                                     device_map=device_map)
        classic.load_prefix_encoder(ptuning.prefix_only)
        with torch.no_grad():
            classic_logits = classic(input_ids=e["input_ids"], attention_mask=e["attention_mask"]).logits.cpu()
    real = e["attention_mask"].bool()
    assert out.past_key_values.get_seq_length() == ptuning.cases["prefix"]["pre_seq_len"] + e["input_ids"].shape[1]
    assert_logits_close(out.logits.cpu()[real], e["batch_logits"][real])
    assert_logits_close(classic_logits[real], e["batch_logits"][real])
    torch.testing.assert_close(out.loss.cpu(), e["batch_loss"], atol=LOSS_ATOL, rtol=0)
    assert generated.sequences[:, e["input_ids"].shape[1]:].cpu().tolist() == e["batch_gen_tokens"].tolist()


# --- both families against the reference forward ------------------------------------------------------------------


def prefix_model(tiny_model, family, projection=False, slots=5, **overrides):
    return tiny_model(family, pre_seq_len=slots, prefix_projection=projection, **overrides)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("projection", [False, True], ids=["embedding", "projection"])
def test_prefix_matches_reference_forward(tiny_model, family, projection):
    """Unrotated prefix keys in front of each layer's, tokens at 0..n-1, computed from the encoder's weights by the
    reference; and the prefix matters (the base model is far off)."""
    model = prefix_model(tiny_model, family, projection)
    ids = torch.randint(3, 256, (2, 13), generator=torch.Generator().manual_seed(20))
    state = model.state_dict()
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    assert relative_max_error(ours, reference_logits(state, model.config, ids)) < 1e-5
    base = {k: v for k, v in state.items() if not k.startswith(PREFIX)}
    assert relative_max_error(ours, reference_logits(base, model.config, ids)) > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_paths_agree(tiny_model, family):
    """Left-padded rows equal each sequence alone (forward and generate); a chunked prefill equals one forward;
    greedy and beam search with the cache equal them without; a static cache equals the dynamic one."""
    model = prefix_model(tiny_model, family, projection=family == "chatglm3")
    sequences = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 11, 7)]
    ids, mask = device_check.left_pad(sequences)
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).logits
        batch_generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)[:, ids.shape[1]:]
        static = model.generate(ids, attention_mask=mask, max_new_tokens=6, cache_implementation="static",
                                **GREEDY)[:, ids.shape[1]:]
        assert static.tolist() == batch_generated.tolist()
        for row, seq in enumerate(sequences):
            alone = torch.tensor([seq])
            torch.testing.assert_close(batch[row, -len(seq):], model(input_ids=alone).logits[0], atol=1e-5, rtol=1e-5)
            generated = model.generate(alone, max_new_tokens=6, **GREEDY)[0, len(seq):]
            assert batch_generated[row].tolist() == generated.tolist()
        full = model(input_ids=ids[1:]).logits
        first = model(input_ids=ids[1:, :5], use_cache=True)
        second = model(input_ids=ids[1:, 5:], past_key_values=first.past_key_values, use_cache=True)
        torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), full, atol=1e-5, rtol=1e-5)
        for kwargs in ({}, {"num_beams": 3}):
            cached = model.generate(ids[1:], max_new_tokens=6, use_cache=True, **kwargs, **GREEDY)
            uncached = model.generate(ids[1:], max_new_tokens=6, use_cache=False, **kwargs, **GREEDY)
            assert cached.tolist() == uncached.tolist()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_sequences_each_see_the_prefix_and_only_themselves(tiny_model, chatglm, attn):
    """A padding-free batch (position_ids restarting at 0): each sequence equals itself alone, prefix included."""
    model = prefix_model(tiny_model, "glm4", attn_implementation=attn)
    first, second = (torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 7))
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat([first, second], 1), position_ids=positions).logits[0]
        alone = torch.cat([model(input_ids=first).logits[0], model(input_ids=second).logits[0]])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="Packed sequences with a P-tuning v2 prefix"):
        chatglm.modeling.build_attention_mask("flash_attention_2", None, torch.arange(3, 5)[None], 5, batch_size=1,
                                              sequence_ids=torch.tensor([[0, 1]]), prefix=3)


@pytest.mark.matrix_ends
def test_split_prefix_model_equals_single_device(tiny_model):
    """ChatGLM3 with a projected prefix over 3 devices: logits, loss, gradients (the prefix encoder's and, unfrozen,
    every other weight's), greedy and batched generation and each layer's cache placement equal the single-device
    run."""
    model = prefix_model(tiny_model, "chatglm3", projection=True).requires_grad_(True)
    with virtual_devices(3) as devices:
        device_map = device_check.spread_device_map(model.config.num_layers, devices)
        device_map["transformer.prefix_encoder"] = str(devices[0])
        report = device_check.run(model, device_map, reference_device=devices[1], new_tokens=5)
    assert report.logits_max_diff <= 1e-6 and report.loss_diff <= 1e-6 and report.grad_max_diff <= 1e-5
    assert report.greedy_same and report.batch_greedy_same and report.cache_on_layer_devices
    assert report.device_warnings == []


def test_balanced_device_map_places_the_prefix_encoder(chatglm):
    fields = json.loads(shared_path("configs", "chatglm3-6b", "config.json").read_text())
    config = chatglm.ChatGLMConfig(**dict(fields, pre_seq_len=128, prefix_projection=True))
    device_map = chatglm.modeling.balanced_device_map(config, ["cuda:0", "cuda:1"])
    assert device_map["transformer.prefix_encoder"] == device_map["transformer.embedding"]
    with torch.device("meta"):
        chatglm.checks.check_device_map(chatglm.modeling.ChatGLMForConditionalGeneration(config), device_map)


# --- bad input -----------------------------------------------------------------------------------------------------


def test_prefix_of_another_shape_fails_naming_the_file_and_the_shapes(ptuning, tmp_path):
    slots = ptuning.cases["prefix"]["pre_seq_len"]
    kv_size = ptuning.cases["prefix"]["kv_size"]
    with pytest.raises(ValueError) as error:  # the whole checkpoint, its config asked for another length
        load_causal_lm(ptuning.folder, pre_seq_len=2 * slots)
    message = str(error.value)
    assert str(ptuning.folder / "model.safetensors") in message
    assert f"[{slots}, {kv_size}]" in message and f"[{2 * slots}, {kv_size}]" in message

    config = transformers.AutoConfig.from_pretrained(ptuning.base_folder, trust_remote_code=True,
                                                     pre_seq_len=slots + 1)
    with pytest.warns(UserWarning, match="is random"):
        model = load_causal_lm(ptuning.base_folder, config=config)
    with pytest.raises(ValueError) as error:  # the classic prefix-only file
        model.load_prefix_encoder(ptuning.prefix_only)
    message = str(error.value)
    assert str(ptuning.prefix_only / "model.safetensors") in message
    assert f"[{slots}, {kv_size}]" in message and f"[{slots + 1}, {kv_size}]" in message and "pre_seq_len" in message
    with pytest.raises(ValueError, match=rf"\[{slots}, {kv_size}\].*expected \[{slots + 1}, {kv_size}\]"):
        model.transformer.prefix_encoder.load_state_dict({"embedding.weight": torch.zeros(slots, kv_size)})
    with pytest.raises(ValueError, match="prefix_projection"):
        model.transformer.prefix_encoder.load_state_dict(
            {"embedding.weight": torch.zeros(slots + 1, kv_size), "trans.0.weight": torch.zeros(4, kv_size)})
    with pytest.raises(ValueError, match="holds no transformer.prefix_encoder"):
        model.load_prefix_encoder(ptuning.base_folder)
    with pytest.raises(FileNotFoundError, match="empty_folder"):
        model.load_prefix_encoder((tmp_path / "empty_folder").mkdir() or tmp_path / "empty_folder")


def test_tensor_parallelism_refuses_a_prefix(chatglm, tiny_model):
    import importlib

    parallel = importlib.import_module(chatglm.modeling.__package__ + ".parallel_chatglm")
    with pytest.raises(ValueError, match="pre_seq_len=5: tensor parallelism"):
        parallel.check_tensor_parallel_size(prefix_model(tiny_model, "glm4").config, 2)


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_bad_pre_seq_len_is_refused(tiny_model, value):
    with pytest.raises(ValueError, match="pre_seq_len"):
        tiny_model("glm4", pre_seq_len=value)


# --- training ------------------------------------------------------------------------------------------------------


def labelled(seed, batch=2, length=10):
    ids = torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :2] = -100
    return ids, labels


def prefix_grads(model, **kwargs):
    ids, labels = labelled(30)
    model.zero_grad()
    torch.manual_seed(0)  # the prefix dropout draws the same mask in every run
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_only_the_prefix_trains_and_gradients_reach_it_through_the_cache(tiny_model, family):
    """Gradients flow from the loss to the prefix encoder through the cached keys and values: with use_cache=True
    (the returned cache holds the prefix) and False (no cache comes back), the same; the base stays frozen; the
    prefix dropout is on in train mode only."""
    model = prefix_model(tiny_model, family, projection=True).train()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {name for name, _ in model.named_parameters() if name.startswith(PREFIX)}
    cached, grads = prefix_grads(model, use_cache=True)
    uncached, grads_without_cache = prefix_grads(model, use_cache=False)
    assert cached.past_key_values.get_seq_length() == 5 + 10 and uncached.past_key_values is None
    assert set(grads) == trainable and all(g.abs().sum() > 0 for g in grads.values())
    for name in grads:
        torch.testing.assert_close(grads_without_cache[name], grads[name], atol=1e-6, rtol=1e-5)
    ids, _ = labelled(31)
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)  # dropout
        model.eval()
        assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("use_reentrant", [None, False])
def test_gradient_checkpointing_gives_the_same_prefix_gradients(tiny_model, use_reentrant):
    model = prefix_model(tiny_model, "glm4", hidden_dropout=0.0).train()
    _, expected = prefix_grads(model)
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    assert all(layer.gradient_checkpointing for layer in model.transformer.encoder.layers)
    _, grads = prefix_grads(model)
    assert set(grads) == set(expected)
    for name in grads:
        torch.testing.assert_close(grads[name], expected[name], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="use_reentrant"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})


def test_requires_grad_trains_the_base_model_too(tiny_model):
    model = prefix_model(tiny_model, "glm4").train()
    model.requires_grad_(True)
    _, grads = prefix_grads(model)
    assert set(grads) == {name for name, _ in model.named_parameters()}


def test_trainer_updates_the_prefix_alone_and_save_pretrained_round_trips(tiny_model, tmp_path):
    from transformers import Trainer, TrainingArguments

    model = prefix_model(tiny_model, "chatglm3", projection=True).train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids, labels = labelled(32, batch=4)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=2,
                             learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no")
    Trainer(model=model, args=args, train_dataset=[{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]).train()
    changed = {name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])}
    assert changed == {name for name in before if name.startswith(PREFIX)}

    model.eval()
    folder = save_checkpoint(model, tmp_path / "ptuning_resaved")
    saved = json.loads((folder / "config.json").read_text())
    assert saved["pre_seq_len"] == 5 and saved["prefix_projection"] is True
    reloaded = load_causal_lm(folder)
    assert {n for n, p in reloaded.named_parameters() if p.requires_grad} == changed
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_fp32_prefix_encoder_in_a_bf16_model(tiny_model):
    """The ChatGLM2 ptuning scripts ran model.half() then prefix_encoder.float()."""
    model = prefix_model(tiny_model, "glm4")
    ids, _ = labelled(33)
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        model.to(torch.bfloat16).transformer.prefix_encoder.float()
        out = model(input_ids=ids, use_cache=True)
    assert out.logits.dtype == torch.bfloat16
    assert relative_max_error(out.logits.float(), reference) < 0.05


# --- PEFT prefix tuning --------------------------------------------------------------------------------------------


def peft_prefix_config(slots=4):
    from peft import PrefixTuningConfig

    # The GLM-4 / ChatGLM3 finetune demos' setting: one key/value per group (num_attention_heads = groups,
    # token_dim = groups * head size).
    groups, head = TINY_SIZES["multi_query_group_num"], TINY_SIZES["kv_channels"]
    return PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=slots, num_attention_heads=groups,
                              token_dim=groups * head)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_prefix_tuning_trains_saves_reloads_and_generates(tiny_model, family, tmp_path):
    from peft import PeftModel, get_peft_model

    peft_model = get_peft_model(tiny_model(family), peft_prefix_config())
    base_before = {n: p.detach().clone() for n, p in peft_model.get_base_model().named_parameters()}
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    ids, labels = labelled(34)
    peft_model.train()
    losses = []
    for _ in range(3):
        loss = peft_model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, base_before[n]) for n, p in peft_model.get_base_model().named_parameters())

    peft_model.eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(tiny_model(family), tmp_path / "adapter").eval()
    prompt = ids[:1, :6]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, peft_model(input_ids=ids).logits)
        generated = reloaded.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                                      **GREEDY)[0, 6:]
        stepwise = prompt  # the same greedy tokens from full forwards (each gets a fresh prefix cache from PEFT)
        for _ in range(5):
            logits = reloaded(input_ids=stepwise, attention_mask=torch.ones_like(stepwise)).logits
            stepwise = torch.cat([stepwise, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert generated.tolist() == stepwise[0, 6:].tolist()


def test_peft_prefix_equals_the_pre_seq_len_prefix_it_converts_to(tiny_model, tmp_path):
    """A PEFT prefix is the prefix encoder output of P-tuning v2 in the same layout: loaded as a pre_seq_len prefix
    (load_prefix_encoder reads the adapter), the logits are the same once positions agree. PEFT puts the tokens after
    its virtual tokens (positions P..P+n-1, and it shifts given position_ids by P); the original P-tuning v2 puts them
    at 0..n-1."""
    from peft import get_peft_model

    slots = 4
    peft_model = get_peft_model(tiny_model("glm4", seed=3), peft_prefix_config(slots))
    with torch.no_grad():
        peft_model.prompt_encoder["default"].embedding.weight.normal_()
    peft_model.eval().save_pretrained(tmp_path / "adapter")
    ptuned = prefix_model(tiny_model, "glm4", slots=slots, seed=3)
    ptuned.load_prefix_encoder(tmp_path / "adapter")
    ids, _ = labelled(35)
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
        ours = ptuned(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None] + slots).logits
        original_positions = ptuned(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert relative_max_error(original_positions, theirs) > 1e-2
