"""GLM-4V (glm-4v-9b): the EVA2-CLIP vision tower, and how its image rows enter the language model.

modeling_chatglm.py loads this file (`import_companion("visual")`) only for a config with `vision_config`; text
models never import it. This file imports nothing of modeling_chatglm.py (no import loop): what it uses of the
language model (device boundaries, default positions) is handed in as `LanguageModelCallbacks`; the cache's
image-row count is kept on the cache here (`IMAGE_ROWS_ATTRIBUTE`). Module names and state-dict keys are the original's (`transformer.vision.patch_embedding`,
`transformer.vision.transformer.layers.N.attention.query_key_value`, `transformer.vision.linear_proj.gate_proj`,
`transformer.vision.boi`, ...), so a glm-4v-9b checkpoint loads with no missing or unexpected key.

Two coordinate systems. Users pass what the GLM-4V tokenizer makes: ids with one image placeholder
(`<|begin_of_image|> <|endoftext|> <|end_of_image|>`), and an attention mask, position ids and labels with one entry
per token (the *token layout*). The language model sees *rows*: the image's N + 2 feature rows (boi, N image rows, eoi)
replace those three tokens, so a sequence of L tokens is L + N - 1 rows, and its KV cache holds rows. Every
token-layout tensor is mapped to rows by repeating the placeholder's entry N times (`ImageRows.expand`): all image
rows share one position, as in the original, the text after the image keeps its token positions, and a cached step
is given (or derives) token positions. The language model itself is the one of modeling_chatglm.py, unchanged: the
rows enter through `EVA2CLIPModel.splice`, its one seam.
"""

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache


@dataclass(frozen=True)
class LanguageModelCallbacks:
    """What the vision tower uses of modeling_chatglm.py, which builds it (`vision_tower`) and hands these in."""

    device_boundary: Callable  # (tensor, device) -> tensor on device: every device crossing
    execution_device: Callable  # module -> the device it computes on
    default_position_ids: Callable  # (token mask, positions, new tokens) -> positions counting real tokens only


# ======================================================================================================================
# Sizes from config.vision_config
# ======================================================================================================================


