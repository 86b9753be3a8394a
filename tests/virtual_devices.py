"""Simulated multi-device backend for tests: up to 8 "virtual devices" that compute on the CPU.

    with virtual_devices(4) as devices:  # [device(type="vdev", index=0), ..., index=3]
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        device_map = pipeline_device_map(skeleton, "model.layers", devices)
        model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map)

Tensors on those devices are ordinary torch.Tensors (device type "vdev") whose memory lives on the host, so
nn.Module.to(), nn.Parameter, autograd, optimizers, safetensors and accelerate's hooks handle them as they handle any
accelerator's tensors. An operator that mixes two of them, or one of them with a CPU tensor that is not a 0-dim
scalar, raises what a GPU raises: "Expected all tensors to be on the same device, but found at least two devices,
vdev:0 and vdev:1!" (real GPUs word some operators differently after that prefix; match the prefix).

How it works: torch's PrivateUse1 dispatch key is renamed "vdev" and gets one Python kernel for every operator (a
boxed fallback). It checks the devices, runs the operator's CPU kernel on CPU tensors that alias the same memory and
returns the results as vdev tensors; view operators run the CPU kernel on the vdev tensors directly, so views share
storage as on a GPU. Memory changes its device tag without a copy through DLPack, whose capsule carries the device:
export, rewrite the device in the capsule, import. copy_, _to_copy and the convolutions get kernels of their own (see
there), and torch.vdev answers the device-module questions of torch, accelerate and transformers.

Limits (besides speed, about 0.1 ms per operator):
- The registration is process-wide and permanent (PrivateUse1 can be renamed once). Outside a block the device
  count is 0: no vdev tensor can be created and torch.accelerator reports nothing. Inside, vdev is torch's
  accelerator: CPU pin_memory() raises, and a bare index means vdev (torch.device(1) is vdev:1, from then on).
- backward() must run on the thread that entered the block (the block turns off autograd's per-device worker
  threads there; elsewhere use torch.autograd.set_multithreading_enabled(False)).
- torch does not count PrivateUse1 among the "dense" backends that can swap a tensor's data with the CPU's:
  `param.data = t` between CPU and vdev is refused, and module.to() between them builds new Parameter objects,
  so weights tied before such a move come out untied (moves between vdev devices keep the Parameter objects,
  and from_pretrained with a device_map keeps ties).
- F.scaled_dot_product_attention takes its math path (as on any backend without fused kernels): close to the CPU
  result, not bit-identical. Autocast on vdev casts nothing. Random numbers come from the CPU generator;
  torch.Generator(device="vdev"), pinned memory, sparse and quantized tensors are not supported.
- Memory queries return fixed numbers, and accelerate's device_map="auto" / max_memory know no vdev: build the map
  explicitly (pipeline_device_map). safetensors rejects "vdev:1" as a device string (an index works).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import pytest
import torch

BACKEND = "vdev"
MAX_DEVICES = 8
# What torch.vdev.mem_get_info reports per device; the virtual devices share host memory and track nothing.
REPORTED_MEMORY_BYTES = 64 * 1024**3

_state = threading.local()  # current device of each thread, as torch.cuda keeps it
_device_count = 0  # devices enabled by the innermost `virtual_devices` block; 0 outside of one
_libraries: list[torch.library.Library] = []  # hold the kernel registrations alive


# ---------------------------------------------------------------------------------------------------------------
# Memory: the same bytes seen as a CPU tensor or as a vdev tensor, exchanged through a DLPack capsule.

_DL_CPU, _DL_EXT_DEV = 1, 12  # DLDeviceType codes; torch maps kDLExtDev to PrivateUse1
_DEVICE_OFFSET = 8  # DLManagedTensor starts with DLTensor {void* data; DLDevice device; ...}
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _retag(tensor: torch.Tensor, dl_device_type: int, index: int) -> torch.Tensor:
    """The tensor's memory under another device tag; the new tensor keeps the old one alive (DLPack deleter)."""
    # DLPack has no conjugate or negative bit (torch would export the bare memory), so they are set again after.
    if tensor.is_conj():
        return _retag(tensor.conj(), dl_device_type, index).conj()
    if tensor.is_neg():
        return torch._neg_view(_retag(torch._neg_view(tensor), dl_device_type, index))
    capsule = torch.utils.dlpack.to_dlpack(tensor.detach())
    device = (ctypes.c_int32 * 2).from_address(_capsule_pointer(capsule, b"dltensor") + _DEVICE_OFFSET)
    device[0], device[1] = dl_device_type, index
    return torch.from_dlpack(capsule)


