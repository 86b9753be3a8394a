"""Tokenizers of GLM-4 (`ChatGLM4Tokenizer`) and ChatGLM3 / ChatGLM2 (`ChatGLMTokenizer`).

This file replaces the `tokenization_chatglm.py` of a downloaded glm-4-9b-chat / glm-4-9b / glm-4-9b-chat-1m,
chatglm3-6b or chatglm2-6b (-32k, -int4, codegeex2-6b) checkpoint: copy it over the original and load the folder
as before, `AutoTokenizer.from_pretrained(folder, trust_remote_code=True)`. The folder's own `tokenizer.model` and
`tokenizer_config.json` are used unchanged. It runs on transformers 4.44 up to 5.x.

Token ids are the originals' wherever the originals were right. What differs, on purpose:

* Special-token text is parsed into control tokens, as the originals and every transformers tokenizer do:
  `tok("[gMASK]<sop><|user|>\\nhi<|assistant|>", add_special_tokens=False)` gives the control ids, so the output of
  `apply_chat_template(..., tokenize=False)` encodes to the ids of `apply_chat_template(..., tokenize=True)` (the
  path of vLLM, SGLang, TRL and hand-built fine-tuning prompts). GLM-4 parses its 14 special tokens; ChatGLM3 the
  original's: "[gMASK]", "sop" (only as a whole word: the original split "isopropyl" around "sop") and the four role
  tokens (the original parsed only "<|user|>" and "<|assistant|>"); "[MASK]", "[sMASK]" and "eop" stay text.
  For untrusted raw text pass `split_special_tokens=True` (per call, or to `from_pretrained` for the tokenizer): such text is then
  encoded as the characters it holds. Tokens added with `add_tokens` (not special) are always matched.
* `apply_chat_template(..., tokenize=True)` keeps every string of the conversation as text: contents, role names,
  dict keys, tools, metadata, documents and extra template variables never produce a control token, not even
  by joining the template's own text (a role "user|>\\nhi<|assistant"). Control tokens come from the template and
  from the family's role names (system, user, assistant, observation). It returns the ids as `list[int]` (a tensor
  with `return_tensors`) unless `return_dict=True`, which returns a `BatchEncoding`, on every transformers version
  (transformers 5 changed its own default to a dict).
* ChatGLM3 with its stock template: the chat is `build_chat_input`'s format (role tokens, tools and metadata
  included), the one the model was trained with, for `tokenize=True` and as text for `tokenize=False` (the
  checkpoint's Jinja template dropped tools and metadata). GLM-4: the tool sections keep the blank line the template
  writes before each `## <tool>` heading (transformers' trim_blocks dropped it), as GLM-4's own Python prompt builder
  wrote it. Both also when the checkpoint's own template is passed as `chat_template=` (as vLLM does); any other
  template is rendered as given.
* `decode` is byte-exact: no spaces are inserted around special tokens (`spaces_between_special_tokens` is accepted
  and ignored), ids without a token decode to "" without repeating earlier bytes, and `skip_special_tokens=True`
  removes ChatGLM3's control tokens too.
* Padding honours `padding_side` "left" and "right" (attribute or call argument). `position_ids` count the real
  tokens from 0 and are 0 on padding, on either side. `return_attention_mask=False` omits both `attention_mask` and
  `position_ids`.
* A pair encodes as `[gMASK] <sop> A B <eos>` (GLM-4 raised KeyError('<eos>')).
* ChatGLM3: `len(tokenizer) == vocab_size == 64798`, and all 9 control tokens are special tokens.
* ChatGLM2 (chatglm2-6b, -32k, -int4 and codegeex2-6b ship a tokenizer.model of the same pieces and class name):
  `ChatGLMTokenizer` takes the original chatglm2-6b tokenizer's form when the checkpoint's files say so (a name or
  field of a ChatGLM2 row of `CHECKPOINT_VARIANTS`) or `chatglm_family="chatglm2"` is passed (`chatglm_family_of`;
  evidence that contradicts the choice is named in a warning): 5 control tokens (vocab_size 64794), special-token
  text always stays text, control tokens and <unk>/<s>/</s> decode to "", `build_prompt` and ChatGLM2's rounds as
  its chat format. Fixed there: `len(tokenizer) == vocab_size`, ids past the vocabulary decode to "" (the original
  raised IndexError), right padding, `return_attention_mask=False`.
* GLM-4 encodes whitespace runs of any length (tiktoken's regex engine gives up on about a million blanks).
* A missing or damaged `tokenizer.model` raises an error naming the file (and, for GLM-4's text file, the line);
  a file that reads well but differs from the released one logs a warning. Text that is not a `str` raises TypeError;
  text holding a surrogate code point (no UTF-8 bytes) raises ValueError naming the argument and the position.

Sections, in order: transformers compatibility; helpers shared by both tokenizers; shared tokenizer logic (one mixin
per concern, combined in `_GLMTokenizerBase`); GLM-4V images; GLM-4; ChatGLM3 (with ChatGLM2's form).

Where to change what (section: names):
  a chat-template fix           GLM-4: `_GLM4_CHAT_TEMPLATE` (used when a checkpoint has none),
                                `keep_glm4_tool_heading_newlines`, `ChatGLM4Tokenizer._resolve_chat_template`;
                                ChatGLM3: `ChatGLMTokenizer._turns` (the `build_chat_input` format, as ids and
                                as text); both: `_ChatRendering` (strings kept as text: `_ChatTextGuard`)
  special-token parsing         Shared tokenizer logic: `_SpecialTokenParsing` (`tokenize`, `split_special_tokens`)
  padding, position ids, pairs  Shared tokenizer logic: `_SequenceLayout` (`_pad`, `build_inputs_with_special_tokens`)
  decode                        Shared tokenizer logic: `_Decoding`; each family's `_decode_run`
  ChatGLM2 or ChatGLM3          ChatGLM3: `chatglm_family_of` (the rule), `_family_evidence` (what the files say),
                                `CHATGLM2_FORM`, `build_prompt`
  a new THUDM checkpoint        ChatGLM3: one row of `CHECKPOINT_VARIANTS` (its `tokenizer` and `chat` columns are
                                this file's); the same row in modeling_chatglm.py's copy, which describes the
                                columns (each file must work copied alone: tests/test_variants.py checks the copies
                                are equal)
  a new checkpoint variant      the family's section: GLM-4 `read_tiktoken_ranks` (tokenizer.model's ranks),
                                ChatGLM2/3 `SPTokenizer`; the vocabulary checks `_check_unfamiliar_ranks`
  GLM-4V images                 GLM-4V: `_ChatImages`, `image_to_pixels`
  a new transformers release    transformers compatibility: `_TransformersCompat` (one flag or method per change)
"""

import base64
import binascii
import functools
import hashlib
import inspect
import json
import numbers
import os
import re
import secrets
import shutil
import unicodedata
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

from transformers import PreTrainedTokenizer
from transformers.tokenization_utils_base import BatchEncoding, PreTrainedTokenizerBase
from transformers.utils import PaddingStrategy, logging

logger = logging.get_logger(__name__)

VOCAB_FILES_NAMES = {"vocab_file": "tokenizer.model"}


def _import_tiktoken():
    # Imported on first use and inside `try`: transformers' remote-code import check skips imports in try blocks,
    # so a ChatGLM3 checkpoint does not need tiktoken installed, nor a GLM-4 one sentencepiece.
    try:
        import tiktoken
    except ImportError as err:
        raise ImportError("ChatGLM4Tokenizer needs the `tiktoken` package: pip install tiktoken") from err
    return tiktoken


def _import_regex():
    # tiktoken's own dependency (GLM-4's `pat_str` is compiled with it, as in the original).
    try:
        import regex
    except ImportError as err:
        raise ImportError("ChatGLM4Tokenizer needs the `regex` package (a tiktoken dependency): pip install regex") \
            from err
    return regex


def _import_sentencepiece():
    try:
        import sentencepiece
    except ImportError as err:
        raise ImportError("ChatGLMTokenizer needs the `sentencepiece` package: pip install sentencepiece") from err
    return sentencepiece


def _import_pillow():
    # Only GLM-4V's images need Pillow; inside `try` so that the remote-code import check does not ask every text
    # checkpoint for it (transformers 5.x reads the imports of the whole file).
    try:
        from PIL import Image
    except ImportError as err:
        raise ImportError("GLM-4V images need the `Pillow` package: pip install pillow") from err
    return Image


# ======================================================================================================================
# transformers version compatibility: every difference between the supported transformers releases is handled here.
# ======================================================================================================================

# transformers < 4.46: pad() and _pad() have no `padding_side` argument, and a `padding_side=` call argument is
# dropped with a warning. The mixin below honours it by setting the attribute for the duration of the call.
_PAD_TAKES_PADDING_SIDE = "padding_side" in inspect.signature(PreTrainedTokenizerBase.pad).parameters

# transformers < 5: `_batch_encode_plus` consumes `split_special_tokens` and calls tokenize() without it, so a per-call
# value was lost for batches. The mixin forwards it under a private name that our tokenize() reads.
_HAS_BATCH_ENCODE_PLUS = hasattr(PreTrainedTokenizer, "_batch_encode_plus")
_SPLIT_FLAG_KWARG = "_chatglm_split_special_tokens"

# transformers < 5: encode_plus / batch_encode_plus are public entry points that need the same input check.
_HAS_ENCODE_PLUS = hasattr(PreTrainedTokenizerBase, "encode_plus")


# transformers 5.x after 5.0: apply_chat_template takes `sanitize_control_tokens`. Ours always keeps control-token text
# from the messages as text, so the option is accepted and dropped (passed on, transformers would render the chat
# with markers meant for its own encoder).
_CHAT_OPTIONS_ALWAYS_ON = ("sanitize_control_tokens",)


def _build_errors_are_masked() -> bool:
    """transformers 4.46 to at least 5.0 (5.23 is fixed): from_pretrained wraps the tokenizer's construction in
    `except import_protobuf_decode_error():`, which raises ImportError when protobuf is not installed -- so any error
    of ours (say, a damaged tokenizer.model) surfaces as an unrelated "requires protobuf" ImportError."""
    try:
        from transformers.tokenization_utils_base import import_protobuf_decode_error

        import_protobuf_decode_error()
    except ImportError as err:
        return "protobuf" in str(err).lower()
    except Exception:  # noqa: BLE001 - any other surprise: assume errors pass through
        return False
    return False


_BUILD_ERRORS_MASKED = _build_errors_are_masked()


