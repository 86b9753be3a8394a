"""The model under tracers. llm-compressor's default (sequential) pipeline traces the forward with torch.fx, the
layers kept as leaves; OpenVINO's export traces it with torch.jit.trace; torch.compile with dynamo. Checks and
shortcuts that read values step aside while any of them traces (`is_tracing`), and telling costs nothing when none
does."""
import logging
import sys

import pytest
import torch
import torch.fx._symbolic_trace as fx_trace


def test_a_forward_logs_nothing_about_tracing(tiny_model, caplog):
    """torch 2.13's `is_fx_tracing()` logs a warning ("is_fx_tracing will return true for both fx.symbolic_trace and
    torch.export ...") at its first call in a process: asking it at every forward put that line into every program's
    output."""
    model = tiny_model("glm4")
    warning_once = getattr(fx_trace, "is_fx_tracing_warning", None)
    if warning_once is not None:
        warning_once.cache_clear()  # as in a new process
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), caplog.at_level(logging.WARNING):
        model(ids, attention_mask=torch.ones_like(ids))
    assert not [record.getMessage() for record in caplog.records if "tracing" in record.getMessage()]


class LayersAsLeaves(torch.fx.Tracer):
    """torch.fx as llm-compressor's sequential pipeline traces: into the modules above the layers, the layers (and
    the norms) called as leaves."""

    def __init__(self, leaves: tuple):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, module, name):
        return isinstance(module, self.leaves) or super().is_leaf_module(module, name)


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_the_encoder_traces_with_torch_fx_and_its_graph_computes_the_same(tiny_model, family):
    """The encoder's forward traced by torch.fx with its layers as leaves: every tensor it handles is a proxy, which
    has no device of its own (the device moves step aside: a proxy's `.device` compared with a device made the trace
    stop at `symbolically traced variables cannot be used as inputs to control flow`). The graph, run on the
    model's own inputs of the encoder, gives the encoder's hidden states."""
    model = tiny_model(family)
    modeling = sys.modules[type(model).__module__]
    encoder = model.transformer.encoder
    captured = {}

    def capture(module, args, kwargs):
        captured.update(args=args, kwargs=kwargs)

    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    handle = encoder.register_forward_pre_hook(capture, with_kwargs=True)
    with torch.no_grad():
        model(ids, attention_mask=torch.ones_like(ids), use_cache=False)
    handle.remove()
    hidden_states, mask = captured["args"]
    rotary = captured["kwargs"]["rotary_pos_emb"]
    concrete = {"kv_caches": None, "use_cache": False, "output_hidden_states": False}
    tracer = LayersAsLeaves((modeling.GLMBlock, modeling.RMSNorm, modeling.LayerNorm))
    graph = torch.fx.GraphModule(encoder, tracer.trace(encoder, concrete_args=concrete))
    assert [node.target for node in graph.graph.nodes if node.op == "call_module"][:2] == ["layers.0", "layers.1"]
    with torch.no_grad():
        expected = encoder(hidden_states, mask, rotary, **concrete)[0]
        traced = graph(hidden_states, mask, rotary, *concrete.values())[0]
    torch.testing.assert_close(traced, expected, atol=0, rtol=0)
