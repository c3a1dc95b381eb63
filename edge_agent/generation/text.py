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
    def __init__(self, tokenizer: Any, chat_template: str | None, eos_token: str | None,
                 bos_token: str | None = None) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.eos_token, self.bos_token = eos_token, bos_token
        self.eos_id = None if eos_token is None else tokenizer.token_to_id(eos_token)
        # Special-token strings a user's message may not smuggle in (a fake system or assistant turn).
        self._specials = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special),
                                key=lambda s: -len(s))  # fmt: skip
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

        def token(key: str) -> str | None:
            value = config.get(key)
            if isinstance(value, dict):  # `{"content": "...", ...}`, as some models write it
                value = value.get("content")
            return value if isinstance(value, str) else None

        template = config.get("chat_template")
        try:
            return cls(tokenizer, template if isinstance(template, str) else None, token("eos_token"),
                       token("bos_token"))  # fmt: skip
        except Exception as exc:  # a template that does not parse
            raise GenerationConfigError(f"{config_path}: the chat template does not parse: {exc}") from None

    @property
    def chat(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        """Tokens of `text`; ValueError for text a tokenizer cannot take (a lone surrogate)."""
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        except TypeError as exc:  # tokenizers refuses str values that are not valid Unicode
            raise ValueError(f"the text cannot be tokenized: {exc}") from None

    def without_specials(self, text: str) -> str:
        """`text` with the model's special-token strings taken out, so that a message cannot open a turn."""
        for special in self._specials:
            text = text.replace(special, "")
        return text

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt the model was trained on for these messages, ending where the assistant's answer begins.
        Message contents lose any special-token string. ValueError when the template refuses the conversation (its
        `raise_exception`, as Hugging Face templates call it) or fails on it."""
        if self._template is None:
            raise ValueError("this model has no chat template: use /v1/completions with a prompt")

        def raise_exception(message: str) -> None:
            raise ValueError(f"the chat template refuses these messages: {message}")

        clean = [{**m, "content": self.without_specials(m["content"])} for m in messages]
        try:
            rendered = self._template.render(
                messages=clean, add_generation_prompt=True, raise_exception=raise_exception,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )  # fmt: skip
            return str(rendered)
        except ValueError:
            raise
        except Exception as exc:  # a template error on this input (an undefined name, a type error)
            raise ValueError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from None

    def incremental(self) -> IncrementalText:
        return IncrementalText(self.tokenizer)


class IncrementalText:
    """One sequence's output text, a token at a time. `push` returns the text the token completes (often one
    character, sometimes nothing: the first bytes of a character, or a special token).

    Each push decodes a short window, not the whole output (vLLM's prefix/read offsets): the tokens since the last
    text that came out whole, decoded with the one piece before them so that a decoder that strips a leading space
    (SentencePiece) sees what came before."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # the window starts here
        self._read = 0  # tokens before this are in `text`

    def push(self, token: int) -> str:
        self.tokens.append(token)
        decode = self._tokenizer.decode
        before = decode(self.tokens[self._prefix : self._read], skip_special_tokens=True)
        decoded = decode(self.tokens[self._prefix :], skip_special_tokens=True)
        if len(decoded) <= len(before) or decoded.endswith(_REPLACEMENT):  # nothing yet, or a character not whole
            return ""
        new = decoded[len(before) :]
        self.text += new
        self._prefix, self._read = self._read, len(self.tokens)
        return new
