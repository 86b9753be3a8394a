"""Devices: complete device maps, clear errors for bad ones. (Runs across virtual devices: test_devices_virtual.py.)"""
import json

import pytest
import torch
from conftest import shared_path, tiny_config_dict


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
    chatglm.modeling.check_device_map(model, device_map)  # complete, nothing unknown, no block split
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
        chatglm.modeling.check_device_map(model, device_map)
