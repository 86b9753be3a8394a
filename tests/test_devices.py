"""Devices: models split over several devices compute what they compute on one, every boundary explicit; device maps
are complete or refused. The devices are the suite's virtual ones (tests/virtual_devices.py): they compute on the
CPU and raise a GPU's "Expected all tensors to be on the same device" error whenever an operation mixes devices."""
import json
import re

from chatglm_tools import device_check
import pytest
import torch
from conftest import FAMILIES, REPO, load_causal_lm, save_checkpoint, shared_path, tiny_config_dict
from virtual_devices import virtual_devices

CROSS_DEVICE = "Expected all tensors to be on the same device"


def meta_model(chatglm, config):
    with torch.device("meta"):
        return chatglm.modeling.ChatGLMForConditionalGeneration(config)


def placed_names(model, device_map):
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    return {n: [e for e in device_map if e == "" or n == e or n.startswith(e + ".")] for n in names}


@pytest.mark.parametrize("name", ["glm-4-9b-chat", "chatglm3-6b"])
@pytest.mark.parametrize("strategy", ["auto", "balanced", "sequential"])
def test_accelerate_maps_place_everything_and_never_split_a_block(chatglm, name, strategy):
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    config = chatglm.ChatGLMConfig(**json.loads(shared_path("configs", name, "config.json").read_text()))
    model = meta_model(chatglm, config).to(torch.bfloat16)
    max_memory = {0: "6GiB", 1: "6GiB", 2: "6GiB", 3: "6GiB", "cpu": "64GiB"}
    no_split = model._no_split_modules
    if strategy != "sequential":
        max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                         dtype=torch.bfloat16, low_zero=False)
    device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split,
                                       dtype=torch.bfloat16)
    for module_name, entries in placed_names(model, device_map).items():
        assert entries, f"{module_name} has no device"
    assert "transformer.rotary_pos_emb" in device_map or any(
        e in device_map for e in ("", "transformer"))
    for entry in device_map:
        parts = entry.split(".")
        assert not (len(parts) > 4 and parts[:3] == ["transformer", "encoder", "layers"]), f"{entry} splits a block"
    assert len({d for d in device_map.values()}) >= 2


@pytest.mark.parametrize("devices", [1, 2, 3, 8])
def test_balanced_device_map_is_complete_contiguous_and_balanced(chatglm, devices):
    config = chatglm.ChatGLMConfig(**json.loads(shared_path("configs", "glm-4-9b-chat", "config.json").read_text()))
    names = [f"cuda:{i}" for i in range(devices)]
    device_map = chatglm.modeling.balanced_device_map(config, names)
    model = meta_model(chatglm, config)
    chatglm.checks.check_device_map(model, device_map)  # complete, nothing unknown, no block split
    layer_devices = [device_map[f"transformer.encoder.layers.{i}"] for i in range(config.num_layers)]
    assert layer_devices == sorted(layer_devices, key=names.index)  # contiguous runs
    assert device_map["transformer.embedding"] == names[0] and device_map["transformer.output_layer"] == names[-1]
    load = {d: 0 for d in names}
    for module_name, module in model.named_modules():
        if module_name in device_map:
            load[device_map[module_name]] += sum(p.numel() for p in module.parameters())
    assert max(load.values()) < 1.35 * sum(load.values()) / devices


def test_incomplete_device_map_fails_before_reading_weights_and_names_what_is_wrong(golden, monkeypatch):
    """ChatGLM3's load_model_on_gpus forgot the word embeddings and the rotary buffer, and old maps used ChatGLM-6B
    names: the error lists both and points at device_map='auto'."""
    import safetensors.torch

    def no_reading(*args, **kwargs):
        raise AssertionError("weights were read before the device map was checked")

    monkeypatch.setattr(safetensors.torch, "load_file", no_reading)
    monkeypatch.setattr(safetensors, "safe_open", no_reading)
    config = golden.cases["config"]
    device_map = {"transformer.word_embeddings": "cpu", "transformer.encoder.final_layernorm": "cpu",
                  "transformer.output_layer": "cpu"}
    device_map.update({f"transformer.encoder.layers.{i}": "cpu" for i in range(config["num_layers"])})
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError) as error:
        AutoModelForCausalLM.from_pretrained(golden.folder, trust_remote_code=True, device_map=device_map)
    message = str(error.value)
    assert "transformer.embedding.word_embeddings.weight" in message
    assert "transformer.rotary_pos_emb.inv_freq" in message
    assert "transformer.word_embeddings" in message and "device_map='auto'" in message


