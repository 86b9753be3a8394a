"""The users' fine-tuning recipes, end to end, as they are written.

Self-LLM's GLM-4 / ChatGLM3 LoRA recipe (the calls below are the recipe's, in its order; only sizes and step counts
are small): a prompt built by hand with the chat format's control-token text, `model.enable_input_require_grads()`,
`LoraConfig(target_modules=["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"])`,
`TrainingArguments(..., gradient_checkpointing=True)`, `DataCollatorForSeq2Seq`, `Trainer.train()`; full fine-tuning
with the Trainer; then `model.chat`. The truths they are held to: the first logged loss is the loss of the first
batch computed by hand, a run split over several (simulated) devices logs the single-device losses, checkpointing
recomputes every block and changes no loss.
"""

import pytest
import torch
import transformers
from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

from conftest import REAL_VOCABULARY, optional_package, save_checkpoint
from tokenizer_fixtures import make_tokenizer_folder
from virtual_devices import pipeline_device_map, virtual_devices

SYSTEM = "Suppose you are the woman beside the emperor: Zhen Huan."
EXAMPLES = [
    {"instruction": "Who are you?", "input": "", "output": "My father is Zhen Yuandao, an official of the court."},
    {"instruction": "What is the weather like today?", "input": "", "output": "The snow in the garden is deep."},
    {"instruction": "Translate to English:", "input": "你好", "output": "Hello."},
    {"instruction": "Recite a line of poetry.", "input": "", "output": "Plum blossoms open alone in the cold."},
]
LORA_TARGETS = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]


def recipe_prompt(family: str, example: dict) -> str:
    """The recipe's hand-built prompt: the chat format written out as text."""
    question = example["instruction"] + example["input"]
    if family == "glm4":
        return f"[gMASK]<sop><|system|>\n{SYSTEM}<|user|>\n{question}<|assistant|>\n"
    return f"[gMASK]sop<|system|>\n {SYSTEM}<|user|>\n {question}<|assistant|>\n "


def process_func(tokenizer, family: str, example: dict, max_length: int = 384) -> dict:
    """The recipe's process_func: prompt tokens masked out of the labels, the answer and a closing pad token learnt."""
    instruction = tokenizer(recipe_prompt(family, example), add_special_tokens=False)
    response = tokenizer(example["output"], add_special_tokens=False)
    input_ids = instruction["input_ids"] + response["input_ids"] + [tokenizer.pad_token_id]
    attention_mask = instruction["attention_mask"] + response["attention_mask"] + [1]
    labels = [-100] * len(instruction["input_ids"]) + response["input_ids"] + [tokenizer.pad_token_id]
    return {"input_ids": input_ids[:max_length], "attention_mask": attention_mask[:max_length],
            "labels": labels[:max_length]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model):
    """family -> a checkpoint folder a user has: the real tokenizer files, our code, tiny random weights."""
    folders = {}
    for family in ("glm4", "chatglm3"):
        folder = make_tokenizer_folder(tmp_path_factory.mktemp(f"recipe-{family}"), family)
        save_checkpoint(tiny_model(family, padded_vocab_size=REAL_VOCABULARY[family], hidden_dropout=0.0), folder)
        folders[family] = folder
    return folders


def training_arguments(output_dir, **overrides) -> TrainingArguments:
    """The recipe's TrainingArguments, with a tiny run: one sequence a step, every step logged, nothing saved."""
    values = dict(output_dir=str(output_dir), per_device_train_batch_size=1, gradient_accumulation_steps=1,
                  logging_steps=1, max_steps=len(EXAMPLES), learning_rate=1e-3, save_strategy="no",
                  gradient_checkpointing=True, report_to=[], use_cpu=True, seed=0, data_seed=0)
    values.update(overrides)
    return TrainingArguments(**values)


