"""Training basics: fp32 loss, the Trainer's num_items_in_batch, gradient checkpointing, inputs_embeds, classification."""
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, TRANSFORMERS, Version


def batch(seed, batch_size=2, length=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (batch_size, length), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


def manual_loss(logits, labels, reduction="mean"):
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction=reduction)


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_is_fp32_cross_entropy_of_the_shifted_labels(tiny_model, family):
    model = tiny_model(family).to(torch.bfloat16)
    ids, labels = batch(10)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    assert out.loss.dtype == torch.float32 and out.logits.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss, manual_loss(out.logits, labels), atol=1e-5, rtol=1e-5)


def test_num_items_in_batch_turns_the_mean_into_a_sum_over_that_count(tiny_model):
    model = tiny_model("glm4")
    ids, labels = batch(11)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40))
    torch.testing.assert_close(out.loss, manual_loss(out.logits, labels, "sum") / 40)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_recomputes_each_block_and_gives_the_same_gradients(tiny_model, use_reentrant):
    ids, labels = batch(12)
    grads, block_calls = [], []
    for checkpointing in (False, True):
        model = tiny_model("glm4", hidden_dropout=0.0).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
            assert all(layer.gradient_checkpointing for layer in model.transformer.encoder.layers)
        calls = []
        model.transformer.encoder.layers[1].input_layernorm.register_forward_pre_hook(lambda *_: calls.append(1))
        model(input_ids=ids, labels=labels).loss.backward()
        block_calls.append(len(calls))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert block_calls == [1, 2]  # a checkpointed block runs again in the backward pass
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4, msg=name)


def test_blocks_are_transformers_gradient_checkpointing_layers_where_it_has_them(tiny_model):
    model = tiny_model("chatglm3")
    try:  # transformers >= 4.52
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        assert TRANSFORMERS < Version("4.52")
        GradientCheckpointingLayer = type(model.transformer.encoder.layers[0]).__mro__[1]
    assert all(isinstance(layer, GradientCheckpointingLayer) for layer in model.transformer.encoder.layers)


def test_inputs_embeds_equal_input_ids(tiny_model):
    model = tiny_model("chatglm3")
    ids, labels = batch(13)
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad():
        a = model(input_ids=ids, labels=labels)
        b = model(inputs_embeds=embeds, labels=labels)
    torch.testing.assert_close(b.logits, a.logits)
    torch.testing.assert_close(b.loss, a.loss)


def test_generate_from_inputs_embeds(tiny_model):
    model = tiny_model("glm4")
    ids, _ = batch(14, batch_size=1, length=7)
    greedy = dict(do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        from_ids = model.generate(ids, **greedy)[:, ids.shape[1]:]
        from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), **greedy)
    assert from_embeds[:, -6:].tolist() == from_ids.tolist()


def test_trainer_step_runs_and_passes_num_items_in_batch(tiny_model, tmp_path):
    from transformers import Trainer, TrainingArguments

    model = tiny_model("glm4").train()
    seen = []
    original_forward = model.forward

    @functools.wraps(original_forward)  # the Trainer reads the signature to keep columns and pass loss kwargs
    def spy(*args, **kwargs):
        seen.append(kwargs.get("num_items_in_batch"))
        return original_forward(*args, **kwargs)

    model.forward = spy
    ids, labels = batch(15, batch_size=4)
    data = [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to=[],
                             use_cpu=True, save_strategy="no", logging_strategy="no")
    result = Trainer(model=model, args=args, train_dataset=data).train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert seen
    if TRANSFORMERS >= Version("4.46"):  # the Trainer passes the token count since 4.46
        assert all(n is not None for n in seen)


def classifier(tiny_model, chatglm, family="glm4", num_labels=3):
    lm = tiny_model(family, num_labels=num_labels)
    model = chatglm.modeling.ChatGLMForSequenceClassification(lm.config)
    model.transformer.load_state_dict(lm.transformer.state_dict())
    return model.eval()


def test_sequence_classification_pools_the_last_real_token_for_either_padding(tiny_model, chatglm):
    model = classifier(tiny_model, chatglm)
    seq = torch.randint(3, 256, (5,), generator=torch.Generator().manual_seed(16))
    with torch.no_grad():
        alone = model(input_ids=seq[None]).logits
        left = model(input_ids=torch.cat([torch.zeros(3, dtype=torch.long), seq])[None],
                     attention_mask=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])).logits
        right = model(input_ids=torch.cat([seq, torch.zeros(3, dtype=torch.long)])[None],
                      attention_mask=torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])).logits
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=1e-5)


def test_sequence_classification_losses(tiny_model, chatglm):
    model = classifier(tiny_model, chatglm)
    ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(17))
    labels = torch.tensor([0, 2])
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels))