def test_device_map_that_splits_a_block_is_refused(chatglm):
    config = chatglm.ChatGLMConfig(**tiny_config_dict("glm4"))
    model = meta_model(chatglm, config)
    device_map = chatglm.modeling.balanced_device_map(config, ["cpu"])
    del device_map["transformer.encoder.layers.1"]
    device_map["transformer.encoder.layers.1.self_attention"] = "cpu"
    device_map["transformer.encoder.layers.1.mlp"] = "meta"
    device_map["transformer.encoder.layers.1.input_layernorm"] = "cpu"
    device_map["transformer.encoder.layers.1.post_attention_layernorm"] = "cpu"
    with pytest.raises(ValueError, match="splits blocks.*transformer.encoder.layers.1"):
        chatglm.checks.check_device_map(model, device_map)


# --- split over virtual devices vs one device ------------------------------------------------------------------------


@pytest.mark.matrix_ends
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_devices", [2, 3, 8])
def test_split_model_equals_single_device(tiny_model, family, num_devices):
    """One block per device; embedding, rotary table, final norm and output layer on other devices. Forward, loss
    and gradients, greedy and left-padded batched generation with the cache; each layer's cache stays on its
    layer's device after prefill and decode; CPU inputs need no move and raise no warning."""
    model = tiny_model(family, num_layers=num_devices)
    with virtual_devices(num_devices) as devices:
        device_map = device_check.spread_device_map(num_devices, devices)
        report = device_check.run(model, device_map, reference_device=devices[0], new_tokens=6)
    assert report.logits_max_diff <= 1e-6 and report.loss_diff <= 1e-6
    assert report.grad_max_diff <= 1e-5
    assert report.greedy_same and report.batch_greedy_same
    assert report.cache_on_layer_devices
    assert report.device_warnings == []


@pytest.mark.parametrize("embedding_on", ["accelerator", "cpu"])
def test_generate_gives_no_device_warning_when_embedding_and_output_layer_differ_in_type(tiny_model, embedding_on):
    """gpu_check's map over the CPU and an accelerator (the embedding on one, the output layer on the other, as
    accelerate places an offloaded model): model.device (the embedding's) and the logits' device are of different
    types. Inputs on the CPU, as a tokenizer returns them: no warning, and the tokens of one device."""
    model = tiny_model("glm4", num_layers=3)
    with virtual_devices(1) as devices:
        order = ["cpu", devices[0]] if embedding_on == "accelerator" else [devices[0], "cpu"]
        device_map = device_check.spread_device_map(3, order)
        report = device_check.run(model, device_map, reference_device=devices[0], new_tokens=4)
    embedding, output = device_map["transformer.embedding"], device_map["transformer.output_layer"]
    assert torch.device(embedding).type != torch.device(output).type
    assert report.device_warnings == []
    assert report.greedy_same and report.batch_greedy_same and report.cache_on_layer_devices


def test_generate_with_the_embedding_offloaded_to_disk(tiny_model, tmp_path):
    """accelerate's disk offload keeps the embedding's weights on `meta` between calls, so model.device is meta:
    generate() keeps its ids where the embedding computes, and gives the tokens of the model in memory."""
    model = tiny_model("glm4")
    folder = save_checkpoint(model, tmp_path / "checkpoint")
    device_map = {"transformer.embedding": "disk", "transformer.rotary_pos_emb": "cpu", "transformer.encoder": "cpu",
                  "transformer.output_layer": "disk"}
    offloaded = load_causal_lm(folder, device_map=device_map, offload_folder=str(tmp_path / "offload"))
    assert offloaded.device.type == "meta"
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        kwargs = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert offloaded.generate(ids, **kwargs).tolist() == model.generate(ids, **kwargs).tolist()


@pytest.mark.matrix_ends
def test_every_boundary_goes_through_device_boundary(tiny_model, chatglm, monkeypatch):
    """Without device_boundary the split model fails the way a GPU would: no other code moves its tensors (no
    accelerate hook, no stray .to()). And the source has no other device move to search for."""
    model = tiny_model("glm4")
    ids = torch.randint(3, 256, (1, 6))
    with virtual_devices(2) as devices:
        device_check.place(model, device_check.spread_device_map(model.config.num_layers, devices))
        monkeypatch.setattr(chatglm.modeling, "device_boundary", lambda tensor, device: tensor)
        with pytest.raises(RuntimeError, match=CROSS_DEVICE):
            model(input_ids=ids)
    source = (REPO / "modeling_chatglm.py").read_text()
    device_moves = [line.strip() for line in source.splitlines() if re.search(r"\.to\((?![^)]*dtype)[^)]*device", line)]
    assert device_moves == ["return tensor.to(device)", "self.to(device)"], device_moves


