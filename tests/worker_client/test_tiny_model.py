"""The locally generated tiny model: loadable, well-formed tokenizer, prefix-stable chat
template, and a deterministic generator."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from worker_client import tiny_model
from worker_client.tiny_model import PLAIN_ADDED_TOKENS, SPECIAL_TOKENS, write_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call-{name}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
]

# (messages, tools) conversations covering plain chat, tool calls (dict and string
# arguments, several calls in one turn, calls with and without text), grouped tool
# results, a mid-conversation system message and tools without a system message.
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "plain": (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi there."},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
        ],
        None,
    ),
    "tool_calls_grouped_results": (
        [
            {"role": "system", "content": "You inspect repositories."},
            {"role": "user", "content": "How long is main.py and what is in README.md?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("bash", {"command": "ls"})]},
            {"role": "tool", "content": "main.py\nREADME.md"},
            {
                "role": "assistant",
                "content": "Reading both.",
                "tool_calls": [
                    _call("bash", '{"command": "wc -l main.py"}'),
                    _call("read_file", {"path": "README.md"}),
                ],
            },
            {"role": "tool", "content": "12 main.py"},
            {"role": "tool", "content": "# Project"},
            {"role": "assistant", "content": "main.py has 12 lines; README is a title."},
            {"role": "user", "content": "Thanks."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [_call("bash", {"command": "pwd"})],
            },
            {"role": "tool", "content": "/work"},
            {"role": "assistant", "content": "Done."},
        ],
        _TOOLS,
    ),
    "mid_conversation_system": (
        [
            {"role": "user", "content": "Start."},
            {"role": "assistant", "content": "Started."},
            {"role": "system", "content": "Switch to French now."},
            {"role": "user", "content": "Continue."},
            {"role": "assistant", "content": "", "tool_calls": [_call("read_file", {"path": "a"})]},
            {"role": "tool", "content": "contenu"},
            {"role": "assistant", "content": "C'est fait. ✓"},
        ],
        _TOOLS,
    ),
    "mid_conversation_system_no_tools": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "One."},
            {"role": "assistant", "content": "1"},
            {"role": "system", "content": "Be verbose."},
            {"role": "user", "content": "Two."},
            {"role": "assistant", "content": "The number two, written 2."},
        ],
        None,
    ),
}


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    generation_prompt: bool = False,
) -> str:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert isinstance(text, str)
    return text


def test_loads_with_auto_classes(tiny_model_dir: Path, tokenizer: Any) -> None:
    """AutoTokenizer and AutoModelForCausalLM load the cached model offline and the model
    produces finite next-token logits over a vocabulary covering the tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.eval()
    ids = tokenizer.encode("list the files", add_special_tokens=False)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert model.config.vocab_size >= len(tokenizer)
    assert bool(torch.isfinite(logits).all())
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"