def _on_device(cpu: torch.Tensor, index: int) -> torch.Tensor:
    _check_index(index)
    return _retag(cpu, _DL_EXT_DEV, index)


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    return _retag(tensor, _DL_CPU, 0)


def _check_index(index: int) -> None:
    if not 0 <= index < _device_count:
        raise RuntimeError(
            f"{BACKEND} error: invalid device ordinal {index}: {_device_count} virtual devices are enabled"
            + ("" if _device_count else " (create tensors inside a `virtual_devices(n)` block)")
        )


def _index_of(device: torch.device) -> int:
    return device.index if device.index is not None else _current_device()


def _index_from(device: int | str | torch.device) -> int:
    return device if isinstance(device, int) else _index_of(torch.device(device))


# ---------------------------------------------------------------------------------------------------------------
# The kernel every aten operator runs on a vdev tensor.

# Operators that move data between devices, so mixing devices is their purpose.
_COPY_OPS = {"aten::_copy_from", "aten::_copy_from_and_resize"}
# Operators whose index tensors may stay on the CPU (CUDA moves them itself); every other tensor must match.
_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
_CPU_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _fallback(_keyset, op, *args, **kwargs):
    """The PrivateUse1 kernel of every aten operator that has no kernel of its own for the backend."""
    info = _op_info(op)
    if info.name not in _COPY_OPS:
        _check_same_device(info.name, args, kwargs)
    if info.name in _SPECIAL_KERNELS:
        return _SPECIAL_KERNELS[info.name](*args, **kwargs)
    if info.rewrites_metadata:
        # Views and set_ only rewrite sizes/strides/storage; the CPU kernels do that for any device, and the
        # result shares the input's storage as a view on a GPU does.
        return op.redispatch(_CPU_KERNEL, *args, **kwargs)
    return _run_on_host(op, info, args, kwargs)


class _OpInfo(NamedTuple):
    name: str
    rewrites_metadata: bool  # a view op, or set_
    out_arguments: frozenset[str]


@functools.lru_cache(maxsize=None)
def _op_info(op) -> _OpInfo:
    schema = op._schema
    is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    outs = frozenset(a.name for a in schema.arguments if a.is_out)
    return _OpInfo(schema.name, is_view or schema.name == "aten::set_", outs)


def _check_same_device(name: str, args, kwargs) -> None:
    """Raise torch's cross-device error; as on CUDA, 0-dim CPU tensors pass as scalars (and CPU indices index)."""
    cpu_indices = {id(t) for t in _tensors(args[1:2])} if name in _INDEX_OPS else ()
    first = None
    for t in _tensors((*args, *kwargs.values())):
        if t.device.type == "cpu" and (t.dim() == 0 or id(t) in cpu_indices):
            continue
        if first is None:
            first = t.device
        elif t.device != first:
            raise RuntimeError(
                "Expected all tensors to be on the same device, "
                f"but found at least two devices, {first} and {t.device}!"
            )


