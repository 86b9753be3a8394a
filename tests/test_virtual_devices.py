"""The simulated multi-device backend (tests/virtual_devices.py) behaves like several GPUs on a CPU-only machine.

It must raise torch's cross-device error where a GPU would, and otherwise compute exactly what the CPU computes,
forward and backward, also inside a transformers model that accelerate spread over the devices.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from virtual_devices import BACKEND, pipeline_device_map, virtual_devices
from virtual_devices import vdevices  # noqa: F401 -- a pytest fixture, taken by parameter name

CROSS_DEVICE = "Expected all tensors to be on the same device, but found at least two devices"


class TwoStage(nn.Module):
    """A two-device pipeline whose output bias lives with the first stage, as parameters of a split model do."""

    def __init__(self, forget_to: bool):
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 4)
        self.bias = nn.Parameter(torch.randn(4))
        self.forget_to = forget_to

    def place(self, first_device, second_device) -> "TwoStage":
        self.to(first_device)
        self.second.to(second_device)
        return self

    def forward(self, x):
        hidden = self.first(x).relu()
        out = self.second(hidden.to(self.second.weight.device))
        bias = self.bias if self.forget_to else self.bias.to(out.device)
        return out + bias


def two_stage_pair(forget_to: bool):
    torch.manual_seed(0)
    cpu = TwoStage(forget_to)
    return cpu, copy.deepcopy(cpu)


def test_forgotten_to_raises_like_a_gpu(vdevices):
    _, model = two_stage_pair(forget_to=True)
    model.place(vdevices[0], vdevices[1])
    x = torch.randn(3, 8, device=vdevices[0])
    with pytest.raises(RuntimeError, match=f"^{CROSS_DEVICE}, vdev:1 and vdev:0!$"):
        model(x)


def test_corrected_module_matches_cpu_forward_and_backward(vdevices):
    cpu, model = two_stage_pair(forget_to=False)
    model.place(vdevices[0], vdevices[1])
    x = torch.randn(3, 8)
    x_dev = x.to(vdevices[0]).requires_grad_()
    x.requires_grad_()

    out_cpu, out_dev = cpu(x), model(x_dev)
    assert out_dev.device == vdevices[1]
    assert torch.equal(out_dev.cpu(), out_cpu)

    weights = torch.randn(3, 4)
    (out_cpu * weights).sum().backward()
    (out_dev * weights.to(vdevices[1])).sum().backward()
    assert x_dev.grad.device == vdevices[0] and torch.equal(x_dev.grad.cpu(), x.grad)
    for (name, p_cpu), p_dev in zip(cpu.named_parameters(), model.parameters()):
        assert p_dev.grad.device == p_dev.device, name
        assert torch.equal(p_dev.grad.cpu(), p_cpu.grad), name


def either_order(first: str, second: str) -> str:
    return f"({first} and {second}|{second} and {first})"


@pytest.mark.parametrize(
    "mix, error",
    [
        pytest.param(lambda a, b: a + b, CROSS_DEVICE, id="add"),
        pytest.param(lambda a, b: torch.cat([a, b]), CROSS_DEVICE, id="cat"),
        pytest.param(lambda a, b: a @ b.T, CROSS_DEVICE, id="matmul"),
        pytest.param(lambda a, b: F.embedding(torch.tensor([0, 1], device=a.device), b), CROSS_DEVICE, id="embedding"),
        pytest.param(lambda a, b: F.layer_norm(a, (4,), weight=b[0]), CROSS_DEVICE, id="layer_norm"),
        # torch checks SDPA's inputs itself, before any kernel runs, with the message a GPU gives as well
        pytest.param(
            lambda a, b: F.scaled_dot_product_attention(a[None], b[None], b[None]),
            "Expected query, key, and value to have the same device type",
            id="sdpa",
        ),
    ],
)
def test_every_mixing_operation_raises(vdevices, mix, error):
    a, b = torch.randn(2, 4, device=vdevices[2]), torch.randn(2, 4, device=vdevices[3])
    with pytest.raises(RuntimeError, match=f"^{error}"):
        mix(a, b)
    with pytest.raises(RuntimeError, match=f"^{error}"):
        mix(a, b.cpu())
    if error == CROSS_DEVICE:
        with pytest.raises(RuntimeError, match=f"^{CROSS_DEVICE}, {either_order('vdev:2', 'vdev:3')}!$"):
            mix(a, b)
    mix(a, b.to(a.device))  # the corrected call runs


def test_cpu_scalars_and_cpu_indices_are_accepted_as_on_cuda(vdevices):
    x = torch.arange(6.0, device=vdevices[1]).reshape(2, 3)
    assert torch.equal((x * torch.tensor(2.0)).cpu(), torch.arange(6.0).reshape(2, 3) * 2)
    assert torch.equal(x[torch.tensor([1, 0])].cpu(), torch.arange(6.0).reshape(2, 3)[[1, 0]])


class TinyAttention(nn.Module):
    """Embedding, LayerNorm, SDPA, cat and indexing: the operations a transformer block is made of."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.qkv = nn.Linear(8, 24)

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        q, k, v = self.qkv(h).view(*ids.shape, 3, 2, 4).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        both = torch.cat([attn.transpose(1, 2).flatten(2), h], dim=-1)
        return both[:, -1], both[torch.arange(ids.shape[0], device=ids.device), 0]


