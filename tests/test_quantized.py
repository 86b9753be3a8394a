"""Pre-quantized checkpoints (chatglm2-6b-int4's storage, quantization_bit 4 or 8): loaded as downloaded, they give
the original int4 code's numbers (testdata/golden/chatglm2-int4-tiny), keep their weights quantized in memory, save in
the original's format, and run generate(), chat(), a device map and LoRA. The 8-bit case, and a second 4-bit truth,
come from the case's fp16 source quantized here with the original's arithmetic (the golden README's formulas)."""
import copy
import io
import json
import shutil
import warnings

import pytest
import torch
import transformers
from chatglm_tools import copy_code_into, device_check, held_bytes
from conftest import dtype_kwarg, make_golden_case, optional_package, shared_path
from safetensors.torch import load_file
from virtual_devices import virtual_devices

CASE = "chatglm2-int4-tiny"
QUANTIZED_LAYERS = ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def load(folder, dtype=torch.float32, **kwargs):
    """As a user loads the folder as downloaded: its auto_map has AutoModel only (no AutoModelForCausalLM)."""
    kwargs.update(dtype_kwarg(dtype) if dtype is not None else {})
    return transformers.AutoModel.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    return make_golden_case(CASE, tmp_path_factory.mktemp("int4"))


@pytest.fixture(scope="module")
def int4_model(int4):
    return load(int4.folder)


def inputs(expected):
    return [expected[f"input_ids_{i}"][None] for i in range(3)]


# ---- the original's arithmetic, written from the golden README (independent of quantization_chatglm.py) ----

def quantize_rows(weight: torch.Tensor, bits: int):
    """(codes, scale): q = round(w / (max|w| of the row / (2^(bits-1) - 1))), computed in fp16 as the original."""
    levels = 2 ** (bits - 1) - 1
    weight = weight.half()
    scale = weight.abs().max(dim=-1).values / levels
    codes = torch.round(weight / scale[:, None]).clamp(-levels, levels).to(torch.int8)
    return codes, scale


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """byte k of a row = (q[2k] << 4) | (q[2k+1] & 15), as int8."""
    high, low = codes[:, 0::2].to(torch.int32), codes[:, 1::2].to(torch.int32)
    packed = ((high << 4) | (low & 15)) & 0xFF
    return torch.where(packed > 127, packed - 256, packed).to(torch.int8)


def quantized_source(tmp_path, bits: int, source=None):
    """(quantized folder, float folder holding exactly the dequantized weights) from an fp16 checkpoint (by default
    the golden case's source)."""
    source = source or shared_path("golden", CASE, "source-fp16")
    state = load_file(str(source / "model.safetensors"))
    quantized, dequantized = dict(state), {k: v.float() for k, v in state.items()}
    for name in [n for n in state if n.endswith(".weight") and n.rsplit(".", 1)[0].endswith(QUANTIZED_LAYERS)]:
        codes, scale = quantize_rows(state[name], bits)
        quantized[name] = pack_int4(codes) if bits == 4 else codes
        quantized[name.replace(".weight", ".weight_scale")] = scale
        dequantized[name] = codes.float() * scale.float()[:, None]
    folders = []
    for label, tensors, width in (("quantized", quantized, bits), ("float", dequantized, 0)):
        folder = tmp_path / f"int{bits}_{label}"
        folder.mkdir()
        config = json.loads((source / "config.json").read_text())
        config.update(quantization_bit=width, torch_dtype="float16" if width else "float32")
        (folder / "config.json").write_text(json.dumps(config))
        torch.save(tensors, folder / "pytorch_model.bin")
        folders.append(copy_code_into(folder))
    return folders


# ---- numbers ----