class _TransformersCompat:
    """Shims for older transformers releases (see the flags above)."""

    @contextmanager
    def _padding_side_from(self, kwargs: dict):
        """transformers < 4.46: apply a `padding_side` call argument by setting the attribute while the call runs."""
        side = None if _PAD_TAKES_PADDING_SIDE else kwargs.pop("padding_side", None)
        if side is None:
            yield
            return
        _check_padding_side(side)
        saved, self.padding_side = self.padding_side, side
        try:
            yield
        finally:
            self.padding_side = saved

    if not _PAD_TAKES_PADDING_SIDE:

        def pad(self, *args, padding_side=None, **kwargs):
            with self._padding_side_from({"padding_side": padding_side}):
                return super().pad(*args, **kwargs)

    if _BUILD_ERRORS_MASKED:

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
            # Check a local folder before transformers builds the tokenizer, so that our error is the one raised.
            folder = os.path.join(os.fspath(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
            vocab_file = kwargs.get("vocab_file") or os.path.join(folder, VOCAB_FILES_NAMES["vocab_file"])
            if os.path.isdir(folder):
                cls._check_before_build(vocab_file, kwargs)
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def _check_before_build(cls, vocab_file: str, kwargs: dict) -> None:
        """What construction would refuse in a local folder (see from_pretrained above): the model file."""
        cls._check_model_file(_read_vocab_file(vocab_file, cls.__name__, cls.EXPECTED_FILE))

    if _HAS_BATCH_ENCODE_PLUS:

        def _batch_encode_plus(self, *args, split_special_tokens=None, **kwargs):
            if split_special_tokens is None:
                return super()._batch_encode_plus(*args, **kwargs)
            kwargs[_SPLIT_FLAG_KWARG] = split_special_tokens
            return super()._batch_encode_plus(*args, split_special_tokens=split_special_tokens, **kwargs)

    if _HAS_ENCODE_PLUS:

        def encode_plus(self, text, text_pair=None, **kwargs):
            _check_text_input(text, "text")
            _check_text_input(text_pair, "text_pair")
            with self._padding_side_from(kwargs):
                return super().encode_plus(text, text_pair=text_pair, **kwargs)

        def batch_encode_plus(self, batch_text_or_text_pairs, **kwargs):
            _check_text_input(batch_text_or_text_pairs, "batch_text_or_text_pairs")
            with self._padding_side_from(kwargs):
                return super().batch_encode_plus(batch_text_or_text_pairs, **kwargs)


# ======================================================================================================================
# Helpers shared by both tokenizers
# ======================================================================================================================


def _check_padding_side(side: str) -> None:
    if side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")


def _is_token_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _checked_token_ids(token_ids) -> List[int]:
    """decode()'s ids as ints: an id, or a sequence of ids (transformers has turned tensors and arrays into lists).
    Floats and strings are refused: int() would truncate 3.7 silently or fail with "invalid literal"."""
    if isinstance(token_ids, numbers.Integral):
        return [int(token_ids)]
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
        raise TypeError(f"decode: token_ids must be an int or a list of int, got {type(token_ids).__name__}")
    token_ids = list(token_ids)
    for position, index in enumerate(token_ids):
        if not isinstance(index, numbers.Integral):
            raise TypeError(f"decode: token_ids must hold ints; token_ids[{position}] is {index!r:.40} "
                            f"({type(index).__name__})")
    return [int(index) for index in token_ids]


def _check_encodable(value, name: str) -> None:
    """Refuse a surrogate code point anywhere in `value` (a str, or lists, tuples and dicts of them, named as
    `name[1]['content']`): text holds one only after a broken decode upstream, and it has no UTF-8 bytes (SentencePiece
    failed with "Unable to cast Python instance", tiktoken replaced it with U+FFFD without a word)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # fails on surrogates only; a few times faster than a regex search
        except UnicodeEncodeError as error:
            raise ValueError(
                f"{name} holds a lone surrogate {value[error.start]!r} at position {error.start}: it is no character "
                "and has no UTF-8 encoding (a decode upstream went wrong, e.g. JSON with an unpaired \\ud800 "
                "escape). Fix the text at its source, or replace such code points: "
                "text.encode('utf-8', 'replace').decode('utf-8')."
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_encodable(key, f"{name} key")
            _check_encodable(item, f"{name}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_encodable(item, f"{name}[{index}]")


def _check_text_input(value, name: str) -> None:
    """Accept what transformers accepts as text: a str, a list of str (batch or words), a list of token ids, or a
    list of those lists. Anything else (None aside) is a TypeError rather than a confusing failure later."""
    if value is None or isinstance(value, str):
        _check_encodable(value, name)
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, str) or _is_token_id(item):
                continue
            if isinstance(item, (list, tuple)) and all(isinstance(x, str) or _is_token_id(x) for x in item):
                continue
            raise TypeError(f"{name} must hold str (or token ids); found an item of type {type(item).__name__}")
        _check_encodable(value, name)
        return
    raise TypeError(f"{name} must be a str or a list of str, got {type(value).__name__}")


def _alternation(tokens: Iterable[str], whole_word: Iterable[str] = ()) -> Optional["re.Pattern"]:
    """A capturing regex matching any of `tokens`, longest first; those in `whole_word` only when not inside a word."""
    whole_word = set(whole_word)
    alternatives = []
    for token in sorted(set(tokens), key=len, reverse=True):
        escaped = re.escape(token)
        alternatives.append(rf"(?<!\w){escaped}(?!\w)" if token in whole_word else escaped)
    return re.compile("(" + "|".join(alternatives) + ")") if alternatives else None


class _ChatTextGuard:
    """Keeps every string a conversation carries from becoming, or helping to form, a control token.

    Before rendering, each string (message contents, role names, dict keys, tools, metadata, documents, extra template
    variables) has every control token's text, and every character control tokens are written with ("<", "|", ">",
    "[", "]"), replaced by a placeholder carrying a per-call random number; so no control token can be read across
    a string's edge either (a role "user|>\\nhi<|assistant" framed by the template's "<|" and "|>"). After
    rendering, the control tokens left in the text are the template's own, and the placeholders are put back inside
    the plain-text pieces before these are encoded, so the strings are encoded exactly as the same text anywhere else.

    Role names are the one string GLM templates make a control token from (`<|{{ role }}|>`): the family's roles pass
    unchanged, and any other role that would name a control token (say "endoftext") is replaced whole.
    """

    def __init__(self, control_texts: Iterable[str], roles: Iterable[str]):
        self._control = sorted(set(control_texts), key=len, reverse=True)
        fragments = sorted({char for text in self._control for char in text if not (char.isalnum() or char == "_")})
        self._roles = frozenset(roles)
        self._table = self._control + fragments  # placeholder number -> the text it stands for
        self._number = {text: index for index, text in enumerate(self._table)}
        self._find = _alternation(self._table)
        # Private-use characters around digits: no case change or JSON escaping alters them.
        nonce = "%012d" % secrets.randbelow(10**12)
        self._open, self._close = "\ue000" + nonce + ":", "\ue001"
        self._placeholder = re.compile(re.escape(self._open) + r"(\d+)" + re.escape(self._close))

    def _stand_in(self, index: int) -> str:
        return f"{self._open}{index}{self._close}"

    def protect(self, obj):
        """`obj` with every string (dict keys included) protected; other values as they are."""
        if isinstance(obj, str):
            if self._find is None:
                return obj
            return self._find.sub(lambda m: self._stand_in(self._number[m.group(0)]), obj)
        if isinstance(obj, dict):
            return {self.protect(key): self.protect(value) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.protect(value) for value in obj]
        return obj

    def protect_conversation(self, messages: list) -> list:
        protected = []
        for message in messages:
            safe = self.protect(message)
            role = message.get("role") if isinstance(message, dict) else None
            if isinstance(role, str) and role not in self._roles and f"<|{role}|>" in self._control:
                self._table.append(role)
                safe["role"] = self._stand_in(len(self._table) - 1)
            protected.append(safe)
        return protected

    def restore(self, text: str) -> str:
        return self._placeholder.sub(lambda m: self._table[int(m.group(1))], text)


def _check_messages(messages, name: str, allow_empty: bool) -> None:
    """Each message a dict with a str 'role': a template writes a missing role as "<||>" (no error of its own)."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"{name} must be a list of message dicts, got {type(messages).__name__}")
    if not messages and not allow_empty:
        raise ValueError(f"{name} is empty: a chat template needs at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{name}[{index}] must be a dict with a str 'role' (and 'content'), got {message!r:.100}")


