"""The model under tracers. llm-compressor's default (sequential) pipeline traces the forward with torch.fx, the
layers kept as leaves; OpenVINO's export traces it with torch.jit.trace; torch.compile with dynamo. Checks and
shortcuts that read values step aside while any of them traces (`is_tracing`), and telling costs nothing when none
does."""
import logging

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