@dataclass(frozen=True)
class VisionSizes:
    """The vision tower's sizes, read from `config.vision_config` (a dict in every glm-4v-9b config.json)."""

    image_size: int
    patch_size: int
    in_channels: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    num_layers: int
    num_positions: int
    layer_norm_eps: float
    hidden_act: str
    dropout: float
    scaling_factor: float

    @classmethod
    def from_config(cls, config) -> "VisionSizes":
        vision = config.vision_config
        vision = dict(vision) if isinstance(vision, dict) else vision.to_dict()
        required = ("image_size", "patch_size", "hidden_size", "num_heads", "intermediate_size", "num_hidden_layers",
                    "num_positions", "scaling_factor")
        missing = [name for name in required if name not in vision]
        if missing:
            raise ValueError(f"config.vision_config lacks {', '.join(missing)}: copy vision_config from the "
                             "glm-4v-9b config.json of this checkpoint.")
        sizes = cls(
            image_size=vision["image_size"], patch_size=vision["patch_size"],
            in_channels=vision.get("in_channels", 3), hidden_size=vision["hidden_size"],
            num_heads=vision["num_heads"], intermediate_size=vision["intermediate_size"],
            num_layers=vision["num_hidden_layers"], num_positions=vision["num_positions"],
            layer_norm_eps=vision.get("layer_norm_eps", 1e-6), hidden_act=vision.get("hidden_act", "gelu"),
            dropout=vision.get("dropout_prob", 0.0), scaling_factor=vision["scaling_factor"],
        )
        sizes.check()
        return sizes

    def check(self):
        if self.image_size % self.patch_size or self.grid % 2:
            raise ValueError(
                f"config.vision_config: image_size {self.image_size} must be an even number of patches of "
                f"patch_size {self.patch_size} per side (the tower merges 2 x 2 patches into one image token)."
            )
        if self.num_positions != self.grid ** 2 + 1:
            raise ValueError(
                f"config.vision_config: num_positions is {self.num_positions}, but an image of {self.image_size} "
                f"pixels in patches of {self.patch_size} has {self.grid ** 2} patches plus the class row: "
                f"{self.grid ** 2 + 1}."
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(f"config.vision_config: hidden_size {self.hidden_size} must be divisible by num_heads "
                             f"{self.num_heads}.")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"config.vision_config: unknown hidden_act {self.hidden_act!r}.")

    @property
    def grid(self) -> int:
        """Patches per image side."""
        return self.image_size // self.patch_size

    @property
    def image_tokens(self) -> int:
        """N: the image rows between boi and eoi (2 x 2 patches merged into one)."""
        return (self.grid // 2) ** 2


def image_token_ids(config):
    boi, eoi = getattr(config, "boi_token_id", None), getattr(config, "eoi_token_id", None)
    if boi is None or eoi is None:
        raise ValueError("A config with vision_config needs boi_token_id and eoi_token_id (the ids of "
                         "<|begin_of_image|> and <|end_of_image|>; 151339 and 151340 in glm-4v-9b).")
    return boi, eoi


def parameter_count(config) -> int:
    """The vision tower's parameters, for balanced_device_map of modeling_chatglm.py (which keeps the tower whole on
    one device: its boi/eoi rows are parameters of the tower itself, which accelerate's maps cannot name alone)."""
    sizes, hidden = VisionSizes.from_config(config), config.hidden_size
    width = sizes.hidden_size
    layer = 4 * width * width + 2 * width * sizes.intermediate_size
    patches = (sizes.num_positions + sizes.in_channels * sizes.patch_size ** 2) * width
    projection = 4 * width * hidden + hidden * hidden + 3 * hidden * config.ffn_hidden_size
    return patches + sizes.num_layers * layer + projection + 2 * hidden


# ======================================================================================================================
# EVA2-CLIP vision tower (bidirectional ViT, post-norm residual blocks)
# ======================================================================================================================


class PatchEmbedding(nn.Module):
    """Non-overlapping patches, a class row in front, learned absolute positions."""

    def __init__(self, sizes: VisionSizes):
        super().__init__()
        self.proj = nn.Conv2d(sizes.in_channels, sizes.hidden_size, kernel_size=sizes.patch_size,
                              stride=sizes.patch_size)
        self.cls_embedding = nn.Parameter(torch.zeros(1, sizes.hidden_size))
        self.position_embedding = nn.Embedding(sizes.num_positions, sizes.hidden_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = self.proj(images).flatten(2).transpose(1, 2)  # [batch, patches, hidden]
        cls = self.cls_embedding.expand(patches.shape[0], -1, -1)
        return torch.cat((cls, patches), dim=1) + self.position_embedding.weight[None]


class Attention(nn.Module):
    """Bidirectional multi-head attention over the patches; fused [q | k | v] per head group as in the checkpoint."""

    def __init__(self, sizes: VisionSizes):
        super().__init__()
        self.num_heads = sizes.num_heads
        self.scale = (sizes.hidden_size // sizes.num_heads) ** -0.5
        self.query_key_value = nn.Linear(sizes.hidden_size, 3 * sizes.hidden_size)
        self.dense = nn.Linear(sizes.hidden_size, sizes.hidden_size)
        self.output_dropout = nn.Dropout(sizes.dropout)

    def attention(self, q, k, v):
        """The original's explicit attention over [batch, heads, length, head_dim] (forward uses SDPA)."""
        return torch.matmul(torch.matmul(q * self.scale, k.transpose(-2, -1)).softmax(dim=-1), v)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, length, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).unflatten(-1, (3, self.num_heads, -1)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [batch, heads, length, head_dim]
        return self.output_dropout(self.dense(out.transpose(1, 2).reshape(batch, length, -1)))


class MLP(nn.Module):
    def __init__(self, sizes: VisionSizes):
        super().__init__()
        self.config = sizes  # the original's name for the vision settings
        self.activation_fn = ACT2FN[sizes.hidden_act]
        self.fc1 = nn.Linear(sizes.hidden_size, sizes.intermediate_size)
        self.fc2 = nn.Linear(sizes.intermediate_size, sizes.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(hidden_states)))


class TransformerLayer(nn.Module):
    """One vision block. Post-norm: each sublayer's output is normalised before the residual add (EVA2-CLIP)."""

    def __init__(self, sizes: VisionSizes):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(sizes.hidden_size, eps=sizes.layer_norm_eps)
        self.attention = Attention(sizes)
        self.mlp = MLP(sizes)
        self.post_attention_layernorm = nn.LayerNorm(sizes.hidden_size, eps=sizes.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.input_layernorm(self.attention(hidden_states))
        return hidden_states + self.post_attention_layernorm(self.mlp(hidden_states))


class Transformer(nn.Module):
    def __init__(self, sizes: VisionSizes, callbacks: LanguageModelCallbacks):
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(sizes) for _ in range(sizes.num_layers)])
        self.gradient_checkpointing = False  # set by PreTrainedModel.gradient_checkpointing_enable()
        self.callbacks = callbacks

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        device_boundary, execution_device = self.callbacks.device_boundary, self.callbacks.execution_device
        for layer in self.layers:
            hidden_states = device_boundary(hidden_states, execution_device(layer))
            if self.gradient_checkpointing and self.training:
                hidden_states = self._gradient_checkpointing_func(layer.__call__, hidden_states)
            else:
                hidden_states = layer(hidden_states)
        return hidden_states


class GLU(nn.Module):
    """Projection into the language model: linear, LayerNorm, GELU, then a SiLU-gated MLP of the LM's ffn size."""

    def __init__(self, config, in_features: int):
        super().__init__()
        self.linear_proj = nn.Linear(in_features, config.hidden_size, bias=False)
        self.norm1 = nn.LayerNorm(config.hidden_size)
        self.act1 = nn.GELU()
        self.act2 = F.silu
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.norm1(self.linear_proj(x)))
        return self.dense_4h_to_h(self.act2(self.gate_proj(x)) * self.dense_h_to_4h(x))