def _clean_up_tokenization(text: str) -> str:
    """transformers' optional `clean_up_tokenization_spaces` rewrite (off in the GLM configs)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _read_vocab_file(vocab_file, tokenizer_name: str, expected: str) -> str:
    # ValueError, not FileNotFoundError: transformers replaces any OSError raised while building a tokenizer by a
    # generic "Unable to load vocabulary" message that names neither the file nor what it should contain.
    if vocab_file is None or not os.path.isfile(vocab_file):
        raise ValueError(
            f"{tokenizer_name}: tokenizer.model not found (looked for {vocab_file!r}); expected {expected} "
            "next to tokenizer_config.json in the checkpoint folder."
        )
    return os.fspath(vocab_file)


# ======================================================================================================================
# Shared tokenizer logic
# ======================================================================================================================


class _SpecialTokenParsing:
    """Special-token parsing: which texts are control tokens, splitting text around them, tokenize() and ids.

    Reads from the tokenizer: CONTROL_TOKENS, PARSED_CONTROL_TOKENS, WHOLE_WORD_CONTROL_TOKENS, `_reserved_ids`,
    `_token_to_id`, the model's `_tokenize` / `_encode_text` (plain text) and transformers' added-token tables."""

    def _special_texts(self) -> List[str]:
        """Texts parsed only on request: the control tokens and any special token a user added."""
        reserved = self._reserved_ids()
        user_specials = [
            token.content for index, token in self._added_tokens_decoder.items()
            if token.special and index not in reserved
        ]
        every = self.PARSED_CONTROL_TOKENS is None or getattr(self, "encode_special_tokens", False)
        parsed = self.CONTROL_TOKENS if every else self.PARSED_CONTROL_TOKENS
        return list(parsed) + user_specials

    def _user_vocabulary_texts(self) -> List[str]:
        """Non-special tokens added with `add_tokens`: always matched, as in transformers."""
        reserved = self._reserved_ids()
        return [
            token.content for index, token in self._added_tokens_decoder.items()
            if not token.special and index not in reserved
        ]

    def _split_pattern(self, parse_special: bool) -> Optional["re.Pattern"]:
        always = tuple(self._user_vocabulary_texts())
        specials = tuple(self._special_texts()) if parse_special else ()
        key = (always, specials)
        if key not in self._split_patterns:
            self._split_patterns[key] = _alternation(always + specials, self.WHOLE_WORD_CONTROL_TOKENS)
        return self._split_patterns[key]

    def _segments(self, text: str, parse_special: bool) -> Iterable[Tuple[str, bool]]:
        """Split `text` into (piece, is_token) pairs: whole added/control tokens and the plain text between them."""
        pattern = self._split_pattern(parse_special)
        if pattern is None:
            return [(text, False)] if text else []
        pieces = pattern.split(text)
        # re.split with one capturing group alternates text, token, text, ...
        return [(piece, index % 2 == 1) for index, piece in enumerate(pieces) if piece]

    def _parse_special_requested(self, kwargs: dict) -> bool:
        split = kwargs.pop("split_special_tokens", None)
        forwarded = kwargs.pop(_SPLIT_FLAG_KWARG, None)
        if split is None:
            split = forwarded
        if split is None:
            split = self.split_special_tokens
        return not split

    def tokenize(self, text, **kwargs) -> list:
        """Tokens of `text`, control tokens parsed unless `split_special_tokens=True` (see the module doc).

        Tokens added with `add_tokens` match exactly where they occur (their lstrip/rstrip/single_word flags are not
        applied). Other keyword arguments are accepted and ignored, as transformers passes its own through here.
        """
        if not isinstance(text, str):
            raise TypeError(f"{type(self).__name__}.tokenize expects a str, got {type(text).__name__}")
        _check_encodable(text, "text")
        tokens = []
        for piece, is_token in self._segments(text, self._parse_special_requested(kwargs)):
            if is_token:
                tokens.append(piece)
            else:
                tokens.extend(self._tokenize(piece))
        return tokens

    def _encode_segments(self, text: str, parse_special: bool,
                         restore: Optional[Callable[[str], str]] = None) -> List[int]:
        """Text to ids without building tokens; `restore` rewrites the plain-text pieces first (chat templates)."""
        ids: List[int] = []
        for piece, is_token in self._segments(text, parse_special):
            if is_token:
                ids.append(self._token_to_id(piece))
            elif restore is not None:
                ids.extend(self._encode_segments(restore(piece), parse_special=False))
            else:
                ids.extend(self._encode_text(piece))
        return ids


class _SequenceLayout:
    """Batching: the `[gMASK] <sop>` prefix and pair layout, and padding on either side with `position_ids`."""

    def build_inputs_with_special_tokens(self, token_ids_0: List[int], token_ids_1: Optional[List[int]] = None):
        ids = self.get_prefix_tokens() + list(token_ids_0)
        if token_ids_1 is not None:
            ids += list(token_ids_1) + [self.eos_token_id]
        return ids

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens=False):
        if already_has_special_tokens:
            if token_ids_1 is not None:
                raise ValueError("token_ids_1 must be None when the ids already contain special tokens")
            special = set(self.all_special_ids) | set(self._control_by_id)
            return [1 if index in special else 0 for index in token_ids_0]
        mask = [1] * len(self.PREFIX_TOKENS) + [0] * len(token_ids_0)
        if token_ids_1 is not None:
            mask += [0] * len(token_ids_1) + [1]
        return mask

    def create_token_type_ids_from_sequences(self, token_ids_0, token_ids_1=None):
        # GLM models have no token types.
        return [0] * len(self.build_inputs_with_special_tokens(token_ids_0, token_ids_1))


    def _pad(self, encoded_inputs, max_length=None, padding_strategy=PaddingStrategy.DO_NOT_PAD,
             pad_to_multiple_of=None, padding_side=None, return_attention_mask=None) -> dict:
        side = padding_side if padding_side is not None else self.padding_side
        _check_padding_side(side)
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        length = len(encoded_inputs[self.model_input_names[0]])

        if padding_strategy == PaddingStrategy.LONGEST:
            max_length = length
        if max_length is not None and pad_to_multiple_of is not None and max_length % pad_to_multiple_of:
            max_length = (max_length // pad_to_multiple_of + 1) * pad_to_multiple_of

        # position_ids come with the attention mask: both describe where the real tokens are.
        if return_attention_mask:
            encoded_inputs.setdefault("attention_mask", [1] * length)
            encoded_inputs.setdefault("position_ids", list(range(length)))

        missing = (max_length - length) if padding_strategy != PaddingStrategy.DO_NOT_PAD and max_length else 0
        if missing > 0:
            fill = {
                self.model_input_names[0]: self.pad_token_id,
                "attention_mask": 0,
                "position_ids": 0,
                "token_type_ids": self.pad_token_type_id,
                "special_tokens_mask": 1,
            }
            for key, value in fill.items():
                if key in encoded_inputs:
                    padding = [value] * missing
                    row = list(encoded_inputs[key])
                    encoded_inputs[key] = padding + row if side == "left" else row + padding
        return encoded_inputs


class _Decoding:
    """decode(): byte-exact, control tokens as their text (or skipped), each run of model ids by `_decode_run`."""

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None,
                spaces_between_special_tokens=None, **kwargs) -> str:
        # `spaces_between_special_tokens` is accepted for compatibility and ignored: decode never adds text.
        token_ids = _checked_token_ids(token_ids)
        if skip_special_tokens:
            skipped = set(self.all_special_ids) | set(self._control_by_id)
        else:
            skipped = set(self._control_by_id) if self.CONTROL_TOKENS_DECODE_EMPTY else set()
        added = self._added_tokens_decoder
        reserved = self._reserved_ids()
        parts: List[str] = []
        run: List[int] = []
        for index in token_ids:
            token_text = self._control_by_id.get(index)
            if token_text is None and index in added and index not in reserved:
                token_text = added[index].content
            if token_text is None:
                if index not in skipped:
                    run.append(index)
                continue
            if run and (index not in skipped or self.SKIPPED_TOKEN_ENDS_RUN):
                parts.append(self._decode_run(run))
                run = []
            if index not in skipped:
                parts.append(token_text)
        if run:
            parts.append(self._decode_run(run))
        text = self._join_decoded(parts)
        cleanup = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        return _clean_up_tokenization(text) if cleanup else text

    def _join_decoded(self, parts: List) -> str:
        return "".join(parts)


class _ChatRendering:
    """apply_chat_template: the family's built-in format or the Jinja template, with conversation strings kept
    as text (_ChatTextGuard) when tokenized; the one place for a chat-template fix."""

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt=False, tokenize=True, padding=False, truncation=False,
                            max_length=None, return_tensors=None, return_dict=False,
                            return_assistant_tokens_mask=False, tokenizer_kwargs=None, **kwargs):
        """Render a conversation with the chat template; with `tokenize=True` encode it safely (see module doc).

        Returns the rendered text (`tokenize=False`), else the ids as a list (or a tensor with `return_tensors`),
        or a `BatchEncoding` with `return_dict=True` -- the same on every transformers version.
        """
        if return_assistant_tokens_mask:
            raise ValueError("return_assistant_tokens_mask needs {% generation %} blocks, which GLM templates lack")
        for option in _CHAT_OPTIONS_ALWAYS_ON:
            kwargs.pop(option, None)
        conversations, batched = self._as_conversations(conversation)
        builtin = self._uses_builtin_chat_format(chat_template)
        for index, conv in enumerate(conversations):
            # ChatGLM3's built-in format renders an empty chat as its prefix; a template needs a message
            # (transformers < 4.47 failed with a bare IndexError).
            name = f"conversation[{index}]" if batched else "conversation"
            _check_messages(conv, name, allow_empty=builtin)
            _check_encodable(conv, name)
        for name, value in {"tools": tools, "documents": documents, **kwargs}.items():
            _check_encodable(value, name)
        if not tokenize:
            rendered = [
                self._builtin_chat_text(conv, add_generation_prompt) if builtin
                else self._render_chat(conv, tools, documents, chat_template, add_generation_prompt, kwargs)
                for conv in conversations
            ]
            return rendered if batched else rendered[0]
        all_ids = [
            self._builtin_chat_ids(conv, add_generation_prompt) if builtin
            else self._chat_ids_from_template(conv, tools, documents, chat_template, add_generation_prompt, kwargs)
            for conv in conversations
        ]
        return self._package_chat_ids(all_ids, batched, padding, truncation, max_length, return_tensors,
                                      return_dict, tokenizer_kwargs or {})

    @staticmethod
    def _as_conversations(conversation) -> Tuple[list, bool]:
        first = conversation[0] if isinstance(conversation, (list, tuple)) and conversation else None
        if isinstance(first, (list, tuple)) or hasattr(first, "messages"):
            return [getattr(conv, "messages", conv) for conv in conversation], True
        return [getattr(conversation, "messages", conversation)], False

    def _resolve_chat_template(self, chat_template: Optional[str], tools) -> str:
        return self.get_chat_template(chat_template, tools)

    def _render_chat(self, conversation, tools, documents, chat_template, add_generation_prompt, kwargs) -> str:
        template = self._resolve_chat_template(chat_template, tools)
        return super().apply_chat_template(
            conversation, tools=tools, documents=documents, chat_template=template,
            add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs,
        )

    # A tokenizer whose chat format no Jinja template can express builds it in Python (ChatGLM3).
    def _uses_builtin_chat_format(self, chat_template: Optional[str]) -> bool:
        return False

    def _builtin_chat_text(self, conversation, add_generation_prompt: bool) -> str:
        raise NotImplementedError

    def _builtin_chat_ids(self, conversation, add_generation_prompt: bool) -> List[int]:
        raise NotImplementedError

    def _chat_ids_from_template(self, conversation, tools, documents, chat_template, add_generation_prompt,
                                kwargs) -> List[int]:
        guard = _ChatTextGuard(self._special_texts(), self.CHAT_ROLES)
        rendered = self._render_chat(
            guard.protect_conversation(conversation), guard.protect(tools), guard.protect(documents), chat_template,
            add_generation_prompt, {key: guard.protect(value) for key, value in kwargs.items()},
        )
        return self._encode_segments(rendered, parse_special=True, restore=guard.restore)

    def _package_chat_ids(self, all_ids, batched, padding, truncation, max_length, return_tensors, return_dict,
                          tokenizer_kwargs):
        tokenizer_kwargs = {key: value for key, value in tokenizer_kwargs.items() if key != "add_special_tokens"}
        if not (return_dict or padding or truncation or return_tensors or tokenizer_kwargs):
            return all_ids if batched else all_ids[0]
        if batched:
            rows = [
                self.prepare_for_model(ids, add_special_tokens=False, truncation=truncation, max_length=max_length,
                                       return_attention_mask=False)["input_ids"]
                for ids in all_ids
            ]
            encoded = self.pad({"input_ids": rows}, padding=padding, max_length=max_length,
                               return_tensors=return_tensors, **tokenizer_kwargs)
        else:
            encoded = self.prepare_for_model(all_ids[0], add_special_tokens=False, padding=padding,
                                             truncation=truncation, max_length=max_length,
                                             return_tensors=return_tensors, prepend_batch_axis=bool(return_tensors),
                                             **tokenizer_kwargs)
        return encoded if return_dict else encoded["input_ids"]


class _GLMTokenizerBase(_ChatRendering, _Decoding, _SequenceLayout, _SpecialTokenParsing, _TransformersCompat,
                        PreTrainedTokenizer):
    """What GLM-4 and ChatGLM3 share: control tokens, special-token parsing, padding, decoding and chat templates.

    A subclass loads its model in `_load_model` and provides `_encode_text` / `_tokenize` (plain text, no control
    tokens), `_decode_run`, `_base_token_to_id` / `_base_id_to_token` and `_base_vocab`.
    """

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask", "position_ids"]
    padding_side = "left"

    CONTROL_TOKENS: Tuple[str, ...] = ()  # in id order, starting right after the model's own vocabulary
    PREFIX_TOKENS: Tuple[str, ...] = ()  # added in front of every sequence by add_special_tokens=True
    WHOLE_WORD_CONTROL_TOKENS: Tuple[str, ...] = ()  # parsed only when not inside a word
    # Control tokens whose text is parsed from text (None: all of them). The others are only ever text.
    PARSED_CONTROL_TOKENS: Optional[Tuple[str, ...]] = None
    CHAT_ROLES = ("system", "user", "assistant", "observation")  # a template writes each as the token <|role|>
    EOS_TOKEN = ""
    EXPECTED_FILE = ""
    # Whether a token removed by skip_special_tokens still separates the decoding of the pieces around it.
    SKIPPED_TOKEN_ENDS_RUN = False
    # Whether the control tokens are registered as special tokens (all_special_tokens, skip_special_tokens), and
    # whether they decode to "" even without skip_special_tokens (ChatGLM2's form: they have no text).
    CONTROL_TOKENS_ARE_SPECIAL = True
    CONTROL_TOKENS_DECODE_EMPTY = False

    def __init__(self, vocab_file, padding_side="left", clean_up_tokenization_spaces=False,
                 split_special_tokens=False, **kwargs):
        _check_padding_side(padding_side)
        self.vocab_file = _read_vocab_file(vocab_file, type(self).__name__, self.EXPECTED_FILE)
        first_control_id = self._load_model(self.vocab_file)
        self.control_token_ids: Dict[str, int] = {
            token: first_control_id + index for index, token in enumerate(self.CONTROL_TOKENS)
        }
        self._control_by_id = {index: token for token, index in self.control_token_ids.items()}
        self._split_patterns: Dict[tuple, Optional[re.Pattern]] = {}
        # Every control token is a special token (skipped by skip_special_tokens, listed in all_special_tokens).
        # transformers 5 renamed additional_special_tokens to extra_special_tokens; it converts the old name.
        if self.CONTROL_TOKENS_ARE_SPECIAL and kwargs.get("additional_special_tokens") is None \
                and kwargs.get("extra_special_tokens") is None:
            kwargs["additional_special_tokens"] = list(self.CONTROL_TOKENS)
        super().__init__(
            padding_side=padding_side,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
            split_special_tokens=split_special_tokens,
            **kwargs,
        )

    # ---- vocabulary ----------------------------------------------------------------------------------------------

    def _reserved_ids(self) -> set:
        """Ids whose meaning is fixed by the model: control tokens (and, for ChatGLM3, SentencePiece's own)."""
        return set(self._control_by_id)

    def get_vocab(self) -> Dict[Union[str, bytes], int]:
        vocab = dict(self._base_vocab())
        vocab.update(self.control_token_ids)
        vocab.update(self._added_tokens_encoder)
        return vocab

    def get_command(self, token: str) -> int:
        """Id of a control token, e.g. `get_command("<|user|>")` (API of the original tokenizers)."""
        if token in self.control_token_ids:
            return self.control_token_ids[token]
        raise KeyError(f"{token!r} is not a control token of {type(self).__name__}")

    def get_prefix_tokens(self) -> List[int]:
        return [self.control_token_ids[token] for token in self.PREFIX_TOKENS]

    def _convert_token_to_id(self, token):
        if isinstance(token, str) and token in self.control_token_ids:
            return self.control_token_ids[token]
        return self._base_token_to_id(token)

    def _convert_id_to_token(self, index: int):
        if index in self._control_by_id:
            return self._control_by_id[index]
        return self._base_id_to_token(index)

    def _token_to_id(self, token):
        if isinstance(token, str):
            added = self._added_tokens_encoder.get(token)
            if added is not None:
                return added
        return self._convert_token_to_id(token)

    def convert_tokens_to_ids(self, tokens):
        # One dict lookup per token (transformers 4.x rebuilds its added-token table for every token).
        if tokens is None:
            return None
        if isinstance(tokens, (str, bytes)):
            return self._token_to_id(tokens)
        return [self._token_to_id(token) for token in tokens]

    def save_vocabulary(self, save_directory: str, filename_prefix: Optional[str] = None) -> Tuple[str]:
        if not os.path.isdir(save_directory):
            raise ValueError(f"save_vocabulary: {save_directory!r} is not a directory")
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        target = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            shutil.copyfile(self.vocab_file, target)
        return (target,)

    # ---- entry points -------------------------------------------------------------------------------------------

    def __call__(self, text=None, text_pair=None, text_target=None, text_pair_target=None, *args, **kwargs):
        for name, value in (("text", text), ("text_pair", text_pair), ("text_target", text_target),
                            ("text_pair_target", text_pair_target)):
            _check_text_input(value, name)
        with self._padding_side_from(kwargs):
            return super().__call__(text, text_pair, text_target, text_pair_target, *args, **kwargs)

    def encode(self, text, text_pair=None, *args, **kwargs):
        if text is None:
            raise TypeError("encode() needs text, got None")
        _check_text_input(text, "text")
        _check_text_input(text_pair, "text_pair")
        with self._padding_side_from(kwargs):
            return super().encode(text, text_pair, *args, **kwargs)


# ======================================================================================================================
# GLM-4V: a chat with an image (glm-4v-9b's tokenizer; its tokenizer_config.json sets `image_size`)
# ======================================================================================================================

# The image placeholder the model replaces by the image's rows, and CLIP's pixel normalisation (EVA2-CLIP's).
IMAGE_PLACEHOLDER = "<|begin_of_image|><|endoftext|><|end_of_image|>"
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def image_to_pixels(image, size: int):
    """A PIL RGB image as GLM-4V's vision input [3, size, size]: bicubic resize to size x size, values scaled to
    [0, 1], normalised per channel -- the original's torchvision Resize / ToTensor / Normalize, with PIL and torch."""
    import torch

    Image = _import_pillow()
    if not isinstance(image, Image.Image):
        raise TypeError(f"A chat message's 'image' must be a PIL image (PIL.Image.open(path).convert('RGB')), got "
                        f"{type(image).__name__}.")
    if image.mode != "RGB":
        raise ValueError(f"A chat message's 'image' has mode {image.mode!r}; GLM-4V takes RGB images: pass "
                         "image.convert('RGB') (choose a background first for a transparent image).")
    if min(image.size) < 1:
        raise ValueError(f"A chat message's 'image' is empty (size {image.size}).")
    resized = image.resize((size, size), Image.BICUBIC)
    pixels = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8).view(size, size, 3)
    pixels = pixels.permute(2, 0, 1).float().div(255)
    mean, std = torch.tensor(IMAGE_MEAN), torch.tensor(IMAGE_STD)
    return pixels.sub(mean[:, None, None]).div(std[:, None, None])


