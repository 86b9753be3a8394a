"""GLM-4V (glm-4v-9b): the golden outputs of the original code, and what the original got wrong, against per-sequence
truth. Images enter the one language model through the embedding seam (visual.py); these tests drive the model as a
user does: token-layout ids, attention mask, position ids and labels, plus `images`."""
import pytest
import torch
import torch.nn.functional as F
from conftest import (GLM4V_ASSISTANT, GLM4V_IMAGE, GLM4V_PREFIX, TRANSFORMERS, Version, glm4v_prompt, load_causal_lm,
                      random_images, save_checkpoint)
from chatglm_tools.device_check import left_pad

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def relative_max_error(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def assert_logits_close(actual, expected):
    """fp32 golden tolerance: 1e-5 of the largest logit (FORMAT.md: eager vs SDPA moves logits by ~2e-5)."""
    assert relative_max_error(actual, expected) < 1e-5
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------------
# The golden checkpoint of the original code
# ----------------------------------------------------------------------------------------------------------------------


def test_original_checkpoint_loads_with_every_key(glm4v_golden):
    from safetensors import safe_open

    case = glm4v_golden["glm4v-tiny"]
    model, info = load_causal_lm(case.folder, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    with safe_open(str(case.folder / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert set(model.state_dict()) == saved
    assert any(key.startswith("transformer.vision.transformer.layers.") for key in saved)
    assert type(model.transformer.vision).__name__ == "EVA2CLIPModel"


def original_folder_with_our_files(case, folder, visual_source=None):
    """The golden checkpoint as a glm-4v-9b user has it (the original configuration class: GLM-4's fields, the
    vision fields read from config.json), with our modeling_chatglm.py and visual.py (or `visual_source`)."""
    import shutil

    from conftest import REPO
    from original_code import original_configuration_source

    folder.mkdir()
    for path in case.folder.iterdir():
        if path.suffix != ".py":
            shutil.copy(path, folder / path.name)
    (folder / "configuration_chatglm.py").write_text(original_configuration_source("glm4"))
    shutil.copy(REPO / "modeling_chatglm.py", folder / "modeling_chatglm.py")
    (folder / "visual.py").write_text(visual_source or (REPO / "visual.py").read_text())
    return folder


def test_modeling_and_visual_copied_over_the_original_files(glm4v_golden, tmp_path):
    case = glm4v_golden["glm4v-tiny-text"]
    model = load_causal_lm(original_folder_with_our_files(case, tmp_path / "glm4v_two_files"),
                           attn_implementation="eager")
    assert not hasattr(type(model.config), "validate_chatglm") and model.transformer.vision is not None
    e = case.expected
    with torch.no_grad():
        logits = model(input_ids=e["input_ids"][None]).logits[0]
    assert_logits_close(logits, e["logits"])


def test_the_original_visual_py_beside_our_modeling_file_is_named(glm4v_golden, tmp_path):
    stand_in = "class EVA2CLIPModel:  # glm-4v-9b's own visual.py has this class, not ours\n    pass\n"
    folder = original_folder_with_our_files(glm4v_golden["glm4v-tiny"], tmp_path / "glm4v_old_visual", stand_in)
    with pytest.raises(ImportError, match=r"visual\.py is not this repository's visual\.py"):
        load_causal_lm(folder)


@pytest.mark.parametrize("attn", ["eager", pytest.param("sdpa", marks=pytest.mark.matrix_ends)])
def test_forward_with_an_image_matches_golden(glm4v_golden, attn):
    """One forward (1600 image rows): the vision tower's rows, the positions the rotary table gets (boi keeps its
    token position, all image rows share the placeholder's, the text after the image keeps its token positions) and
    the logits, one row per image row."""
    case = glm4v_golden["glm4v-tiny"]
    e = case.expected
    model = case.load(attn_implementation=attn)
    seen = {}
    hooks = [model.transformer.vision.register_forward_hook(lambda m, args, out: seen.update(features=out)),
             # the positions the rotary module is handed: the rows of the table they pick
             model.transformer.rotary_pos_emb.register_forward_hook(lambda m, args, out: seen.update(rope=args[0]))]
    try:
        with torch.no_grad():
            logits = model(input_ids=e["input_ids"][None], images=e["pixel_values"], use_cache=False).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    # recorded in another process: FORMAT.md's 1e-4 (another thread count moves values by ~1e-5)
    torch.testing.assert_close(seen["features"][0], e["image_features"], atol=1e-4, rtol=1e-4)
    assert seen["rope"][0].tolist() == e["expanded_position_ids"].tolist()
    assert logits.shape == e["logits"].shape
    assert_logits_close(logits, e["logits"])


@pytest.mark.matrix_ends
def test_tokenizer_mask_and_positions_give_the_same_logits(glm4v_golden, glm4v_model):
    e = glm4v_golden["glm4v-tiny"].expected
    with torch.no_grad():
        logits = glm4v_model(input_ids=e["input_ids"][None], images=e["pixel_values"],
                             attention_mask=e["attention_mask"][None], position_ids=e["position_ids"][None],
                             use_cache=False).logits[0]
    assert_logits_close(logits, e["logits"])


def test_text_only_forward_matches_golden(glm4v_golden, glm4v_model):
    e = glm4v_golden["glm4v-tiny-text"].expected
    with torch.no_grad():
        logits = glm4v_model(input_ids=e["input_ids"][None], use_cache=False).logits[0]
    assert_logits_close(logits, e["logits"])


# The image case runs the 1600-row vision tower: on the matrix ends only.
CASES = ["glm4v-tiny-text", pytest.param("glm4v-tiny", marks=pytest.mark.matrix_ends)]


@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize("step_inputs", ["position_ids", "attention_mask", "nothing"])
def test_cached_step_matches_golden(glm4v_golden, glm4v_model, case_name, step_inputs):
    """The cache holds rows, the step takes token positions: given (as the golden), from the token mask, or derived
    from the cache alone (the original put the token at position 0 there)."""
    e = glm4v_golden[case_name].expected
    ids = e["input_ids"][None]
    n = ids.shape[1]
    images = {"images": e["pixel_values"]} if "pixel_values" in e else {}
    step_kwargs = {"position_ids": dict(position_ids=torch.tensor([[n - 1]])),
                   "attention_mask": dict(attention_mask=torch.ones(1, n, dtype=torch.long)),
                   "nothing": {}}[step_inputs]
    with torch.no_grad():
        prefill = glm4v_model(input_ids=ids[:, :-1], use_cache=True, **images)
        step = glm4v_model(input_ids=ids[:, -1:], past_key_values=prefill.past_key_values, use_cache=True,
                           **step_kwargs)
    assert_logits_close(step.logits[0, -1], e["incr_logits"])


@pytest.mark.parametrize("case_name", CASES)
def test_greedy_generation_matches_golden(glm4v_golden, glm4v_model, case_name):
    case = glm4v_golden[case_name]
    e = case.expected
    ids = e["input_ids"][None]
    images = {"images": e["pixel_values"]} if "pixel_values" in e else {}
    with torch.no_grad():
        out = glm4v_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **images, **case.gen_kwargs)
        plain = glm4v_model.generate(input_ids=ids, **images, **case.gen_kwargs)  # no mask, no positions
    assert out.sequences[0, ids.shape[1]:].tolist() == e["gen_tokens"].tolist()
    assert_logits_close(torch.stack(out.logits, 1)[0], e["gen_logits"])
    assert plain.sequences[0, ids.shape[1]:].tolist() == e["gen_tokens"].tolist()


@pytest.mark.matrix_ends
def test_loss_with_an_image_matches_golden(glm4v_golden, glm4v_model):
    e = glm4v_golden["glm4v-tiny"].expected
    with torch.no_grad():
        out = glm4v_model(input_ids=e["train_input_ids"][None], images=e["pixel_values"],
                          labels=e["train_labels"][None], use_cache=False)
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, e["loss"], atol=1e-5, rtol=0)
    assert_logits_close(out.logits[0], e["train_logits"])


def test_text_only_loss_is_the_shifted_cross_entropy(glm4v_golden, glm4v_model):
    """The original crashed here (`508 is not in list`: it looked for an image)."""
    e = glm4v_golden["glm4v-tiny-text"].expected
    with torch.no_grad():
        out = glm4v_model(input_ids=e["train_input_ids"][None], labels=e["train_labels"][None], use_cache=False)
    torch.testing.assert_close(out.loss, e["reference_loss_shifted_ce"], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------------------------------
# What the original got wrong, against per-sequence truth (tiny model: N = 4 image rows)
# ----------------------------------------------------------------------------------------------------------------------


def image_batch(lengths, seed, image_size=8, images=True):
    """Left-padded prompts of `lengths` text tokens (each with an image), their masks and images."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [glm4v_prompt(n, generator, image=images) for n in lengths]
    ids, mask = left_pad(prompts)
    return prompts, ids, mask, (random_images(len(lengths), image_size, seed) if images else None)


def rows_of(prompt, image_tokens):
    """Rows of a prompt in the model: the three image tokens become image_tokens + 2 rows."""
    return len(prompt) + (image_tokens - 1 if GLM4V_IMAGE[0] in prompt else 0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padded_image_batch_equals_each_sequence_alone(tiny_glm4v, attn):
    """The original crashed on a left-padded image batch unless the mask was expanded by hand."""
    model = tiny_glm4v(seed=1, attn_implementation=attn)
    n_image = model.transformer.vision.image_tokens
    prompts, ids, mask, images = image_batch([3, 9, 6], seed=2)
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask, images=images).logits
        for row, prompt in enumerate(prompts):
            alone = model(input_ids=torch.tensor([prompt]), images=images[row:row + 1]).logits[0]
            rows = rows_of(prompt, n_image)
            assert_logits_close(batch[row, -rows:], alone)


def test_left_padded_image_batch_generates_each_sequences_tokens(tiny_glm4v):
    """Also with the tokenizer's position_ids (0 on padding, then counting the tokens), as `generate(**inputs)`
    passes them."""
    model = tiny_glm4v(seed=3)
    prompts, ids, mask, images = image_batch([2, 8, 5], seed=4)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, images=images, max_new_tokens=6, **GREEDY)
        with_positions = model.generate(ids, attention_mask=mask, position_ids=positions, images=images,
                                        max_new_tokens=6, **GREEDY)
        for row, prompt in enumerate(prompts):
            alone = model.generate(torch.tensor([prompt]), images=images[row:row + 1], max_new_tokens=6, **GREEDY)
            assert batch[row, ids.shape[1]:].tolist() == alone[0, len(prompt):].tolist()
    assert with_positions.tolist() == batch.tolist()


def test_left_padded_text_batch_generates_and_trains(tiny_glm4v):
    """Both crashed in the original (it grew any mask by N, and looked for an image in train mode)."""
    model = tiny_glm4v(seed=5)
    prompts, ids, mask, _ = image_batch([2, 7], seed=6, images=False)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
        for row, prompt in enumerate(prompts):
            alone = model.generate(torch.tensor([prompt]), max_new_tokens=5, **GREEDY)
            assert batch[row, ids.shape[1]:].tolist() == alone[0, len(prompt):].tolist()
    model.train()
    labels = ids.masked_fill(mask == 0, -100)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)


def loss_by_hand(logits, prompt, labels, image_tokens):
    """Mean cross entropy of each labelled text token, read from the row before its own; a token's row is its index,
    plus image_tokens - 1 after the image. Independent of the model's row mapping."""
    placeholder = prompt.index(GLM4V_IMAGE[0]) + 1 if GLM4V_IMAGE[0] in prompt else len(prompt)
    terms = []
    for t in range(1, len(prompt)):
        if labels[t] == -100 or t == placeholder:
            continue
        row = t + (image_tokens - 1 if t > placeholder else 0)
        terms.append(F.cross_entropy(logits[row - 1].float()[None], torch.tensor([labels[t]]), reduction="sum"))
    return torch.stack(terms)


@pytest.mark.parametrize("image_size", [8, 12])  # N = 4 and N = 9 image rows (the original assumed 1600)
def test_loss_is_right_for_any_image_size_and_padding(tiny_glm4v, image_size):
    model = tiny_glm4v(seed=7, image_size=image_size)
    n_image = model.transformer.vision.image_tokens
    prompts, ids, mask, images = image_batch([4, 9], seed=8, image_size=image_size)
    answers = [[11, 12, 13], [21, 22]]
    rows = [prompt + answer for prompt, answer in zip(prompts, answers)]
    ids, mask = left_pad(rows)
    labels = torch.full_like(ids, -100)
    for row, answer in enumerate(answers):
        labels[row, -len(answer):] = torch.tensor(answer)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, images=images, labels=labels)
        terms = []
        for row, sequence in enumerate(rows):
            alone = model(input_ids=torch.tensor([sequence]), images=images[row:row + 1]).logits[0]
            seq_labels = labels[row, -len(sequence):].tolist()
            terms.append(loss_by_hand(alone, sequence, seq_labels, n_image))
    torch.testing.assert_close(out.loss, torch.cat(terms).mean(), atol=1e-5, rtol=1e-5)


def test_shift_labels_with_an_image_give_the_same_loss(tiny_glm4v):
    """Labels already shifted (sequence / context parallelism) are mapped to the rows too."""
    model = tiny_glm4v(seed=15)
    _, ids, mask, images = image_batch([3, 6], seed=15)
    labels = ids.masked_fill(mask == 0, -100)
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, images=images, labels=labels).loss
        by_shifted = model(input_ids=ids, attention_mask=mask, images=images, shift_labels=shifted).loss
    torch.testing.assert_close(by_shifted, plain)


# ----------------------------------------------------------------------------------------------------------------------
# Cache API; masks in tokens or in rows
# ----------------------------------------------------------------------------------------------------------------------


def full_and_chunked(model, prompt, images, split, images_with=("prefill", "rest")):
    """The last logits of the whole prompt, and of the prompt prefilled up to `split` then continued with the cache
    (`images` passed to the chunks named in `images_with`, as generate() passes them to every step), and the rows
    the prefill cached."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        full = model(input_ids=ids, images=images).logits[0, -1]
        prefill = model(input_ids=ids[:, :split], use_cache=True,
                        images=images if "prefill" in images_with else None)
        cached_rows = prefill.past_key_values.get_seq_length()
        rest = model(input_ids=ids[:, split:], past_key_values=prefill.past_key_values, use_cache=True,
                     images=images if "rest" in images_with else None)
    return full, cached_rows, rest


def test_the_cache_holds_rows_and_continues_in_tokens(tiny_glm4v):
    from transformers.cache_utils import DynamicCache

    model = tiny_glm4v(seed=9)
    prompt = glm4v_prompt(6, torch.Generator().manual_seed(9))
    full, cached_rows, rest = full_and_chunked(model, prompt, random_images(1, 8, 9), len(prompt) - 3)
    assert isinstance(rest.past_key_values, DynamicCache)
    assert cached_rows == len(prompt) - 3 + model.transformer.vision.image_tokens - 1
    assert_logits_close(rest.logits[0, -1], full)


def test_an_image_in_a_later_chunk_of_the_prompt(tiny_glm4v):
    """Text prefilled first (a shared system prompt, say), then the chunk with the image."""
    model = tiny_glm4v(seed=10)
    prompt = glm4v_prompt(5, torch.Generator().manual_seed(10))
    full, _, rest = full_and_chunked(model, prompt, random_images(1, 8, 10), 2, images_with=("rest",))
    assert_logits_close(rest.logits[0, -1], full)


def test_a_mask_expanded_to_rows_by_hand_is_accepted(tiny_glm4v):
    """What users of the original did for padded batches: a mask with one column per row."""
    model = tiny_glm4v(seed=11)
    _, ids, mask, images = image_batch([2, 5], seed=11)
    added = model.transformer.vision.image_tokens - 1
    pads = (mask == 0).sum(-1).tolist()
    row_mask = torch.tensor([[0] * p + [1] * (ids.shape[1] - p + added) for p in pads])  # pads first, then rows
    with torch.no_grad():
        by_tokens = model(input_ids=ids, attention_mask=mask, images=images).logits
        by_rows = model(input_ids=ids, attention_mask=row_mask, images=images).logits
    real = row_mask.bool()
    assert_logits_close(by_rows[real], by_tokens[real])


@pytest.mark.skipif(TRANSFORMERS >= Version("5.0"), reason="tuple caches are gone in transformers 5")
def test_legacy_tuple_cache_with_a_token_mask(tiny_glm4v):
    model = tiny_glm4v(seed=12)
    prompt = glm4v_prompt(4, torch.Generator().manual_seed(12))
    images = random_images(1, 8, 12)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        full = model(input_ids=ids, images=images).logits[0, -1]
        prefill = model(input_ids=ids[:, :-1], images=images, use_cache=True)
        legacy = prefill.past_key_values.to_legacy_cache()
        step = model(input_ids=ids[:, -1:], past_key_values=legacy, attention_mask=torch.ones_like(ids),
                     use_cache=True)
    assert isinstance(step.past_key_values, tuple)
    assert_logits_close(step.logits[0, -1], full)


def test_beam_search_with_images_equals_each_sequence_alone(tiny_glm4v):
    model = tiny_glm4v(seed=13)
    prompts, ids, mask, images = image_batch([2, 6], seed=13)
    beams = dict(GREEDY, num_beams=3, max_new_tokens=4)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, images=images, **beams)
        for row, prompt in enumerate(prompts):
            alone = model.generate(torch.tensor([prompt]), images=images[row:row + 1], **beams)
            assert batch[row, ids.shape[1]:].tolist() == alone[0, len(prompt):].tolist()


def test_save_pretrained_writes_a_checkpoint_that_loads_again(tiny_glm4v, tmp_path):
    import json

    model = tiny_glm4v(seed=14)
    folder = save_checkpoint(model, tmp_path / "glm4v_saved")
    config = json.loads((folder / "config.json").read_text())
    assert config["vision_config"] == model.config.vision_config
    assert (config["boi_token_id"], config["eoi_token_id"]) == (508, 509)
    reloaded, info = load_causal_lm(folder, output_loading_info=True)
    assert not any(info.values()), info
    _, ids, _, images = image_batch([3], seed=14)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, images=images).logits,
                                   model(input_ids=ids, images=images).logits)


# ----------------------------------------------------------------------------------------------------------------------
# Clear errors
# ----------------------------------------------------------------------------------------------------------------------

IMAGE_PROMPT = GLM4V_PREFIX + GLM4V_IMAGE + [7, 8] + GLM4V_ASSISTANT


@pytest.mark.parametrize("ids,images,message", [
    (GLM4V_PREFIX + [7, 8], random_images(1, 8, 0), r"exactly one <\|begin_of_image\|>.*found \[0\]"),
    (GLM4V_PREFIX + GLM4V_IMAGE + GLM4V_IMAGE, random_images(1, 8, 0), r"one image per sequence"),
    (GLM4V_PREFIX + [508, 7, 8, 509], random_images(1, 8, 0), r"after exactly one placeholder"),
    (IMAGE_PROMPT, random_images(1, 16, 0), r"shape \(1, 3, 16, 16\).*\[batch, 3, 8, 8\]"),
    (IMAGE_PROMPT, random_images(2, 8, 0), r"2 images for 1 sequences"),
    (IMAGE_PROMPT, torch.zeros(1, 3, 8, 8, dtype=torch.uint8), r"normalised float pixels"),
    (IMAGE_PROMPT, [random_images(1, 8, 0)[0]], r"images must be a tensor"),
], ids=["no-placeholder", "two-images", "broken-placeholder", "wrong-size", "wrong-count", "uint8", "list"])
def test_bad_images_are_refused_with_a_clear_error(tiny_glm4v, ids, images, message):
    model = tiny_glm4v()
    with pytest.raises((ValueError, TypeError), match=message):
        model(input_ids=torch.tensor([ids]), images=images)


def test_images_with_a_static_cache_or_inputs_embeds_are_refused(tiny_glm4v):
    model = tiny_glm4v()
    ids, images = torch.tensor([IMAGE_PROMPT]), random_images(1, 8, 0)
    with pytest.raises(ValueError, match="preallocated cache"):
        model.generate(ids, images=images, max_new_tokens=2, cache_implementation="static", **GREEDY)
    with pytest.raises(ValueError, match="inputs_embeds cannot be combined with images"):
        model(inputs_embeds=model.get_input_embeddings()(ids), images=images)


def test_a_mask_of_the_wrong_length_names_both_layouts(tiny_glm4v):
    model = tiny_glm4v()
    ids, images = torch.tensor([IMAGE_PROMPT]), random_images(1, 8, 0)
    with torch.no_grad():
        prefill = model(input_ids=ids, images=images, use_cache=True)
        with pytest.raises(ValueError, match=r"one per token, cached and new \(11, .* one per row .*\(14, "):
            model(input_ids=torch.tensor([[7]]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                  past_key_values=prefill.past_key_values)
        with pytest.raises(ValueError, match=r"one per token, cached and new \(3\)"):
            model(input_ids=torch.tensor([[7, 8, 9]]), attention_mask=torch.ones(1, 2, dtype=torch.long))


def test_images_for_a_text_model_are_refused(tiny_model):
    with pytest.raises(ValueError, match="no vision tower"):
        tiny_model("glm4")(input_ids=torch.tensor([[5, 6]]), images=random_images(1, 8, 0))


def test_vision_config_that_cannot_work_names_the_field(chatglm):
    from conftest import tiny_glm4v_config_dict

    config = tiny_glm4v_config_dict()
    config["vision_config"]["num_positions"] = 10
    with pytest.raises(ValueError, match=r"num_positions is 10.*17"):
        chatglm.modeling.ChatGLMForConditionalGeneration(chatglm.ChatGLMConfig(**config))
    with pytest.raises(ValueError, match="boi_token_id"):
        chatglm.ChatGLMConfig(**dict(tiny_glm4v_config_dict(), boi_token_id=None))