class EVA2CLIPModel(nn.Module):
    """`transformer.vision`: pixels [batch, 3, S, S] -> image rows [batch, N + 2, hidden] (boi, N, eoi), in the
    language model's hidden size and divided by `scaling_factor`, as the original computes them."""

    def __init__(self, config, callbacks: LanguageModelCallbacks):
        super().__init__()
        self.callbacks = callbacks
        self.sizes = VisionSizes.from_config(config)
        self.boi_token_id, self.eoi_token_id = image_token_ids(config)
        self.patch_embedding = PatchEmbedding(self.sizes)
        self.transformer = Transformer(self.sizes, callbacks)
        self.linear_proj = GLU(config, in_features=config.hidden_size)
        self.conv = nn.Conv2d(self.sizes.hidden_size, config.hidden_size, kernel_size=2, stride=2)
        self.boi = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.eoi = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.scaling_factor = self.sizes.scaling_factor

    @property
    def image_tokens(self) -> int:
        return self.sizes.image_tokens

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.check_images(images)
        device_boundary, execution_device = self.callbacks.device_boundary, self.callbacks.execution_device
        embedding_device = execution_device(self.patch_embedding)
        pixels = device_boundary(images, embedding_device).to(self.patch_embedding.proj.weight.dtype)
        x = self.transformer(self.patch_embedding(pixels))[:, 1:]  # the class row is dropped
        grid = self.sizes.grid
        x = x.unflatten(1, (grid, grid)).permute(0, 3, 1, 2)  # [batch, hidden, grid, grid]
        x = self.conv(device_boundary(x, execution_device(self.conv))).flatten(2).transpose(1, 2)
        x = self.linear_proj(device_boundary(x, execution_device(self.linear_proj)))
        boi = device_boundary(self.boi, x.device).expand(x.shape[0], -1, -1)
        eoi = device_boundary(self.eoi, x.device).expand(x.shape[0], -1, -1)
        return torch.cat((boi, x, eoi), dim=1) / self.scaling_factor

    def check_images(self, images):
        size, channels = self.sizes.image_size, self.sizes.in_channels
        expected = f"[batch, {channels}, {size}, {size}]"
        if not isinstance(images, torch.Tensor):
            raise TypeError(f"images must be a tensor {expected} of normalised pixels (the tokenizer's "
                            f"apply_chat_template(..., return_dict=True) returns it), got {type(images).__name__}.")
        if images.dim() != 4 or tuple(images.shape[1:]) != (channels, size, size):
            raise ValueError(
                f"images has shape {tuple(images.shape)}; this model takes {expected}: {channels}-channel images "
                f"resized to {size} x {size} (vision_config.image_size). The GLM-4V tokenizer's apply_chat_template "
                "resizes and normalises PIL images."
            )
        if not images.is_floating_point():
            raise ValueError(f"images has dtype {images.dtype}: pass the normalised float pixels the tokenizer "
                             "returns, not raw 0-255 values.")

    # ---- the seam: image rows into the language model's input -------------------------------------------------------

    def splice(self, input_ids, inputs_embeds, images, position_ids, attention_mask, past_key_values,
               past_length: int):
        """The language model's input in rows: `inputs_embeds` with the image rows spliced in when `images` come with
        this step's ids, and the token-layout `position_ids` / 2D `attention_mask` mapped to rows whenever the
        sequence holds an image (in this step or in the cache). Returns (inputs_embeds, position_ids,
        attention_mask); text without an image passes through unchanged."""
        query_length = inputs_embeds.shape[1]
        callbacks = self.callbacks
        added_before = rows_added_before(getattr(past_key_values, IMAGE_ROWS_ATTRIBUTE, None), past_key_values,
                                         attention_mask, past_length + query_length)
        layout = None
        if images is not None and not added_before:  # one image per sequence: later images are generate()'s repeats
            layout = self.locate(input_ids, images, past_length)
            if layout is not None:
                check_rows_fit(past_key_values, attention_mask)
        if past_key_values is not None and (layout is not None or added_before is None):  # for the later steps
            setattr(past_key_values, IMAGE_ROWS_ATTRIBUTE, (added_before or 0) + (layout.added if layout else 0))
        if layout is None and not added_before:
            return inputs_embeds, position_ids, check_mask_covers(attention_mask, past_length, query_length, 0)

        added_before = added_before or 0
        text_past = past_length - added_before
        token_mask = attention_mask if is_token_layout(attention_mask, text_past + query_length) else None
        if position_ids is None:  # token positions, as for a text model: from the token-layout mask or the count
            text_positions = (torch.arange(query_length, device=inputs_embeds.device) + text_past)[None]
            position_ids = callbacks.default_position_ids(token_mask, text_positions, query_length)
        if layout is not None:
            check_padding_before_images(token_mask, layout, text_past)
            features = callbacks.device_boundary(self(images), inputs_embeds.device).to(inputs_embeds.dtype)
            feature_rows = layout.feature_rows(features.shape[1]).unsqueeze(-1).expand(-1, -1, features.shape[-1])
            inputs_embeds = layout.expand(inputs_embeds).scatter(1, feature_rows, features)
            if position_ids.shape[-1] == query_length:  # token positions (the tokenizer's)
                position_ids = layout.expand(position_ids)
        if token_mask is not None:
            # The image's columns go right after each sequence's first real token: the same mask as at the image
            # itself, since no padding sits between them (checked when the image was spliced).
            first_real = token_mask.long().argmax(-1)
            attention_mask = self.image_rows(first_real, added_before + (layout.added if layout else 0)
                                             ).expand(token_mask)
        return inputs_embeds, position_ids, check_mask_covers(attention_mask, past_length, inputs_embeds.shape[1],
                                                              inputs_embeds.shape[1] - query_length + added_before)

    def locate(self, input_ids, images, past_length: int) -> Optional["ImageRows"]:
        """Where this step's images go: one image per sequence, between its boi and eoi tokens. None for a cached
        step whose ids hold no image (generate() passes `images` on every step)."""
        if input_ids is None:
            raise ValueError("images need input_ids (the image goes where <|begin_of_image|> is); inputs_embeds "
                             "cannot be combined with images.")
        is_boi, is_eoi = input_ids == self.boi_token_id, input_ids == self.eoi_token_id
        per_sequence = is_boi.sum(-1)
        if past_length > 0 and not bool(per_sequence.any()):
            return None
        if bool((per_sequence != 1).any()) or bool((is_eoi.sum(-1) != 1).any()):
            raise ValueError(
                f"images were given, so every sequence of input_ids must hold exactly one <|begin_of_image|> "
                f"({self.boi_token_id}) <|endoftext|> <|end_of_image|> ({self.eoi_token_id}) placeholder; found "
                f"{per_sequence.tolist()} begin-of-image tokens per sequence. GLM-4V takes one image per sequence: "
                "give text-only conversations in a batch of their own, without images."
            )
        boi_column = is_boi.long().argmax(-1)
        if not bool((is_eoi.long().argmax(-1) == boi_column + 2).all()):
            raise ValueError("<|end_of_image|> must follow <|begin_of_image|> after exactly one placeholder token "
                             "(<|begin_of_image|><|endoftext|><|end_of_image|>), as the GLM-4V tokenizer writes it.")
        self.check_images(images)
        if images.shape[0] != input_ids.shape[0]:
            raise ValueError(f"images holds {images.shape[0]} images for {input_ids.shape[0]} sequences: give one "
                             "image per sequence, in the order of the sequences.")
        return self.image_rows(boi_column + 1, self.image_tokens - 1)

    def image_rows(self, columns: torch.Tensor, added: int) -> "ImageRows":
        return ImageRows(columns, added, self.callbacks.device_boundary)

    def labels_in_rows(self, input_ids, labels, shifted: bool = False):
        """Token-layout labels as rows: nothing to predict at the image rows (-100), for any image size. `shifted`:
        labels already shifted left (`shift_labels`), so the rows from boi to the last-but-one image row get -100.
        Labels already given in rows, and labels of text without an image, pass through."""
        if labels is None:
            return None
        is_boi = input_ids == self.boi_token_id
        if labels.shape[-1] != input_ids.shape[-1] or not bool(is_boi.any()):
            return labels
        layout = self.image_rows(is_boi.long().argmax(-1) + 1, self.image_tokens - 1)
        feature_rows = layout.feature_rows(self.image_tokens + 2)
        image_rows = feature_rows[:, :-2] if shifted else feature_rows[:, 1:-1]
        return layout.expand(labels).scatter(1, layout.move(image_rows, labels.device), -100)


