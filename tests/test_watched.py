"""One program, watched or not (issue 48): hooks only read. A forward hook on every module (no-op, or one that records
what it sees), a process-wide hook (what DeepSpeed ZeRO-3, FlopCounterMode and the profilers install), torch.compile,
and a second model loaded from the same folder (transformers 4.44 to 4.4x execute the remote file again at each
load) leave the model computing the same thing: the same logits bit for bit, the same operators in a decode step,
the attention weights returned. A padded prompt makes no float mask of the original's."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from chatglm_tools import kv_cache

try:  # 4.48+: generate() compiles the forward itself for a static cache
    from transformers.generation import CompileConfig
except ImportError:
    CompileConfig = None
from conftest import load_causal_lm, save_checkpoint

IDS = torch.tensor([[11, 12, 13, 14, 15, 16], [0, 0, 21, 22, 23, 24]])  # row 2 left-padded
PADDING = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])


class Operators(TorchDispatchMode):
    """The aten operators a piece of code runs, in order, with their outputs' dtypes and shapes."""

    def __init__(self):
        super().__init__()
        self.calls, self.inside_kernel = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        shapes = tuple((t.dtype, tuple(t.shape)) for t in outputs if isinstance(t, torch.Tensor))
        self.calls.append((str(func), shapes, self.inside_kernel))
        return out


def run(model, steps: int = 2, output_attentions: bool = False):
    """A padded prompt and `steps` cached decode steps (generate()'s arguments): each step's logits, the attention
    weights of every forward, and the operators of the last decode step."""
    logits, attentions = [], []
    with torch.no_grad():
        out = model(IDS, attention_mask=PADDING, position_ids=(PADDING.cumsum(-1) - 1).clamp(min=0),
                    output_attentions=output_attentions)
        mask, position = PADDING, PADDING.sum(-1, keepdim=True)
        for step in range(steps + 1):
            logits.append(out.logits)
            attentions.append(out.attentions)
            if step == steps:
                break
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], -1)
            with Operators() as operators:
                out = model(token, attention_mask=mask, position_ids=position, output_attentions=output_attentions,
                            **kv_cache.argument(kv_cache.returned(out)))
            position = position + 1
    return logits, attentions, operators.calls


def assert_same_run(watched, unwatched):
    for got, expected in zip(watched[0], unwatched[0]):
        assert torch.equal(got, expected)
    assert [call[0] for call in watched[2]] == [call[0] for call in unwatched[2]]


