"""Tensor parallelism for ChatGLM2/3 and GLM-4 on torch.distributed (launch with torchrun).

Two entry points:

* `tensor_parallel(model, mesh_or_size=None)` shards a model loaded normally, in place, over a 1-D DeviceMesh (or
  over `size` ranks of the torch.distributed world; the whole world by default).
* `from_pretrained_tensor_parallel(load, *args, **kwargs)` is what `from_pretrained(..., tp_plan="auto")` runs: the
  model class hands it transformers' own `from_pretrained`. The checkpoint is read unchanged on every rank, each rank
  keeps its shards and moves them to its device (cuda:LOCAL_RANK, or the CPU with gloo).

Why the model's own plan and not a transformers `_tp_plan`: the fused `query_key_value` ([all q | all k | all v],
with key/value groups replicated when the TP size exceeds them) and the fused `dense_h_to_4h` ([gate | up]) have no
transformers plan style on any release, and the styles transformers has changed their internal interface in nearly
every release from 4.47 to 5.x. The styles below are torch `ParallelStyle`s applied with `parallelize_module`; the
collectives are DTensor redistributions. Parameters are plain local tensors (each rank's slice of the checkpoint
tensor, in the order the module's forward splits them), so the modeling code runs unchanged with per-rank sizes.

What each rank holds (tp = TP size, r = the rank in the TP mesh):

* `self_attention.query_key_value`: its query heads, and the key/value heads that serve them ([q | k | v] of its
  heads with multi-query attention, the [q_h | k_h | v_h] blocks of its heads otherwise). With more ranks than
  key/value groups each group sits on tp / groups ranks, whose gradients for it are summed.
* `self_attention.dense`, `mlp.dense_4h_to_h`: row-parallel (input columns of its heads / its FFN slice), outputs
  summed over the ranks (all-reduce), bias added once after the sum.
* `mlp.dense_h_to_4h`: [gate slice r | up slice r], so the MLP's own chunk(2) still pairs gate and up.
* `embedding.word_embeddings` and `output_layer`: sharded by vocabulary (lookups summed, logits gathered), or
  replicated when the TP size does not divide the padded vocabulary.
* Norms and the rotary table: replicated.
"""

import functools
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# ======================================================================================================================
# Compatibility: torch 2.4 ... (DTensor public since 2.5), transformers 4.44.2 ... 5.x
# ======================================================================================================================

try:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    try:  # torch >= 2.5: the public torch.distributed.tensor namespace
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    except ImportError:  # torch 2.4: the same classes under their private name
        from torch.distributed._tensor import DTensor, Partial, Replicate, Shard
except ImportError as error:  # pragma: no cover - a build without torch.distributed
    raise ImportError(
        f"ChatGLM tensor parallelism needs torch >= 2.4 with torch.distributed; torch {torch.__version__} is installed."
    ) from error

# The from_pretrained arguments that ask for tensor parallelism. `tp_plan` / `tp_size` / `device_mesh`: transformers
# 4.47+ (and accepted here on every release); `distributed_config`: 4.57 (no sizes) and 5.x (tp_size, fsdp/pp/ep).
TENSOR_PARALLEL_KWARGS = ("tp_plan", "tp_size", "device_mesh", "distributed_config")
# DistributedConfig fields of 5.x that ask for other kinds of parallelism, which this model does not implement.
_OTHER_PARALLEL_SIZES = ("fsdp_size", "dp_size", "dp_replicate_size", "pp_size", "ep_size")


# ======================================================================================================================
# Sizes per rank, and the errors for sizes that cannot work
# ======================================================================================================================


@dataclass(frozen=True)
class ShardSizes:
    """What one rank holds for a TP size."""

    tp_size: int
    num_heads: int  # query heads per rank
    num_kv_heads: int  # key/value heads per rank (1 when groups are replicated)
    kv_replicas: int  # ranks holding each key/value head: tp_size / groups when tp_size > groups, else 1
    ffn_hidden_size: int  # per rank, for gate and for up
    vocab_sharded: bool  # False: embedding and output layer replicated