# ======================================================================================================================
# Token layout -> rows
# ======================================================================================================================


@dataclass(frozen=True)
class ImageRows:
    """Per sequence, the token column whose entry the image repeats (its placeholder), and how many rows the image
    adds (N - 1)."""

    columns: torch.Tensor  # [batch], long
    added: int
    move: Callable = field(compare=False)  # the language model's device_boundary

    def sources(self, length: int) -> torch.Tensor:
        """[batch, length + added]: the token column each row takes its entry from."""
        rows = torch.arange(length + self.added, device=self.columns.device)[None]
        return rows - (rows - self.columns[:, None]).clamp(0, self.added)

    def expand(self, tokens: torch.Tensor) -> torch.Tensor:
        """[batch, length, ...] in tokens -> [batch, length + added, ...] in rows."""
        index = self.move(self.sources(tokens.shape[1]), tokens.device)
        index = index.view(index.shape + (1,) * (tokens.dim() - 2)).expand(-1, -1, *tokens.shape[2:])
        return tokens.expand(index.shape[0], *tokens.shape[1:]).gather(1, index)

    def feature_rows(self, count: int) -> torch.Tensor:
        """[batch, count]: the rows of the image's features, boi first."""
        return (self.columns - 1)[:, None] + torch.arange(count, device=self.columns.device)