@pytest.mark.parametrize("token", SPECIAL_TOKENS)
def test_special_tokens_are_special_single_ids(tokenizer: Any, token: str) -> None:
    """Each ChatML special token encodes to one id (also inside text), is flagged special
    and is dropped by decode(skip_special_tokens=True)."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    assert len(ids) == 1
    (tid,) = ids
    assert tokenizer.convert_tokens_to_ids(token) == tid
    assert tokenizer.added_tokens_decoder[tid].special is True
    inside = tokenizer.encode(f"abc{token}def", add_special_tokens=False)
    assert tid in inside
    assert tokenizer.decode(inside, skip_special_tokens=True) == "abcdef"
    assert tokenizer.decode(inside) == f"abc{token}def"


@pytest.mark.parametrize("token", PLAIN_ADDED_TOKENS)
def test_tool_markup_tokens_are_single_ids_kept_by_decode(tokenizer: Any, token: str) -> None:
    """<tool_call>, <think> etc. are single, non-special ids that survive
    decode(skip_special_tokens=True) (a tool parser must see them)."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    assert len(ids) == 1
    (tid,) = ids
    assert tokenizer.added_tokens_decoder[tid].special is False
    text = f'<|im_start|>assistant\n{token}\n{{"name": "x"}}<|im_end|>'
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert tid in encoded
    assert (
        tokenizer.decode(encoded, skip_special_tokens=True)
        == f'assistant\n{token}\n{{"name": "x"}}'
    )


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld — naïve café",
        "日本語のテキストと中文 и русский",
        "emoji 🚀🧪👩‍💻 and flags 🇫🇷",
        "  leading, trailing and\ttabs \n\n  multiple   spaces  ",
        "a , b . c ! d ? it 's don 't",
        "zero\u200bwidth, \x00 nul and \x7f del, precomposed \u00e9",
        "e\u0301 decomposed (combining acute accent)",
        "<|im_sta partial markup <tool_cal and </think",
    ],
)
def test_unicode_text_round_trips(tokenizer: Any, text: str) -> None:
    """Byte-level BPE: decode(encode(text)) == text for any unicode text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_auto_tokenizer_encodes_like_written_tokenizer_json(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    """The tokenizer AutoTokenizer loads (the proxy's) encodes text exactly like the
    tokenizer.json the generator trained and imprinted the model with."""
    written = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for text in ("wc -l main.py returned 12345 lines", "e\u0301", "it's done 42 times"):
        assert (
            tokenizer.encode(text, add_special_tokens=False)
            == written.encode(text, add_special_tokens=False).ids
        ), text


def test_generation_config_eos(tiny_model_dir: Path, tokenizer: Any) -> None:
    """generation_config.json stops on <|im_end|> and <|endoftext|>, in that order."""
    generation = GenerationConfig.from_pretrained(str(tiny_model_dir))
    expected = [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    assert generation.eos_token_id == expected
    assert generation.pad_token_id == tokenizer.pad_token_id


def test_context_window_is_large(tiny_model_dir: Path, tokenizer: Any) -> None:
    """The config announces a context window of at least 65536 tokens."""
    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    assert config.max_position_embeddings >= 65536
    assert tokenizer.model_max_length >= 65536


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_is_prefix_stable(tokenizer: Any, name: str) -> None:
    """After every assistant turn, the rendering of the conversation so far is a string
    prefix of the full rendering (with and without a generation prompt), and the
    generation prompt before that turn is a prefix of the rendering including it."""
    messages, tools = CONVERSATIONS[name]
    full = _render(tokenizer, messages, tools)
    full_prompted = _render(tokenizer, messages, tools, generation_prompt=True)
    checked = 0
    for k in range(1, len(messages) + 1):
        if messages[k - 1]["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:k], tools)
        assert full.startswith(prefix), (name, k)
        assert full_prompted.startswith(prefix), (name, k)
        prompt = _render(tokenizer, messages[: k - 1], tools, generation_prompt=True)
        assert prefix.startswith(prompt), (name, k)
        assert prompt.endswith("<|im_start|>assistant\n")
        checked += 1
    assert checked >= 2


def test_chat_template_groups_tool_results_and_keeps_system_blocks(tokenizer: Any) -> None:
    """Consecutive tool results share one user block; the first system message is merged
    into the tools block once, and a later system message gets its own block."""
    messages, tools = CONVERSATIONS["tool_calls_grouped_results"]
    text = _render(tokenizer, messages, tools)
    assert (
        "<|im_start|>user\n<tool_response>\n12 main.py\n</tool_response>"
        "\n<tool_response>\n# Project\n</tool_response><|im_end|>\n"
    ) in text
    assert text.count("<|im_start|>system\n") == 1
    assert text.startswith("<|im_start|>system\nYou inspect repositories.\n\n# Tools")
    assert (
        '<tool_call>\n{"name": "bash", "arguments": {"command": "wc -l main.py"}}\n</tool_call>'
        in text
    )

    messages, tools = CONVERSATIONS["mid_conversation_system"]
    text = _render(tokenizer, messages, tools)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert (
        "<|im_start|>system\nSwitch to French now.<|im_end|>\n<|im_start|>user\nContinue." in text
    )


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_generator_is_deterministic(tmp_path: Path) -> None:
    """Same seed: byte-identical tokenizer.json and identical weights; another seed:
    different weights."""
    a = write_tiny_model(tmp_path / "a", seed=7, imprint=False)
    b = write_tiny_model(tmp_path / "b", seed=7, imprint=False)
    c = write_tiny_model(tmp_path / "c", seed=8, imprint=False)

    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "chat_template.jinja").read_bytes() == (b / "chat_template.jinja").read_bytes()
    ta, tb, tc = _tensors(a), _tensors(b), _tensors(c)
    assert ta
    assert ta.keys() == tb.keys()
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key
    assert ta.keys() == tc.keys()
    assert any(ta[key].shape != tc[key].shape or not torch.equal(ta[key], tc[key]) for key in ta)
    # Nothing but the final directories is left behind (the staging dir was renamed).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]


def test_training_reports_its_progress(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Writing the model says how far its training is, every tenth of the steps (the demo
    prints it on a first run instead of staying silent for two minutes)."""
    monkeypatch.setattr(tiny_model, "IMPRINT_STEPS", 20)
    seen: list[tuple[int, int]] = []
    write_tiny_model(tmp_path / "m", progress=lambda done, total: seen.append((done, total)))
    assert seen == [(step, 20) for step in range(2, 21, 2)]


def test_shipped_model_is_the_generators_output(tmp_path: Path) -> None:
    """The shipped tiny model is what ``write_tiny_model`` writes for seed 0: the same
    tokenizer, template and configuration byte for byte, and weights of the same names and
    shapes (their values come from training, which rounds differently on each processor).
    A change to the generator fails here until the shipped model is written again with
    ``rollout-relay tiny-model worker_client/assets/tiny-model``."""
    shipped = tiny_model.SHIPPED_TINY_MODEL
    fresh = write_tiny_model(tmp_path / "fresh", seed=0, imprint=False)
    assert sorted(p.name for p in shipped.iterdir()) == sorted(p.name for p in fresh.iterdir())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (shipped / name).read_bytes() == (fresh / name).read_bytes(), name
    for name in ("config.json", "generation_config.json"):
        # Which transformers release wrote the file is not part of the model.
        ours, theirs = (
            json.loads((d / name).read_text()) | {"transformers_version": None}
            for d in (shipped, fresh)
        )
        assert ours == theirs, name
    weights, initial = _tensors(shipped), _tensors(fresh)
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in initial.items()}
    # Trained, not the seed's random initialisation.
    assert any(not torch.equal(weights[k], initial[k]) for k in weights)