def _chat_image(conversation):
    """The one image of a conversation (a message's 'image'), or None."""
    images = [message["image"] for message in conversation
              if isinstance(message, dict) and message.get("image") is not None]
    if len(images) > 1:
        raise ValueError(f"A conversation holds {len(images)} images; GLM-4V takes one image per conversation (the "
                         "original's limit too): keep one, or describe the others in text.")
    return images[0] if images else None


class _ChatImages:
    """`apply_chat_template` with images, as glm-4v-9b's tokenizer did: a message's `image` (a PIL image) puts the
    image placeholder in front of its text, and `return_dict=True` adds the pixels as `images` [batch, 3, S, S]
    (S = `image_size` of tokenizer_config.json), the model's `images` argument."""

    def apply_chat_template(self, conversation, *args, **kwargs):
        images = [_chat_image(conv) for conv in self._as_conversations(conversation)[0]]
        encoded = super().apply_chat_template(conversation, *args, **kwargs)
        if all(image is None for image in images) or not isinstance(encoded, (dict, BatchEncoding)):
            return encoded
        if any(image is None for image in images):
            raise ValueError("Some conversations of this batch hold an image and some do not: GLM-4V takes one "
                             "image per sequence in a batch with images; batch text-only conversations apart.")
        import torch

        encoded["images"] = torch.stack([image_to_pixels(image, self._image_size()) for image in images])
        return encoded

    def _image_size(self) -> int:
        size = self.init_kwargs.get("image_size")
        if not isinstance(size, int) or size < 1:
            raise ValueError("This tokenizer has no image_size, so it cannot prepare images: glm-4v-9b's "
                             "tokenizer_config.json sets \"image_size\": 1120 (vision_config.image_size of the model); "
                             "add it there, or pass image_size=... to AutoTokenizer.from_pretrained.")
        return size

    def _render_chat(self, conversation, *args, **kwargs) -> str:
        return super()._render_chat([_with_image_placeholder(message) for message in conversation], *args, **kwargs)


def _with_image_placeholder(message):
    """The message with its image replaced by the placeholder tokens in front of its text (written here, after the
    chat text guard, so that they are the template's control tokens, not user text)."""
    if not isinstance(message, dict) or message.get("image") is None:
        return message
    message = {key: value for key, value in message.items() if key != "image"}
    message["content"] = IMAGE_PLACEHOLDER + (message.get("content") or "")
    return message


# ======================================================================================================================
# GLM-4
# ======================================================================================================================

# GLM-4's pre-tokenization regex (a fact of the model, as stored by tiktoken).
GLM4_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
GLM4_N_RANKS = 151329

# tiktoken's regex engine gives up on a run of about a million blanks that no line break ends (PanicException
# "StackOverflow", which `except Exception` does not catch): its `\s+(?!\S)` backtracks once per character. The
# whitespace around a long run of blanks is cut out of the text before the regex and byte-pair merged in the pieces the
# regex would have made of it; see _blank_run_pieces. Whitespace is Unicode White_Space, the regex's \s (Python's
# str.isspace differs); blanks are whitespace but the line breaks \r and \n.
_WHITESPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                        + "".join(map(chr, range(0x2000, 0x200B))))
_BLANK_CLASS = "[" + re.escape("".join(sorted(_WHITESPACE - {"\r", "\n"}))) + "]"
_WHITESPACE_RUN = re.compile("[" + re.escape("".join(sorted(_WHITESPACE))) + "]*")
_LINE_BREAKS = re.compile("[\r\n]*")


@functools.lru_cache(maxsize=None)
def _blank_run_pattern(min_length: int) -> "re.Pattern":
    # Anchored at the start of a run, so each run is scanned once.
    return re.compile(f"(?<!{_BLANK_CLASS}){_BLANK_CLASS}{{{min_length},}}")


