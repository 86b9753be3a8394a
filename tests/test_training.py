"""Training basics: fp32 loss, the Trainer's num_items_in_batch, gradient checkpointing, inputs_embeds, classification."""
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, TRANSFORMERS, LoggedMessages, Version, optional_package


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


def written_out_loss(logits, labels=None, ignore_index=-100, shift_labels=None, num_items_in_batch=None):
    """The causal-LM loss by its definition: each position predicts the next label (or its shift_labels entry);
    positions whose target is ignore_index do not count; the sum is divided by the targets counted, or by
    num_items_in_batch."""
    if shift_labels is None:
        shift_labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)], dim=1)
    targets = shift_labels.flatten()
    counted = targets != ignore_index
    per_position = F.cross_entropy(logits.float().flatten(0, 1)[counted], targets[counted], reduction="none")
    return per_position.sum() / (counted.sum() if num_items_in_batch is None else num_items_in_batch)


def loss_case(case, ids, labels):
    """(labels, extra forward arguments) for one argument of transformers' causal-LM loss."""
    g = torch.Generator().manual_seed(21)
    if case == "shift_labels":  # already shifted, unrelated to labels: only they may count
        shifted = torch.randint(3, 256, labels.shape, generator=g)
        shifted[:, ::3] = -100
        return labels, {"shift_labels": shifted}
    if case == "ignore_index":
        return labels.masked_fill(labels == -100, 7), {"ignore_index": 7}
    if case == "num_items_in_batch":
        return labels, {"num_items_in_batch": torch.tensor(40)}
    return labels, {}


def transformers_loss_takes(argument: str) -> bool:
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # before 4.46
        return False
    import inspect

    return argument in inspect.signature(ForCausalLMLoss).parameters


@pytest.mark.parametrize("case", ["shift_labels", "ignore_index", "num_items_in_batch"])
def test_loss_arguments_change_the_loss_as_transformers_does(tiny_model, case):
    model = tiny_model("glm4")
    ids, plain_labels = batch(20)
    labels, extra = loss_case(case, ids, plain_labels)
    with torch.no_grad():
        plain = model(input_ids=ids, labels=labels).loss
        out = model(input_ids=ids, labels=labels, **extra)
    assert not torch.allclose(out.loss, plain)  # the argument matters
    torch.testing.assert_close(out.loss, written_out_loss(out.logits, labels, **extra))
    name = next(iter(extra))
    if transformers_loss_takes(name):  # transformers' own loss and GlmForCausalLM on the same weights (>= 4.46)
        from chatglm_tools.native_glm import native_glm
        from transformers.loss.loss_utils import ForCausalLMLoss

        torch.testing.assert_close(out.loss, ForCausalLMLoss(out.logits, labels, 256, **extra))
        with torch.no_grad():
            native = native_glm(model)(input_ids=ids, labels=labels, **extra).loss
        torch.testing.assert_close(out.loss, native, atol=1e-5, rtol=1e-5)


def test_shift_labels_alone_give_the_loss(tiny_model):
    """Sequence parallelism hands each rank shift_labels (its shard, already shifted) and no labels."""
    model = tiny_model("chatglm3")
    ids, labels = batch(22)
    _, extra = loss_case("shift_labels", ids, labels)
    with torch.no_grad():
        out = model(input_ids=ids, **extra)
    torch.testing.assert_close(out.loss, written_out_loss(out.logits, **extra))


def nothing_scored_warnings(log) -> list:
    return [message for message in log.messages if "every label is ignore_index" in message]


