"""Every override of a transformers method, called the way the newest transformers calls it.

The call sites are quoted from transformers 5.23 (trainer.py, modeling_utils.py, generation/utils.py). An override
that took fewer arguments than its caller passes broke every Trainer run with gradient_checkpointing=True on 5.23.
"""

import pytest
import torch
import transformers
from transformers import GenerationConfig

from conftest import load_causal_lm, save_checkpoint

HAS_ACTIVATION_CHECKPOINTING = hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")


def enable_checkpointing_as_the_trainer_does(model, every_n_layers=1):
    if HAS_ACTIVATION_CHECKPOINTING:  # trainer.py, 5.23
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=None, every_n_layers=every_n_layers,
                                              offload=False)
    else:  # trainer.py, 4.x
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None)


def forward_backward(model, ids):
    """Gradients of one training step, and how often each block's attention ran in it."""
    calls = [0] * len(model.transformer.encoder.layers)
    for index, layer in enumerate(model.transformer.encoder.layers):
        # A submodule: under checkpointing its calls are replayed in the backward pass. (A hook on the block itself
        # stays outside the checkpoint on 5.x by design, so it would count one call either way.)
        layer.self_attention.register_forward_pre_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}, calls


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_checkpointing_as_the_trainer_enables_it_recomputes_every_block(tiny_model, family):
    ids = torch.randint(3, 250, (2, 10), generator=torch.Generator().manual_seed(0))
    plain, plain_calls = forward_backward(tiny_model(family, hidden_dropout=0.0).train(), ids)
    model = tiny_model(family, hidden_dropout=0.0).train()
    enable_checkpointing_as_the_trainer_does(model)
    assert model.is_gradient_checkpointing
    checkpointed, calls = forward_backward(model, ids)
    assert plain_calls == [1, 1, 1] and calls == [2, 2, 2]
    assert checkpointed.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.skipif(not HAS_ACTIVATION_CHECKPOINTING, reason="every_n_layers arrived with activation_checkpointing_enable")
def test_every_n_layers_checkpoints_every_nth_block(tiny_model):
    model = tiny_model("glm4", hidden_dropout=0.0).train()
    enable_checkpointing_as_the_trainer_does(model, every_n_layers=2)
    _, calls = forward_backward(model, torch.randint(3, 250, (1, 8)))
    assert calls == [2, 1, 2]


def test_the_users_gradient_checkpointing_enable_recomputes(tiny_model):
    """model.gradient_checkpointing_enable() with no argument, as users call it (an alias on 5.x)."""
    model = tiny_model("chatglm3", hidden_dropout=0.0).train()
    model.gradient_checkpointing_enable()
    _, calls = forward_backward(model, torch.randint(3, 250, (1, 8)))
    assert calls == [2, 2, 2]


def test_save_pretrained_as_the_trainer_calls_it(tiny_model, tmp_path):
    """trainer.py: self.model.save_pretrained(output_dir, state_dict=state_dict, is_main_process=...)"""
    model = tiny_model("glm4")
    state_dict = {name: tensor * 0 + 1 if name.endswith("final_layernorm.weight") else tensor
                  for name, tensor in model.state_dict().items()}
    model.save_pretrained(tmp_path / "out", state_dict=state_dict, is_main_process=True)
    loaded = load_causal_lm(tmp_path / "out")
    torch.testing.assert_close(loaded.transformer.encoder.final_layernorm.weight,
                               torch.ones_like(model.transformer.encoder.final_layernorm.weight))


def test_from_pretrained_with_no_path_takes_the_config_and_state_dict(tiny_model):
    model = tiny_model("glm4")
    ids = torch.randint(3, 250, (1, 9))
    loaded = type(model).from_pretrained(None, config=model.config, state_dict=model.state_dict()).eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_from_pretrained_tie_word_embeddings_ties(tiny_model, tmp_path):
    model = tiny_model("chatglm3")
    folder = save_checkpoint(model, tmp_path / "untied")
    tied = load_causal_lm(folder, tie_word_embeddings=True)
    assert tied.transformer.output_layer.weight is tied.transformer.embedding.word_embeddings.weight
    # The input embedding wins, as transformers 4.x ties: the logits are those of the model with that output layer.
    with torch.no_grad():
        model.transformer.output_layer.weight.copy_(model.transformer.embedding.word_embeddings.weight)
    ids = torch.randint(3, 250, (1, 7))
    torch.testing.assert_close(tied(input_ids=ids).logits, model(input_ids=ids).logits)


def test_generate_takes_transformers_positional_arguments(tiny_model):
    """GenerationMixin.generate(inputs, generation_config, logits_processor, ...) by position."""
    model = tiny_model("glm4")
    ids = torch.randint(3, 250, (1, 6))
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    by_keyword = model.generate(ids, generation_config=config)
    torch.testing.assert_close(model.generate(ids, config), by_keyword)
    torch.testing.assert_close(model.generate(ids, config, None), by_keyword)
    assert by_keyword.shape == (1, 10)


def test_generate_refuses_more_positional_arguments_than_transformers_takes(tiny_model):
    with pytest.raises(TypeError, match="positional arguments"):
        tiny_model("glm4").generate(torch.ones(1, 3, dtype=torch.long), *([None] * 40))