def _sizes_fit(config, tp_size: int) -> Optional[str]:
    """Why `tp_size` cannot shard this config, or None."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp_size:
        return f"it does not divide num_attention_heads={heads} (each rank computes whole attention heads)"
    if (kv_heads % tp_size) if tp_size <= kv_heads else (tp_size % kv_heads):
        return (f"it and the {kv_heads} key/value heads (multi_query_group_num) must divide one another (each rank "
                "holds whole key/value heads, a head shared by tp_size / heads ranks when there are fewer heads)")
    if config.ffn_hidden_size % tp_size:
        return f"it does not divide ffn_hidden_size={config.ffn_hidden_size} (gate and up are split evenly)"
    return None


def valid_tensor_parallel_sizes(config) -> list:
    return [size for size in range(1, config.num_attention_heads + 1) if _sizes_fit(config, size) is None]


def check_shardable(config):
    """A ValueError for what the plan does not shard, whatever the size: a P-tuning v2 prefix, and pre-quantized
    weights (their per-row scales and packed int4 columns would need layouts of their own)."""
    refused = None
    if getattr(config, "pre_seq_len", None):
        refused = f"config.pre_seq_len={config.pre_seq_len}: tensor parallelism does not shard a P-tuning v2 prefix"
    elif getattr(config, "quantization_bit", 0):
        refused = (f"config.quantization_bit={config.quantization_bit}: tensor parallelism does not shard the "
                   "pre-quantized weights of a checkpoint such as chatglm2-6b-int4")
    if refused:
        raise ValueError(f"{refused}. Load the model without tp_plan (device_map='auto' splits it over several GPUs).")


def check_tensor_parallel_size(config, tp_size) -> ShardSizes:
    """The per-rank sizes for `tp_size`, or a ValueError naming the sizes and the TP sizes that work."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"The tensor parallel size must be a positive integer, got {tp_size!r}.")
    check_shardable(config)
    problem = _sizes_fit(config, tp_size)
    if problem:
        raise ValueError(
            f"Tensor parallel size {tp_size} cannot shard this model: {problem}. "
            f"Sizes that work for num_attention_heads={config.num_attention_heads}, "
            f"{config.num_key_value_heads} key/value heads and ffn_hidden_size={config.ffn_hidden_size}: "
            f"{valid_tensor_parallel_sizes(config)}. Launch that many processes per model replica "
            "(torchrun --nproc-per-node N), or pass tp_size."
        )
    kv_heads = config.num_key_value_heads
    return ShardSizes(
        tp_size=tp_size,
        num_heads=config.num_attention_heads // tp_size,
        num_kv_heads=max(kv_heads // tp_size, 1),
        kv_replicas=max(tp_size // kv_heads, 1),
        ffn_hidden_size=config.ffn_hidden_size // tp_size,
        vocab_sharded=config.padded_vocab_size % tp_size == 0,
    )


# ======================================================================================================================
# Layouts: which pieces of a checkpoint tensor each rank holds
# ======================================================================================================================


@dataclass(frozen=True)
class Layout:
    """The pieces of dimension `dim` of a full (checkpoint) tensor that each rank holds, concatenated in this order.
    `pieces[rank]` is a tuple of (start, stop). Every rank holds the same number of elements."""

    dim: int
    pieces: Tuple[Tuple[Tuple[int, int], ...], ...]

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        # clone: a slice would keep the whole checkpoint tensor alive
        parts = [full.narrow(self.dim, start, stop - start) for start, stop in self.pieces[rank]]
        return torch.cat(parts, dim=self.dim).clone(memory_format=torch.contiguous_format)

    def assemble(self, shards, full_shape) -> torch.Tensor:
        """The full tensor from every rank's shard (replicated pieces are written once per holder)."""
        full = shards[0].new_empty(full_shape)
        for rank, shard in enumerate(shards):
            offset = 0
            for start, stop in self.pieces[rank]:
                full.narrow(self.dim, start, stop - start).copy_(shard.narrow(self.dim, offset, stop - start))
                offset += stop - start
        return full


def chunk_layout(dim: int, total: int, tp_size: int, blocks: int = 1) -> Layout:
    """`blocks` equal blocks fused along `dim` ([gate | up] for blocks=2), each split evenly: rank r holds chunk r of
    every block."""
    block = total // blocks
    chunk = block // tp_size
    return Layout(dim, tuple(
        tuple((b * block + r * chunk, b * block + (r + 1) * chunk) for b in range(blocks)) for r in range(tp_size)
    ))


def kv_heads_of_rank(rank: int, kv_heads: int, tp_size: int) -> Tuple[int, int]:
    """First key/value head of a rank and how many it holds. With more ranks than heads, consecutive ranks share a
    head: rank r's query heads are served by head r * kv_heads // tp_size."""
    return rank * kv_heads // tp_size, max(kv_heads // tp_size, 1)


def qkv_layout(config, sizes: ShardSizes) -> Layout:
    tp, dim = sizes.tp_size, config.kv_channels
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if not config.multi_query_attention:  # per head [q_h | k_h | v_h]: a rank's heads are one run of rows
        return chunk_layout(0, 3 * heads * dim, tp)
    pieces = []
    for rank in range(tp):
        first_kv, n_kv = kv_heads_of_rank(rank, kv_heads, tp)
        q = (rank * sizes.num_heads * dim, (rank + 1) * sizes.num_heads * dim)
        k_start = heads * dim + first_kv * dim
        v_start = (heads + kv_heads) * dim + first_kv * dim
        pieces.append((q, (k_start, k_start + n_kv * dim), (v_start, v_start + n_kv * dim)))
    return Layout(0, tuple(pieces))


@dataclass(frozen=True)
class SharedRows:
    """Rows [start, stop) of a rank's shard that other ranks hold too (its key/value head when the TP size exceeds the
    key/value heads). Each holder computes only its query heads' part of their gradient: the parts are summed."""

    start: int
    stop: int
    group: int  # which key/value head; ranks with the same group hold the same rows
    num_groups: int


def qkv_shared_rows(config, sizes: ShardSizes, rank: int) -> Optional[SharedRows]:
    if sizes.kv_replicas == 1:
        return None
    dim = config.kv_channels
    group, _ = kv_heads_of_rank(rank, config.num_key_value_heads, sizes.tp_size)
    start = sizes.num_heads * dim
    return SharedRows(start, start + 2 * dim, group, config.num_key_value_heads)


# ======================================================================================================================
# Collectives: DTensor redistributions. Every local tensor is made contiguous right before it is handed over (gloo and
# NCCL read raw memory), and so is every gradient that a backward collective receives.
# ======================================================================================================================


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the DTensor conversion just before it hands that
    gradient to an all-reduce in its own backward."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def replicated_input(tensor: torch.Tensor, mesh) -> torch.Tensor:
    """The input of a column-parallel layer. Forward: the rank's copy, unchanged. Backward: each rank computed the
    gradient of its columns only; the ranks' gradients are summed (all-reduce) so every rank holds the full one."""
    if not (torch.is_grad_enabled() and tensor.requires_grad):
        return tensor  # no backward: nothing to sum
    replicated = DTensor.from_local(tensor.contiguous(), mesh, [Replicate()], run_check=False)
    return _ContiguousGrad.apply(replicated.to_local(grad_placements=[Partial()]))


def sum_over_ranks(partial: torch.Tensor, mesh) -> torch.Tensor:
    """All-reduce of the ranks' partial results; the backward passes the (replicated) gradient to every rank."""
    summed = DTensor.from_local(partial.contiguous(), mesh, [Partial()], run_check=False)
    return summed.redistribute(mesh, [Replicate()]).to_local()


def gather_last_dim(shard: torch.Tensor, mesh) -> torch.Tensor:
    """All-gather of the ranks' slices of the last dimension; the backward keeps the rank's slice of the gradient."""
    sharded = DTensor.from_local(shard.contiguous(), mesh, [Shard(shard.dim() - 1)], run_check=False)
    return sharded.redistribute(mesh, [Replicate()]).to_local()


def gather_shards(shard: torch.Tensor, mesh) -> list:
    """Every rank's tensor (same shape on each), for reassembling full tensors; not differentiable."""
    stacked = DTensor.from_local(shard.detach().contiguous().unsqueeze(0), mesh, [Shard(0)], run_check=False)
    return list(stacked.full_tensor().unbind(0))


def _sum_shared_rows(grad: torch.Tensor, shared: SharedRows, mesh) -> torch.Tensor:
    """The gradient of a shard with its shared rows summed over the ranks that hold them. Without subgroups: each rank
    puts its part in its group's slot of a zero tensor, one all-reduce over the mesh sums every group's slots."""
    rows = grad.narrow(0, shared.start, shared.stop - shared.start)
    slots = rows.new_zeros((shared.num_groups,) + tuple(rows.shape))
    slots[shared.group] = rows
    summed = sum_over_ranks(slots, mesh)[shared.group]
    grad = grad.clone()
    grad.narrow(0, shared.start, shared.stop - shared.start).copy_(summed)
    return grad


# ======================================================================================================================
# Parallel styles (torch ParallelStyle, applied with parallelize_module)
# ======================================================================================================================


def _shard_parameter(module: nn.Module, name: str, layout: Layout, rank: int):
    param = getattr(module, name, None)
    if param is None:
        return
    local = layout.local(param.detach(), rank)
    module.register_parameter(name, nn.Parameter(local, requires_grad=param.requires_grad))
    module._tp_layouts = {**getattr(module, "_tp_layouts", {}), name: layout}


def _record_mesh(module: nn.Module, mesh):
    module._tp_mesh = mesh


class AttentionHeads(ParallelStyle):
    """SelfAttention: the rank's head counts, read by its forward (split of the fused projection, grouping)."""

    def __init__(self, num_heads: int, num_kv_heads: int):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads

    def _apply(self, module, device_mesh):
        module.sizes = module.sizes.shard(self.num_heads, self.num_kv_heads)
        return module


class FusedColwiseParallel(ParallelStyle):
    """Column-parallel Linear whose output fuses several blocks ([q | k | v], [gate | up]). Each rank keeps its rows
    of every block in block order (`layout.pieces[rank]`), so the module's own split of the output still works. The
    output stays local; the input's gradient is summed over the ranks; shared rows' gradients over their holders."""

    def __init__(self, layout: Layout, shared_rows_by_rank: Optional[tuple] = None):
        self.layout = layout
        self.shared_rows_by_rank = shared_rows_by_rank

    def _apply(self, module, device_mesh):
        rank = device_mesh.get_local_rank()
        for name in ("weight", "bias"):
            _shard_parameter(module, name, self.layout, rank)
        _record_mesh(module, device_mesh)
        module.register_forward_pre_hook(lambda mod, args: (replicated_input(args[0], device_mesh),) + args[1:])
        shared = self.shared_rows_by_rank[rank] if self.shared_rows_by_rank else None
        if shared is not None:
            for param in (module.weight, module.bias):
                if param is not None and param.requires_grad:
                    # register_hook (not post-accumulate): sums this backward's contribution only, so gradient
                    # accumulation over several backwards stays right.
                    param.register_hook(lambda grad: _sum_shared_rows(grad, shared, device_mesh))
        return module


def _row_parallel_linear_forward(self, hidden_states):
    # The bias is replicated: added once, after the sum, not by every rank.
    out = sum_over_ranks(F.linear(hidden_states, self.weight), self._tp_mesh)
    return out if self.bias is None else out + self.bias


class SummedRowwiseParallel(ParallelStyle):
    """Row-parallel Linear: the rank's input columns (its heads / its FFN slice, local from the previous
    column-parallel layer), partial outputs summed over the ranks, the replicated bias added after the sum."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def _apply(self, module, device_mesh):
        _shard_parameter(module, "weight", self.layout, device_mesh.get_local_rank())
        _record_mesh(module, device_mesh)
        # Replaces forward rather than hooking it: the bias must stay out of the per-rank matmul.
        module.forward = _row_parallel_linear_forward.__get__(module)
        return module


def _vocab_parallel_embedding_forward(self, input_ids):
    start, stop = self._tp_vocab_range
    outside = (input_ids < start) | (input_ids >= stop)
    local = F.embedding((input_ids - start).masked_fill(outside, 0), self.weight)
    return sum_over_ranks(local.masked_fill(outside.unsqueeze(-1), 0.0), self._tp_mesh)


class VocabParallelEmbedding(ParallelStyle):
    """Embedding sharded by vocabulary: each rank looks up the ids in its range (zeros for the others) and the ranks'
    lookups are summed, which is exact (one non-zero term per token)."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def _apply(self, module, device_mesh):
        rank = device_mesh.get_local_rank()
        _shard_parameter(module, "weight", self.layout, rank)
        _record_mesh(module, device_mesh)
        ((start, stop),) = self.layout.pieces[rank]
        module._tp_vocab_range = (start, stop)
        module.forward = _vocab_parallel_embedding_forward.__get__(module)
        return module


class VocabParallelOutput(ParallelStyle):
    """Output layer sharded by vocabulary: each rank computes the logits of its vocabulary slice, the slices are
    gathered, so every rank returns the full logits (generation and the loss need them)."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def _apply(self, module, device_mesh):
        _shard_parameter(module, "weight", self.layout, device_mesh.get_local_rank())
        _shard_parameter(module, "bias", self.layout, device_mesh.get_local_rank())
        _record_mesh(module, device_mesh)
        module.register_forward_pre_hook(lambda mod, args: (replicated_input(args[0], device_mesh),) + args[1:])
        module.register_forward_hook(lambda mod, args, out: gather_last_dim(out, device_mesh))
        return module


def chatglm_parallel_plan(config, sizes: ShardSizes) -> Dict[str, "ParallelStyle"]:
    """The plan by role, keyed by module path under the base model (`model.transformer`)."""
    tp = sizes.tp_size
    heads_dim = config.num_attention_heads * config.kv_channels
    layer = "encoder.layers.*."
    plan = {
        layer + "self_attention": AttentionHeads(sizes.num_heads, sizes.num_kv_heads),
        layer + "self_attention.query_key_value": FusedColwiseParallel(
            qkv_layout(config, sizes), tuple(qkv_shared_rows(config, sizes, rank) for rank in range(tp))
        ),
        layer + "self_attention.dense": SummedRowwiseParallel(chunk_layout(1, heads_dim, tp)),
        layer + "mlp.dense_h_to_4h": FusedColwiseParallel(chunk_layout(0, 2 * config.ffn_hidden_size, tp, 2)),
        layer + "mlp.dense_4h_to_h": SummedRowwiseParallel(chunk_layout(1, config.ffn_hidden_size, tp)),
    }
    if sizes.vocab_sharded:
        vocab = chunk_layout(0, config.padded_vocab_size, tp)
        plan["embedding.word_embeddings"] = VocabParallelEmbedding(vocab)
        plan["output_layer"] = VocabParallelOutput(vocab)
    return plan


# ======================================================================================================================
# Entry points
# ======================================================================================================================


@dataclass
class TensorParallelState:
    """Kept on a sharded model as `model._chatglm_tp`."""

    mesh: object
    sizes: ShardSizes


def _check_placement(model: nn.Module):
    """Tensor parallelism places the whole (sharded) model on the rank's device: a device_map that spreads it over
    several devices, or offloads it, cannot be combined with it (a one-device map such as "cuda:0" can)."""
    device_map = getattr(model, "hf_device_map", None) or {}
    hooked = any(hasattr(module, "_hf_hook") for module in model.modules())
    devices = {p.device for p in model.parameters()}
    spread = len({str(device) for device in device_map.values()}) > 1
    if spread or hooked or len(devices) > 1 or any(d.type == "meta" for d in devices):
        raise ValueError(
            "Tensor parallelism cannot be combined with a device_map, offloading or a model spread over several "
            f"devices (found device_map={device_map!r}, parameters on {sorted(map(str, devices))}). Load the model "
            "without device_map (each rank keeps its shards on its own device), then shard it."
        )


def _is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def make_tp_mesh(tp_size: Optional[int], device_type: str):
    """A 1-D mesh of `tp_size` ranks (the whole world by default). With fewer ranks than the world, the world is a
    (data parallel x tensor parallel) grid and this rank's row of it is returned."""
    if not _is_initialized():
        raise RuntimeError(
            "Tensor parallelism needs torch.distributed to be initialized: launch with torchrun "
            "(torchrun --nproc-per-node N script.py) and call torch.distributed.init_process_group(), or load with "
            "from_pretrained(..., tp_plan='auto'), which does both steps."
        )
    world = dist.get_world_size()
    tp_size = world if tp_size is None else tp_size
    if world % tp_size:
        raise ValueError(f"The tensor parallel size ({tp_size}) must divide the number of processes ({world}).")
    if tp_size == world:
        return init_device_mesh(device_type, (tp_size,), mesh_dim_names=("tp",))
    return init_device_mesh(device_type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))["tp"]


def tensor_parallel(model: nn.Module, mesh_or_size=None) -> nn.Module:
    """Shard a ChatGLM / GLM-4 model (loaded normally, on the rank's device) in place over a 1-D DeviceMesh, or over
    `mesh_or_size` ranks of the torch.distributed world (all of it when None). Every rank must call it. Returns the
    model, whose forward, generate() and backward then match the unsharded model's."""
    if isinstance(mesh_or_size, DeviceMesh):
        if mesh_or_size.ndim != 1:
            raise ValueError(
                f"Tensor parallelism takes a 1-D DeviceMesh, got {mesh_or_size.ndim} dimensions: pass its "
                "tensor-parallel dimension, for example mesh['tp']."
            )
        check_tensor_parallel_size(model.config, mesh_or_size.size())
    elif mesh_or_size is not None:
        check_tensor_parallel_size(model.config, mesh_or_size)  # a clear error before any collective
    _check_placement(model)
    device = next(model.parameters()).device
    mesh = mesh_or_size if isinstance(mesh_or_size, DeviceMesh) else make_tp_mesh(mesh_or_size, device.type)
    if mesh.device_type != device.type:
        raise ValueError(
            f"The model is on {device} but the mesh is a {mesh.device_type!r} mesh: move the model to the rank's "
            "device first (model.to(device)), then shard it."
        )
    return _shard(model, mesh)


def _shard(model: nn.Module, mesh) -> nn.Module:
    """Apply the plan. No communication: every rank slices its shards from the full weights it holds."""
    if getattr(model, "_chatglm_tp", None) is not None:
        raise ValueError("This model is already tensor-parallel.")
    sizes = check_tensor_parallel_size(model.config, mesh.size())
    if sizes.tp_size > 1:
        with torch.no_grad():
            parallelize_module(getattr(model, "base_model", model), mesh, chatglm_parallel_plan(model.config, sizes))
        _save_in_checkpoint_layout(model)
    model._chatglm_tp = TensorParallelState(mesh, sizes)
    return model


def _save_in_checkpoint_layout(model: nn.Module):
    """save_pretrained of a sharded model writes the original checkpoint layout, not the rank's shards: every rank
    calls it (gathering the shards is a collective), the first rank writes, all return once the files exist."""
    save = type(model).save_pretrained.__get__(model)

    @functools.wraps(save)
    def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
        state_dict = full_state_dict(model) if state_dict is None else state_dict
        result = save(save_directory, *args, state_dict=state_dict, **kwargs) if dist.get_rank() == 0 else None
        dist.barrier()
        return result

    model.save_pretrained = save_pretrained


def _tensor_parallel_request(kwargs: dict) -> Optional[dict]:
    """Pop the TP arguments of from_pretrained: {"tp_size": int or None, "mesh": DeviceMesh or None}, or None when
    they ask for no tensor parallelism."""
    tp_plan = kwargs.pop("tp_plan", None)
    tp_size = kwargs.pop("tp_size", None)
    mesh = kwargs.pop("device_mesh", None)
    distributed_config = kwargs.pop("distributed_config", None)
    if distributed_config is not None:
        read = distributed_config.get if isinstance(distributed_config, dict) else (
            lambda name: getattr(distributed_config, name, None))
        others = {name: read(name) for name in _OTHER_PARALLEL_SIZES if (read(name) or 1) > 1}
        if others:
            raise ValueError(
                f"distributed_config asks for {others}: ChatGLM implements tensor parallelism only. Use "
                "DistributedConfig(tp_size=N) or tp_plan='auto', and wrap the model for data parallelism yourself."
            )
        # 5.x DistributedConfig has sizes (no tp_plan and no tp_size: no tensor parallelism); 4.57's has none and
        # means tp_plan="auto".
        has_sizes = "tp_size" in distributed_config if isinstance(distributed_config, dict) else \
            hasattr(distributed_config, "tp_size")
        tp_plan = tp_plan if tp_plan is not None else (read("tp_plan") or (None if has_sizes else "auto"))
        tp_size = tp_size if tp_size is not None else read("tp_size")
    if (tp_plan is None and tp_size is None and mesh is None) or (mesh is None and tp_size == 1):
        return None
    if tp_plan not in (None, "auto"):
        raise ValueError(
            f"tp_plan={tp_plan!r}: ChatGLM shards by its own plan (fused query_key_value and gate/up layouts); "
            "pass tp_plan='auto'."
        )
    if mesh is not None and mesh.ndim != 1:
        if "tp" not in (mesh.mesh_dim_names or ()):
            raise ValueError("A multi-dimensional device_mesh must have a 'tp' dimension; or pass mesh['tp'].")
        mesh = mesh["tp"]
    return {"tp_size": mesh.size() if mesh is not None else tp_size, "mesh": mesh}


def _rank_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is there, else the CPU (gloo)."""
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _init_distributed(device: torch.device):
    if _is_initialized():
        return
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"tp_plan='auto' needs torch.distributed: launch with torchrun (missing {', '.join(missing)}), or call "
            "torch.distributed.init_process_group() before from_pretrained."
        )
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")


def from_pretrained_tensor_parallel(load, *args, **kwargs):
    """from_pretrained with tp_plan="auto" (or tp_size / device_mesh / distributed_config). `load` is transformers'
    from_pretrained bound to the model class. Every rank reads the checkpoint unchanged onto the CPU, keeps its shards
    and moves them to its device."""
    request = _tensor_parallel_request(kwargs)
    if request is None:
        return load(*args, **kwargs)
    device_map = kwargs.get("device_map")
    if device_map is not None:
        raise ValueError(
            f"tp_plan='auto' cannot be combined with device_map={device_map!r}: tensor parallelism puts each rank's "
            "shards on its own device (cuda:LOCAL_RANK under torchrun). Drop device_map, or drop tp_plan to spread "
            "whole layers over devices in one process."
        )
    config = kwargs.get("config")
    if request["tp_size"] is not None and hasattr(config, "num_attention_heads"):
        check_tensor_parallel_size(config, request["tp_size"])  # fail before any process group or checkpoint read
    given_mesh = request["mesh"]
    device = torch.device("cpu") if given_mesh is not None and given_mesh.device_type == "cpu" else _rank_device()
    _init_distributed(device)
    mesh = given_mesh or make_tp_mesh(request["tp_size"], device.type)
    if hasattr(config, "num_attention_heads"):
        check_tensor_parallel_size(config, mesh.size())
    loaded = load(*args, **kwargs)
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    _check_placement(model)
    _shard(model, mesh)  # on the CPU: only the shards reach the accelerator
    if device.type != "cpu":
        model.to(device)
    return loaded


# ======================================================================================================================
# Gathering shards back into checkpoint layout (saving, checks)
# ======================================================================================================================


def _gather_full(model: nn.Module, name: str, local: torch.Tensor, full_shape) -> torch.Tensor:
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    layout = getattr(module, "_tp_layouts", {}).get(param_name)
    if layout is None:
        return local.detach()  # replicated
    return layout.assemble(gather_shards(local, module._tp_mesh), full_shape)


def _full_shapes(model: nn.Module) -> dict:
    """Checkpoint shapes of the sharded parameters: the local shape with the sharded dimension times the TP size."""
    shapes = {}
    for module_name, module in model.named_modules():
        for param_name, layout in getattr(module, "_tp_layouts", {}).items():
            local = getattr(module, param_name)
            shape = list(local.shape)
            shape[layout.dim] = max(stop for pieces in layout.pieces for _, stop in pieces)
            shapes[f"{module_name}.{param_name}" if module_name else param_name] = shape
    return shapes


def full_state_dict(model: nn.Module) -> dict:
    """The state dict in checkpoint layout, on every rank (a collective: every rank must call it). A sharded model's
    save_pretrained uses it."""
    shapes = _full_shapes(model)
    return {name: _gather_full(model, name, tensor, shapes.get(name)) for name, tensor in model.state_dict().items()}


def full_gradients(model: nn.Module) -> dict:
    """The parameters' gradients in checkpoint layout, on every rank (a collective)."""
    shapes = _full_shapes(model)
    return {name: _gather_full(model, name, param.grad, shapes.get(name))
            for name, param in model.named_parameters() if param.grad is not None}


__all__ = [
    "ShardSizes", "check_tensor_parallel_size", "valid_tensor_parallel_sizes", "chatglm_parallel_plan",
    "tensor_parallel", "from_pretrained_tensor_parallel", "make_tp_mesh", "full_state_dict", "full_gradients",
    "TENSOR_PARALLEL_KWARGS",
]
