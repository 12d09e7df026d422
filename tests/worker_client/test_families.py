"""Family tokenizers built from packaged vocabularies are the families' real ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import quicktok

from tests.families import FIXTURES
from worker_client.families import Family, FamilyError

TEXTS = [
    "Hello, world! 12345 don't",
    "def f(x):\n    return x**2  # squares\n\n\n",
    "Ünïcödé — 日本語のテキスト, emoji 🚀🔥 and CJK 中文.",
    "   leading spaces\tand\ttabs\r\nCRLF lines\n",
    'JSON {"a": [1, 2.5, -3e10], "b": null}',
    "I'M SHOUTING, you're not; THEY'LL see.",
]


@pytest.fixture(scope="module")
def gpt_oss() -> Any:
    return Family.load(FIXTURES / "gpt_oss").tokenizer()


@pytest.mark.parametrize(
    ("family", "encoding", "specials"),
    [
        ("gpt_oss", "o200k_harmony", "<|start|>assistant<|channel|>final<|message|>hi<|return|>"),
        ("llama31", "llama3", "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"),
    ],
)
def test_vocabulary_matches_the_reference_encoder(
    family: str, encoding: str, specials: str
) -> None:
    """A tokenizer written from quicktok's ranks encodes exactly as quicktok's own
    (tiktoken-identical) encoder of that vocabulary, special tokens included."""
    tokenizer = Family.load(FIXTURES / family).tokenizer()
    reference = quicktok.get_encoding(encoding)
    for text in [*TEXTS, specials]:
        ours = tokenizer.encode(text, add_special_tokens=False)
        assert ours == reference.encode(text, allowed_special="all"), text


def test_llama_31_names_its_reserved_tokens() -> None:
    """Llama 3.1's tool-use tokens sit on the ids Llama 3 had reserved for them."""
    tokenizer = Family.load(FIXTURES / "llama31").tokenizer()
    found = {
        t: tokenizer.convert_tokens_to_ids(t)
        for t in ["<|begin_of_text|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    }
    assert found == {
        "<|begin_of_text|>": 128000,
        "<|eom_id|>": 128008,
        "<|eot_id|>": 128009,
        "<|python_tag|>": 128010,
    }
    assert len(tokenizer) == 128256


def test_gpt_oss_special_tokens_have_their_ids(gpt_oss: Any) -> None:
    """Harmony's control tokens land on the ids the real model uses."""
    ids = {
        "<|endoftext|>": 199999,
        "<|return|>": 200002,
        "<|constrain|>": 200003,
        "<|channel|>": 200005,
        "<|start|>": 200006,
        "<|end|>": 200007,
        "<|message|>": 200008,
        "<|call|>": 200012,
    }
    found = {t: gpt_oss.convert_tokens_to_ids(t) for t in ids}
    assert found == ids
    assert len(gpt_oss) == 201088


def test_unknown_vocabulary_format_is_a_family_error(tmp_path: Path) -> None:
    """A family.json naming a format nobody reads fails with a FamilyError, not later."""
    folder = tmp_path
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "family.json").write_text(
        '{"vocabulary": {"package": "quicktok", "file": "data/o200k.vocab", "format": "x"}}'
    )
    with pytest.raises(FamilyError, match="unknown vocabulary format"):
        Family.load(folder).tokenizer()