class _Saved:
    """What ``save_atomically`` writes with: an object that saves one named file."""

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self.text = text

    def save_pretrained(self, directory: Path, **_: Any) -> None:
        (Path(directory) / self.name).write_text(self.text)


class _Crash(BaseException):
    """The process dying at that instant: nothing after it runs."""


def test_a_crash_while_replacing_a_checkpoint_leaves_a_whole_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dying right after the first directory removal of a replace leaves the old or the
    new checkpoint in place, never none."""
    out = tmp_path / "step-1"
    tiny_model.save_atomically(out, _Saved("config.json", "old"), _Saved("tokenizer.json", "t"))
    real = shutil.rmtree
    crashed: list[str] = []

    def rmtree_then_die(path: Any, *args: Any, **kwargs: Any) -> None:
        if crashed:
            return  # the process is gone: nothing more happens
        real(path, *args, **kwargs)
        crashed.append(str(path))
        raise _Crash

    monkeypatch.setattr(tiny_model.shutil, "rmtree", rmtree_then_die)
    with pytest.raises(_Crash):
        tiny_model.save_atomically(out, _Saved("config.json", "new"), _Saved("tokenizer.json", "t"))
    assert crashed
    assert (out / "config.json").read_text() in {"old", "new"}
    assert (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("exchange", [True, False])
def test_save_atomically_replaces_a_checkpoint_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """A second save replaces the first whole (no file of the old one left), with the
    atomic exchange and without it; no staging directory stays behind."""
    if not exchange:
        monkeypatch.setattr(tiny_model, "_exchange", lambda a, b: False)
    out = tmp_path / "ckpt"
    tiny_model.save_atomically(out, _Saved("old.json", "1"), _Saved("tokenizer.json", "t"))
    tiny_model.save_atomically(out, _Saved("new.json", "2"), _Saved("tokenizer.json", "t"))
    assert sorted(p.name for p in out.iterdir()) == ["new.json", "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_widened_heads_compute_the_same_function(tmp_path: Path) -> None:
    """The shipped model with heads 32 wide (what vLLM's CPU attention takes) gives the
    shipped model's logprobs within float rounding, on a sequence long enough for RoPE's
    slow frequencies to matter."""
    from rollout_relay.cli import main

    assert main(["tiny-model", "--head-dim", "32", str(tmp_path / "wide")]) == 0
    shipped = AutoModelForCausalLM.from_pretrained(tiny_model.SHIPPED_TINY_MODEL)
    wide = AutoModelForCausalLM.from_pretrained(tmp_path / "wide")
    assert (wide.config.head_dim, wide.config.num_attention_heads) == (32, 4)
    ids = torch.randint(
        0, shipped.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        a = shipped(ids).logits.log_softmax(-1)
        b = wide(ids).logits.log_softmax(-1)
    assert (a - b).abs().max().item() < 1e-4
    tokenizer = tmp_path / "wide" / "tokenizer.json"
    assert tokenizer.read_bytes() == (tiny_model.SHIPPED_TINY_MODEL / "tokenizer.json").read_bytes()


def test_widening_refuses_what_it_cannot_keep(tmp_path: Path) -> None:
    """A head size that is not a multiple of the model's, or --head-dim with options of a
    trained model, is refused."""
    from rollout_relay.cli import main

    with pytest.raises(ValueError, match="not a multiple"):
        tiny_model.widen_heads(tiny_model.SHIPPED_TINY_MODEL, tmp_path / "w", head_dim=24)
    assert main(["tiny-model", "--head-dim", "32", "--seed", "3", str(tmp_path / "w")]) == 2