def _is_punctuation(char: str) -> bool:
    """The regex's [^\\s\\p{L}\\p{N}]."""
    return char not in _WHITESPACE and unicodedata.category(char)[0] not in "LN"


def _blank_run_pieces(text: str, min_length: int) -> Iterable[Tuple[int, int]]:
    """(start, end) of the pieces GLM4_PAT_STR splits from each whitespace run of `text` holding `min_length` or more
    blanks, in order; the text between them may go to tiktoken in parts.

    The whitespace run W ends before a non-space or the end of the text. The regex splits it as follows: if a
    punctuation piece precedes W, that piece takes W's leading line breaks (`[\\r\\n]*`); `\\s*[\\r\\n]+` then takes
    W up to its last line break; of the blanks left, `\\s+(?!\\S)` takes all at the end of the text, else all but the
    last, which starts the next piece. The pattern looks only ahead, so the text from a piece boundary splits the
    same whatever precedes it, and a piece that ends where the text is cut ends there too.
    """
    done = 0
    for run in _blank_run_pattern(min_length).finditer(text):
        if run.start() < done:  # part of a run already split
            continue
        start, end = run.start(), _WHITESPACE_RUN.match(text, run.end()).end()
        while start > done and text[start - 1] in _WHITESPACE:
            start -= 1
        if start > 0 and _is_punctuation(text[start - 1]):
            start = _LINE_BREAKS.match(text, start).end()
        last_break = max(text.rfind("\r", start, end), text.rfind("\n", start, end))
        if last_break >= 0:
            yield start, last_break + 1
            start = last_break + 1
        blanks_end = end if end == len(text) else end - 1
        if blanks_end > start:
            yield start, blanks_end
            start = blanks_end
        done = start


# The prompt format of glm-4-9b-chat (its tokenizer_config.json chat_template). Used when a checkpoint has no
# template (glm-4-9b base), where the original tokenizer built the same prompt in Python.
_GLM4_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for item in messages %}"
    "{% if item['tools'] is defined %}<|system|>\n"
    "你是一个名为 ChatGLM 的人工智能助手。你是基于智谱AI训练的语言模型 GLM-4 模型开发的，你的任务是针对用户的问题和要求提供适当的答复和支持。\n"
    "\n"
    "# 可用工具"
    "{% set tools = item['tools'] %}"
    "{% for tool in tools %}"
    "{% if tool['type'] == 'function' %}\n"
    "\n"
    "## {{ tool['function']['name'] }}\n"
    "\n"
    "{{ tool['function'] | tojson(indent=4) }}\n"
    "在调用上述函数时，请使用 Json 格式表示调用的参数。"
    "{% elif tool['type'] == 'python' %}\n"
    "\n"
    "## python\n"
    "\n"
    "当你向 `python` 发送包含 Python 代码的消息时，该代码将会在一个有状态的 Jupyter notebook 环境中执行。\n"
    "`python` 返回代码执行的输出，或在执行 60 秒后返回超时。\n"
    "`/mnt/data` 将会持久化存储你的文件。在此会话中，`python` 无法访问互联网。不要使用 `python` 进行任何网络请求或者在线 API 调用，这些在线内容的访问将不会成功。"
    "{% elif tool['type'] == 'simple_browser' %}\n"
    "\n"
    "## simple_browser\n"
    "\n"
    "你可以使用 `simple_browser` 工具。该工具支持以下函数：\n"
    "`search(query: str, recency_days: int)`：使用搜索引擎进行查询并显示结果，可以使用 `recency_days` 参数控制搜索内容的时效性。\n"
    "`mclick(ids: list[int])`：获取一系列指定 id 的页面内容。每次调用时，须选择3-10个页面。选择多个角度的页面，同时尽可能选择可信任的信息来源。考虑到部分页面是无法加载的，你也可以多打开一些可能有用的页面而不用担心内容过多。\n"
    "`open_url(url: str)`：打开指定的 URL。\n"
    "\n"
    "使用 `【{引用 id}†{引用文本}】` 来引用内容。\n"
    "\n"
    "操作步骤：1. 使用 `search` 来获得信息列表; 2. 使用 `mclick` 来获取指定 ID 页面的内容; 3. 根据获得的内容进行回复。在回复中应当引用信息来源。\n"
    " 如果用户提供了 URL，也可以用 `open_url` 直接打开页面。\n"
    "如果初次搜索结果没有找到合适的信息，也可以再次使用 `search` 进行搜索。"
    "{% elif tool['type'] == 'cogview' %}\n"
    "\n"
    "## cogview\n"
    "\n"
    "如果用户的请求中包含了对图像的描述，你可以使用 `cogview` 来生成图像并展示给用户。你需要向 `cogview` 发送图像描述，规则：\n"
    "- 发送给 `cogview` 的消息必须使用英语。用户的中文描述必须完全翻译为英语。\n"
    "- 应当尽可能详细地描述图像生成的需求，需求描述约 100 英文单词。\n"
    "- 保持用户原始描述的意图。不要虚构内容或者没见过的人物。\n"
    "- 如无特殊说明，所在地为中国，持有中国立场并遵循中国社会主义价值观。"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{% if item['content'] %}<|{{ item['role'] }}|>{{ item['metadata'] }}\n"
    "{{ item['content'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% endif %}"
)

# transformers renders templates with trim_blocks=True, which drops the newline right after a block tag. GLM-4's
# template writes "{% if tool... %}\n\n## name", meaning a blank line before each tool heading (as GLM-4's Python
# prompt builder wrote it), but rendered only one newline. One more newline after the tag survives the trim.
_NEWLINES_BEFORE_HEADING_AFTER_TAG = re.compile(r"(\{%[^%]*%\})\n\n(## )")


def keep_glm4_tool_heading_newlines(template: str) -> str:
    """GLM-4 template with the blank line before each `## <tool>` heading kept under trim_blocks (idempotent)."""
    return _NEWLINES_BEFORE_HEADING_AFTER_TAG.sub(r"\1\n\n\n\2", template)


# sha256 of glm-4-9b-chat's tokenizer.model, which the GLM-4 checkpoints share (its lines read with "\n" endings).
GLM4_TOKENIZER_SHA256 = "5a493598071550244b2ee7f26118f3edec2150b9dfa967929a99052ac83fe716"


def read_tiktoken_ranks(path: str) -> Dict[bytes, int]:
    """Parse GLM-4's tokenizer.model: line i holds "<base64 of token i> i", for ranks 0..151328.

    A damaged line (wrong fields, base64 that does not decode or does not encode back to itself, a rank out of
    sequence, a repeated token) raises a ValueError naming the file and the line. A file that reads well but is not
    glm-4-9b-chat's is checked further (see _check_unfamiliar_ranks), because a flipped base64 character can still
    decode to another token.
    """
    ranks: Dict[bytes, int] = {}
    line_numbers: List[int] = []  # rank -> line
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for line_number, line in enumerate(handle, 1):
            line = line.rstrip(b"\r\n")
            if not line.strip():
                continue
            digest.update(line + b"\n")
            fields = line.split()
            if len(fields) != 2:
                raise _damaged_ranks(path, line_number, "is not '<base64 token> <rank>'")
            try:
                token = base64.b64decode(fields[0], validate=True)
            except (ValueError, binascii.Error):
                raise _damaged_ranks(path, line_number, "holds a token that is not base64") from None
            if not token or base64.b64encode(token) != fields[0]:
                raise _damaged_ranks(path, line_number, "holds damaged base64 (it does not encode back)")
            if fields[1] != b"%d" % len(ranks):
                rank = fields[1].decode("ascii", "replace")
                raise _damaged_ranks(path, line_number, f"has rank {rank!r} where {len(ranks)} belongs")
            if token in ranks:
                raise _damaged_ranks(path, line_number, f"holds the same token as line {line_numbers[ranks[token]]}")
            ranks[token] = len(ranks)
            line_numbers.append(line_number)
    if len(ranks) != GLM4_N_RANKS:
        raise _damaged_ranks(path, None, f"holds {len(ranks)} tokens")
    if digest.hexdigest() != GLM4_TOKENIZER_SHA256:
        _check_unfamiliar_ranks(path, ranks, line_numbers)
        logger.warning(
            f"{path} reads as a GLM-4 tokenizer file but is not glm-4-9b-chat's (sha256 {digest.hexdigest()}, "
            f"expected {GLM4_TOKENIZER_SHA256}); if you did not change it on purpose, re-download it."
        )
    return ranks


def _damaged_ranks(path: str, line_number: Optional[int], problem: str) -> ValueError:
    where = f"{path}: line {line_number}" if line_number is not None else path
    return ValueError(
        f"{where} {problem}; expected GLM-4's tiktoken BPE file ({GLM4_N_RANKS} lines '<base64 token> <rank>', ranks "
        f"0..{GLM4_N_RANKS - 1} in order). Re-download tokenizer.model from the checkpoint's repository."
    )


def _check_unfamiliar_ranks(path: str, ranks: Dict[bytes, int], line_numbers: List[int]) -> None:
    """Byte-pair merges build every token longer than a byte from two shorter tokens, and start from all 256 bytes
    (true of glm-4-9b-chat's file): a token that breaks this is a damaged line."""
    for byte in range(256):
        if bytes([byte]) not in ranks:
            raise _damaged_ranks(path, None, f"has no token for the byte {byte:#04x}")
    for token, rank in ranks.items():
        if len(token) > 1 and not any(token[:cut] in ranks and token[cut:] in ranks for cut in range(1, len(token))):
            raise _damaged_ranks(path, line_numbers[rank], "holds a token that no two tokens of the file join into")


