"""Does a ChatGLM model split over several devices compute what it computes on one device?

Used twice: by `tools/gpu_check.py` on real devices (cpu + cuda:N) and by the test suite on its virtual devices.
Modules are placed with plain `module.to(device)` per map entry, without accelerate's hooks, so what is tested is
the model's own device boundaries.
"""
import copy
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from . import kv_cache

# repetition_penalty: a logits processor that reads the ids beside the scores, so both must share a device.
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0, repetition_penalty=1.3)


def spread_device_map(num_layers: int, devices) -> dict:
    """A map with every boundary in play: one block per device in turn, and embedding, rotary table, final norm and
    output layer each on a different device from its neighbours."""
    devices = [str(d) for d in devices]
    n = len(devices)
    device_map = {f"transformer.encoder.layers.{i}": devices[i % n] for i in range(num_layers)}
    device_map["transformer.embedding"] = devices[-1]
    device_map["transformer.rotary_pos_emb"] = devices[1 % n]
    device_map["transformer.encoder.final_layernorm"] = devices[num_layers % n]
    device_map["transformer.output_layer"] = devices[(num_layers + 1) % n]
    return device_map


def place(model: torch.nn.Module, device_map: dict) -> torch.nn.Module:
    for name, device in device_map.items():
        model.get_submodule(name).to(device)
    return model


def cache_devices(cache) -> list:
    """The device of each layer's cached keys and values."""
    return [(str(k.device), str(v.device)) for k, v in kv_cache.layer_tensors(cache)]


def layer_devices(model) -> list:
    return [str(next(layer.parameters()).device) for layer in model.transformer.encoder.layers]


def left_pad(sequences, pad_id=0):
    """Left-padded ids and attention mask for token lists, on the CPU as a tokenizer returns them."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, length - len(seq):] = torch.as_tensor(seq)
        mask[row, length - len(seq):] = 1
    return ids, mask


def padded_batch(lengths, vocab, seed):
    """Random sequences of `lengths` (ids in [3, vocab)), left-padded with id 0."""
    generator = torch.Generator().manual_seed(seed)
    return left_pad([torch.randint(3, vocab, (n,), generator=generator) for n in lengths])


@dataclass
class Report:
    logits_max_diff: float
    loss_diff: float
    grad_max_diff: float
    greedy_same: bool
    batch_greedy_same: bool
    cache_on_layer_devices: bool
    device_warnings: list  # the text of every warning about devices raised by the split model's calls
    # Where greedy tokens first differ: (which generation, row, new-token index, the one-device model's margin between
    # its two best scores there); None where both generations are equal.
    divergence: Optional[tuple] = None

    def ok(self, logits_tol: float, grad_tol: float) -> bool:
        """Greedy tokens may part only at a near tie: where the one-device model's two best scores are closer than
        twice the logits tolerance, the split model's rounding (within that tolerance) can swap them."""
        greedy_ok = (self.greedy_same and self.batch_greedy_same) or (
            self.divergence is not None and self.divergence[3] <= 2 * logits_tol)
        return (self.logits_max_diff <= logits_tol and self.loss_diff <= grad_tol and self.grad_max_diff <= grad_tol
                and greedy_ok and self.cache_on_layer_devices and not self.device_warnings)


def first_divergence(reference, runs) -> Optional[tuple]:
    """runs: (name, prompt ids, prompt mask, [reference tokens, split tokens]). The first place where the split
    model's greedy tokens leave the reference's, with the reference's margin between its two best (processed) scores
    at that step."""
    from transformers import RepetitionPenaltyLogitsProcessor

    penalty = RepetitionPenaltyLogitsProcessor(GREEDY["repetition_penalty"])
    for name, prompt, mask, (expected, got) in runs:
        differs = (expected != got).nonzero()
        if not len(differs):
            continue
        row, column = (int(i) for i in differs[0])
        ids = expected[row:row + 1, :column]
        row_mask = torch.cat([mask[row:row + 1], torch.ones(1, column - mask.shape[1], dtype=mask.dtype)], 1)
        device = next(reference.parameters()).device
        with torch.no_grad():
            logits = reference(input_ids=ids.to(device), attention_mask=row_mask.to(device)).logits[:, -1].float()
        best = penalty(ids.to(device), logits).topk(2).values[0]
        return name, row, column - prompt.shape[1], float(best[0] - best[1])
    return None


def device_warnings(caught) -> list:
    """The distinct messages among caught warnings that speak of devices."""
    return sorted({str(w.message) for w in caught if "device" in str(w.message)})


def run(model, device_map: dict, reference_device, new_tokens: int = 8, seed: int = 0) -> Report:
    """Compare `model` placed by `device_map` with a copy of it on `reference_device`. Inputs start on the CPU."""
    single = copy.deepcopy(model).to(reference_device)
    split = place(copy.deepcopy(model), device_map)
    vocab = model.config.padded_vocab_size
    ids, mask = padded_batch([5, 11, 8], vocab, seed)
    labels = ids.masked_fill(mask == 0, -100)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = {}
        for name, m in (("single", single), ("split", split)):
            m.zero_grad()
            out = m(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            outputs[name] = out
    warned = device_warnings(caught)
    logits_diff = (outputs["split"].logits.float().cpu() - outputs["single"].logits.float().cpu())
    logits_diff = logits_diff[mask.bool()].abs().max().item()
    loss_diff = abs(outputs["split"].loss.item() - outputs["single"].loss.item())
    grad_diff = max((p.grad.float().cpu() - q.grad.float().cpu()).abs().max().item()
                    for p, q in zip(split.parameters(), single.parameters()))

    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prompt = ids[1:2, -11:]
        greedy = [m.generate(prompt, max_new_tokens=new_tokens, **GREEDY).cpu() for m in (single, split)]
        batch = [m.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, **GREEDY).cpu()
                 for m in (single, split)]
        prefill = split(input_ids=ids, attention_mask=mask, use_cache=True)
        placement_ok = cache_devices(kv_cache.returned(prefill)) == [(d, d) for d in layer_devices(split)]
        step = split(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], 1),
                     **kv_cache.argument(kv_cache.returned(prefill)), use_cache=True)
        placement_ok &= cache_devices(kv_cache.returned(step)) == [(d, d) for d in layer_devices(split)]
    warned = sorted(set(warned) | set(device_warnings(caught)))
    divergence = first_divergence(single, [("greedy", prompt, torch.ones_like(prompt), greedy),
                                           ("batch", ids, mask, batch)])
    return Report(logits_diff, loss_diff, grad_diff, torch.equal(*greedy), torch.equal(*batch), placement_ok, warned,
                  divergence)
