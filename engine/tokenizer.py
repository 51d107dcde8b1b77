"""Tokenizer of the model folder, and incremental detokenization with exact stop-string cuts."""
from __future__ import annotations

import json
from pathlib import Path

from engine.model_config import ModelFolderError

# Pre-tokenizer steps that keep every byte of the text (a "removed" split drops its matches).
_BYTE_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Punctuation", "Split"}


class Tokenizer:
    def __init__(self, folder: str | Path):
        from transformers import AutoTokenizer  # heavy import, only when a real tokenizer is needed

        try:
            # No clean-up of spaces around punctuation: the engine decodes a window of tokens at a time, and a
            # clean-up that reads its neighbours would make the streamed text differ from the whole. Transformers
            # skips it for BPE (every supported family) anyway, with a warning unless it is set false.
            self.hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                    clean_up_tokenization_spaces=False)
        except (OSError, ValueError) as e:
            raise ModelFolderError(f"no usable tokenizer in {folder}: {e}") from None
        self.eos_token_id = self.hf.eos_token_id
        self.max_bytes_per_token = _max_bytes_per_token(self.hf)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound of `len(self.encode(text))` that reads only the text's length (0 where none is known):
        a prompt far over the context length is refused without tokenizing it."""
        most = self.max_bytes_per_token
        return -(-len(text) // most) if most else 0  # a character is at least one byte

    @classmethod
    def of_folder(cls, folder: str | Path) -> "Tokenizer | None":
        """The folder's tokenizer; None when it ships none (prompts are then token ids)."""
        if any((Path(folder) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            return cls(folder)
        return None

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        out = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)


def _max_bytes_per_token(hf) -> int | None:
    """The most bytes of text one token can stand for, where that bounds the token count of any text: a byte-level
    BPE whose normalizer and pre-tokenizer drop nothing (GPT-2, Llama 3, SmolLM2). None otherwise (a normalizer may
    shrink the text, a pre-tokenizer may drop whitespace)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    # the components' own JSON (their pickled state): the whole tokenizer's would take far longer to read
    normalizer = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else None
    pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else None
    if normalizer is not None and normalizer != {"type": "Sequence", "normalizers": []}:
        return None
    steps = pre.get("pretokenizers", []) if pre is not None and pre.get("type") == "Sequence" else [pre]
    if not any(s is not None and s.get("type") == "ByteLevel" for s in steps) or any(
            s is None or s.get("type") not in _BYTE_KEEPING_PRE_TOKENIZERS or s.get("behavior") == "Removed"
            for s in steps):
        return None
    vocab = max(map(len, backend.get_vocab(with_added_tokens=False)))  # one character per byte
    added = (len(t.content.encode()) for t in backend.get_added_tokens_decoder().values())
    return max([vocab, *added])


class Detokenizer:
    """Text of one request's output, grown a token at a time.

    Decodes only a short window (the previous token run and the new one) so the cost per token does not grow with
    the output; holds text back while it ends in an incomplete UTF-8 sequence or could be the start of a stop string.
    """

    __slots__ = ("tokenizer", "stop", "text", "prefix_offset", "read_offset", "ids", "max_stop_len", "emitted")

    def __init__(self, tokenizer: Tokenizer | None, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.text, self.ids = "", []
        self.prefix_offset = self.read_offset = 0
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.emitted = 0  # characters already handed to the caller

    def add(self, token_id: int) -> bool:
        """Appends a token; True when the text now contains a stop string (the text is cut before it)."""
        if self.tokenizer is None:
            return False
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        hits = [at for at in (self.text.find(s, search_from) for s in self.stop) if at >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return True
        return False

    def take_delta(self, finished: bool) -> str:
        """New text that is safe to stream: all of it once finished, else all but a possible stop-string prefix."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - max(0, self.max_stop_len - 1))
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