class ChatGLM4Tokenizer(_ChatImages, _GLMTokenizerBase):
    """GLM-4 tokenizer: tiktoken byte-level BPE (151329 ranks) plus 14 special tokens at ids 151329..151342."""

    CONTROL_TOKENS = (
        "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
        "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
        "<|end_of_video|>",
    )
    PREFIX_TOKENS = ("[gMASK]", "<sop>")
    EOS_TOKEN = "<|endoftext|>"
    EXPECTED_FILE = "GLM-4's tiktoken BPE file"
    LONG_BLANK_RUN = 1 << 15  # runs of this many blanks or more are split before tiktoken's regex (see above)

    name = "GLM4Tokenizer"  # the original's name

    def __init__(self, vocab_file, padding_side="left", clean_up_tokenization_spaces=False, **kwargs):
        kwargs.setdefault("eos_token", self.EOS_TOKEN)
        kwargs.setdefault("pad_token", self.EOS_TOKEN)
        super().__init__(vocab_file, padding_side=padding_side,
                         clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)

    @classmethod
    def _check_model_file(cls, vocab_file: str) -> None:
        read_tiktoken_ranks(vocab_file)

    def _load_model(self, vocab_file: str) -> int:
        tiktoken = _import_tiktoken()
        ranks = read_tiktoken_ranks(vocab_file)
        self.mergeable_ranks = ranks
        self._id_to_bytes = [b""] * len(ranks)
        for token, rank in ranks.items():
            self._id_to_bytes[rank] = token
        specials = {token: len(ranks) + index for index, token in enumerate(self.CONTROL_TOKENS)}
        # `tokenizer` is the original's name for the tiktoken encoder (tok.tokenizer.encode(text, ...)).
        self.tokenizer = tiktoken.Encoding(
            name="glm4", pat_str=GLM4_PAT_STR, mergeable_ranks=ranks, special_tokens=specials
        )
        self.special_tokens = specials
        # The original's names: its id -> bytes table, the count of ranks and tiktoken's split pattern, compiled.
        self.decoder = dict(enumerate(self._id_to_bytes))
        self.n_words = len(ranks)
        self.pat_str = _import_regex().compile(GLM4_PAT_STR)
        return len(ranks)

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_bytes)

    def _base_vocab(self) -> Dict[bytes, int]:
        return self.mergeable_ranks

    def _base_token_to_id(self, token):
        if isinstance(token, str):
            token = token.encode("utf-8")
        return self.mergeable_ranks.get(token)

    def _base_id_to_token(self, index: int):
        # Ids without a token (negative, or past the special tokens) give "", as in the original.
        return self._id_to_bytes[index] if 0 <= index < len(self._id_to_bytes) else ""

    def _encode_text(self, text: str) -> List[int]:
        if len(text) < self.LONG_BLANK_RUN:
            return self.tokenizer.encode_ordinary(text)
        ids, done = [], 0
        for start, end in _blank_run_pieces(text, self.LONG_BLANK_RUN):
            ids += self.tokenizer.encode_ordinary(text[done:start])
            ids += self._encode_single_piece(text[start:end])
            done = end
        return ids + self.tokenizer.encode_ordinary(text[done:])

    def _encode_single_piece(self, piece: str) -> List[int]:
        encode = getattr(self.tokenizer, "_encode_single_piece", None)  # tiktoken's byte-pair merge, without the regex
        if encode is None:
            raise RuntimeError(f"encoding a run of {len(piece)} blanks needs tiktoken >= 0.5: pip install -U tiktoken")
        return encode(piece)

    def _tokenize(self, text: str, **kwargs) -> List[bytes]:
        """Byte tokens of plain text (bytes, as in the original; control tokens are str)."""
        return [self._id_to_bytes[index] for index in self._encode_text(text)]

    def _decode_run(self, ids: List[int]) -> bytes:
        size = len(self._id_to_bytes)
        return b"".join(self._id_to_bytes[index] for index in ids if 0 <= index < size)

    def _join_decoded(self, parts: List) -> str:
        # Byte runs and token texts are joined as bytes first, so a character split around a skipped special
        # token is still whole; invalid UTF-8 becomes U+FFFD.
        return b"".join(part.encode("utf-8") if isinstance(part, str) else part for part in parts).decode(
            "utf-8", errors="replace"
        )

    def convert_tokens_to_string(self, tokens: List[Union[bytes, str]]) -> str:
        return self._join_decoded(list(tokens))

    def build_single_message(self, role: str, metadata: str, message: str, tokenize=True) -> Union[List[int], str]:
        """`<|role|>metadata\\nmessage` as ids, message encoded as plain text, or as text with `tokenize=False`
        (API of the original)."""
        if role not in ("system", "user", "assistant", "observation"):
            raise ValueError(f"unknown role {role!r}")
        _check_encodable(metadata, "metadata")
        _check_encodable(message, "message")
        if not tokenize:
            return f"<|{role}|>{metadata}\n{message}"
        return [self.get_command(f"<|{role}|>")] + self._encode_text(f"{metadata}\n") + self._encode_text(message)

    def _resolve_chat_template(self, chat_template, tools) -> str:
        own = self.get_chat_template(None, tools) if self.chat_template is not None else _GLM4_CHAT_TEMPLATE
        template = own if chat_template is None else self.get_chat_template(chat_template, tools)
        # GLM-4's template gets its tool-heading fix also when passed explicitly, as vLLM and SGLang pass the
        # tokenizer's own; any other template is rendered as given.
        return keep_glm4_tool_heading_newlines(template) if template in (own, _GLM4_CHAT_TEMPLATE) else template


# ======================================================================================================================
# ChatGLM3
# ======================================================================================================================

CHATGLM3_N_PIECES = 64789
# sha256 of chatglm3-6b's Jinja chat_template. With that template the chat is built in Python, as build_chat_input
# builds it (ids, and the text that encodes to them), because the template cannot express ChatGLM3's format: it
# drops tools and metadata.
_CHATGLM3_STOCK_TEMPLATE_SHA256 = "e4496f930bf7b7bc7e7cf8232e90fd43ab4a9d8eb9c77f6ec98f5beb5c5cbeaa"
_CHATGLM3_ROLES = _GLMTokenizerBase.CHAT_ROLES


class SPTokenizer:
    """ChatGLM2/3's SentencePiece model with its control tokens: the original's `tokenizer.tokenizer`, with its names
    and what they return (`n_words` and `index_special_tokens` count the control tokens, as scripts that map ids to
    text read them). The tokenizer itself reads `sp_model`, `pieces`, `encode` and `decode_pieces`."""

    def __init__(self, path: str, control_tokens: Tuple[str, ...], control_tokens_have_text: bool = True):
        sentencepiece = _import_sentencepiece()
        expected = f"ChatGLM3's SentencePiece model ({CHATGLM3_N_PIECES} pieces)"
        self.sp_model = sentencepiece.SentencePieceProcessor()
        try:
            self.sp_model.Load(path)
        except (OSError, RuntimeError) as err:
            raise ValueError(f"{path}: not a SentencePiece model ({err}); expected {expected}") from None
        if self.sp_model.vocab_size() != CHATGLM3_N_PIECES:
            raise ValueError(f"{path}: has {self.sp_model.vocab_size()} pieces; expected {expected}")
        for index in range(self.sp_model.vocab_size()):
            # A damaged byte inside a piece's text reads as a model whose pieces sentencepiece cannot return.
            try:
                self.sp_model.id_to_piece(index)
            except UnicodeDecodeError:
                raise ValueError(f"{path}: piece {index} is not valid UTF-8 (the file is damaged); expected "
                                 f"{expected}") from None
        self.pieces = self.sp_model.vocab_size()
        self.bos_id, self.eos_id, self.pad_id = self.sp_model.bos_id(), self.sp_model.eos_id(), self.sp_model.unk_id()
        self.special_tokens = {token: self.pieces + index for index, token in enumerate(control_tokens)}
        self.index_special_tokens = {index: token for token, index in self.special_tokens.items()}
        self.n_words = self.pieces + len(control_tokens)
        self.role_special_token_expression = "|".join(re.escape(token) for token in control_tokens)
        self._control_tokens_have_text = control_tokens_have_text  # ChatGLM2's have none: convert_id_to_token gives ""

    def encode(self, s: str, bos: bool = False, eos: bool = False) -> List[int]:
        ids = self.sp_model.encode(s)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def tokenize(self, s: str, encode_special_tokens=False) -> List[str]:
        """Pieces of `s`; with `encode_special_tokens` every control token's text is kept whole (the original's)."""
        if not encode_special_tokens:
            return self.sp_model.encode(s, out_type=str)
        tokens = []
        for index, part in enumerate(re.split(f"({self.role_special_token_expression})", s)):
            tokens += [part] if index % 2 else (self.sp_model.encode(part, out_type=str) if part else [])
        return tokens

    def decode(self, t: List[int]) -> str:
        """The text of ids, ChatGLM3's control tokens written as their text (the original's; ChatGLM2's have none;
        the tokenizer's decode() has the skip_special_tokens choice)."""
        text, run = "", []
        for index in list(t) + [None]:
            if index is None or index in self.index_special_tokens:
                text += self.sp_model.decode(run) if run else ""
                text += self.index_special_tokens.get(index, "") if self._control_tokens_have_text else ""
                run = []
            else:
                run.append(index)
        return text

    def decode_pieces(self, ids: List[int]) -> str:
        # SentencePiece's control pieces (<unk>, <s>, </s>) and ids outside the model decode to "" (the original
        # tokenizer's behaviour; byte fallback means text never produces <unk>).
        control = (self.bos_id, self.eos_id, self.pad_id)
        return self.sp_model.decode([index for index in ids if 0 <= index < self.pieces and index not in control])

    def decode_tokens(self, tokens: List[str]) -> str:
        return self.sp_model.decode_pieces(list(tokens))

    def convert_token_to_id(self, token):
        return self.special_tokens[token] if token in self.special_tokens else self.sp_model.piece_to_id(token)

    def convert_id_to_token(self, index):
        """A piece, a control token's text, or "" for <s>, </s>, <unk> and ids outside the vocabulary."""
        if index in self.index_special_tokens:
            return self.index_special_tokens[index] if self._control_tokens_have_text else ""
        if index in (self.eos_id, self.bos_id, self.pad_id) or not 0 <= index < self.pieces:
            return ""
        return self.sp_model.id_to_piece(index)


# ---- ChatGLM2 (chatglm2-6b): the same class, in the original chatglm2-6b tokenizer's form ------------------------
# chatglm2-6b ships chatglm3-6b's tokenizer.model (same sha256) and names `ChatGLMTokenizer` in its auto_map, so the
# files beside the model decide which form a ChatGLMTokenizer takes (`chatglm_family_of`). ChatGLM2's form: five
# control tokens (vocab_size 64794), none of them parsed from text, all decoding to "" (as do <unk>, <s>, </s>), none
# registered as a special token, no role tokens; its chat prompt is `build_prompt`'s rounds.

CHATGLM_FAMILIES = ("chatglm2", "chatglm3")
CHATGLM2_FORM = {
    "CONTROL_TOKENS": ("[MASK]", "[gMASK]", "[sMASK]", "sop", "eop"),
    "PARSED_CONTROL_TOKENS": (),
    "WHOLE_WORD_CONTROL_TOKENS": (),
    "SKIPPED_TOKEN_ENDS_RUN": False,  # a control token vanishes from decoded text without splitting it
    "CONTROL_TOKENS_ARE_SPECIAL": False,
    "CONTROL_TOKENS_DECODE_EMPTY": True,
}



