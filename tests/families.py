"""Real model families for the tests: their fixtures, tiny models, and what they sample.

Each family folder under ``tests/fixtures/families/`` holds the family's real chat
template and where its vocabulary comes from (see the README there). ``family_model``
writes a tiny random-weight model on it once and caches it under ``.cache/``.

``FAMILIES[name].sample(reasoning, content, calls)`` is the text a model of that family
writes for one assistant turn, in its native markup, ending with the stop token it
samples: the scripted policy of the end-to-end tests and the sampled side of the
continuation tests.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import worker_client.families as families_module
import worker_client.tiny_model as tiny_model_module
from worker_client.families import write_family_model

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "families"

# A call as the policy writes it: (name, arguments).
Call = tuple[str, dict[str, Any]]


def _hermes(content: str, calls: list[Call]) -> str:
    blocks = [
        "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
        for name, args in calls
    ]
    return "\n".join([content, *blocks] if content else blocks)


def _qwen3(reasoning: str, content: str, calls: list[Call]) -> str:
    think = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else "<think>\n\n</think>\n\n"
    return think + _hermes(content, calls) + "<|im_end|>"


def _qwen25(reasoning: str, content: str, calls: list[Call]) -> str:
    return _hermes(content, calls) + "<|im_end|>"


def _qwen3_coder(reasoning: str, content: str, calls: list[Call]) -> str:
    blocks = []
    for name, args in calls:
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
        blocks.append(f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
    # The template writes a blank line between content and the first call.
    head = f"{content}\n\n" if content and blocks else content
    return head + "\n".join(blocks) + "<|im_end|>"


def _deepseek_calls(calls: list[Call], fmt: Callable[[str, dict[str, Any]], str]) -> str:
    if not calls:
        return ""
    inner = "".join(f"<｜tool▁call▁begin｜>{fmt(n, a)}<｜tool▁call▁end｜>" for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"


def _deepseek_v31(reasoning: str, content: str, calls: list[Call]) -> str:
    # Non-thinking mode: the generation prompt already closed the think block.
    body = _deepseek_calls(calls, lambda n, a: f"{n}<｜tool▁sep｜>{json.dumps(a)}")
    return content + body + "<｜end▁of▁sentence｜>"


def _deepseek_r1(reasoning: str, content: str, calls: list[Call]) -> str:
    # The generation prompt opened the think block: the model writes its reasoning first.
    body = _deepseek_calls(
        calls, lambda n, a: f"function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```"
    )
    return f"{reasoning}\n</think>\n\n{content}{body}<｜end▁of▁sentence｜>"


def _llama31(reasoning: str, content: str, calls: list[Call]) -> str:
    if calls:
        ((name, args),) = calls
        return json.dumps({"name": name, "parameters": args}) + "<|eot_id|>"
    return content + "<|eot_id|>"


def _glm45(reasoning: str, content: str, calls: list[Call]) -> str:
    text = f"\n<think>{reasoning}</think>" + (f"\n{content}" if content else "")
    for name, args in calls:
        pairs = "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items()
        )
        text += f"\n<tool_call>{name}\n{pairs}</tool_call>"
    # GLM has no end-of-turn token: it stops on the token that opens the next message.
    return text + ("<|observation|>" if calls else "<|user|>")


def _kimi_k2(reasoning: str, content: str, calls: list[Call]) -> str:
    if not calls:
        return content + "<|im_end|>"
    inner = "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}"
        "<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)
    )
    return f"{content}<|tool_calls_section_begin|>{inner}<|tool_calls_section_end|><|im_end|>"


def _gpt_oss(reasoning: str, content: str, calls: list[Call]) -> str:
    # The generation prompt wrote `<|start|>assistant`: the reply opens with a header.
    analysis = (
        f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant" if reasoning else ""
    )
    if calls:  # one call per message; the model stops on <|call|>
        ((name, args),) = calls
        preamble = (
            f"<|channel|>commentary<|message|>{content}<|end|><|start|>assistant" if content else ""
        )
        return (
            f"{analysis}{preamble}<|channel|>commentary to=functions.{name} <|constrain|>json"
            f"<|message|>{json.dumps(args)}<|call|>"
        )
    return f"{analysis}<|channel|>final<|message|>{content}<|return|>"


@dataclass(frozen=True)
class FamilyCase:
    name: str
    sample: Callable[[str, str, list[Call]], str]
    reasoning: bool  # the family writes reasoning (think blocks)
    # The template renders history exactly as the model samples it (no reasoning dropped,
    # no markup rewritten): a continued chain then equals the template's full rendering.
    exact_history: bool
    single_call: bool = False  # the template allows one tool call per message
    # The id of the index-th call of a reply (Kimi-K2's model writes its own ids).
    call_id: Callable[[str, int], str] = field(default=lambda name, index: f"call_{index}")
    # A known, documented difference between a chain and the template's full rendering,
    # removed from both before they are compared.
    deviation: str = ""
    # Whether the template's full rendering of a multi-turn tool episode is a sequence the
    # model could have sampled at all (else only the new text of each turn is compared).
    coherent_history: bool = True
    # The model writes its own call ids (Kimi-K2): the agent must get those back.
    model_call_ids: bool = False

    def reply(self, prompt: str, reasoning: str, content: str, calls: list[Call]) -> str:
        """What the model samples after ``prompt``: ``sample``, with the think block opened
        by the model itself when the family's sample expects the prompt to have opened it
        and this prompt did not (R1's template writes no generation prompt after tool
        output)."""
        text = self.sample(reasoning, content, calls)
        if self.opened_by_prompt and not prompt.rstrip().endswith("<think>"):
            return "<think>\n" + text
        return text

    @property
    def opened_by_prompt(self) -> bool:
        return self.name == "deepseek_r1"

    @property
    def folder(self) -> Path:
        return FIXTURES / self.name


FAMILIES: dict[str, FamilyCase] = {
    case.name: case
    for case in [
        FamilyCase("qwen3", _qwen3, reasoning=True, exact_history=False),
        FamilyCase("qwen3_coder", _qwen3_coder, reasoning=False, exact_history=True),
        FamilyCase("qwen25", _qwen25, reasoning=False, exact_history=True),
        FamilyCase("deepseek_v31", _deepseek_v31, reasoning=False, exact_history=False),
        # R1's template keeps two namespace flags for the whole conversation: it opens tool
        # outputs with <｜tool▁outputs▁begin｜> only for the first group (a chain opens
        # each), and renders a later turn's tool calls inside the first turn's call block,
        # which no model samples; so only each turn's new text is compared.
        FamilyCase(
            "deepseek_r1",
            _deepseek_r1,
            reasoning=True,
            exact_history=False,
            deviation="<｜tool▁outputs▁begin｜>",
            coherent_history=False,
        ),
        FamilyCase("llama31", _llama31, reasoning=False, exact_history=True, single_call=True),
        FamilyCase("glm45", _glm45, reasoning=True, exact_history=False),
        FamilyCase(
            "kimi_k2",
            _kimi_k2,
            reasoning=False,
            exact_history=True,
            call_id=lambda name, index: f"functions.{name}:{index}",
            model_call_ids=True,
        ),
        # History drops analysis once a final answer follows, writes the recipient in the
        # role where the model wrote it after the channel, and <|end|> where it sampled
        # <|return|>: only each turn's new text is compared with the template's.
        FamilyCase(
            "gpt_oss",
            _gpt_oss,
            reasoning=True,
            exact_history=False,
            single_call=True,
            coherent_history=False,
        ),
    ]
}


def family_model(name: str) -> Path:
    """The tiny model of family ``name``, written once and cached under .cache/ by a hash
    of its fixture folder and the generators."""
    folder = FIXTURES / name
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    for module in (families_module, tiny_model_module):
        digest.update(Path(module.__file__ or "").read_bytes())
    root = Path(os.environ.get("RELAY_TEST_CACHE", REPO / ".cache"))
    path = root / f"family-{name}-{digest.hexdigest()[:16]}"
    if not (path / "model.safetensors").is_file():
        write_family_model(path, folder, seed=0)
    return path


def tool_aware_deepseek_v31() -> str:
    """DeepSeek-V3.1's official template with a tools block of the tests' own wording added
    to its system prompt: a tool-aware template as an operator would give one with
    ``--chat-template`` (distinct from the proxy's listing, so a prompt shows which)."""
    official = (FIXTURES / "deepseek_v31" / "chat_template.jinja").read_text()
    block = (
        "{%- if tools %}{% set ns.system_prompt = ns.system_prompt + 'Tools you may call:' %}"
        "{%- for tool in tools %}{% set ns.system_prompt = ns.system_prompt + '\\n- ' + "
        "tool.function.name + ': ' + tool.function.description + ' ' + "
        "(tool.function.parameters | tojson) %}{%- endfor %}{%- endif %}"
    )
    assert official.count("{{ bos_token }}") == 1
    return official.replace("{{ bos_token }}", block + "{{ bos_token }}")
