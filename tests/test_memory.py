"""Memory: the KV cache holds its keys and values and nothing else (the storage it keeps alive, not just the
shapes), on one device and split over several, with dynamic and static caches; loading in a narrower dtype keeps no
checkpoint file mapped."""
import gc
from pathlib import Path

from chatglm_tools import device_check, kv_cache
import pytest
import torch
from conftest import FAMILIES, load_causal_lm
from virtual_devices import virtual_devices

PROMPT, STEPS = 40, 3


def theory(model, length, batch=1):
    config = model.config
    return kv_cache.theory_bytes(config.num_layers, batch, config.multi_query_group_num, length, config.kv_channels,
                                 model.dtype)


def held_after_prefill_and_decode(model, cache, batch=1):
    ids = torch.randint(3, 256, (batch, PROMPT + STEPS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(input_ids=ids[:, :PROMPT], past_key_values=cache, use_cache=True).past_key_values
        after_prefill = kv_cache.held_bytes(cache)
        for step in range(PROMPT, PROMPT + STEPS):
            cache = model(input_ids=ids[:, step:step + 1], past_key_values=cache, use_cache=True).past_key_values
    return after_prefill, kv_cache.held_bytes(cache)


def assert_theory(held, expected):
    assert abs(held - expected) <= 0.01 * expected, f"the cache keeps {held} bytes alive, {held / expected:.2f}x " \
                                                    f"the {expected} its keys and values need"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 2])
def test_dynamic_cache_holds_only_keys_and_values(tiny_model, family, batch):
    """On transformers 4.44-4.53 the cache kept the first keys/values it was given: views into the fused
    query_key_value output, which kept each layer's whole projection (queries included) alive."""
    model = tiny_model(family)
    after_prefill, after_decode = held_after_prefill_and_decode(model, None, batch)
    assert_theory(after_prefill, theory(model, PROMPT, batch))
    assert_theory(after_decode, theory(model, PROMPT + STEPS, batch))


def test_static_cache_holds_only_keys_and_values(tiny_model):
    model = tiny_model("glm4")
    cache = kv_cache.new_static_cache(model.config, 1, PROMPT + STEPS + 5, device="cpu", dtype=model.dtype)
    after_prefill, after_decode = held_after_prefill_and_decode(model, cache)
    assert after_prefill == after_decode
    assert_theory(after_decode, theory(model, PROMPT + STEPS + 5))


@pytest.mark.parametrize("family", FAMILIES)
def test_split_model_cache_holds_only_keys_and_values(tiny_model, family):
    model = tiny_model(family, num_layers=2)
    with virtual_devices(2) as devices:
        device_check.place(model, device_check.spread_device_map(2, devices))
        after_prefill, after_decode = held_after_prefill_and_decode(model, None)
    assert_theory(after_prefill, theory(model, PROMPT))
    assert_theory(after_decode, theory(model, PROMPT + STEPS))


def largest_allocation(step) -> int:
    """Bytes of the largest tensor allocated while `step()` runs (the profiler's allocation events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return max(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_no_decode_step_expands_the_cached_key_value_groups(tiny_model, kind):
    """With sdpa, a decode step allocates nothing larger than one layer's cached keys: the key/value groups go to
    attention as groups. transformers' own sdpa kernel copied each layer's cache to every query head at every step
    (4.49, 4.53) or at every masked step (a padded batch, any static cache: 4.57, 5.0); before 4.48 ours did."""
    model = tiny_model("glm4")
    config, batch, context = model.config, 2, 200
    ids, mask = device_check.padded_batch([context, context - 20], 256, seed=1)
    cache = kv_cache.new_static_cache(config, batch, context + 1, "cpu", model.dtype) if kind == "static" else None
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).past_key_values
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=1)
        largest = largest_allocation(lambda: model(input_ids=ids[:, -1:], attention_mask=mask, past_key_values=cache,
                                                   use_cache=True))
    layer_keys = kv_cache.theory_bytes(1, batch, config.multi_query_group_num, context + 1, config.kv_channels,
                                       model.dtype) // 2
    assert largest <= layer_keys


def mapped_checkpoint_regions(folder: Path) -> list:
    """(start, end) of every memory mapping of a file inside `folder` (Linux /proc/self/maps)."""
    regions = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(folder.resolve())):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            regions.append((start, end))
    return regions


def test_loading_in_bfloat16_keeps_no_checkpoint_mapping(golden):
    """The fp32 checkpoint loaded as bf16: no parameter or buffer may live in the file's memory map (transformers
    >= 4.53 left the fp32 rotary `inv_freq` there, which kept the whole shard mapped and resident), and the
    state-dict key stays."""
    model = load_causal_lm(golden.folder, dtype=torch.bfloat16)
    gc.collect()
    regions = mapped_checkpoint_regions(golden.folder)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    in_file = [name for name, t in tensors.items() if any(start <= t.data_ptr() < end for start, end in regions)]
    assert in_file == []
    assert "transformer.rotary_pos_emb.inv_freq" in model.state_dict()


def test_checkpoint_inv_freq_is_copied_as_it_loads(tiny_model, tmp_path):
    """transformers 4.x loads each checkpoint tensor through module.load_state_dict(assign=True) while it reads the
    shards: the rotary `inv_freq` arriving as a view of its shard's memory map must be copied there, or that shard
    stays mapped and resident while the others load (an fp32 checkpoint loaded as bf16 peaked a shard above native
    Glm)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    rotary = tiny_model("glm4").transformer.rotary_pos_emb
    save_file({"inv_freq": rotary.checkpoint_inv_freq()}, str(tmp_path / "shard.safetensors"))
    with safe_open(str(tmp_path / "shard.safetensors"), "pt") as shard:
        arriving = shard.get_slice("inv_freq")[...]
    rotary.load_state_dict({"inv_freq": arriving}, strict=False, assign=True)
    regions = mapped_checkpoint_regions(tmp_path)
    assert any(start <= arriving.data_ptr() < end for start, end in regions)  # the source is a view of the file
    assert not any(start <= rotary.inv_freq.data_ptr() < end for start, end in regions)
    assert torch.equal(rotary.inv_freq, arriving)
