"""A tiny causal LM in Hugging Face format, generated locally, for demos and tests.

``write_tiny_model(dir)`` writes a model that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load offline:

* a byte-level BPE tokenizer (about 4k tokens) trained with ``tokenizers`` on a corpus this
  module generates from a seed, so any text round-trips;
* special tokens ``<|endoftext|>`` (padding), ``<|im_start|>``, ``<|im_end|>`` (end of
  turn, the eos token) and added plain tokens ``<tool_call>``, ``</tool_call>``,
  ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``;
* a ChatML chat template with hermes-style tool calling (tools in the first system block,
  calls as ``<tool_call>{json}</tool_call>``, consecutive tool results grouped in one user
  block), prefix-stable after every assistant turn;
* a ``LlamaForCausalLM`` with two layers of width 64 and a 131072-token context window
  (real agents send 20k-token system prompts, which this small vocabulary turns into
  several times more tokens).

The weights are randomly initialised from the seed. With ``imprint=True`` (the default)
they are then trained for a few seconds on synthetic conversations rendered with the
template, so that the model often answers a request that comes with tools by calling one
of them in well-formed hermes markup, and ends its turns with ``<|im_end|>``. It stays a
stochastic model: at temperature 1 it also writes plain text and, now and then, malformed
calls, which is what the tests need.

The project ships one such model, written by ``write_tiny_model(SHIPPED_TINY_MODEL)``
(seed 0): the demo starts on it at once instead of training for minutes, and the tests
run on the same weights on every machine (training on another processor rounds floats
differently, so a model generated there differs in its weights, never in its tokenizer,
template or shapes). ``rollout-relay tiny-model DIR`` writes a new one.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PLAIN_ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
VOCAB_SIZE = 4096
CONTEXT_WINDOW = 131072
# The model the project ships (package data; about 1.7 MB).
SHIPPED_TINY_MODEL = Path(__file__).resolve().parent / "assets" / "tiny-model"

CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{{- (messages[0].content or '') + '\\n\\n' -}}{%- set ns.start = 1 -%}"
    "{%- else -%}{{- 'You are a helpful assistant.\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.index0 >= ns.start -%}"
    "{%- if message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') -}}"
    "{%- for call in (message.tool_calls or []) -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \' -}}'
    "{%- if f.arguments is string -%}{{- f.arguments -}}"
    "{%- else -%}{{- f.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# ----------------------------------------------------------------------------- corpus

_WORDS = [
    "the",
    "a",
    "an",
    "file",
    "files",
    "list",
    "read",
    "write",
    "run",
    "test",
    "tests",
    "check",
    "look",
    "project",
    "code",
    "module",
    "function",
    "class",
    "value",
    "result",
    "error",
    "output",
    "input",
    "line",
    "lines",
    "number",
    "count",
    "directory",
    "path",
    "repository",
    "branch",
    "commit",
    "change",
    "fix",
    "bug",
    "issue",
    "task",
    "agent",
    "model",
    "tool",
    "call",
    "answer",
    "question",
    "user",
    "system",
    "assistant",
    "please",
    "show",
    "find",
    "search",
    "open",
    "close",
    "build",
    "install",
    "python",
    "script",
    "data",
    "table",
    "report",
    "summary",
    "first",
    "next",
    "last",
    "every",
    "each",
    "some",
    "all",
    "none",
    "done",
    "ok",
    "yes",
    "no",
    "because",
    "then",
    "when",
    "while",
    "after",
    "before",
    "into",
    "from",
    "with",
    "without",
    "about",
    "small",
    "large",
    "quick",
    "slow",
    "new",
    "old",
    "good",
    "bad",
    "true",
    "false",
    "main",
    "readme",
    "config",
    "settings",
]
_FILES = ("main.py", "README.md", "setup.cfg", "src/app.py", "tests/test_app.py", "data.csv")
_COMMANDS = ("ls", "ls -la", "pwd", "cat main.py", "wc -l README.md", "echo hello", "cat README.md")
_TOOL_SPECS: dict[str, dict[str, Any]] = {
    "bash": {
        "description": "Run a read-only command (ls, cat, wc, pwd, echo) in the workspace.",
        "properties": {"command": {"type": "string", "description": "the command"}},
    },
    "read_file": {
        "description": "Read a file of the workspace.",
        "properties": {"path": {"type": "string"}},
    },
    "search": {
        "description": "Search the workspace for a word.",
        "properties": {"query": {"type": "string"}},
    },
    "write_file": {
        "description": "Write a file of the workspace.",
        "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    },
}


def _tool(name: str) -> dict[str, Any]:
    spec = _TOOL_SPECS[name]
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": spec["description"],
            "parameters": {
                "type": "object",
                "properties": spec["properties"],
                "required": list(spec["properties"]),
            },
        },
    }


def _sentence(rng: random.Random, low: int = 4, high: int = 12) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(low, high))]
    return " ".join(words).capitalize() + rng.choice([".", ".", "?", "!"])


def _arguments(rng: random.Random, name: str) -> dict[str, str]:
    if name == "bash":
        return {"command": rng.choice(_COMMANDS)}
    if name == "search":
        return {"query": rng.choice(_WORDS)}
    if name == "write_file":
        return {"path": rng.choice(_FILES), "content": _sentence(rng, 2, 5)}
    return {"path": rng.choice(_FILES)}


def _conversation(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A system/user request with tools, a tool call, its result and a final answer."""
    names = rng.sample(sorted(_TOOL_SPECS), rng.randint(1, len(_TOOL_SPECS)))
    tools = [_tool(n) for n in names]
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.7:
        messages.append({"role": "system", "content": _sentence(rng)})
    messages.append({"role": "user", "content": " ".join(_sentence(rng) for _ in range(2))})
    for _ in range(rng.randint(1, 2)):
        name = rng.choice(names)
        call = {"type": "function", "function": {"name": name, "arguments": _arguments(rng, name)}}
        content = _sentence(rng, 2, 6) if rng.random() < 0.3 else ""
        messages.append({"role": "assistant", "content": content, "tool_calls": [call]})
        messages.append({"role": "tool", "content": _sentence(rng, 3, 10)})
    messages.append({"role": "assistant", "content": " ".join(_sentence(rng) for _ in range(2))})
    return messages, tools