@pytest.mark.parametrize("targets", ["labels", "shift_labels"])
def test_labels_all_ignored_give_the_originals_nan_and_warn_once_with_the_cause(tiny_model, targets):
    """Every target -100 (a prompt truncated before its answer): the mean over no token is NaN, as in the original,
    which said nothing."""
    model = tiny_model("glm4")
    ids, labels = batch(23)
    ignored = torch.full_like(labels, -100)
    if targets == "labels":  # the first label is never a target (it is shifted away)
        ignored[:, 0] = labels[:, 0]
    with torch.no_grad(), LoggedMessages(type(model).__module__.rpartition(".")[0]) as log:
        losses = [model(input_ids=ids, **{targets: ignored}).loss for _ in range(2)]
    assert all(torch.isnan(loss) for loss in losses)
    assert torch.isnan(F.cross_entropy(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long)))  # the original's loss
    warned = nothing_scored_warnings(log)
    assert len(warned) == 1 and "-100" in warned[0] and "max_length" in warned[0] and "truncat" in warned[0], warned


@pytest.mark.parametrize("targets", [("labels",), ("shift_labels",), ("labels", "shift_labels")])
def test_a_training_forward_reads_one_value_of_its_targets(tiny_model, monkeypatch, targets):
    """Reading a value waits for the device: the label-id check and the all-ignored check share one read (one more
    than a forward without targets makes), and the loss itself is read only when no position has a target."""
    model = tiny_model("glm4")
    ids, labels = batch(25)
    reads = []
    for method in ("tolist", "item", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            reads.append(_method)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    with torch.no_grad():
        model(input_ids=ids)
        without_targets = list(reads)
        reads.clear()
        model(input_ids=ids, **{name: labels for name in targets})
    assert len(reads) == len(without_targets) + 1, (without_targets, reads)


@pytest.mark.parametrize("case", ["one row ignored", "num_items_in_batch"])
def test_labels_ignored_only_in_part_or_summed_give_a_number_and_no_warning(tiny_model, case):
    """A batch with a fully ignored row has a loss over the other rows; with the Trainer's num_items_in_batch an
    all-ignored micro-batch adds 0 to the sum. Neither is NaN, so nothing is said."""
    model = tiny_model("glm4")
    ids, labels = batch(24)
    extra = {}
    if case == "one row ignored":
        labels[0] = -100
    else:
        labels[:] = -100
        extra = {"num_items_in_batch": torch.tensor(40)}
    with torch.no_grad(), LoggedMessages(type(model).__module__.rpartition(".")[0]) as log:
        out = model(input_ids=ids, labels=labels, **extra)
    torch.testing.assert_close(out.loss, written_out_loss(out.logits, labels, **extra))
    assert torch.isfinite(out.loss) and not nothing_scored_warnings(log)


def test_padding_free_trainer_loss_equals_the_padded_batch(tiny_model, tmp_path):
    """DataCollatorWithFlattening packs a batch into one row with restarting position_ids; the Trainer's loss is the
    loss of the same sequences padded."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    g = torch.Generator().manual_seed(23)
    sequences = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 11, 8)]
    features = [{"input_ids": seq, "labels": seq} for seq in sequences]

    def padded(batch_features):
        """The same sequences right-padded, with the targets DataCollatorWithFlattening keeps (none for the first
        token of a sequence, which no position predicts)."""
        width = max(len(f["input_ids"]) for f in batch_features)
        rows = [f["input_ids"] for f in batch_features]
        return {
            "input_ids": torch.tensor([r + [0] * (width - len(r)) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
            "labels": torch.tensor([[-100] + r[1:] + [-100] * (width - len(r)) for r in rows]),
        }

    losses, shapes = {}, []
    for name, collator in (("flattened", DataCollatorWithFlattening()), ("padded", padded)):
        model = tiny_model("glm4").train()
        original_forward = model.forward

        @functools.wraps(original_forward)
        def spy(*args, **kwargs):
            shapes.append((tuple(kwargs["input_ids"].shape), kwargs.get("position_ids")))
            return original_forward(*args, **kwargs)

        model.forward = spy
        args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=3, max_steps=1,
                                 report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no")
        losses[name] = Trainer(model=model, args=args, train_dataset=features, data_collator=collator).train()
    (flat_shape, flat_positions), (padded_shape, _) = shapes
    assert flat_shape == (1, 24) and padded_shape == (3, 11)
    assert sorted(flat_positions[0].tolist()) == sorted(sum([list(range(len(s))) for s in sequences], []))
    assert losses["flattened"].training_loss == pytest.approx(losses["padded"].training_loss, rel=1e-5)


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


# --- GLM-4V: training with images --------------------------------------------------------------------------------------


def glm4v_answers_batch(seed, image_size=8):
    """Left-padded prompts with one image each plus an answer; labels on the answers only (token layout)."""
    from conftest import glm4v_prompt, random_images
    from chatglm_tools.device_check import left_pad

    generator = torch.Generator().manual_seed(seed)
    rows = [glm4v_prompt(n, generator) + torch.randint(3, 495, (a,), generator=generator).tolist()
            for n, a in ((2, 3), (6, 2))]
    ids, mask = left_pad(rows)
    labels = torch.full_like(ids, -100)
    for row, answer in enumerate((3, 2)):
        labels[row, -answer:] = ids[row, -answer:]
    return rows, ids, mask, labels, random_images(2, image_size, seed)


def gradients(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_glm4v_full_fine_tuning_gradients_equal_the_per_sequence_gradients(tiny_glm4v, checkpointing):
    """The mean loss of a padded image batch, backpropagated into every weight (vision tower included), equals the
    per-sequence losses weighted by their answer tokens; gradient checkpointing (vision blocks too) changes nothing."""
    model = tiny_glm4v(seed=31).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert model.transformer.vision.transformer.gradient_checkpointing
    rows, ids, mask, labels, images = glm4v_answers_batch(31)
    model(input_ids=ids, attention_mask=mask, labels=labels, images=images).loss.backward()
    batch_grads = gradients(model)
    assert any(name.startswith("transformer.vision.transformer.layers.") for name in batch_grads)
    expected, total = {}, int((labels[:, 1:] != -100).sum())
    for row, sequence in enumerate(rows):
        model.zero_grad(set_to_none=True)
        seq_labels = labels[row, -len(sequence):][None]
        loss = model(input_ids=torch.tensor([sequence]), labels=seq_labels, images=images[row:row + 1]).loss
        (loss * int((seq_labels[:, 1:] != -100).sum()) / total).backward()
        for name, grad in gradients(model).items():
            expected[name] = expected.get(name, 0) + grad
    assert set(batch_grads) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(batch_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_glm4v_lora_on_the_language_model_trains_with_images(tiny_glm4v, tmp_path):
    """PEFT LoRA on the language model's layers only (the vision tower has a `query_key_value` too), trained by the
    Trainer on batches with images; the merged model computes what the adapted one does."""
    optional_package("peft", "PEFT")
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    model = tiny_glm4v(seed=32)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=r".*encoder\.layers\.\d+\.(self_attention\.(query_key_value|dense)|mlp\.\w+)")
    peft_model = get_peft_model(model, lora)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ".encoder.layers." in n for n in trainable)
    _, ids, mask, labels, images = glm4v_answers_batch(32)
    data = [{"input_ids": i, "attention_mask": m, "labels": l, "images": x}
            for i, m, l, x in zip(ids, mask, labels, images)] * 2
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, report_to=[],
                             use_cpu=True, save_strategy="no", logging_strategy="no", learning_rate=1e-2,
                             remove_unused_columns=False)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    result = Trainer(model=peft_model, args=args, train_dataset=data).train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = {n for n, p in peft_model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and changed <= set(trainable)
    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(input_ids=ids, attention_mask=mask, images=images).logits
        generated = peft_model.generate(input_ids=ids, attention_mask=mask, images=images, max_new_tokens=3,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)
        merged = peft_model.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=ids, attention_mask=mask, images=images).logits, adapted,
                                   atol=1e-5, rtol=1e-5)
    assert generated.shape == (2, ids.shape[1] + 3)