def _tensors(values):
    """The tensors among operator arguments, which nest at most one list deep (Tensor[], Tensor?[])."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, torch.Tensor))


def _map_tensors(fn, value):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(fn(t) if isinstance(t, torch.Tensor) else t for t in value)
    return value


def _is_virtual(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == BACKEND


def _target_device(args, kwargs) -> torch.device | None:
    """Where results go: the `device=` argument of factories, else the device of the vdev inputs."""
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    return next((t.device for t in _tensors((*args, *kwargs.values())) if _is_virtual(t)), None)


def _run_on_host(op, info: _OpInfo, args, kwargs):
    """Run the CPU kernel on host aliases of the inputs; in-place and out= results land in the vdev tensors."""
    target = _target_device(args, kwargs)
    if kwargs.get("device") is not None:
        kwargs = dict(kwargs, device="cpu")
    stands_for = {}  # id(host tensor given to the kernel) -> the vdev tensor it stands for
    outs = []  # (host tensor, vdev out= tensor) pairs to store after the kernel ran

    def alias(t):
        if not _is_virtual(t):
            return t
        host = _on_host(t)
        stands_for[id(host)] = t
        return host

    def fresh_out(t):
        # out= kernels may resize their output, which memory taken over through DLPack cannot do; so they write
        # into a new host tensor that is stored into the vdev tensor afterwards.
        if not _is_virtual(t):
            return t
        host = torch.empty(0, dtype=t.dtype)
        stands_for[id(host)] = t
        outs.append((host, t))
        return host

    host_args = tuple(_map_tensors(alias, a) for a in _numbers_as_tensors(op, args))
    host_kwargs = {k: _map_tensors(fresh_out if k in info.out_arguments else alias, v) for k, v in kwargs.items()}
    result = op(*host_args, **host_kwargs)
    for host, device_out in outs:
        _store_into(device_out, host)

    def to_device(t):
        if id(t) in stands_for:
            return stands_for[id(t)]
        if target is not None and target.type == BACKEND:
            return _on_device(t, _index_of(target))
        return t

    if isinstance(result, (list, tuple)):
        return type(result)(to_device(t) if isinstance(t, torch.Tensor) else t for t in result)
    return to_device(result) if isinstance(result, torch.Tensor) else result


def _numbers_as_tensors(op, args) -> tuple:
    """The arguments, with a Python number where the schema wants a Tensor made a 0-dim tensor again: torch passes
    the scalar of `t & 15` to the Tensor overload as a wrapped number, which boxing into Python turns into an int."""
    schema = op._schema.arguments
    return tuple(torch.tensor(a) if isinstance(a, (bool, int, float)) and i < len(schema)
                 and isinstance(schema[i].type, torch.TensorType) else a for i, a in enumerate(args))


def _store_into(device_out: torch.Tensor, host: torch.Tensor) -> None:
    """Write an out= result into its vdev tensor: into its memory when the shape fits, else (a resize) into new."""
    if device_out.shape == host.shape:
        _on_host(device_out).copy_(host)
    else:
        _set_memory(device_out, _on_device(host, device_out.device.index))


def _set_memory(tensor: torch.Tensor, source: torch.Tensor) -> None:
    torch.ops.aten.set_.source_Tensor.redispatch(_CPU_KERNEL, tensor, source)


def _copy(dst, src, non_blocking=False):
    """copy_ into or out of a vdev tensor (CPU<->vdev, vdev:i<->vdev:j): a real copy, by the CPU kernel.

    Registered for PrivateUse1 itself, in place of torch's generic copy_: that one resolves a conjugate source
    by cloning it, which copies it again, and so on until the stack overflows.
    """
    _host_view(dst).copy_(_host_view(src))
    return dst


def _to_copy(tensor, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    """tensor.to(...) from a vdev tensor. Registered itself because torch's generic one pins the host copy of a
    non_blocking move to the CPU, and a backend written in Python cannot provide pinned memory."""
    target = torch.device(device) if device is not None else tensor.device
    host = torch.ops.aten._to_copy.default(_on_host(tensor), dtype=dtype, layout=layout, memory_format=memory_format)
    return _on_device(host, _index_of(target)) if target.type == BACKEND else host.to(target)


def _copy_from(src, dst, non_blocking=False):
    return _copy(dst, src)


def _copy_from_and_resize(src, dst):
    if dst.shape != src.shape:
        _resize(dst, src.shape)
    return _copy_from(src, dst)


def _resize(tensor, size, memory_format=None):
    """resize_: memory taken over through DLPack cannot grow, so a tensor that outgrows it gets new memory."""
    size = torch.Size(size)
    needed = tensor.storage_offset() + size.numel()
    if needed * tensor.element_size() > tensor.untyped_storage().nbytes():
        old = _on_host(tensor.as_strided((tensor.untyped_storage().nbytes() // tensor.element_size(),), (1,), 0))
        host = torch.empty(needed, dtype=tensor.dtype)
        host[: old.numel()].copy_(old)  # resize_ keeps the old contents
        _set_memory(tensor, _on_device(host, tensor.device.index))
    strides = torch.empty(size, memory_format=memory_format or torch.contiguous_format, device="meta").stride()
    torch.ops.aten.set_.source_Tensor_storage_offset.redispatch(
        _CPU_KERNEL, tensor, tensor, tensor.storage_offset(), size, strides
    )
    return tensor


def _host_view(t: torch.Tensor) -> torch.Tensor:
    return _on_host(t) if _is_virtual(t) else t


def _convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """convolution_overrideable: where torch's convolution sends a backend it has no kernels for. It has a kernel
    of its own that raises, so the fallback never sees it: the CPU convolution, on host aliases."""
    _check_same_device("aten::convolution_overrideable", (input, weight, bias), {})
    host = torch.ops.aten.convolution.default(_host_view(input), _host_view(weight),
                                              None if bias is None else _host_view(bias), stride, padding, dilation,
                                              transposed, output_padding, groups)
    return _on_device(host, input.device.index)


def _convolution_backward(grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups,
                          output_mask):
    _check_same_device("aten::convolution_backward_overrideable", (grad_output, input, weight), {})
    grads = torch.ops.aten.convolution_backward.default(
        _host_view(grad_output), _host_view(input), _host_view(weight), [weight.shape[0]], stride, padding,
        dilation, transposed, output_padding, groups, output_mask,
    )
    return tuple(None if g is None else _on_device(g, input.device.index) for g in grads)


_SPECIAL_KERNELS = {
    "aten::_copy_from": _copy_from,
    "aten::_copy_from_and_resize": _copy_from_and_resize,
    "aten::resize_": _resize,
}


# ---------------------------------------------------------------------------------------------------------------
# torch.vdev: the device module that torch, accelerate and transformers query (torch.cuda's API, reduced).


def _current_device() -> int:
    return getattr(_state, "device", 0)


class _DeviceModule:
    """Installed as torch.vdev. Memory figures are fixed: the devices share host memory and track nothing."""

    @staticmethod
    def is_available() -> bool:
        return _device_count > 0

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _lazy_init() -> None:
        pass

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return _device_count

    @staticmethod
    def current_device() -> int:
        return _current_device()

    @staticmethod
    def set_device(device) -> None:
        _check_index(_index_from(device))
        _state.device = _index_from(device)

    class device:
        """`with torch.vdev.device(i):` makes vdev:i the current device (torch's storage moves use it)."""

        def __init__(self, device):
            self.index = None if device is None else _index_from(device)

        def __enter__(self):
            self.previous = _current_device()
            if self.index is not None:
                _state.device = self.index

        def __exit__(self, *exc_info):
            _state.device = self.previous

    @staticmethod
    def synchronize(device=None) -> None:
        pass  # kernels run synchronously

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        return REPORTED_MEMORY_BYTES, REPORTED_MEMORY_BYTES

    @staticmethod
    def memory_allocated(device=None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def get_device_name(device=None) -> str:
        return "virtual device (CPU memory)"

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        # Asked by torch.autocast(device_type="vdev"); no autocast kernels exist, so an enabled autocast casts nothing.
        return [torch.float16, torch.bfloat16]

    # Random numbers come from the CPU generator, which torch.manual_seed already seeds.
    @staticmethod
    def manual_seed(seed) -> None:
        pass

    manual_seed_all = manual_seed


# Python hooks for a PrivateUse1 backend (torch._C._acc) are newer than torch 2.4: without them there are no virtual
# devices, and every test that asks for them skips, naming the torch release.
_ACC = getattr(torch._C, "_acc", None)
UNSUPPORTED = None if _ACC is not None else (
    f"virtual devices need torch._C._acc (Python hooks for a PrivateUse1 backend), which torch {torch.__version__} "
    "lacks"
)


class _Hooks(_ACC.PrivateUse1Hooks if _ACC else object):
    """What torch's C++ side asks a backend: whether it is there (torch.accelerator, DLPack import, ...)."""

    def is_available(self) -> bool:
        return _device_count > 0

    def has_primary_context(self, device_index) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _DeviceGuard(_ACC.DeviceGuard if _ACC else object):
    """torch wants a device guard for every backend it runs kernels on. The Python one switches nothing and claims a
    single device (torch fixes both), which is fine for host memory, except for autograd: see virtual_devices."""

    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def _allocate_storages_through_tensors() -> None:
    """Make `torch.UntypedStorage(n, device="vdev:i")` work instead of crashing the process.

    torch offers no Python hook to give a backend an allocator, so a storage built directly on a vdev device (as
    copy.deepcopy of a tensor does, through UntypedStorage.clone) would be filled by a null allocator: a segfault.
    Such storages are taken from a vdev tensor instead; every other device goes to torch's own constructor.
    """
    torch_new = torch.UntypedStorage.__new__

    def __new__(cls, *args, device=None, **kwargs):
        if device is None or torch.device(device).type != BACKEND:
            device_kwarg = {} if device is None else {"device": device}
            return torch_new(cls, *args, **device_kwarg, **kwargs)
        if kwargs or len(args) > 1 or (args and not isinstance(args[0], int)):
            raise TypeError(f"on {BACKEND} devices, only UntypedStorage(nbytes, device=...) is supported")
        return torch.empty(args[0] if args else 0, dtype=torch.uint8, device=device).untyped_storage()

    torch.UntypedStorage.__new__ = staticmethod(__new__)


def _register() -> None:
    """Turn PrivateUse1 into the vdev backend, once per process."""
    if _libraries:
        return
    if torch._C._get_privateuse1_backend_name() != "privateuseone":
        # Also the case when this file was imported a second time under another module name (the two copies
        # would keep separate device counts): import it as `virtual_devices` everywhere.
        raise RuntimeError(
            f"PrivateUse1 already belongs to backend {torch._C._get_privateuse1_backend_name()!r}; "
            "virtual devices need it (is tests/virtual_devices.py imported under two module names?)"
        )
    torch.utils.rename_privateuse1_backend(BACKEND)
    torch._register_device_module(BACKEND, _DeviceModule())
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=False)
    _allocate_storages_through_tensors()
    _ACC.register_python_privateuseone_hook(_Hooks())
    _ACC.register_python_privateuseone_device_guard(_DeviceGuard())
    every_op = torch.library.Library("_", "IMPL")
    every_op.fallback(_fallback, "PrivateUse1", with_keyset=True)
    # Autocast on a backend needs kernels for its Autocast key; passing through makes autocast cast nothing here.
    every_op.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    aten = torch.library.Library("aten", "IMPL")
    aten.impl("copy_", _copy, "PrivateUse1")
    aten.impl("_to_copy", _to_copy, "PrivateUse1")
    aten.impl("convolution_overrideable", _convolution, "PrivateUse1")
    aten.impl("convolution_backward_overrideable", _convolution_backward, "PrivateUse1")
    _libraries.extend([every_op, aten])


# ---------------------------------------------------------------------------------------------------------------
# Public API


@contextlib.contextmanager
def virtual_devices(n: int) -> Iterator[list[torch.device]]:
    """Enable `n` virtual devices (1..8) for the block and yield them as torch.device objects."""
    global _device_count
    if not 1 <= n <= MAX_DEVICES:
        raise ValueError(f"virtual_devices takes 1 to {MAX_DEVICES} devices, not {n}")
    if UNSUPPORTED:
        pytest.skip(UNSUPPORTED)
    _register()
    previous = _device_count
    _device_count = n
    try:
        # torch's autograd engine keeps one worker queue per device of a backend, and a Python-registered backend
        # declares a single device; backward on vdev:1+ would hit an internal assert. On the calling thread, the
        # engine runs every device's work itself.
        with torch.autograd.set_multithreading_enabled(False):
            yield [torch.device(BACKEND, i) for i in range(n)]
    finally:
        _device_count = previous


@pytest.fixture
def vdevices() -> Iterator[list[torch.device]]:
    """Four virtual devices for one test; import this fixture into a test module to use it."""
    with virtual_devices(4) as devices:
        yield devices


def pipeline_device_map(
    model: torch.nn.Module, layers: str, devices: Sequence[torch.device | str]
) -> dict[str, str]:
    """A `device_map` for from_pretrained / accelerate that lays a model out as a pipeline over `devices`.

    The blocks of the ModuleList at `layers` ("model.layers", "transformer.encoder.layers") are split into
    contiguous runs, one per device, in order. The other modules go to the first device when they come before the
    list in their parent (embeddings) and to the last when they come after it (final norm, output head), so every
    module, including those with only non-persistent buffers such as rotary tables, gets a device. Modules whose
    parameters are tied (an output head sharing the input embedding) all go to the earliest device among theirs:
    a tied parameter lives on one device only, and the embedding must stay with the inputs. `model` may be the model
    itself or a skeleton built under `with torch.device("meta"):` (not accelerate.init_empty_weights, whose
    skeletons no longer share tied parameters).
    """
    names = [str(torch.device(d)) for d in devices]
    blocks = model.get_submodule(layers)
    device_map = {}
    path = layers.split(".")
    for depth, child_on_path in enumerate(path):
        parent_name = ".".join(path[:depth])
        parent = model.get_submodule(parent_name)
        for name, _ in [*parent.named_parameters(recurse=False), *parent.named_buffers(recurse=False)]:
            device_map[_join(parent_name, name)] = names[0]
        after = False
        for name, _ in parent.named_children():
            if name == child_on_path:
                after = True
            else:
                device_map[_join(parent_name, name)] = names[-1] if after else names[0]
    for i in range(len(blocks)):
        device_map[f"{layers}.{i}"] = names[i * len(names) // len(blocks)]
    _keep_tied_parameters_together(model, device_map, names)
    return device_map


def _keep_tied_parameters_together(model: torch.nn.Module, device_map: dict[str, str], names: list[str]) -> None:
    for group in _tied_parameter_groups(model):
        owners = [_entry_of(device_map, name) for name in group]
        earliest = min((device_map[owner] for owner in owners), key=names.index)
        for owner in owners:
            device_map[owner] = earliest


def _tied_parameter_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of parameters that are one: shared objects, and the ties transformers >= 5 declares (its skeletons on
    the meta device are tied only when weights load)."""
    from accelerate.utils import find_tied_parameters

    declared = getattr(model, "all_tied_weights_keys", None) or {}
    return [*map(list, find_tied_parameters(model)), *([target, source] for target, source in declared.items())]


def _entry_of(device_map: dict[str, str], name: str) -> str:
    """The device-map key that places `name`: the longest key that is `name` or one of its parents."""
    while name and name not in device_map:
        name = name.rpartition(".")[0]
    return name


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
