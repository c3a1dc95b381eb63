"""Text in and out of a generative model: its tokenizer (`tokenizer.json`, Hugging Face `tokenizers`), its chat
template (`tokenizer_config.json`'s `chat_template`, Jinja, rendered in a sandbox), and incremental detokenization,
which turns tokens into text as they come without ever cutting a UTF-8 character in two."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from edge_agent.generation.runner import GenerationConfigError

__all__ = ["IncrementalText", "TextCodec"]

_REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of a character not complete yet


class TextCodec:
    def __init__(self, tokenizer: Any, chat_template: str | None, eos_token: str | None) -> None:
        self.tokenizer = tokenizer
        self.eos_id = None if eos_token is None else tokenizer.token_to_id(eos_token)
        self._template = None
        if chat_template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # deferred: only chat models need it

            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = environment.from_string(chat_template)

    @classmethod
    def load(cls, folder: Path) -> TextCodec:
        from tokenizers import Tokenizer  # deferred: importing the generation package stays light

        source = folder / "tokenizer.json"
        try:
            tokenizer = Tokenizer.from_file(str(source))
        except Exception as exc:  # tokenizers raises plain Exceptions for a missing or broken file
            raise GenerationConfigError(f"{source}: cannot load the tokenizer: {exc}") from None
        config: Mapping[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.exists():
            try:
                config = json.loads(config_path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise GenerationConfigError(f"{config_path}: cannot read it: {exc}") from None
        eos = config.get("eos_token")
        if isinstance(eos, dict):  # `{"content": "...", ...}`, as some models write it
            eos = eos.get("content")
        template = config.get("chat_template")
        try:
            return cls(
                tokenizer, template if isinstance(template, str) else None, eos if isinstance(eos, str) else None
            )
        except Exception as exc:  # a template that does not parse
            raise GenerationConfigError(f"{config_path}: the chat template does not parse: {exc}") from None

    @property
    def chat(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt the model was trained on for these messages, ending where the assistant's answer begins."""
        if self._template is None:
            raise ValueError("this model has no chat template: use /v1/completions with a prompt")
        return str(self._template.render(messages=list(messages), add_generation_prompt=True))

    def incremental(self) -> IncrementalText:
        return IncrementalText(self.tokenizer)


class IncrementalText:
    """One sequence's output text, a token at a time. `push` returns the text the token completes (often one
    character, sometimes nothing: the first bytes of a character, or a special token)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        decoded = self._tokenizer.decode(self.tokens, skip_special_tokens=True)
        if decoded.endswith(_REPLACEMENT):  # a character not complete yet: wait for its other bytes
            return ""
        new = decoded[len(self.text) :]
        self.text = decoded
        return new