# ---- THUDM checkpoint variants: the same literal as in modeling_chatglm.py -------------------------------------------
# Each file must work copied alone, so neither imports it from the other; tests/test_variants.py checks the two are
# equal. This file reads `tokenizer` (which form a ChatGLMTokenizer takes) and `chat` (its chat format); the model
# reads `rotary` and `chat`. The columns are described in modeling_chatglm.py.
CHECKPOINT_VARIANTS = {
    "chatglm2-6b": dict(rotary="base", tokenizer="chatglm2", chat="rounds", fields={}),
    "chatglm2-6b-32k": dict(rotary="positions", tokenizer="chatglm2", chat="rounds", fields={"rope_ratio": 16}),
    "chatglm2-6b-int4": dict(rotary="base", tokenizer="chatglm2", chat="rounds", fields={}),
    "codegeex2-6b": dict(rotary="base", tokenizer="chatglm2", chat="rounds", fields={}),
    "chatglm3-6b": dict(rotary="base", tokenizer="chatglm3", chat="roles", fields={}),
    "chatglm3-6b-base": dict(rotary="base", tokenizer="chatglm3", chat="roles", fields={}),
    "chatglm3-6b-32k": dict(rotary="base", tokenizer="chatglm3", chat="roles", fields={}),
    "chatglm3-6b-128k": dict(rotary="base", tokenizer="chatglm3", chat="roles", fields={}),
    "glm-4-9b": dict(rotary="base", tokenizer="glm4", chat="template", fields={}),
    "glm-4-9b-chat": dict(rotary="base", tokenizer="glm4", chat="template", fields={}),
    "glm-4-9b-chat-1m": dict(rotary="base", tokenizer="glm4", chat="template", fields={}),
    "codegeex4-all-9b": dict(rotary="base", tokenizer="glm4", chat="template", fields={}),
    "glm-4v-9b": dict(rotary="base", tokenizer="glm4", chat="template", fields={}),
}


def variant_named(name) -> Optional[str]:
    """The row a checkpoint name says: the longest row name found in its last part (a Hub id's model, a folder, or
    a Hub cache folder `models--THUDM--<model>`), in any case. None: no row is named."""
    if not isinstance(name, str) or not name:
        return None
    parts = [part for part in re.split(r"[\\/]", name.lower()) if part]
    cache = [part.split("--")[-1] for part in parts if part.startswith("models--")]
    last = cache[-1] if cache else (parts[-1] if parts else "")
    found = [row for row in CHECKPOINT_VARIANTS if row in last]
    return max(found, key=len) if found else None


def variant_of_fields(config: dict) -> Optional[str]:
    """The row whose own config.json values `config` has (rows without such values are never found this way)."""
    found = [row for row, columns in CHECKPOINT_VARIANTS.items()
             if columns["fields"] and all(config.get(k) == v for k, v in columns["fields"].items())]
    return found[0] if len(found) == 1 else None


def _json_field(path: str, key: Optional[str] = None):
    """`key` of a JSON object file (the object without a key), or None when the file is missing or unreadable (it is
    only a hint here)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return data if key is None else data.get(key)


# The chat format of each tokenizer family (a function of it: tests/test_variants.py checks it row by row).
FAMILY_CHAT = {columns["tokenizer"]: columns["chat"] for columns in CHECKPOINT_VARIANTS.values()}


def _family_named(name) -> Optional[str]:
    """The tokenizer family a name says: its CHECKPOINT_VARIANTS row's, else "chatglm2" / "chatglm3" written in it
    (a fine-tune named after its base); None for other names (chatglm2-6b-int4's tokenizer_config.json names the
    first-generation "THUDM/chatglm-6b", which says nothing)."""
    row = variant_named(name)
    if row is not None:
        return CHECKPOINT_VARIANTS[row]["tokenizer"]
    return next((family for family in CHATGLM_FAMILIES if isinstance(name, str) and family in name.lower()), None)


def _family_evidence(tokenizer_config: dict, config: dict) -> List[Tuple[str, str]]:
    """(where, family) of every file beside tokenizer.model that says which checkpoint this is, strongest first:
    the names in tokenizer_config.json and config.json, the variant our model wrote, the model's own fields."""
    found = []
    for file_name, data, key in (("tokenizer_config.json", tokenizer_config, "name_or_path"),
                                 ("config.json", config, "chatglm_variant"), ("config.json", config, "_name_or_path")):
        family = _family_named(data.get(key))
        if family is not None:
            found.append((f"{file_name}: {key} {data[key]!r}", family))
    row = variant_of_fields(config)
    if row is not None:
        found.append((f"config.json: {json.dumps(CHECKPOINT_VARIANTS[row]['fields'])} ({row})",
                      CHECKPOINT_VARIANTS[row]["tokenizer"]))
    return found


def chatglm_family_of(vocab_file: str, requested: Optional[str] = None, warn: bool = False
                      ) -> Tuple[str, Optional[str]]:
    """Which checkpoint a ChatGLMTokenizer serves, "chatglm2" or "chatglm3", and the evidence (None: nothing said).

    The first rule that applies decides:
    1. `chatglm_family` passed to `from_pretrained` or written in tokenizer_config.json (save_pretrained writes it
       for ChatGLM2, so the form survives a save, which drops the names below).
    2. The files beside tokenizer.model, strongest first (`_family_evidence`): tokenizer_config.json's
       `name_or_path`, config.json's `chatglm_variant` and `_name_or_path` (a CHECKPOINT_VARIANTS row, or a name
       holding "chatglm2" / "chatglm3"), config.json's fields that only one checkpoint has.
    3. "chatglm3".
    With `warn`, evidence that says another family is named in a warning (for example a chatglm3-6b folder whose
    tokenizer_config.json names chatglm2), as is a chat template in a folder taken as ChatGLM2 (ChatGLM2 has none).
    """
    if requested is not None:
        if requested not in CHATGLM_FAMILIES:
            raise ValueError(f"chatglm_family={requested!r}: ChatGLMTokenizer serves 'chatglm2' (chatglm2-6b) or "
                             "'chatglm3' (chatglm3-6b); pass one of them, or leave it out to read it from the files.")
        return requested, "chatglm_family"
    if not isinstance(vocab_file, (str, os.PathLike)):
        return "chatglm3", None  # no file: the tokenizer's own check names what is missing
    folder = os.path.dirname(os.path.abspath(vocab_file))
    tokenizer_config = _json_field(os.path.join(folder, "tokenizer_config.json")) or {}
    config = _json_field(os.path.join(folder, "config.json")) or {}
    evidence = [(where, family) for where, family in _family_evidence(tokenizer_config, config)
                if family in CHATGLM_FAMILIES]
    if not evidence:  # a name of no known checkpoint still says the files were named (no warning about names)
        names = [tokenizer_config.get("name_or_path"), config.get("_name_or_path")]
        return "chatglm3", next((f"a name {name!r}" for name in names if isinstance(name, str) and name), None)
    family, reason = evidence[0][1], evidence[0][0]
    against = [where for where, other in evidence if other != family]
    if family == "chatglm2" and tokenizer_config.get("chat_template"):
        against.append("tokenizer_config.json has a chat template (ChatGLM2's has none)")
    if warn and against:
        logger.warning(
            f"{vocab_file}: taken as {family}'s tokenizer from {reason}, but {'; '.join(against)} says otherwise. "
            f"If this checkpoint is not {family}, pass chatglm_family='chatglm2' or 'chatglm3' to from_pretrained "
            "(or write \"chatglm_family\" in tokenizer_config.json)."
        )
    return family, reason


def _warn_unnamed_checkpoint(vocab_file: str) -> None:
    # chatglm3-6b's files carry a chat template, chatglm2-6b's do not: without names either, this may be a ChatGLM2
    # checkpoint whose names were lost (a save_pretrained drops them).
    logger.warning(
        f"{vocab_file}: neither tokenizer_config.json nor config.json names the model, so this is taken as ChatGLM3's "
        "tokenizer. For a ChatGLM2 checkpoint pass chatglm_family='chatglm2' to from_pretrained (or add "
        "\"chatglm_family\": \"chatglm2\" to tokenizer_config.json)."
    )


def _require_family(tokenizer, family: str, method: str, instead: str) -> None:
    if tokenizer.chatglm_family != family:
        names = {"chatglm2": "ChatGLM2", "chatglm3": "ChatGLM3"}
        raise ValueError(
            f"{method} builds {names[family]}'s prompt, but this tokenizer is {names[tokenizer.chatglm_family]}'s "
            f"(chatglm_family={tokenizer.chatglm_family!r}, see ChatGLMTokenizer's docstring): use {instead}. If the "
            f"checkpoint is {names[family]}, load the tokenizer with from_pretrained(..., chatglm_family={family!r})."
        )


def chatglm2_round(number: int, query: str, response: Optional[str] = None) -> str:
    """One round of ChatGLM2's chat prompt; without a response it ends where the model answers."""
    return f"[Round {number}]\n\n问：{query}\n\n答：" + ("" if response is None else response)


def _chatglm2_pairs(history, name: str) -> List[Tuple[str, str]]:
    if not isinstance(history, (list, tuple)):
        raise ValueError(f"{name} must be a list of (query, response) pairs, got {type(history).__name__}")
    for index, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise ValueError(f"{name}[{index}] must be a (query, response) pair of str (ChatGLM2's history, as its "
                             f"chat() returns it), got {pair!r:.100}")
    return [tuple(pair) for pair in history]


def _chatglm2_rounds_of(messages, name: str) -> List[str]:
    """A conversation of alternating user / assistant messages as ChatGLM2 rounds (the last may be unanswered)."""
    rounds = []
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content") or ""
        expected = "user" if index % 2 == 0 else "assistant"
        if role != expected:
            raise ValueError(f"{name}[{index}] has role {role!r} where ChatGLM2's prompt needs {expected!r}: it holds "
                             "only rounds of a user query and the assistant's answer (no system or tool messages)")
        if not isinstance(content, str):
            raise TypeError(f"{name}[{index}]: 'content' must be str")
        if role == "user":
            rounds.append((content, None))
        else:
            rounds[-1] = (rounds[-1][0], content)
    return [chatglm2_round(number, query, response) for number, (query, response) in enumerate(rounds, 1)]


