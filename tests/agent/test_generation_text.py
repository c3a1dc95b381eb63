"""The text side of generation: tiny-lm's byte-level tokenizer round-trips any text, its chat template renders a
conversation, and incremental detokenization never cuts a character in two."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.generation.runner import GenerationConfigError
from edge_agent.generation.text import TextCodec
from spillway.demo.tiny_lm import EOS, TINY, build_tiny_lm_version


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> TextCodec:
    return TextCodec.load(build_tiny_lm_version(tmp_path_factory.mktemp("lm"), 1, TINY))


def test_any_text_round_trips_and_specials_are_single_tokens(codec: TextCodec) -> None:
    text = "héllo, 世界! \U0001f600 tabs\tand\nnewlines"
    ids = codec.encode(text)
    assert ids == list(text.encode())  # byte-level: one token per byte
    assert codec.tokenizer.decode(ids) == text
    assert codec.encode("<|eos|>") == [EOS] and codec.eos_id == EOS


def test_the_chat_template_renders_a_conversation(codec: TextCodec) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert codec.chat_prompt(messages) == "<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"


def test_incremental_text_waits_for_whole_characters(codec: TextCodec) -> None:
    stream = codec.incremental()
    pieces = [stream.push(t) for t in "a世\U0001f600b".encode()]
    assert pieces == ["a", "", "", "世", "", "", "", "\U0001f600", "b"]
    assert stream.push(EOS) == "" and stream.text == "a世\U0001f600b"


def test_a_missing_or_broken_tokenizer_is_refused_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(GenerationConfigError, match=r"tokenizer\.json"):
        TextCodec.load(tmp_path)
    folder = build_tiny_lm_version(tmp_path / "lm", 1, TINY)
    (folder / "tokenizer_config.json").write_text('{"chat_template": "{% for %}"}')
    with pytest.raises(GenerationConfigError, match="chat template does not parse"):
        TextCodec.load(folder)
