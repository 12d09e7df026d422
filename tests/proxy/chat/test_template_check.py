"""The template check run when a worker brings a model."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from proxy.chat.renderer import ChatRenderer
from proxy.chat.template_check import SHAPES, check_template, summary_line
from proxy.models import ModelRegistry
from relay import protocol
from tests.families import FAMILIES, family_model
from worker_client.client import collect_tokenizer_files


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_continues_every_shape_its_template_accepts(name: str) -> None:
    """Each real template continues every shape; Llama 3's refuses parallel calls, which
    the check reports as unsupported, with the template's own words."""
    results = check_template(ChatRenderer.from_directory(family_model(name)))
    assert [r.shape for r in results] == [s.name for s in SHAPES]
    outcome = {r.shape: r.result for r in results}
    if name == "llama31":
        assert outcome.pop("parallel_tool_calls") == "unsupported"
        (refused,) = [r for r in results if r.result == "unsupported"]
        assert refused.reason is not None
        assert "single tool-calls" in refused.reason
    assert set(outcome.values()) == {"continued"}


def test_a_template_that_rewrites_closes_is_reported_as_full_render(
    tiny_model_dir: Path,
) -> None:
    """A template that writes an earlier assistant turn's close differently from the last
    one's: every shape falls back to a full rendering, and the reason says why."""
    renderer = ChatRenderer.from_directory(tiny_model_dir)
    renderer.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% if loop.last %}[last]{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    results = check_template(renderer)
    assert {r.result for r in results} == {"full_render"}
    assert all(r.reason and "rewrote the close" in r.reason for r in results)
    line = summary_line(results)
    assert line.startswith("tool_call full_render (the template rewrote the close")
    assert line.count(";") == len(SHAPES) - 1


async def test_admitting_a_model_logs_and_keeps_its_check(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's model is checked when it is admitted: the result stays with the served
    model and one log line tells the operator."""
    registry = ModelRegistry(tmp_path)
    info = protocol.ModelInfo("tiny", 2048, "raw", "hf", collect_tokenizer_files(tiny_model_dir))
    with caplog.at_level(logging.INFO, logger="proxy.models"):
        await registry.admit(protocol.Hello(protocol.PROTOCOL_VERSION, "w", "t", [info]))
    served = registry.models["tiny"]
    assert [r.result for r in served.template_check] == ["continued"] * len(SHAPES)
    assert served.tools_check is not None
    assert served.tools_check.result == "rendered"
    (line,) = [r.getMessage() for r in caplog.records if "template check" in r.getMessage()]
    assert line.startswith(
        "model tiny (tool calls: hermes): template check: tools rendered; tool_call continued"
    )


async def test_admitting_a_model_whose_template_drops_tools_says_what_happens_to_them(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """DeepSeek-V3.1's template drops tools: its log line says they are listed in the
    system prompt. A template that drops them in a format with no listing (given as the
    worker's ``--chat-template``) is logged as a warning: its requests with tools are
    refused."""
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    registry = ModelRegistry(tmp_path / "cache")
    infos = [
        protocol.ModelInfo(
            "ds", 2048, "raw", "hf", collect_tokenizer_files(family_model("deepseek_v31"))
        ),
        protocol.ModelInfo(
            "plain", 2048, "raw", "hf", collect_tokenizer_files(tiny_model_dir, plain)
        ),
    ]
    with caplog.at_level(logging.INFO, logger="proxy.models"):
        await registry.admit(protocol.Hello(protocol.PROTOCOL_VERSION, "w", "t", infos))
    lines = {r.getMessage().split()[1]: r for r in caplog.records if "template check" in r.msg}
    assert "template check: tools listed (the template ignores tools" in lines["ds"].getMessage()
    assert lines["ds"].levelno == logging.INFO
    assert "template check: tools refused" in lines["plain"].getMessage()
    assert lines["plain"].levelno == logging.WARNING
    checks = {name: served.tools_check for name, served in registry.models.items()}
    assert {name: c.result if c else None for name, c in checks.items()} == {
        "ds": "listed",
        "plain": "refused",
    }
