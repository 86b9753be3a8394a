"""torch.compile with a static cache: every decode step is the same graph (no graph break, nothing logged inside it,
no recompilation from one position to the next) and gives the eager tokens, on every supported transformers."""
import pytest
import torch
from chatglm_tools.device_check import GREEDY, left_pad
from torch._dynamo.testing import CompileCounter


@pytest.fixture
def compile_counter():
    torch._dynamo.reset()
    yield CompileCounter()  # a backend that counts the graphs it is given, then runs them eagerly
    torch._dynamo.reset()


@pytest.mark.parametrize("padded", [False, True])
def test_static_cache_generation_compiles_one_graph_for_every_decode_step(tiny_model, compile_counter, padded):
    """forward compiled with fullgraph=True (a graph break or a logging call fails) and dynamic=False (any change of
    shape or guarded value between steps recompiles): one graph for the prompt, one for all 8 decode steps. The
    calls are generate()'s: a left-padded batch gets the positions and the mask it has alone."""
    model = tiny_model("glm4")
    sequences = [[5, 6, 7, 8, 9, 10], [11, 12, 13]] if padded else [[5, 6, 7, 8, 9, 10]]
    ids, mask = left_pad(sequences)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, **GREEDY)
    with torch.no_grad():
        eager = model.generate(ids, **kwargs)
        model.forward = torch.compile(model.forward, backend=compile_counter, fullgraph=True, dynamic=False)
        compiled = model.generate(ids, cache_implementation="static", **kwargs)
    assert compiled.tolist() == eager.tolist()
    assert compile_counter.frame_count == 2