@pytest.mark.matrix_ends
def test_from_pretrained_with_device_map_onto_virtual_devices(golden):
    """The original checkpoint loaded by from_pretrained(device_map=...) over three devices gives the golden logits,
    with the inputs left on the CPU; model.device is where the inputs go (the embedding's device)."""
    e = golden.expected
    with virtual_devices(3) as devices:
        device_map = device_check.spread_device_map(golden.cases["config"]["num_layers"], devices)
        model = load_causal_lm(golden.folder, attn_implementation="eager", device_map=device_map)
        assert model.device == model.transformer.embedding.word_embeddings.weight.device == devices[-1]
        assert {str(p.device) for p in model.parameters()} == {str(d) for d in devices}
        with torch.no_grad():
            out = model(input_ids=e["input_ids"], attention_mask=e["attention_mask"], labels=e["labels"])
            generated = model.generate(input_ids=e["input_ids"], attention_mask=e["attention_mask"],
                                       **golden.gen_kwargs)
        real = e["attention_mask"].bool()
        torch.testing.assert_close(out.logits.cpu()[real], e["batch_logits"][real], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.loss.cpu(), e["batch_loss"], atol=1e-5, rtol=0)
        assert generated.sequences[:, e["input_ids"].shape[1]:].cpu().tolist() == e["batch_gen_tokens"].tolist()


@pytest.mark.matrix_ends
def test_sequence_classification_pools_on_the_logits_device(tiny_model, chatglm):
    lm = tiny_model("chatglm3", num_labels=2)
    model = chatglm.modeling.ChatGLMForSequenceClassification(lm.config).eval()
    ids, mask = device_check.padded_batch([4, 7], 256, seed=1)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        with virtual_devices(2) as devices:
            device_map = device_check.spread_device_map(lm.config.num_layers, devices)
            device_map["classifier_head"] = str(devices[0])
            device_check.place(model, device_map)
            out = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1]))
            assert out.logits.device == devices[0]
    torch.testing.assert_close(out.logits.cpu(), expected, atol=1e-6, rtol=1e-6)


def test_balanced_device_map_is_reachable_as_the_docs_show(golden):
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    config = AutoConfig.from_pretrained(golden.folder, trust_remote_code=True)
    balanced_device_map = get_class_from_dynamic_module("modeling_chatglm.balanced_device_map", golden.folder)
    device_map = balanced_device_map(config, ["cpu"])
    model = load_causal_lm(golden.folder, device_map=device_map)
    assert {str(p.device) for p in model.parameters()} == {"cpu"}


# --- GLM-4V: the vision tower and the language model split ------------------------------------------------------------
# glm-4v-9b's vision tower (its config.json's vision_config; the golden checkpoint shrinks these sizes).
GLM4V_9B_VISION = dict(dropout_prob=0.0, hidden_act="gelu", in_channels=3, num_hidden_layers=63, hidden_size=1792,
                       patch_size=14, num_heads=16, intermediate_size=15360, layer_norm_eps=1e-06, num_positions=6401,
                       image_size=1120, scaling_factor=8)


def glm4v_spread_map(devices) -> dict:
    """Every GLM-4V boundary in play (device_check.place applies entries in order, so the tower's own rows go with
    "transformer.vision" first): the pixels' way in, each vision block, the merge conv, the projection and the
    image rows' way into the embedding each on another device than their neighbours."""
    d = [str(device) for device in devices]
    device_map = {"transformer.vision": d[2], "transformer.vision.patch_embedding": d[0],
                  "transformer.vision.transformer.layers.0": d[1], "transformer.vision.transformer.layers.1": d[2],
                  "transformer.vision.conv": d[0], "transformer.vision.linear_proj": d[1]}
    device_map.update(device_check.spread_device_map(2, devices))
    return device_map


def glm4v_training_batch(seed):
    from conftest import glm4v_prompt, random_images

    generator = torch.Generator().manual_seed(seed)
    ids, mask = device_check.left_pad([glm4v_prompt(n, generator) for n in (3, 8)])
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-4] = -100  # the answer: the last tokens
    return ids, mask, labels, random_images(2, 8, seed)


@pytest.mark.matrix_ends
def test_glm4v_split_over_devices_equals_single_device(tiny_glm4v):
    """Vision blocks, projection and language model on three devices; inputs and pixels on the CPU. Forward, loss
    and gradients (vision tower included), greedy batched generation with the cache, and each layer's cache on its
    layer's device equal the one-device run."""
    import copy
    import warnings

    model = tiny_glm4v(seed=21)
    ids, mask, labels, images = glm4v_training_batch(21)
    with virtual_devices(3) as devices, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        single = copy.deepcopy(model).to(devices[0])
        split = device_check.place(copy.deepcopy(model), glm4v_spread_map(devices))
        assert len({str(p.device) for p in split.transformer.vision.parameters()}) == 3
        outputs = []
        for m in (single, split):
            out = m(input_ids=ids, attention_mask=mask, images=images, labels=labels)
            out.loss.backward()
            outputs.append(out)
        greedy = [m.generate(ids, attention_mask=mask, images=images, max_new_tokens=5, **device_check.GREEDY).cpu()
                  for m in (single, split)]
        with torch.no_grad():
            prefill = split(input_ids=ids, attention_mask=mask, images=images, use_cache=True)
        on_layers = device_check.cache_devices(prefill.past_key_values) == [
            (d, d) for d in device_check.layer_devices(split)]
    torch.testing.assert_close(outputs[1].logits.cpu(), outputs[0].logits.cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs[1].loss.cpu(), outputs[0].loss.cpu(), atol=1e-6, rtol=1e-6)
    for (name, p), q in zip(split.named_parameters(), single.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), atol=1e-5, rtol=1e-4, msg=name)
    assert greedy[0].tolist() == greedy[1].tolist()
    assert on_layers
    assert not [w for w in caught if "device" in str(w.message)]