_ONSETS = (
    "",
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "st",
    "tr",
    "pl",
    "ch",
    "sh",
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_CODAS = ("", "", "n", "r", "s", "t", "l", "nd", "ng", "x")


def _pseudo_word(rng: random.Random) -> str:
    """Made-up words give BPE enough variety to learn a few thousand merges."""
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.randint(1, 3))
    )


def _corpus(rng: random.Random, size: int) -> list[str]:
    texts: list[str] = []
    for i in range(size):
        kind = i % 5
        if kind == 4:
            words = [_pseudo_word(rng) for _ in range(rng.randint(20, 60))]
            texts.append(" ".join(words).capitalize() + ".")
            continue
        if kind == 0:
            texts.append(" ".join(_sentence(rng) for _ in range(5)))
        elif kind == 1:
            messages, tools = _conversation(rng)
            texts.append(json.dumps({"tools": tools, "messages": messages}, ensure_ascii=False))
        elif kind == 2:
            texts.append(
                "\n".join(f"$ {rng.choice(_COMMANDS)}\n{_sentence(rng)}" for _ in range(3))
            )
        else:
            fn = rng.choice(_WORDS)
            texts.append(
                f"def {fn}_{rng.choice(_WORDS)}(value):\n    return value + {rng.randint(0, 99)}\n"
            )
    return texts


# ----------------------------------------------------------------------------- writing