def test_int4_checkpoint_gives_the_original_logits_and_greedy_tokens(int4, int4_model):
    e = int4.expected
    layer = int4_model.transformer.encoder.layers[0].self_attention.query_key_value
    assert layer.weight.dtype == torch.int8 and layer.weight.shape[1] * 2 == layer.in_features
    for i, ids in enumerate(inputs(e)):
        with torch.no_grad():
            logits = int4_model(ids).logits[0]
        torch.testing.assert_close(logits, e[f"logits_{i}"], atol=1e-4, rtol=1e-4)
        greedy = e[f"greedy_{i}"]
        generated = int4_model.generate(ids, max_new_tokens=len(greedy), do_sample=False, eos_token_id=None)
        assert generated[0, ids.shape[1]:].tolist() == greedy.tolist()


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_from_the_fp16_source_equals_its_dequantized_float_model(tmp_path, int4, bits):
    quantized_folder, float_folder = quantized_source(tmp_path, bits)
    quantized, reference = load(quantized_folder), load(float_folder)
    for ids in inputs(int4.expected):
        with torch.no_grad():
            torch.testing.assert_close(quantized(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
    if bits == 4:  # the same codes as the original's quantize(4)
        original = torch.load(int4.folder / "pytorch_model.bin", weights_only=True)
        mine = torch.load(quantized_folder / "pytorch_model.bin", weights_only=True)
        name = "transformer.encoder.layers.0.mlp.dense_h_to_4h.weight"
        assert torch.equal(original[name], mine[name])


def test_a_default_load_runs(int4):
    model = load(int4.folder, dtype=None)
    ids = inputs(int4.expected)[0]
    logits = model(ids).logits
    assert torch.isfinite(logits.float()).all()
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


# ---- the kernels: packed (torch's int4 kernel) and exact (the original's arithmetic) ----

def companion(model):
    import sys
    layer = model.transformer.encoder.layers[0].mlp.dense_h_to_4h
    return sys.modules[type(layer).__module__]


def int4_kernel_or_skip(model):
    if companion(model).int4_kernel(torch.device("cpu")) is None:
        pytest.skip(f"torch {torch.__version__} has no int4 kernel for the CPU: the exact path runs (tested above)")


def quantized_layers(model):
    return [module for module in model.modules() if hasattr(module, "weight_scale")]


def test_a_float32_load_runs_the_exact_path(int4_model):
    assert all(layer.kernel == "auto" and layer.packed is None for layer in quantized_layers(int4_model))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_the_exact_path_block_by_block_equals_the_dequantized_weights_product(int4, monkeypatch, dtype, tolerance):
    """The exact path turns a block of rows of codes into floats at a time; several blocks give the product of the
    whole dequantized weight (the original's arithmetic), within fp32's or bf16's rounding of the regrouped sums."""
    model = load(int4.folder, dtype)
    generator = torch.Generator().manual_seed(0)
    for layer in quantized_layers(model.transformer.encoder.layers[0]):
        monkeypatch.setattr(companion(model), "EXACT_BLOCK", 48 * layer.weight.shape[1])  # 48 rows: a short last one
        x = torch.randn(3, 5, layer.in_features, generator=generator).to(dtype)
        expected = torch.nn.functional.linear(x.float(), layer.dequantized_weight(torch.float32),
                                              None if layer.bias is None else layer.bias.float())
        torch.testing.assert_close(layer.exact_forward(x, layer.bias).float(), expected,
                                   atol=tolerance * expected.abs().max().item(), rtol=0)


def test_the_packed_kernel_gives_the_exact_paths_logits_within_bf16s_rounding(int4):
    """One decode step of the packed kernel (the default in bf16) against the same model on the exact path, and the
    fp32 opt-in against the fp32 exact path: within 2% of the largest logit (bf16 activations: ~8 bits of mantissa)."""
    for dtype in (torch.bfloat16, torch.float32):
        model = load(int4.folder, dtype)
        int4_kernel_or_skip(model)
        if dtype == torch.float32:
            assert model.use_quantized_kernel("packed") == len(quantized_layers(model))
        assert all(layer.packed is not None for layer in quantized_layers(model))
        ids = inputs(int4.expected)[0]
        with torch.no_grad():
            cache = model(ids[:, :-1], use_cache=True).past_key_values  # the prompt (many rows) runs exact
            packed = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits.float()
            model.use_quantized_kernel("exact")
            exact = model(ids).logits[:, -1:].float()
        scale = exact.abs().max().item()
        torch.testing.assert_close(packed, exact, atol=0.02 * scale, rtol=0)
        assert not torch.equal(packed, exact)  # the packed kernel did run


def test_exact_again_after_packed_gives_the_original_logits(int4):
    model = load(int4.folder)
    int4_kernel_or_skip(model)
    model.use_quantized_kernel("packed")
    model.use_quantized_kernel("exact")
    with torch.no_grad():
        torch.testing.assert_close(model(inputs(int4.expected)[1]).logits[0], int4.expected["logits_1"],
                                   atol=1e-4, rtol=1e-4)


def test_the_packed_kernel_runs_for_few_rows_only_and_never_under_autograd(int4):
    model = load(int4.folder, torch.bfloat16)
    int4_kernel_or_skip(model)
    layer = model.transformer.encoder.layers[0].mlp.dense_4h_to_h
    generator = torch.Generator().manual_seed(0)
    rows = companion(model).PACKED_MAX_ROWS
    few, many = (torch.randn(1, n, layer.in_features, generator=generator, dtype=torch.bfloat16)
                 for n in (rows, rows + 1))
    with torch.no_grad():
        assert not torch.equal(layer(few), layer.exact_forward(few, None))
        assert torch.equal(layer(many), layer.exact_forward(many, None))
    x = few.clone().requires_grad_(True)
    layer(x).float().square().sum().backward()  # torch's int4 kernels have no backward: the exact path runs
    reference = few.clone().requires_grad_(True)
    layer.exact_forward(reference, None).float().square().sum().backward()
    assert torch.equal(x.grad, reference.grad)


def test_without_an_int4_kernel_the_exact_path_runs_and_packed_is_refused(int4, monkeypatch):
    model = load(int4.folder, torch.bfloat16)
    monkeypatch.setitem(companion(model)._KERNELS, "cpu", None)  # as on a torch without the kernel
    assert model.use_quantized_kernel("auto") == 0
    with torch.no_grad():
        assert torch.isfinite(model(inputs(int4.expected)[0]).logits).all()
    with pytest.raises(ValueError, match="use_quantized_kernel\\('packed'\\): torch .* no int4 kernel.*'exact'"):
        model.use_quantized_kernel("packed")
    with pytest.raises(ValueError, match="kernel='fast'.*'auto', 'exact', 'packed'"):
        model.use_quantized_kernel("fast")


def int8_kernel_or_skip(model):
    if not companion(model).int8_kernel_works(torch.device("cpu")):
        pytest.skip(f"torch {torch.__version__} has no int8 kernel for the CPU: the exact path runs (tested below)")


def dequantized_reference(folder) -> dict:
    """name -> the float weight the stored codes stand for (codes * scale per row, 8 bits), in fp32."""
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    return {name: tensor.float() * state[name + "_scale"].float()[:, None]
            for name, tensor in state.items() if tensor.dtype == torch.int8}


def decode_step_logits(model, ids):
    """The logits of the last token fed alone after the others as a prompt (the prompt runs exact)."""
    with torch.no_grad():
        cache = model(ids[:, :-1], use_cache=True).past_key_values
        return model(ids[:, -1:], past_key_values=cache, use_cache=True).logits.float()


def test_an_8_bit_model_decodes_on_torchs_int8_kernel_within_bf16s_rounding(tmp_path, int4):
    """quantization_bit=8: in bf16 each layer multiplies one row through `_weight_int8pack_mm` on the stored codes
    (x @ codes.T * scale), within bf16's rounding of the dequantized weights' product; a decode step's logits within
    2% of the largest of the exact path's; the codes are the kernel's input as stored (no second copy)."""
    quantized_folder, _ = quantized_source(tmp_path, 8)
    model = load(quantized_folder, torch.bfloat16)
    int8_kernel_or_skip(model)
    layers = quantized_layers(model)
    assert all(layer.packed is not None for layer in layers)
    generator = torch.Generator().manual_seed(0)
    for name, weight in dequantized_reference(quantized_folder).items():
        layer = model.get_submodule(name.rsplit(".", 1)[0])
        x = torch.randn(1, layer.in_features, generator=generator).to(torch.bfloat16)
        expected = x.float() @ weight.T
        with torch.no_grad():
            got = layer(x).float() - (0 if layer.bias is None else layer.bias.float())
        torch.testing.assert_close(got, expected, atol=0.01 * expected.abs().max().item(), rtol=0)
    exact_model = load(quantized_folder, torch.bfloat16)
    exact_model.use_quantized_kernel("exact")
    # all the kernel adds: its bf16 scales (none where the load made the scales bf16 already: 4.x)
    scales = sum(layer.out_features * 2 for layer in layers)
    assert held_bytes(model) - held_bytes(exact_model) in (0, scales)
    ids = inputs(int4.expected)[0]
    packed = decode_step_logits(model, ids)
    model.use_quantized_kernel("exact")
    exact = decode_step_logits(model, ids)
    torch.testing.assert_close(packed, exact, atol=0.02 * exact.abs().max().item(), rtol=0)
    assert not torch.equal(packed, exact)  # the kernel did run


def test_an_8_bit_model_in_fp32_takes_the_int8_kernel_as_an_opt_in(tmp_path, int4):
    quantized_folder, float_folder = quantized_source(tmp_path, 8)
    model, reference = load(quantized_folder), load(float_folder)
    int8_kernel_or_skip(model)
    assert all(layer.packed is None for layer in quantized_layers(model))  # fp32: exact by default
    ids = inputs(int4.expected)[1]
    assert model.use_quantized_kernel("packed") == len(quantized_layers(model))
    exact = decode_step_logits(reference, ids)
    torch.testing.assert_close(decode_step_logits(model, ids), exact, atol=0.02 * exact.abs().max().item(), rtol=0)
    model.use_quantized_kernel("exact")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)


def test_without_an_int8_kernel_the_exact_path_runs_and_packed_is_refused(tmp_path, int4, monkeypatch):
    model = load(quantized_source(tmp_path, 8)[0], torch.bfloat16)
    monkeypatch.setitem(companion(model)._INT8_WORKS, "cpu", False)  # as on a torch without the kernel
    assert model.use_quantized_kernel("auto") == 0
    assert all(layer.packed is None for layer in quantized_layers(model))
    with pytest.raises(ValueError, match="use_quantized_kernel\\('packed'\\): torch .* no int8 kernel.*'exact'"):
        model.use_quantized_kernel("packed")


def test_use_quantized_kernel_on_a_float_model_is_refused(tiny_model):
    with pytest.raises(ValueError, match="not pre-quantized.*quantization_bit"):
        tiny_model("chatglm3").use_quantized_kernel()


def test_a_packed_model_saves_the_original_storage(int4, tmp_path):
    model = load(int4.folder, torch.bfloat16)
    original = torch.load(int4.folder / "pytorch_model.bin", weights_only=True)
    assert sorted(model.state_dict()) == sorted(original)
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():  # (a bf16 load on 4.x rounds the fp16 scales to bf16: dtype only)
        if tensor.dtype == torch.int8 or name.endswith("weight_scale"):
            assert saved[name].dtype == tensor.dtype, name
        if tensor.dtype == torch.int8:
            assert torch.equal(saved[name], tensor), name


def test_loading_new_codes_packs_them_again(int4):
    model = load(int4.folder, torch.bfloat16)
    int4_kernel_or_skip(model)
    layers = model.transformer.encoder.layers
    layer, other = layers[1].self_attention.dense, layers[0].self_attention.dense
    x = torch.randn(1, layer.in_features, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    with torch.no_grad():
        layer.load_state_dict(other.state_dict())
        assert layer.packed is not None and torch.equal(layer(x), other(x))


# ---- the packed bytes as the only storage (bf16/fp16 models, where the kernel's layout reads back) ----

def stored_codes(folder):
    return {name: tensor for name, tensor in torch.load(folder / "pytorch_model.bin", weights_only=True).items()
            if tensor.dtype == torch.int8}


def packed_bf16_model(int4):
    model = load(int4.folder, torch.bfloat16)
    int4_kernel_or_skip(model)
    layers = quantized_layers(model)
    assert all(layer.packed_storage() is not None for layer in layers), [layer.packed for layer in layers]
    return model


def test_a_packed_model_holds_one_copy_of_the_codes_and_reads_them_back(int4):
    model = packed_bf16_model(int4)
    codes = stored_codes(int4.folder)
    int4_bytes = sum(t.numel() for t in codes.values())
    codes_beside = load(int4.folder, torch.bfloat16)
    codes_beside.use_quantized_kernel("exact")
    # the packed bytes replace the codes: only the kernel's scales are added (4 bytes per group of columns)
    assert held_bytes(model) - held_bytes(codes_beside) <= 0.15 * int4_bytes
    state = model.state_dict()
    for name, tensor in codes.items():
        layer = model.get_submodule(name.rsplit(".", 1)[0])
        assert not torch.equal(layer.weight, tensor), name  # the storage is the packed layout...
        assert torch.equal(layer.codes(), tensor) and torch.equal(state[name], tensor), name  # ...read back exactly


def test_prompts_on_the_packed_storage_equal_the_exact_path_on_the_codes(int4):
    """A prompt (more rows than the packed kernel takes) reads the codes back from the packed bytes, block by block:
    the same logits, bit for bit, as the model holding the codes."""
    model = packed_bf16_model(int4)
    reference = load(int4.folder, torch.bfloat16)
    reference.use_quantized_kernel("exact")
    rows = companion(model).PACKED_MAX_ROWS
    for seed in range(2):
        ids = torch.randint(0, 512, (1, rows + 8), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.matrix_ends  # torch.compile of one kernel: the torch ends and the matrix's ends run it
def test_a_gpus_compiled_dequantization_is_as_accurate_as_the_exact_path(int4, int4_model, monkeypatch):
    """On a GPU a prompt dequantizes the packed bytes in one compiled kernel (here run on the CPU): the weight equals
    the codes' bit for bit, and the bf16 logits are as far from the fp32 model's as the block path's (one product
    rounds differently from two); where torch.compile fails, a warning and the block path, and where it gives up on a
    shape, the block path."""
    model = packed_bf16_model(int4)
    module = companion(model)
    rows = module.PACKED_MAX_ROWS
    ids = torch.randint(0, 512, (1, rows + 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        truth = int4_model(ids).logits
        blocks = model(ids).logits.float()
        monkeypatch.setattr(module, "FUSED_DEVICES", ("cpu",))
        monkeypatch.setitem(module._FUSED, "dequantize", torch.compile(module.compiled_dequantize, dynamic=False))
        layer = quantized_layers(model)[0]
        scale = layer.weight_scale.to(torch.bfloat16)
        weight = module.fused_dequantize(layer.packed.layout, layer.weight, scale, layer.out_features,
                                         layer.in_features, torch.bfloat16)
        assert torch.equal(weight, layer.dequantized_weight(torch.bfloat16))
        fused = model(ids).logits.float()
        assert not torch.equal(fused, blocks)  # the compiled path ran
        for error in (torch.amax, torch.mean):
            assert error((fused - truth).abs()) <= 1.25 * error((blocks - truth).abs())

        # torch.compile giving up on a shape runs the function eagerly, which would take several times the weight's
        # memory: the block path instead, and the compiled one stays for the other shapes
        monkeypatch.setitem(module._FUSED, "dequantize", module.compiled_dequantize)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(model(ids).logits.float(), blocks)
        assert module._FUSED["dequantize"] is module.compiled_dequantize

        def failing(*args):
            raise RuntimeError("no compiler")

        monkeypatch.setitem(module._FUSED, "dequantize", failing)
        with pytest.warns(UserWarning, match="slower exact path: torch.compile failed.*no compiler"):
            assert torch.equal(model(ids).logits.float(), blocks)
        assert module._FUSED["dequantize"] is None


def test_a_packed_layer_stays_right_through_copies_moves_and_replacements(int4):
    model = packed_bf16_model(int4)
    layer = model.transformer.encoder.layers[0].mlp.dense_h_to_4h
    codes = layer.codes().clone()
    x = torch.randn(1, layer.in_features, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    with torch.no_grad():
        expected = layer(x)
        copied = copy.deepcopy(layer)  # copied (and pickled) as codes, packed again
        assert copied.packed_storage() is not None and torch.equal(copied.codes(), codes)
        assert torch.equal(copied(x), expected)
        buffer = io.BytesIO()
        torch.save(layer, buffer)
        buffer.seek(0)
        assert torch.equal(torch.load(buffer, weights_only=False).codes(), codes)
        layer.to("meta")  # a move packs again where the layer is now (on meta: nothing to pack)
        assert layer.packed is None and layer.weight.device.type == "meta"
        layer = copied
        # accelerate's set_module_tensor_to_device puts a new tensor in: the packed bytes moved, or codes
        layer._parameters["weight"] = torch.nn.Parameter(layer.weight.clone(), requires_grad=False)
        assert torch.equal(layer.codes(), codes) and torch.equal(layer(x), expected)
        layer._parameters["weight"] = torch.nn.Parameter(codes.clone(), requires_grad=False)
        assert torch.equal(layer.codes(), codes) and torch.equal(layer.state_dict()["weight"], codes)
        layer.use_kernel("auto")
        assert layer.packed_storage() is not None and torch.equal(layer(x), expected)
        layer.float()  # "auto" in fp32 is the exact path: the codes come back into the weight
        assert layer.packed is None and torch.equal(layer.weight, codes)


def test_a_packed_model_moved_to_another_device_and_back_keeps_its_codes_and_kernel(int4):
    """model.to() carries the packed bytes, reads the codes back from them on the new device and packs them again
    for that device's kernel (a virtual device has none: the exact path), and again on the way back."""
    model = packed_bf16_model(int4)
    codes = stored_codes(int4.folder)
    ids = inputs(int4.expected)[0]
    with torch.no_grad():
        expected = model(ids).logits
        with virtual_devices(1) as devices:
            model.to(devices[0])
            for name, tensor in codes.items():
                layer = model.get_submodule(name.rsplit(".", 1)[0])
                assert layer.packed is None and torch.equal(layer.weight.cpu(), tensor), name
            exact = model(ids.to(devices[0])).logits.cpu()
            model.to("cpu")
        assert all(layer.packed_storage() is not None for layer in quantized_layers(model))
        assert torch.equal(model(ids).logits, expected)
        assert torch.equal(model.state_dict()[next(iter(codes))], next(iter(codes.values())))
    torch.testing.assert_close(exact.float(), expected.float(), atol=0.05 * expected.abs().max().item(), rtol=0)


def test_a_packed_model_with_a_layer_offloaded_to_disk_computes_what_one_device_does(int4, tmp_path):
    """accelerate's disk offload: the offloaded layer is on meta when the model packs (it keeps its codes, which the
    hook brings in for each call: the exact path), the others pack; prompts and generate() as one device's, the
    packed layers' codes in the state dict."""
    model = packed_bf16_model(int4)
    device_map = {"transformer.embedding": "cpu", "transformer.rotary_pos_emb": "cpu",
                  "transformer.encoder.layers.0": "cpu", "transformer.encoder.layers.1": "disk",
                  "transformer.encoder.final_layernorm": "cpu", "transformer.output_layer": "cpu"}
    offloaded = load(int4.folder, torch.bfloat16, device_map=device_map, offload_folder=str(tmp_path / "offload"))
    layers = offloaded.transformer.encoder.layers
    assert all(layer.packed_storage() is not None for layer in quantized_layers(layers[0]))
    assert all(layer.weight.device.type == "meta" and layer.packed is None for layer in quantized_layers(layers[1]))
    ids = torch.randint(0, 512, (1, companion(model).PACKED_MAX_ROWS + 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(offloaded(ids).logits, model(ids).logits)
        assert torch.equal(offloaded.generate(ids[:, :5], max_new_tokens=6, do_sample=False, eos_token_id=None),
                           model.generate(ids[:, :5], max_new_tokens=6, do_sample=False, eos_token_id=None))
    state = offloaded.state_dict()  # (the offloaded layer's entries are accelerate's meta placeholders)
    held = {name: tensor for name, tensor in stored_codes(int4.folder).items() if ".layers.0." in name}
    assert held and all(torch.equal(state[name], tensor) for name, tensor in held.items())


def test_where_the_layout_is_not_known_the_codes_stay_beside_the_packed_copy(int4, monkeypatch):
    model = load(int4.folder, torch.bfloat16)
    int4_kernel_or_skip(model)
    monkeypatch.setattr(companion(model), "learn_layout", lambda kernel, device: None)
    companion(model)._LAYOUTS.clear()
    try:
        assert model.use_quantized_kernel("auto") == len(quantized_layers(model))
        layers = quantized_layers(model)
        assert all(layer.packed is not None and layer.packed_storage() is None for layer in layers)
        state = model.state_dict()
        for name, tensor in stored_codes(int4.folder).items():
            assert torch.equal(state[name], tensor), name
    finally:
        companion(model)._LAYOUTS.clear()


def test_the_learned_layout_explains_a_made_up_packing(int4, monkeypatch):
    """learn_layout recovers a tiling it was not written for (tiles of 8 rows x 16 columns, each tile's values
    reversed; a GPU's tiles have several columns too), which unpack and dequantize_tiles then read; it finds none in
    a packing that changes the values."""
    module = companion(load(int4.folder, torch.bfloat16))

    def tiled(q):
        out, inputs = q.shape
        tiles = q.view(out // 8, 8, inputs // 16, 16).transpose(1, 2).reshape(-1, 128).flip(-1)
        return (tiles[:, 1::2] << 4 | tiles[:, 0::2]).reshape(-1)

    kernel = module.Int4Kernel("made_up", "made_up", "int32", 0)
    monkeypatch.setattr(module.Int4Kernel, "convert", lambda self, q: tiled(q.to(torch.uint8)))
    layout = module.learn_layout(kernel, torch.device("cpu"))
    assert (layout.rows, layout.cols) == (8, 16)
    codes = torch.randint(-128, 128, (64, 128), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    q = torch.stack(((codes >> 4) + 8, ((codes << 4) >> 4) + 8), dim=-1).flatten(-2).to(torch.uint8)
    assert torch.equal(layout.unpack(tiled(q), 64, 256), codes)
    assert torch.equal(layout.unpack(tiled(q), 64, 256, 20, 37), codes[20:37])
    # the GPU's compiled dequantization reads the same tiles (eager here: the index tensors are small)
    scale = torch.rand(64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    weight = module.dequantize_tiles(tiled(q), layout.order, scale, 8, 16, 64, 256, torch.bfloat16)
    assert torch.equal(weight, (q.to(torch.bfloat16) - 8) * scale[:, None])
    monkeypatch.setattr(module.Int4Kernel, "convert", lambda self, q: tiled(q.to(torch.uint8) ^ 1))
    assert module.learn_layout(kernel, torch.device("cpu")) is None


# ---- memory and storage ----

def test_weights_stay_quantized_in_memory(int4):
    stored = sum(t.numel() * t.element_size()
                 for t in torch.load(int4.folder / "pytorch_model.bin", weights_only=True).values())
    model = load(int4.folder, dtype=torch.float16)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert held <= 1.2 * stored, (held, stored)


def test_save_pretrained_writes_the_original_format_and_reloads(int4, int4_model, tmp_path):
    int4_model.save_pretrained(tmp_path / "saved")  # safetensors (the original's loader reads them since 4.27)
    original = torch.load(int4.folder / "pytorch_model.bin", weights_only=True)
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        if tensor.dtype == torch.int8 or name.endswith("weight_scale"):  # the quantized layers, bit for bit
            assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["quantization_bit"] == 4
    reloaded = load(tmp_path / "saved")
    ids = inputs(int4.expected)[1]
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, int4_model(ids).logits)


# ---- what users run on it ----

def test_generate_over_a_device_map_equals_one_device(int4, int4_model):
    ids = inputs(int4.expected)[2]
    expected = int4_model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    with virtual_devices(2) as devices:
        num_layers = json.loads((int4.folder / "config.json").read_text())["num_layers"]
        device_map = device_check.spread_device_map(num_layers, devices)
        model = load(int4.folder, device_map=device_map)
        assert {p.device for p in model.transformer.encoder.layers.parameters()} == set(devices)
        generated = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert generated.cpu().tolist() == expected.tolist()


def test_chat_on_a_quantized_chatglm2_model_answers_as_its_float_twin(tmp_path):
    """ChatGLM2's chat() through the quantized layers: the same answer as the float model with the dequantized weights.
    The model: a random chatglm2-6b-shaped one with the real vocabulary, quantized here."""
    from conftest import randomize_
    from tokenizer_fixtures import make_chatglm2_folder

    source = make_chatglm2_folder(tmp_path / "source", config_changes={"padded_vocab_size": 65024})
    config = transformers.AutoConfig.from_pretrained(source, trust_remote_code=True)
    randomize_(transformers.AutoModel.from_config(config, trust_remote_code=True)).half().save_pretrained(source)
    quantized_folder, float_folder = quantized_source(tmp_path, 4, source)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source, trust_remote_code=True)
    answers = []
    for folder in (quantized_folder, float_folder):
        model = load(folder)
        torch.manual_seed(0)
        answers.append(model.chat(tokenizer, "hi", history=[], max_length=40, do_sample=False)[0])
    assert answers[0] == answers[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-codes-held", "bf16-packed-bytes"])
def test_lora_trains_on_top_of_the_quantized_layers(int4, dtype):
    """LoRA through PEFT on the original module names; in bf16 on the packed storage, whose codes the grad path
    reads back. The codes never change."""
    peft = optional_package("peft", "peft")
    model = packed_bf16_model(int4) if dtype == torch.bfloat16 else load(int4.folder)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value"],
                                                       init_lora_weights=False))
    model.train()
    ids = inputs(int4.expected)[0]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    base = model.base_model.model
    for name, tensor in stored_codes(int4.folder).items():
        layer = base.get_submodule(name.rsplit(".", 1)[0])
        assert torch.equal(getattr(layer, "base_layer", layer).codes(), tensor), name


def test_the_quantized_codes_cannot_be_trained(int4_model):
    with pytest.raises(RuntimeError, match="floating point"):
        int4_model.transformer.encoder.layers[0].mlp.dense_4h_to_h.weight.requires_grad_(True)


def test_quantize_on_a_model_loaded_quantized_is_refused(int4_model):
    with pytest.raises(ValueError, match="already quantized.*quantization_bit=4"):
        int4_model.quantize(8)


# ---- quantizing a float model: the blocks in the original's storage, the output layer (opt-in) ----

@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_in_the_original_storage_writes_what_the_original_would(tmp_path, int4, bits):
    """quantize(bits, storage="original") on the fp16 source: the codes and scales of the original's quantize(bits)
    (quantize_rows above, from the golden README), the logits of the pre-quantized checkpoint holding them, and
    save_pretrained writes that checkpoint (quantization_bit, the same keys), which loads back to the same logits."""
    quantized_folder, _ = quantized_source(tmp_path, bits)
    source = tmp_path / "source"
    shutil.copytree(shared_path("golden", CASE, "source-fp16"), source)
    copy_code_into(source)
    model = load(source).quantize(bits, storage="original")
    assert model.config.quantization_bit == bits and len(quantized_layers(model)) == len(stored_codes(quantized_folder))
    expected = torch.load(quantized_folder / "pytorch_model.bin", weights_only=True)
    state = model.state_dict()
    for name, tensor in expected.items():
        if tensor.dtype == torch.int8 or name.endswith("weight_scale"):
            assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    reference = load(quantized_folder)
    ids = inputs(int4.expected)[2]
    with torch.no_grad():
        logits = model(ids).logits
        torch.testing.assert_close(logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_bit"] == bits
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(saved) == sorted(expected)
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "saved")(ids).logits, logits)


def test_quantize_with_an_unknown_storage_is_refused(int4_model, tiny_model):
    with pytest.raises(ValueError, match="storage='codes'.*'library'.*'original'"):
        tiny_model("glm4").quantize(8, storage="codes")


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_output_layer_gives_its_codes_product_and_saves_as_floats(tiny_model, tmp_path, bits):
    """quantize_output_layer(bits): the logits are the hidden states times the original's per-row quantization of
    the head (quantize_rows), within bf16's rounding of the activations (the packed kernel decodes); a prompt's
    logits on the exact path within fp32's; the state dict keeps the original's key with the float values of the
    codes, so a saved checkpoint loads as a float one."""
    model = tiny_model("glm4")
    head = model.transformer.output_layer.weight.detach().clone()
    codes, scale = quantize_rows(head, bits)
    dequantized = codes.float() * scale.float()[:, None]
    assert model.quantize_output_layer(bits) is model
    layer = model.transformer.output_layer
    assert layer.weight.dtype == torch.int8 and layer.weight.numel() == head.numel() * bits // 8
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model.transformer(ids).last_hidden_state
        prompt = model(ids).logits  # 40 rows: the exact path
        decode = model(ids, logits_to_keep=1).logits  # 1 row: the packed kernel where torch has it
    expected = hidden.float() @ dequantized.T
    torch.testing.assert_close(prompt.float(), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    torch.testing.assert_close(decode.float(), expected[:, -1:], atol=0.01 * expected.abs().max().item(), rtol=0)
    state = model.state_dict()
    assert "transformer.output_layer.weight_scale" not in state
    assert torch.equal(state["transformer.output_layer.weight"], dequantized)
    model.save_pretrained(tmp_path / "saved")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", trust_remote_code=True)
    assert type(reloaded.transformer.output_layer) is torch.nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, prompt, atol=1e-5, rtol=1e-5)


def test_quantize_output_layer_refuses_what_it_cannot_do(tiny_model):
    model = tiny_model("glm4")
    with pytest.raises(ValueError, match="bits=3.*8 or 4"):
        model.quantize_output_layer(3)
    model.quantize_output_layer(8)
    with pytest.raises(ValueError, match="QuantizedHead already"):
        model.quantize_output_layer(4)
    tied = tiny_model("glm4", tie_word_embeddings=True)
    tied.tie_weights()
    with pytest.raises(ValueError, match="shares its weight with the input embedding.*untie"):
        tied.quantize_output_layer(8)


def test_a_pre_quantized_model_with_a_quantized_output_layer_follows_the_models_kernel(int4):
    """On chatglm2-6b-int4's layout (fp16 output layer): the int4 head packs beside the blocks in bf16, and
    use_quantized_kernel("exact") takes the whole model, head included, back to the exact path."""
    model = load(int4.folder, torch.bfloat16).quantize_output_layer(4)
    int4_kernel_or_skip(model)
    head = model.transformer.output_layer
    assert head.packed is not None and head in quantized_layers(model)
    model.use_quantized_kernel("exact")
    assert head.packed is None and head.kernel == "exact"


# ---- 16-bit weights in oneDNN's blocked layout for a CPU's decode (use_cpu_packed_weights, opt-in) ----

def onednn_or_skip(model):
    if not companion_of(model).onednn_works():
        pytest.skip(f"torch {torch.__version__} has no oneDNN prepacked linear on this CPU: the opt-in is refused")


def companion_of(model):
    import sys
    model.use_cpu_packed_weights(False)  # imports the companion file
    return sys.modules[type(model).__module__.rsplit(".", 1)[0] + ".quantization_chatglm"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_packed_weights_give_the_eager_decode_within_rounding_and_change_nothing_else(tiny_model, dtype):
    """use_cpu_packed_weights(): one sequence's decode step (one row per layer) takes the matrix-vector kernel in bf16
    (no copy made) and the blocked copy in fp16; two sequences' step (two rows) the blocked copy; each within the
    dtype's rounding of the plain model's logits; a prompt is bit for bit (it takes F.linear); the state dict and the
    parameters are the same tensors; a deepcopy and a weight changed in place are seen; False gives plain nn.Linear
    layers back."""
    model, plain = tiny_model("glm4").to(dtype), tiny_model("glm4").to(dtype)
    onednn_or_skip(model)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    before = dict(model.state_dict())
    assert model.use_cpu_packed_weights() == len(linears) > 0
    assert all(isinstance(m, torch.nn.Linear) for m in linears)
    state = model.state_dict()
    assert list(state) == list(before) and all(state[k] is before[k] or torch.equal(state[k], before[k]) for k in state)
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = decode_step_logits(plain, ids[:1]), decode_step_logits(model, ids[:1])
        copies = [m.__dict__.get("onednn") is not None for m in linears]
        assert copies == [dtype == torch.float16] * len(linears)  # bf16: the matrix-vector kernel, no copy
        torch.testing.assert_close(got, expected, atol=0.01 * expected.abs().max().item(), rtol=0)
        expected, got = decode_step_logits(plain, ids), decode_step_logits(model, ids)
        assert all(m.__dict__.get("onednn") is not None for m in linears)  # two rows: the blocked copies
        torch.testing.assert_close(got, expected, atol=0.01 * expected.abs().max().item(), rtol=0)
        assert torch.equal(model(ids).logits, plain(ids).logits)  # 80 rows: F.linear
        copied = copy.deepcopy(model)
        torch.testing.assert_close(decode_step_logits(copied, ids), got, atol=0, rtol=0)
        for m in (model, plain):
            m.transformer.encoder.layers[0].mlp.dense_4h_to_h.weight.mul_(2)
        expected, got = decode_step_logits(plain, ids), decode_step_logits(model, ids)
        torch.testing.assert_close(got, expected, atol=0.01 * expected.abs().max().item(), rtol=0)
    assert model.use_cpu_packed_weights(False) == 0
    assert all(type(m) is torch.nn.Linear and "onednn" not in m.__dict__ for m in linears)


def test_cpu_packed_weights_share_an_fp32_rows_product_over_the_threads_and_leave_training_alone(
        tiny_model, monkeypatch):
    """fp32 (no oneDNN needed): one row's product runs over blocks of output rows, one per torch thread, each block
    on torch's matrix-vector kernel: the same bits as that kernel on the whole weight, within fp32's rounding of the
    plain model (F.linear); a prompt (many rows) is F.linear's bit for bit; no copy is made. Under autograd: the plain
    product, the same gradients."""
    model, plain = tiny_model("glm4"), tiny_model("glm4")
    companion = companion_of(model)
    model.use_cpu_packed_weights()
    split = []
    split_rows = companion.split_rows
    monkeypatch.setattr(companion, "split_rows", lambda *args: split.append(split_rows(*args)) or split[-1])
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(companion, "SPLIT_MIN_BYTES", 0)  # the tiny model's layers would stay whole
        monkeypatch.setattr(companion, "SPLIT_ALIGN", 8)
        shared = decode_step_logits(model, ids)
        with torch.inference_mode():  # the other threads take the caller's mode along
            assert torch.equal(decode_step_logits(model, ids), shared)
        monkeypatch.setattr(companion, "SPLIT_MIN_BYTES", 2 ** 62)
        whole = decode_step_logits(model, ids)
    finally:
        torch.set_num_threads(threads)
    linears = [m for m in model.modules() if type(m) is companion.OneDnnLinear]
    assert split == [True] * 2 * len(linears) + [False] * len(linears)  # every layer shared out (twice), then none
    assert torch.equal(shared, whole)
    expected = decode_step_logits(plain, ids)
    torch.testing.assert_close(shared, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)  # 12 rows: F.linear
    assert not any("onednn" in m.__dict__ for m in linears)
    monkeypatch.setattr(companion, "SPLIT_MIN_BYTES", 2 ** 20)
    monkeypatch.setattr(companion, "SPLIT_ALIGN", 64)
    for rows, row_bytes, count in [(4096, 1024, 2), (130, 2 ** 14, 2), (130, 2 ** 10, 1), (64, 2 ** 20, 1)]:
        torch.set_num_threads(2)
        try:
            got = companion.row_blocks(rows, row_bytes)
        finally:
            torch.set_num_threads(threads)
        assert [start for start, _ in got] == [0] + [stop for _, stop in got[:-1]] and got[-1][1] == rows
        assert all(start % 64 == 0 for start, _ in got) and len(got) == count, (rows, row_bytes, got)
    model.train()
    plain.train()
    for m in (model, plain):
        m(input_ids=ids[:, :1], labels=ids[:, :1]).loss.backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), name


def test_cpu_packed_weights_under_torch_compile_take_the_plain_product(tiny_model):
    """A compiled forward (fullgraph, static cache, as the docs' CPU recipe) traces F.linear: before, a prompt of up to
    32 rows reached oneDNN's reorder under the compiler's fake tensors and failed. The backend here runs the traced
    graphs eagerly: the eager plain model's tokens, and no copy made."""
    from torch._dynamo.testing import CompileCounter

    model, plain = tiny_model("glm4").to(torch.bfloat16), tiny_model("glm4").to(torch.bfloat16)
    onednn_or_skip(model)
    model.use_cpu_packed_weights()
    ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            expected = plain.generate(ids, **kwargs)
            model.forward = torch.compile(model.forward, backend=CompileCounter(), fullgraph=True, dynamic=False)
            got = model.generate(ids, cache_implementation="static", **kwargs)
    finally:
        torch._dynamo.reset()
    assert got.tolist() == expected.tolist()
    assert not any("onednn" in m.__dict__ for m in model.modules())


def test_cpu_packed_weights_are_refused_for_16_bits_where_torch_has_no_onednn_linear(tiny_model, monkeypatch):
    """An AVX2 CPU without AVX-512: torch's oneDNN linear has no bf16 path there. A 16-bit model is refused (its
    paths would be the eager ones); an fp32 one takes its own path, which needs no oneDNN."""
    model = tiny_model("glm4")
    monkeypatch.setattr(companion_of(model), "_ONEDNN_WORKS", [False])
    assert model.use_cpu_packed_weights() > 0
    model.use_cpu_packed_weights(False)
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="use_cpu_packed_weights\\(\\): torch .* no working oneDNN linear.*bfloat16"):
        model.use_cpu_packed_weights()


@pytest.mark.parametrize("request_kwargs", [{"tp_plan": "auto"}, {"tp_size": 2}])
def test_tensor_parallelism_refuses_a_quantized_checkpoint(int4, request_kwargs):
    # As a user asks for it, here without torchrun: the refusal must come before torchrun's environment is asked for.
    with pytest.raises(ValueError, match="quantization_bit=4: tensor parallelism does not shard.*device_map='auto'"):
        load(int4.folder, **request_kwargs)


# ---- config.json's quantization_bit against what the checkpoint stores ----

@pytest.mark.parametrize("layout", ["safetensors", "torch file"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_bit_over_float_weights_is_refused_naming_the_field_and_the_fix(tmp_path, bits, layout):
    """"quantization_bit": 8 over float weights loaded with every int8 weight zero (logits off by 9, only a missing
    weight_scale in the load report); 4 ended in transformers' size-mismatch error, which never named the field."""
    folder = tmp_path / f"float_with_bits_{bits}"
    if layout == "safetensors":
        shutil.copytree(shared_path("golden", CASE, "source-fp16"), folder)
        stored = "float16"
    else:
        folder = quantized_source(tmp_path, bits)[1]  # the float twin, a pytorch_model.bin in float32
        stored = "float32"
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, quantization_bit=bits)))
    copy_code_into(folder)
    with pytest.raises(ValueError, match=rf"quantization_bit={bits} .* stores transformer\.encoder\.layers\.0\.\S+ "
                                         rf"as {stored}: the checkpoint holds float weights.*Remove quantization_bit "
                                         rf"from config\.json.*model\.quantize\({bits}\) after loading"):
        load(folder)
    (folder / "config.json").write_text(json.dumps(dict(config, quantization_bit=0)))  # the fix the message names
    assert quantized_layers(load(folder).quantize(bits, storage="original"))


def test_pre_quantized_weights_under_a_config_without_quantization_bit_name_the_field(int4, tmp_path):
    folder = tmp_path / "int4_without_bits"
    shutil.copytree(int4.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_bit"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"is stored as int8 .* It is pre-quantized: set quantization_bit in "
                                         r"config\.json"):
        load(folder)


def test_modeling_file_copied_alone_names_the_companion_file(int4, tmp_path):
    folder = tmp_path / "modeling_only"
    shutil.copytree(int4.folder, folder)
    (folder / "quantization_chatglm.py").unlink()
    with pytest.raises(ImportError, match="quantization_chatglm.py"):
        load(folder)