@pytest.mark.matrix_ends
def test_glm4v_every_boundary_goes_through_device_boundary(tiny_glm4v, monkeypatch):
    """The vision tower's crossings too: without the device_boundary the model hands visual.py, the split model fails
    as on GPUs, and visual.py has no other device move."""
    import dataclasses

    model = tiny_glm4v()
    ids, mask, _, images = glm4v_training_batch(22)
    vision = model.transformer.vision
    with virtual_devices(3) as devices:
        device_check.place(model, glm4v_spread_map(devices))
        no_boundary = dataclasses.replace(vision.callbacks, device_boundary=lambda tensor, device: tensor)
        for module in (vision, vision.transformer):
            monkeypatch.setattr(module, "callbacks", no_boundary)
        # A convolution words it its own way on GPUs too: "Input type (...) and weight type (...) should be the same".
        with pytest.raises(RuntimeError, match=f"{CROSS_DEVICE}|Input type .* and weight type .* should be the same"):
            model(input_ids=ids, attention_mask=mask, images=images)
    source = (REPO / "visual.py").read_text()
    assert not [line for line in source.splitlines() if re.search(r"\.to\((?![^)]*dtype)[^)]*device", line)]


@pytest.mark.matrix_ends
def test_glm4v_from_pretrained_with_a_device_map(glm4v_golden):
    """The original glm-4v checkpoint loaded with the vision tower and the language model's pieces on three devices:
    the golden logits of the image prompt (one forward: 6400 patches run slowly on virtual devices) and the golden
    tokens of the text prompt, with inputs and pixels left on the CPU."""
    image_case, text_case = glm4v_golden["glm4v-tiny"], glm4v_golden["glm4v-tiny-text"]
    with virtual_devices(3) as devices:
        device_map = dict(device_check.spread_device_map(2, devices), **{"transformer.vision": str(devices[1])})
        model = load_causal_lm(image_case.folder, attn_implementation="eager", device_map=device_map)
        assert len({str(p.device) for p in model.parameters()}) == 3
        e = image_case.expected
        with torch.no_grad():
            logits = model(input_ids=e["input_ids"][None], images=e["pixel_values"]).logits[0].cpu()
            ids = text_case.expected["input_ids"][None]
            generated = model.generate(input_ids=ids, **text_case.gen_kwargs)
    torch.testing.assert_close(logits, e["logits"], atol=1e-4, rtol=1e-4)
    assert generated.sequences[0, ids.shape[1]:].cpu().tolist() == text_case.expected["gen_tokens"].tolist()


@pytest.mark.parametrize("devices", [2, 4])
def test_glm4v_9b_device_maps_keep_vision_blocks_whole(chatglm, devices):
    """accelerate's auto map (through _no_split_modules) and balanced_device_map on glm-4v-9b's sizes: every tensor
    placed, no GLMBlock and no vision block split."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    fields = json.loads(shared_path("configs", "glm-4-9b-chat", "config.json").read_text())
    fields.update(vision_config=GLM4V_9B_VISION, boi_token_id=151339, eoi_token_id=151340)
    config = chatglm.ChatGLMConfig(**fields)
    model = meta_model(chatglm, config).to(torch.bfloat16)
    no_split = model._no_split_modules
    max_memory = get_balanced_memory(model, max_memory={i: "12GiB" for i in range(devices)} | {"cpu": "64GiB"},
                                     no_split_module_classes=no_split, dtype=torch.bfloat16, low_zero=False)
    auto = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split,
                                 dtype=torch.bfloat16)
    balanced = chatglm.modeling.balanced_device_map(config, [f"cuda:{i}" for i in range(devices)])
    for device_map in (auto, balanced):
        chatglm.checks.check_device_map(model, device_map)  # complete, known names, no block split
    assert len(set(balanced.values())) == devices and balanced["transformer.vision"] == "cuda:0"
    vision_blocks = {name for name in auto if name.startswith("transformer.vision.transformer.layers.")}
    assert vision_blocks or "transformer.vision" in auto or "transformer" in auto