class ChatGLMTokenizer(_GLMTokenizerBase):
    """ChatGLM3 tokenizer: SentencePiece (64789 pieces) plus 9 control tokens at ids 64789..64797; for a ChatGLM2
    checkpoint, the original chatglm2-6b tokenizer (5 control tokens, 64789..64793, see CHATGLM2_FORM).

    Which one: `chatglm_family_of` ("chatglm2" when the checkpoint's tokenizer_config.json or config.json names a
    ChatGLM2 checkpoint (chatglm2-6b, -32k, -int4, codegeex2-6b) or has its fields, else "chatglm3");
    `from_pretrained(..., chatglm_family="chatglm2")` or the same key in
    tokenizer_config.json chooses explicitly. The choice is the attribute `chatglm_family`.
    """

    CONTROL_TOKENS = (
        "[MASK]", "[gMASK]", "[sMASK]", "sop", "eop", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    )
    PREFIX_TOKENS = ("[gMASK]", "sop")
    # The original parsed "[gMASK]", "sop", "<|user|>" and "<|assistant|>" in text and kept "[MASK]", "[sMASK]" and
    # "eop" as text; of its bugs, "sop" inside words is fixed (whole words only) and the two other role tokens are
    # parsed too (the template writes all four roles).
    PARSED_CONTROL_TOKENS = ("[gMASK]", "sop", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
    WHOLE_WORD_CONTROL_TOKENS = ("sop",)
    # Text after a control token was encoded on its own (with SentencePiece's word-start marker), so it is decoded
    # on its own even when the control token is skipped: the result is the text without the control token.
    SKIPPED_TOKEN_ENDS_RUN = True
    EOS_TOKEN = "</s>"
    EXPECTED_FILE = "ChatGLM3's SentencePiece model"

    name = "GLMTokenizer"  # the original's names
    unique_no_split_tokens: List[str] = []

    def __init__(self, vocab_file, padding_side="left", clean_up_tokenization_spaces=False, chatglm_family=None,
                 encode_special_tokens=False, **kwargs):
        self.chatglm_family, evidence = chatglm_family_of(vocab_file, chatglm_family, warn=True)
        # The original's switch: True parses every control token in text, "[MASK]" and "eop" included.
        self.encode_special_tokens = encode_special_tokens
        if self.chatglm_family == "chatglm2":
            for name, value in CHATGLM2_FORM.items():
                setattr(self, name, value)
        if chatglm_family is not None or self.chatglm_family == "chatglm2":
            kwargs["chatglm_family"] = self.chatglm_family  # kept in init_kwargs: save_pretrained writes it
        kwargs.setdefault("eos_token", self.EOS_TOKEN)
        kwargs.setdefault("unk_token", "<unk>")
        kwargs.setdefault("pad_token", "<unk>")
        super().__init__(vocab_file, padding_side=padding_side,
                         clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        # The original's `special_tokens` attribute: SentencePiece's own control pieces by name (ChatGLM2's has no
        # "<unk>").
        sp = self.tokenizer
        self.special_tokens = {"<bos>": sp.bos_id, "<eos>": sp.eos_id, "<unk>": sp.pad_id, "<pad>": sp.pad_id}
        if self.chatglm_family == "chatglm2":
            del self.special_tokens["<unk>"]
        if evidence is None and self.chat_template is None:
            _warn_unnamed_checkpoint(vocab_file)

    @classmethod
    def _check_model_file(cls, vocab_file: str) -> None:
        SPTokenizer(vocab_file, cls.CONTROL_TOKENS)

    @classmethod
    def _check_before_build(cls, vocab_file: str, kwargs: dict) -> None:
        super()._check_before_build(vocab_file, kwargs)
        config = os.path.join(os.path.dirname(vocab_file), "tokenizer_config.json")
        chatglm_family_of(vocab_file, kwargs.get("chatglm_family", _json_field(config, "chatglm_family")))

    def _load_model(self, vocab_file: str) -> int:
        self.tokenizer = SPTokenizer(vocab_file, self.CONTROL_TOKENS, not self.CONTROL_TOKENS_DECODE_EMPTY)
        return self.tokenizer.pieces

    def get_command(self, token: str) -> int:
        """Id of a control token, or of "<bos>", "<eos>", "<unk>", "<pad>" (API of the original)."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        return super().get_command(token)

    def _reserved_ids(self) -> set:
        sp = self.tokenizer
        return super()._reserved_ids() | {sp.bos_id, sp.eos_id, sp.pad_id}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.n_words

    def _base_vocab(self) -> Dict[str, int]:
        if not hasattr(self, "_piece_vocab"):
            sp_model = self.tokenizer.sp_model
            self._piece_vocab = {sp_model.id_to_piece(index): index for index in range(self.tokenizer.pieces)}
        return self._piece_vocab

    def _base_token_to_id(self, token):
        return self.tokenizer.sp_model.piece_to_id(token)

    def _base_id_to_token(self, index: int) -> str:
        return self.tokenizer.sp_model.id_to_piece(index) if 0 <= index < self.tokenizer.pieces else ""

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if not self.CONTROL_TOKENS_DECODE_EMPTY:
            return super().convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)
        # ChatGLM2's form: the control tokens and <unk>, <s>, </s> have no token text (the original's tokens; ahead
        # of transformers' table, where it registers </s> and <unk>).
        reserved, convert = self._reserved_ids(), super().convert_ids_to_tokens
        if isinstance(ids, numbers.Integral):
            return "" if int(ids) in reserved else convert(int(ids))
        skipped = set(self.all_special_ids) if skip_special_tokens else set()
        return ["" if int(index) in reserved else convert(int(index)) for index in ids if int(index) not in skipped]

    def _encode_text(self, text: str) -> List[int]:
        return self.tokenizer.encode(text)

    def _tokenize(self, text: str, **kwargs) -> List[str]:
        return self.tokenizer.tokenize(text)

    def _decode_run(self, ids: List[int]) -> str:
        # Each run of pieces between control tokens was encoded on its own, with SentencePiece's leading "▁"; decoding
        # the run on its own drops that marker again.
        return self.tokenizer.decode_pieces(ids)

    def convert_tokens_to_string(self, tokens: List[str]) -> str:
        return self._decode(self.convert_tokens_to_ids(list(tokens)))

    # ---- ChatGLM3 chat format ------------------------------------------------------------------------------------

    def build_single_message(self, role: str, metadata: str, message: str) -> List[int]:
        """`<|role|>` + metadata line + message, each encoded as plain text (API of the original)."""
        if role not in _CHATGLM3_ROLES:
            raise ValueError(f"unknown role {role!r}; ChatGLM3 roles are {_CHATGLM3_ROLES}")
        if not isinstance(message, str) or not isinstance(metadata, str):
            raise TypeError("ChatGLM3 message content and metadata must be str")
        _check_encodable(metadata, "metadata")
        _check_encodable(message, "message")
        return [self.get_command(f"<|{role}|>")] + self._encode_text(f"{metadata}\n") + self._encode_text(message)

    def _turns(self, messages, name: str) -> List[Tuple[str, str, str]]:
        """(role, metadata, content) of each message; a system message's tools are appended to its content as JSON,
        as the original did. An entry of the wrong shape, or with a role ChatGLM3 does not have, is named."""
        turns = []
        for index, message in enumerate(messages):
            where = f"{name}[{index}]"
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"{where} must be a dict with 'role' and 'content' (the original's history format), "
                                 f"got {message!r:.100}")
            role = message["role"]
            if role not in _CHATGLM3_ROLES:
                raise ValueError(f"{where}: unknown role {role!r}; ChatGLM3 roles are {', '.join(_CHATGLM3_ROLES)}")
            content, metadata = message.get("content") or "", message.get("metadata") or ""
            if not isinstance(content, str) or not isinstance(metadata, str):
                raise TypeError(f"{where}: 'content' and 'metadata' must be str")
            if role == "system" and "tools" in message:
                content = content + "\n" + json.dumps(message["tools"], indent=4, ensure_ascii=False)
            turns.append((role, metadata, content))
        return turns

    def _ids_of_turns(self, turns, add_generation_prompt: bool) -> List[int]:
        ids = self.get_prefix_tokens()
        for role, metadata, content in turns:
            ids += self.build_single_message(role, metadata, content)
        return ids + ([self.get_command("<|assistant|>")] if add_generation_prompt else [])

    def _text_of_turns(self, turns, add_generation_prompt: bool) -> str:
        # The same prompt as text that encodes to those ids: SentencePiece starts the content it encodes on its own
        # with a word-start marker, which as text is the space the stock template also writes before the content.
        parts = list(self.PREFIX_TOKENS)
        for role, metadata, content in turns:
            parts += [f"<|{role}|>", f"{metadata}\n", f" {content}" if content else ""]
        return "".join(parts + (["<|assistant|>"] if add_generation_prompt else []))

    def build_chat_input(self, query: str, history: Optional[List[dict]] = None, role: str = "user",
                         return_tensors: Optional[str] = "pt") -> BatchEncoding:
        """ChatGLM3 prompt for `history` + (`role`, `query`), ending with `<|assistant|>` (API of the original)."""
        _require_family(self, "chatglm3", "build_chat_input", "build_prompt(query, history) or model.build_inputs")
        if role not in _CHATGLM3_ROLES:
            raise ValueError(f"role={role!r} is not a ChatGLM3 role ({', '.join(_CHATGLM3_ROLES)})")
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}")
        _check_encodable(query, "query")
        _check_encodable(history, "history")
        turns = self._turns(history or [], "history") + [(role, "", query)]
        return self.pad({"input_ids": [self._ids_of_turns(turns, add_generation_prompt=True)]},
                        return_tensors=return_tensors)

    @property
    def _chat_rounds(self) -> bool:
        """Whether this tokenizer's chat is ChatGLM2's rounds (the table's `chat` column), else ChatGLM3's roles."""
        return FAMILY_CHAT[self.chatglm_family] == "rounds"

    def _uses_builtin_chat_format(self, chat_template: Optional[str]) -> bool:
        template = self.chat_template if chat_template is None else chat_template
        if self._chat_rounds:
            return template is None
        return template is None or (
            isinstance(template, str)
            and hashlib.sha256(template.encode("utf-8")).hexdigest() == _CHATGLM3_STOCK_TEMPLATE_SHA256
        )

    def _builtin_chat_text(self, conversation, add_generation_prompt: bool) -> str:
        if self._chat_rounds:
            # ChatGLM2's rounds; the last user message's round ends with "答：" (the format has no other marker).
            return "\n\n".join(_chatglm2_rounds_of(conversation, "conversation"))
        return self._text_of_turns(self._turns(conversation, "conversation"), add_generation_prompt)

    def _builtin_chat_ids(self, conversation, add_generation_prompt: bool) -> List[int]:
        if self._chat_rounds:  # as build_inputs encodes build_prompt's text
            return self.encode(self._builtin_chat_text(conversation, add_generation_prompt))
        return self._ids_of_turns(self._turns(conversation, "conversation"), add_generation_prompt)

    # ---- ChatGLM2 chat format ------------------------------------------------------------------------------------

    def build_prompt(self, query: str, history: Optional[List[Tuple[str, str]]] = None) -> str:
        """ChatGLM2's prompt text: each (query, response) pair of `history` as a round, then `query`'s round ending
        with "答：" (API of the original chatglm2-6b tokenizer; `tokenizer([prompt])` gives the model inputs)."""
        _require_family(self, "chatglm2", "build_prompt", "build_chat_input(query, history) or apply_chat_template")
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}")
        _check_encodable(query, "query")
        _check_encodable(history, "history")
        history = _chatglm2_pairs(history or [], "history")
        past = [chatglm2_round(number, old_query, response) + "\n\n"
                for number, (old_query, response) in enumerate(history, 1)]
        return "".join(past) + chatglm2_round(len(history) + 1, query)