def run_recipe(folder, family, output_dir, lora=True, device_map=None, **argument_overrides):
    """The recipe from loading to trainer.train(); returns the trainer and the tokenized data set."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), use_fast=False, trust_remote_code=True)
    tokenized = [process_func(tokenizer, family, example) for example in EXAMPLES]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True,
                                                              device_map=device_map)
    if lora:
        optional_package("peft", "PEFT")
        from peft import LoraConfig, TaskType, get_peft_model

        model.enable_input_require_grads()
        # LoRA draws its A matrices from the global generator (the Trainer seeds only later): the same seed gives every
        # run the same adapter, whatever ran before it in the process.
        transformers.set_seed(0)
        config = LoraConfig(task_type=TaskType.CAUSAL_LM, target_modules=LORA_TARGETS, inference_mode=False, r=8,
                            lora_alpha=32, lora_dropout=0.0)
        model = get_peft_model(model, config)
    trainer = Trainer(model=model, args=training_arguments(output_dir, **argument_overrides),
                      train_dataset=tokenized, data_collator=DataCollatorForSeq2Seq(tokenizer=tokenizer, padding=True))
    return trainer, tokenizer, tokenized


def logged_losses(trainer) -> list:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_self_llm_lora_recipe_trains_with_gradient_checkpointing(checkpoints, family, tmp_path):
    trainer, tokenizer, tokenized = run_recipe(checkpoints[family], family, tmp_path)
    blocks = trainer.model.base_model.model.transformer.encoder.layers
    attention_calls = []
    blocks[0].self_attention.register_forward_pre_hook(lambda *_: attention_calls.append(1))
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    result = trainer.train()

    losses = logged_losses(trainer)
    assert len(losses) == len(EXAMPLES) and all(loss == loss and loss > 0 for loss in losses)
    assert result.global_step == len(EXAMPLES)
    assert trainer.model.base_model.model.is_gradient_checkpointing
    assert len(attention_calls) == 2 * len(EXAMPLES)  # each step's forward, and its recomputation in backward
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)
    changed = [n for n, p in trainer.model.named_parameters() if n in trainable and not torch.equal(p, trainable[n])]
    assert changed and all("lora_" in n for n in changed)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in changed} == set(LORA_TARGETS)


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_lora_recipe_losses_with_and_without_checkpointing_are_equal(checkpoints, family, tmp_path):
    with_checkpointing, _, _ = run_recipe(checkpoints[family], family, tmp_path / "gc")
    with_checkpointing.train()
    without, _, _ = run_recipe(checkpoints[family], family, tmp_path / "plain", gradient_checkpointing=False)
    without.train()
    assert logged_losses(with_checkpointing) == pytest.approx(logged_losses(without), rel=1e-5)


@pytest.mark.multi_device
@pytest.mark.matrix_ends
@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_lora_recipe_over_several_devices_logs_the_single_device_losses(checkpoints, family, tmp_path):
    single, _, _ = run_recipe(checkpoints[family], family, tmp_path / "one")
    single.train()
    with virtual_devices(3) as devices:
        with torch.device("meta"):
            config = transformers.AutoConfig.from_pretrained(str(checkpoints[family]), trust_remote_code=True)
            skeleton = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=True)
        device_map = pipeline_device_map(skeleton, "transformer.encoder.layers", devices)
        split, _, _ = run_recipe(checkpoints[family], family, tmp_path / "split", device_map=device_map)
        layers = split.model.base_model.model.transformer.encoder.layers
        assert len({p.device for layer in layers for p in layer.parameters()}) == 3
        split.train()
    assert logged_losses(split) == pytest.approx(logged_losses(single), rel=1e-5)


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_full_fine_tuning_with_checkpointing_equals_the_plain_run(checkpoints, family, tmp_path):
    runs = {}
    for checkpointing in (True, False):
        trainer, _, _ = run_recipe(checkpoints[family], family, tmp_path / str(checkpointing), lora=False,
                                   gradient_checkpointing=checkpointing, learning_rate=1e-4)
        calls = []
        trainer.model.transformer.encoder.layers[1].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        trainer.train()
        runs[checkpointing] = (logged_losses(trainer), len(calls), dict(trainer.model.named_parameters()))
    (losses, calls, weights), (plain_losses, plain_calls, plain_weights) = runs[True], runs[False]
    assert (calls, plain_calls) == (2 * len(EXAMPLES), len(EXAMPLES))
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for name, weight in weights.items():
        torch.testing.assert_close(weight, plain_weights[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_first_logged_loss_is_the_first_batch_loss(checkpoints, tmp_path):
    """What the Trainer logs is the model's loss on the batch it drew, computed here from the collated batch."""
    trainer, tokenizer, tokenized = run_recipe(checkpoints["glm4"], "glm4", tmp_path, max_steps=1)
    first = next(iter(trainer.get_train_dataloader()))
    fresh = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints["glm4"]), trust_remote_code=True)
    with torch.no_grad():
        logits = fresh(input_ids=first["input_ids"], attention_mask=first["attention_mask"]).logits
    targets = first["labels"][:, 1:]
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                 targets.reshape(-1), ignore_index=-100)
    trainer.train()
    assert logged_losses(trainer)[0] == pytest.approx(expected.item(), rel=1e-4)


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_chat_after_lora_training_answers_alike_with_the_adapter_and_merged(checkpoints, family, tmp_path):
    trainer, tokenizer, _ = run_recipe(checkpoints[family], family, tmp_path)
    trainer.train()
    adapted = trainer.model.eval()
    with_adapter = adapted.chat(tokenizer, "Who are you?", history=[], do_sample=False, max_length=48)
    merged = adapted.merge_and_unload().eval()
    response, history = merged.chat(tokenizer, "Who are you?", history=[], do_sample=False, max_length=48)
    assert (response, history) == with_adapter
    assert history[0] == {"role": "user", "content": "Who are you?"} and history[-1]["role"] == "assistant"