def hook_every_module(model, recorded: list):
    """No-op pre- and post-hooks (with keyword arguments) on every module, recording only each call's module name."""
    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(
            lambda module, args, kwargs, name=name: recorded.append(name), with_kwargs=True))
        handles.append(module.register_forward_hook(lambda module, args, output: None))
    return handles


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_hooks_on_every_module_change_nothing(tiny_model, family):
    model = tiny_model(family)
    unwatched, unwatched_eager = run(model), run(model, output_attentions=True)
    called = []
    handles = hook_every_module(model, called)
    try:
        assert_same_run(run(model), unwatched)
        watched_eager = run(model, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    assert_same_run(watched_eager, unwatched_eager)
    for weights in watched_eager[1]:  # every forward returns every layer's weights
        assert len(weights) == model.config.num_layers and all(isinstance(w, torch.Tensor) for w in weights)
    # the hooks did see every module the forward reaches, core_attention and rotary_pos_emb included
    layer = "transformer.encoder.layers.0.self_attention"
    assert {layer, layer + ".core_attention", "transformer.rotary_pos_emb"} <= set(called)


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_a_process_wide_hook_changes_nothing(tiny_model, family):
    model = tiny_model(family)
    unwatched = run(model, output_attentions=True)
    seen = []
    pre = register_module_forward_pre_hook(lambda module, args: seen.append(type(module).__name__))
    post = register_module_forward_hook(lambda module, args, output: None)
    try:
        watched = run(model, output_attentions=True)
    finally:
        pre.remove()
        post.remove()
    assert_same_run(watched, unwatched)
    assert all(w is not None for weights in watched[1] for w in weights)
    assert {"SdpaAttention", "RotaryEmbedding", "GLMBlock"} <= set(seen)  # sdpa: core_attention's class


def test_a_hooked_decode_step_does_not_repeat_the_keys(tiny_model):
    """The operators of a hooked decode step are the unhooked one's: keys and values stay per group (no copy of
    the cache to every query head), and the rotary module computes the new position's row, not its whole table."""
    model = tiny_model("glm4", seq_length=300)  # (a length no other tensor of the tiny model has)
    handles = hook_every_module(model, [])
    try:
        _, _, operators = run(model)
    finally:
        for handle in handles:
            handle.remove()
    heads, groups = model.config.num_attention_heads, model.config.multi_query_group_num
    key_length = IDS.shape[1] + 2
    for _, outputs, _ in operators:
        for dtype, shape in outputs:
            assert not (len(shape) == 4 and shape[1] == heads and shape[2] == key_length), shape  # repeated keys
            assert model.config.seq_length not in shape  # a table of seq_length rows
    assert heads != groups


def test_compiled_generation_returns_every_output(tiny_model):
    """transformers' own test_generate_compilation_all_outputs, as it runs: a static cache, generate() compiling the
    forward (on every device), attentions, hidden states, scores and logits asked for. Every step returns every
    layer's attention weights, as the eager run does. (Releases before generate() compiled by itself: the forward
    compiled by hand, the same outputs asked for.)"""
    model = tiny_model("glm4")
    kwargs = dict(do_sample=False, max_new_tokens=4, output_attentions=True, output_hidden_states=True,
                  output_scores=True, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        eager = model.generate(IDS, attention_mask=PADDING, **kwargs)
    torch._dynamo.reset()
    compile_config = CompileConfig() if CompileConfig is not None else None
    try:
        if compile_config is not None:  # (the test's own words: compile on every device)
            compile_config._compile_all_devices = True
            model.generation_config.compile_config = compile_config
        else:
            model.forward = torch.compile(model.forward, backend="eager", fullgraph=True, dynamic=False)
        with torch.no_grad():
            compiled = model.generate(IDS, attention_mask=PADDING, cache_implementation="static", **kwargs)
    finally:
        model.__dict__.pop("forward", None)
        model.generation_config.compile_config = None
        torch._dynamo.reset()
    if compile_config is not None:
        assert hasattr(model, "_compiled_call")
    assert compiled.sequences.tolist() == eager.sequences.tolist()
    assert len(compiled.attentions) == len(eager.attentions) == 4
    for step, (got, expected) in enumerate(zip(compiled.attentions, eager.attentions)):
        assert len(got) == model.config.num_layers
        # the queries of real tokens (a padding query's weights mean nothing); a static cache's unwritten slots
        # weigh 0
        real = PADDING.bool()[:, None, :, None] if step == 0 else torch.ones(1, 1, 1, 1, dtype=torch.bool)
        for weights, reference in zip(got, expected):
            assert weights.shape[:3] == reference.shape[:3]
            keys = reference.shape[-1]
            torch.testing.assert_close(weights[..., :keys] * real, reference * real)
            assert not (weights[..., keys:] * real).any()


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_a_second_load_of_the_same_folder_leaves_the_first_model_as_it_was(tiny_model, tmp_path, family):
    """transformers 4.44 to 4.4x execute the remote file again at every load, so the classes change under a model
    loaded before (a policy and its reference model in TRL). The first model keeps its kernels and weights."""
    folder = save_checkpoint(tiny_model(family), tmp_path / f"watched_{family}")
    first = load_causal_lm(folder, attn_implementation="sdpa")
    before = run(first, output_attentions=True)
    second = load_causal_lm(folder, attn_implementation="sdpa")
    after = run(first, output_attentions=True)
    assert_same_run(after, before)
    assert all(w is not None for weights in after[1] for w in weights)
    assert_same_run(run(second, output_attentions=True), before)


class InsideAttentionKernels(TorchFunctionMode):
    """Tells `Operators` whether an operator runs inside torch's scaled_dot_product_attention (which turns a boolean
    mask into a float one for its own arithmetic, per layer: torch's, not this model's)."""

    def __init__(self, operators: "Operators"):
        super().__init__()
        self.operators = operators

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        self.operators.inside_kernel = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.operators.inside_kernel = False


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_a_padded_prompt_makes_no_float_mask(tiny_model, family):
    """sdpa, left padding: the kernel's mask is boolean; this model makes no [batch, seq, seq] or [batch, 1, seq,
    seq] float tensor (the original's get_masks builds one in float32, and multiplies and compares it)."""
    model = tiny_model(family)
    batch, length = 4, 40  # (no other tensor of the tiny model has that shape)
    ids = torch.randint(3, 200, (batch, length))
    mask = torch.ones_like(ids)
    mask[1:, :7] = 0
    operators = Operators()
    with torch.no_grad(), operators, InsideAttentionKernels(operators):
        model(ids, attention_mask=mask, use_cache=False)
    masks = [(name, dtype) for name, outputs, inside in operators.calls if not inside for dtype, shape in outputs
             if shape in ((batch, length, length), (batch, 1, length, length))]
    assert masks and all(dtype == torch.bool for _, dtype in masks), masks