def _train_tokenizer(rng: random.Random) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(PLAIN_ADDED_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(rng, 6000), trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=CONTEXT_WINDOW,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _training_sequences(
    tokenizer: Any, rng: random.Random, count: int
) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) pairs; the mask is 1 on assistant tokens (content + <|im_end|>)."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out: list[tuple[list[int], list[int]]] = []
    for _ in range(count):
        messages, tools = _conversation(rng)
        ids: list[int] = []
        mask: list[int] = []
        rendered = ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(
                messages[:i], tools=tools, tokenize=False, add_generation_prompt=True
            )
            context = tokenizer.encode(prompt[len(rendered) :], add_special_tokens=False)
            full = tokenizer.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False)
            body = full[len(prompt) :].removesuffix("<|im_end|>\n")
            reply = [*tokenizer.encode(body, add_special_tokens=False), end]
            ids += context + reply
            mask += [0] * len(context) + [1] * len(reply)
            rendered = full.removesuffix("\n")
        out.append((ids, mask))
    return out


IMPRINT_STEPS = 400


def imprint_tool_use(
    model: Any,
    tokenizer: Any,
    rng: random.Random,
    steps: int,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Train ``model`` for ``steps`` steps on synthetic chats in which the assistant answers
    or calls the tools it is offered (the loss on its own tokens only): a tiny model so
    trained writes well-formed tool calls some of the time, which an agent can act on and
    a reward can tell apart. ``progress(done, steps)`` every tenth of the steps."""
    import torch

    sequences = _training_sequences(tokenizer, rng, 256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    model.train()
    pad = tokenizer.pad_token_id
    for step in range(steps):
        batch = [sequences[rng.randrange(len(sequences))] for _ in range(8)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.tensor(
                [t if m else -100 for t, m in zip(ids, mask, strict=True)]
            )
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if progress is not None and (step + 1) % max(1, steps // 10) == 0:
            progress(step + 1, steps)
    model.eval()


def write_tiny_model(
    out_dir: Path,
    *,
    seed: int = 0,
    imprint: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write the tiny model to ``out_dir`` (replacing it atomically) and return the path.
    ``progress(done, total)`` is called every tenth of the training steps."""
    rng = random.Random(seed)
    tokenizer = _train_tokenizer(rng)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model = random_model(
        vocab_size=len(tokenizer),
        hidden_size=64,
        eos_ids=[end, pad],
        pad_id=pad,
        seed=seed,
        train=(lambda m: imprint_tool_use(m, tokenizer, rng, IMPRINT_STEPS, progress))
        if imprint
        else None,
    )
    return save_atomically(out_dir, model, tokenizer)


# The head sizes vLLM's CPU attention takes start at 32; the tiny models' heads are 16 wide.
VLLM_HEAD_DIM = 32


def widen_heads(src: Path, out_dir: Path, *, head_dim: int = VLLM_HEAD_DIM) -> Path:
    """Write the Llama model at ``src`` to ``out_dir`` with attention heads ``head_dim``
    wide that compute the same function (up to float rounding), and return the path.

    For engines that take no heads as narrow as the tiny model's (vLLM's CPU attention
    starts at 32). Each head's dimensions keep their rotary frequency: with rotate-half
    RoPE, dimension ``j`` of the first half turns at ``theta ** (-2j / d)`` with its partner
    ``j + d/2``, so old dimension ``j`` goes to ``f * j`` and its partner to
    ``f * j + new/2`` (``f = new / old``), the rest of each head is zero. The queries are
    scaled by ``sqrt(f)`` so that ``q . k / sqrt(new)`` stays ``q . k / sqrt(old)``; the
    values' zero dimensions meet zero columns of the output projection.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = model.config
    if config.model_type != "llama":
        raise ValueError(f"widen_heads takes a llama model, not {config.model_type!r}")
    old = config.head_dim
    if head_dim % old or head_dim < old:
        raise ValueError(f"head_dim {head_dim} is not a multiple of the model's {old}")
    factor = head_dim // old
    half_old, half_new = old // 2, head_dim // 2
    places = torch.tensor(
        [factor * j for j in range(half_old)] + [factor * j + half_new for j in range(half_old)]
    )

    def spread(weight: Any, heads: int, scale: float = 1.0) -> Any:
        # Rows head by head, ``old`` each, into rows ``head_dim`` each at ``places``.
        rows = weight.reshape(heads, old, -1)
        wide = rows.new_zeros(heads, head_dim, rows.shape[-1])
        wide[:, places] = rows * scale
        return wide.reshape(heads * head_dim, -1)

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(config.num_hidden_layers):
        at = f"model.layers.{i}.self_attn."
        state[at + "q_proj.weight"] = spread(state[at + "q_proj.weight"], heads, factor**0.5)
        state[at + "k_proj.weight"] = spread(state[at + "k_proj.weight"], kv_heads)
        state[at + "v_proj.weight"] = spread(state[at + "v_proj.weight"], kv_heads)
        out_proj = state[at + "o_proj.weight"]
        state[at + "o_proj.weight"] = spread(out_proj.t().contiguous(), heads).t().contiguous()
    config.head_dim = head_dim
    wide_model = type(model)(config).float()
    wide_model.load_state_dict(state)
    wide_model.generation_config = model.generation_config
    tokenizer = AutoTokenizer.from_pretrained(src)
    return save_atomically(out_dir, wide_model, tokenizer)


def random_model(
    *,
    vocab_size: int,
    hidden_size: int,
    eos_ids: list[int],
    pad_id: int,
    seed: int,
    train: Callable[[Any], None] | None = None,
) -> Any:
    """A two-layer ``LlamaForCausalLM`` with seeded random weights (then ``train``-ed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT_WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_ids[0],
        pad_token_id=pad_id,
    )
    return seeded_model(
        LlamaForCausalLM, config, seed=seed, eos_ids=eos_ids, pad_id=pad_id, shape=train
    )


def seeded_model(
    model_class: Any,
    config: Any,
    *,
    seed: int,
    eos_ids: list[int],
    pad_id: int,
    shape: Callable[[Any], None] | None = None,
) -> Any:
    """``model_class(config)`` with weights random from ``seed``, then ``shape``-d (trained,
    or rescaled), on one torch thread (the same float reductions on every machine), with a
    generation config that stops at ``eos_ids``."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = model_class(config).float()
        if shape is not None:
            shape(model)
    finally:
        torch.set_num_threads(threads)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=None
    )
    return model


def save_atomically(
    out_dir: Path,
    model: Any,
    tokenizer: Any,
    files: dict[str, str] | None = None,
    *,
    state_dict: Mapping[str, Any] | None = None,
) -> Path:
    """Save a model, its tokenizer and ``files`` (name: text) to ``out_dir``, replacing it
    whole or not at all.

    ``state_dict``: the weights to write instead of the model's own (a trainer's gathered
    state dict under ZeRO-3 or FSDP, where the local model holds only a shard).
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        if state_dict is None:
            model.save_pretrained(staging)
        else:
            model.save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
        for name, text in (files or {}).items():
            (staging / name).write_text(text, encoding="utf-8")
        if not out_dir.exists():
            staging.rename(out_dir)
        elif _exchange(staging, out_dir):
            # The new checkpoint took the old one's name in one step; the old one now
            # sits in the staging directory, removed with it below.
            pass
        else:
            # Without an atomic exchange, the old one is moved aside (never removed)
            # before the new one takes its name: a crash between the two renames leaves it
            # whole under the aside name.
            aside = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-old-"))
            aside.rmdir()
            out_dir.rename(aside)
            staging.rename(out_dir)
            staging = aside
        shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories' names in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the system or the file system cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}:
        return False
    raise OSError(code, os.strerror(code), str(b))