def is_token_layout(attention_mask, token_length: int) -> bool:
    return attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[-1] == token_length


# How many rows images added to the sequence a cache holds (an image's N + 2 rows replace its 3 tokens), written by the
# step that spliced the image in and read by later steps. Kept on the cache object itself: the one thing that lives
# exactly as long as those rows and is copied with them (copy.deepcopy of a prompt cache, beam reordering).
IMAGE_ROWS_ATTRIBUTE = "chatglm_image_rows_added"


def rows_added_before(recorded: Optional[int], past_key_values, attention_mask, row_length: int) -> Optional[int]:
    """Rows an image added to the cached part of the sequence: the count the splicing step `recorded` on the cache;
    for a cache without it (a legacy tuple cache, or one built elsewhere) the excess of the rows over a shorter 2D
    mask, which is then in tokens; None for a fresh cache."""
    if past_key_values is None:
        return None
    added = recorded
    if added is not None or past_key_values.get_seq_length() == 0:
        return added
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[-1] < row_length:
        return row_length - attention_mask.shape[-1]
    return 0


def check_mask_covers(attention_mask, past_rows: int, new_rows: int, image_rows: int):
    """A 2D mask, once mapped, has a column per cached and new row (it was given per token, or per row by hand);
    `image_rows`: how many more rows than tokens the sequence has."""
    rows = past_rows + new_rows if isinstance(past_rows, int) else None
    if attention_mask is not None and attention_mask.dim() == 2 and rows is not None \
            and attention_mask.shape[-1] != rows:
        expected = f"{rows - image_rows}, as the tokenizer and generate() make it, or one per row of the model " \
                   f"({rows}, the image's rows included)" if image_rows else f"{rows}"
        raise ValueError(f"attention_mask has {attention_mask.shape[-1]} columns; it must have one per token, cached "
                         f"and new ({expected}).")
    return attention_mask