def test_trl_sft_trainer_with_lora_trains_with_gradient_checkpointing(checkpoints, tmp_path):
    """TRL's SFTTrainer with a LoRA peft_config on a "text" data set, as its documentation writes the call (the TRL
    release pinned for this transformers by scripts/env.sh; its argument names changed over the releases)."""
    trl = optional_package("trl", "TRL")
    datasets = optional_package("datasets", "datasets (TRL's)")
    optional_package("peft", "PEFT")
    import inspect

    from peft import LoraConfig

    folder = str(checkpoints["glm4"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    # The tokenizer adds [gMASK]<sop> itself: the text starts after it.
    texts = [recipe_prompt("glm4", example).removeprefix("[gMASK]<sop>") + example["output"] for example in EXAMPLES]
    config_fields = inspect.signature(trl.SFTConfig).parameters
    length = {"max_length" if "max_length" in config_fields else "max_seq_length": 128}
    # fp32 on the CPU: TRL 0.19's SFTConfig turns bf16 on by default, and its bf16 run changes the losses of every later
    # Trainer in the same process (seen on transformers 4.53.3; accelerate's state reset does not undo it).
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=len(EXAMPLES),
                         logging_steps=1, learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True,
                         gradient_checkpointing=True, dataset_text_field="text", packing=False, bf16=False, **length)
    tokenizer_argument = "processing_class" if "processing_class" in inspect.signature(trl.SFTTrainer).parameters \
        else "tokenizer"
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": texts}),
                             peft_config=LoraConfig(task_type="CAUSAL_LM", target_modules=LORA_TARGETS, r=8,
                                                    lora_alpha=32, lora_dropout=0.0),
                             **{tokenizer_argument: tokenizer})
    calls = []
    trainer.model.base_model.model.transformer.encoder.layers[0].self_attention.register_forward_pre_hook(
        lambda *_: calls.append(1))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = logged_losses(trainer)
    assert len(losses) == len(EXAMPLES) and all(loss == loss and loss > 0 for loss in losses)
    assert len(calls) == 2 * len(EXAMPLES)  # checkpointed: every step's block runs again in the backward pass
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed)


def test_chatglm3_ptuning_v2_recipe_trains_the_prefix_alone(checkpoints, tmp_path):
    """ChatGLM3's P-tuning v2 fine-tuning as its demo writes it: pre_seq_len through AutoConfig, the model loaded with
    that config, gradient_checkpointing_enable() + enable_input_require_grads(), Seq2SeqTrainer."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    folder = str(checkpoints["chatglm3"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True, pre_seq_len=8,
                                                     prefix_projection=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, trust_remote_code=True)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    calls = []
    model.transformer.encoder.layers[0].self_attention.register_forward_pre_hook(lambda *_: calls.append(1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                                    logging_steps=1, learning_rate=1e-2, save_strategy="no", report_to=[],
                                    use_cpu=True, seed=0)
    trainer = Seq2SeqTrainer(model=model, args=args,
                             train_dataset=[process_func(tokenizer, "chatglm3", e) for e in EXAMPLES],
                             data_collator=DataCollatorForSeq2Seq(tokenizer=tokenizer, padding=True))
    trainer.train()
    assert len(logged_losses(trainer)) == 2 and len(calls) == 2 * 2  # two steps, each recomputed
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed == {"transformer.prefix_encoder.embedding.weight"}