def test_transformer_operations_match_cpu_with_gradients(vdevices):
    torch.manual_seed(0)
    cpu = TinyAttention()
    model = copy.deepcopy(cpu).to(vdevices[2])
    assert all(p.device == vdevices[2] for p in model.parameters())
    ids = torch.randint(0, 16, (2, 5))

    outs_cpu, outs_dev = cpu(ids), model(ids.to(vdevices[2]))
    weights = [torch.randn(o.shape) for o in outs_cpu]
    sum((o * w).sum() for o, w in zip(outs_cpu, weights)).backward()
    sum((o * w.to(o.device)).sum() for o, w in zip(outs_dev, weights)).backward()

    for o_cpu, o_dev in zip(outs_cpu, outs_dev):
        assert o_dev.device == vdevices[2]
        torch.testing.assert_close(o_dev.cpu(), o_cpu)  # SDPA takes its math path off the CPU: not bit-exact
    for (name, p_cpu), p_dev in zip(cpu.named_parameters(), model.parameters()):
        assert p_dev.grad.device == vdevices[2], name
        torch.testing.assert_close(p_dev.grad.cpu(), p_cpu.grad, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_to_round_trips_through_every_device_as_real_copies(vdevices, dtype):
    x = (torch.arange(24).reshape(4, 6) % 5).to(dtype).T  # non-contiguous
    moved = x
    for device in [*vdevices, *reversed(vdevices)]:
        previous, moved = moved, moved.to(device)
        assert moved.device == device and moved.dtype == dtype
        assert previous.device == device or moved.data_ptr() != previous.data_ptr()
    assert torch.equal(moved.cpu(), x)

    copy_on_1 = moved.to(vdevices[1])
    copy_on_1.zero_()
    assert torch.equal(moved.cpu(), x), "writing the copy changed the original"


def test_safetensors_and_deepcopy(vdevices, tmp_path):
    tensors = {"w": torch.randn(3, 4, device=vdevices[1]), "b": torch.ones(2, dtype=torch.bfloat16, device=vdevices[3])}
    save_file(tensors, tmp_path / "t.safetensors")
    loaded = load_file(tmp_path / "t.safetensors")
    assert all(torch.equal(loaded[k], t.cpu()) for k, t in tensors.items())
    # safetensors' own device strings know only real backends; an index means the current accelerator.
    on_device = load_file(tmp_path / "t.safetensors", device=2)
    assert {t.device for t in on_device.values()} == {vdevices[2]}

    clone = copy.deepcopy(tensors["w"])
    assert clone.device == vdevices[1] and torch.equal(clone.cpu(), tensors["w"].cpu())


def test_devices_exist_only_inside_the_block():
    with virtual_devices(2) as devices:
        assert devices == [torch.device(BACKEND, 0), torch.device(BACKEND, 1)]
        assert torch.vdev.device_count() == 2 and torch.accelerator.is_available()
        with pytest.raises(RuntimeError, match="invalid device ordinal 2"):
            torch.ones(1, device=f"{BACKEND}:2")
    assert torch.vdev.device_count() == 0 and not torch.accelerator.is_available()
    with pytest.raises(RuntimeError, match="invalid device ordinal 0"):
        torch.ones(1, device=f"{BACKEND}:0")


# --- transformers + accelerate: from_pretrained(..., device_map=...) onto the virtual devices


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    return LlamaForCausalLM(config), "model.layers"


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=96, n_embd=32, n_layer=4, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config), "transformer.h"  # ties lm_head to the input embedding


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_from_pretrained_with_device_map_matches_cpu(vdevices, tmp_path, build):
    torch.manual_seed(0)
    cpu_model, layers = build()
    cpu_model.eval().save_pretrained(tmp_path)
    with torch.device("meta"):
        skeleton = type(cpu_model)(cpu_model.config)
    device_map = pipeline_device_map(skeleton, layers, vdevices)

    model = type(cpu_model).from_pretrained(tmp_path, device_map=device_map).eval()

    for i in range(len(vdevices)):
        assert {p.device for p in model.get_submodule(f"{layers}.{i}").parameters()} == {vdevices[i]}
    ids = torch.randint(1, 96, (2, 7))
    out_cpu = cpu_model(ids, labels=ids)
    out_dev = model(ids.to(vdevices[0]), labels=ids.to(vdevices[0]))
    torch.testing.assert_close(out_dev.logits.cpu(), out_cpu.logits)

    out_cpu.loss.backward()
    out_dev.loss.backward()
    for (name, p_cpu), (_, p_dev) in zip(cpu_model.named_parameters(), model.named_parameters()):
        assert p_dev.grad.device == p_dev.device, name
        torch.testing.assert_close(p_dev.grad.cpu(), p_cpu.grad, msg=name)

    with torch.no_grad():
        new_cpu = cpu_model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        new_dev = model.generate(ids.to(vdevices[0]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(new_dev.cpu(), new_cpu)
