"""What a transformers KV cache holds, on every supported release (its layout changed in 4.56): each layer's keys
and values, the memory they keep alive, and a static cache built the way each release takes it. Shared by the tests
(device placement, KV memory) and benchmarks/model_benchmark.py."""
import inspect

import torch
import transformers
from packaging.version import Version

# transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache` (the old name still works
# there, logging a deprecation); earlier releases know `past_key_values` only.
NAME = "cache" if Version(transformers.__version__) >= Version("5.24.0.dev0") else "past_key_values"


def argument(cache) -> dict:
    """A forward's or generate()'s cache keyword, under the installed release's name: `model(**argument(cache))`."""
    return {NAME: cache}


def returned(outputs):
    """The cache a forward returned, read under the installed release's name."""
    return getattr(outputs, NAME)


def layer_tensors(cache) -> list:
    """(keys, values) of each layer."""
    if hasattr(cache, "layers"):  # 4.56+
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def held_bytes(cache) -> int:
    """Bytes of every storage the cache keeps alive, each counted once: a view keeps its whole storage alive, so this
    is the memory the cache costs, which tensor shapes alone do not tell."""
    storages = {}
    for pair in layer_tensors(cache):
        for tensor in pair:
            storage = tensor.untyped_storage()
            storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def theory_bytes(layers: int, batch: int, kv_heads: int, length: int, head_dim: int, dtype: torch.dtype) -> int:
    """Keys and values of `length` positions: nothing more is needed."""
    return 2 * layers * batch * kv_heads * length * head_dim * dtype.itemsize


def new_static_cache(config, batch: int, max_length: int, device=None, dtype=None):
    """A StaticCache; releases before 5.0 want the batch size, device and dtype up front (5.x reads them from the
    first keys it stores, each layer on its own device)."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs = dict(config=config, max_cache_len=max_length)
    for name, value in (("max_batch_size", batch), ("batch_size", batch), ("device", device), ("dtype", dtype)):
        if name in params:
            kwargs[name] = value
    return StaticCache(**kwargs)