def check_rows_fit(past_key_values, attention_mask):
    """Image rows need a cache that grows and a mask that can be mapped to rows."""
    if past_key_values is not None and not isinstance(past_key_values, DynamicCache):
        raise ValueError(
            f"images cannot go into a {type(past_key_values).__name__}: a preallocated cache is sized by token count, "
            "and an image adds rows (N - 1 beyond its three tokens). Use the default dynamic cache (no "
            "cache_implementation='static' in generate) for prompts with images."
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("images take the 2D attention_mask of the tokens (batch x tokens, 1 = token, 0 = padding), "
                         f"not a {attention_mask.dim()}D mask: the model maps it to the image rows.")


def check_padding_before_images(attention_mask, layout: ImageRows, text_past: int):
    """Later steps place the image's mask columns after each sequence's first real token: no padding may sit between
    that token and the image."""
    if attention_mask is None:
        return
    mask = attention_mask.bool()
    columns = torch.arange(mask.shape[-1], device=mask.device)[None]
    first_real = mask.long().argmax(-1, keepdim=True)
    image = layout.move(layout.columns, mask.device)[:, None] + text_past
    if bool((~mask & (columns > first_real) & (columns < image)).any()):
        raise ValueError("attention_mask has padding between the start of a sequence and its image: pad on the left "
                         "(or right) of each sequence only.")
