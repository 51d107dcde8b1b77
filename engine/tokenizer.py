"""Tokenizer of the model folder, and incremental detokenization with exact stop-string cuts."""
from __future__ import annotations

from pathlib import Path

from engine.model_config import ModelFolderError


class Tokenizer:
    def __init__(self, folder: str | Path):
        from transformers import AutoTokenizer  # heavy import, only when a real tokenizer is needed

        try:
            self.hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelFolderError(f"no usable tokenizer in {folder}: {e}") from None
        self.eos_token_id = self.hf.eos_token_id

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
