"""The command line: its refusal to run the proxy without credentials, its parsing, and
what it does to the process (the event loop, freezing what is alive)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from proxy.coalesce import CoalesceMode
from proxy.config import ProxyConfig
from rollout_relay.cli import _freeze_alive, _secured_config, build_parser, main
from tests.families import FIXTURES
from worker_client.tiny_model import SHIPPED_TINY_MODEL
from worker_client.tiny_moe import SHIPPED_TINY_MOE
from worker_client.tiny_vlm import SHIPPED_TINY_VLM


@pytest.fixture(autouse=True)
def _no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RELAY_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("RELAY_WORKER_TOKEN", raising=False)


def test_proxy_refuses_to_start_without_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    """No tokens and no --no-auth: no config, and the message names what is missing."""
    assert _secured_config(build_parser().parse_args(["proxy"])) is None
    err = capsys.readouterr().err
    assert "--admin-token" in err
    assert "--worker-token" in err
    assert "--no-auth" in err


def test_proxy_refuses_with_one_token_missing(capsys: pytest.CaptureFixture[str]) -> None:
    """Both tokens are needed; only the missing one is named."""
    args = build_parser().parse_args(["proxy", "--admin-token", "a"])
    assert _secured_config(args) is None
    err = capsys.readouterr().err
    assert "--worker-token" in err
    assert "--admin-token and" not in err


def test_tokens_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flags or RELAY_ADMIN_TOKEN / RELAY_WORKER_TOKEN reach the config."""
    monkeypatch.setenv("RELAY_ADMIN_TOKEN", "env-admin")
    monkeypatch.setenv("RELAY_WORKER_TOKEN", "env-worker")
    config = _secured_config(build_parser().parse_args(["proxy"]))
    assert config is not None
    assert (config.admin_token, config.worker_token) == ("env-admin", "env-worker")
    args = build_parser().parse_args(["proxy", "--admin-token", "a", "--worker-token", "w"])
    config = _secured_config(args)
    assert config is not None
    assert (config.admin_token, config.worker_token) == ("a", "w")


def test_no_auth_runs_open_and_says_so_loudly(capsys: pytest.CaptureFixture[str]) -> None:
    """--no-auth gives an open config, even with tokens in the environment, and a banner."""
    args = build_parser().parse_args(["proxy", "--no-auth", "--host", "0.0.0.0"])
    config = _secured_config(args)
    assert config is not None
    assert config.admin_token is None
    assert config.worker_token is None
    err = capsys.readouterr().err
    assert "AUTHENTICATION IS OFF" in err
    assert "all interfaces" in err


def test_limits_and_tls_flags_reach_the_config() -> None:
    """--max-messages, --max-session-tokens, --max-sessions, --tls-cert/--tls-key."""
    args = build_parser().parse_args(
        [
            "proxy",
            "--no-auth",
            "--max-messages",
            "7",
            "--max-session-tokens",
            "99",
            "--max-sessions",
            "3",
            "--tls-cert",
            "c.pem",
            "--tls-key",
            "k.pem",
        ]
    )
    config = _secured_config(args)
    assert config is not None
    assert (config.max_messages, config.max_session_tokens, config.max_sessions) == (7, 99, 3)
    assert (str(config.tls_cert), str(config.tls_key)) == ("c.pem", "k.pem")


def test_image_flags_reach_the_config() -> None:
    """--image-url-allow extends over repeats; the image limits reach the config; the
    defaults are the config's, the body limit (64 MiB) included."""
    args = build_parser().parse_args(
        [
            "proxy",
            "--no-auth",
            "--image-url-allow",
            "images.example.org",
            ".cdn.example.net",
            "--image-url-allow",
            "127.0.0.1",
            "--image-fetch-seconds",
            "2.5",
            "--max-image-bytes",
            "1000",
            "--max-image-pixels",
            "4096",
            "--max-images",
            "3",
        ]
    )
    config = _secured_config(args)
    assert config is not None
    assert config.image_url_allow == ("images.example.org", ".cdn.example.net", "127.0.0.1")
    assert config.image_fetch_seconds == 2.5
    assert (config.max_image_bytes, config.max_image_pixels, config.max_images) == (1000, 4096, 3)
    default = _secured_config(build_parser().parse_args(["proxy", "--no-auth"]))
    assert default is not None
    fields = ("image_url_allow", "image_fetch_seconds", "max_image_bytes", "max_image_pixels")
    for name in (*fields, "max_images", "max_body_bytes"):
        assert getattr(default, name) == getattr(ProxyConfig(), name), name
    assert default.max_body_bytes == 64 * 1024 * 1024


def test_event_loop_defaults_to_uvloop_and_runs_either() -> None:
    """uvloop by default; both loops run a coroutine to completion through the CLI helper."""
    from rollout_relay.cli import _run_loop

    assert build_parser().parse_args(["proxy"]).event_loop == "uvloop"
    assert build_parser().parse_args(["proxy", "--event-loop", "asyncio"]).event_loop == "asyncio"
    seen: list[str] = []

    async def record() -> None:
        import asyncio

        seen.append(type(asyncio.get_running_loop()).__module__.split(".")[0])

    _run_loop(record(), "uvloop")
    _run_loop(record(), "asyncio")
    assert seen == ["uvloop", "asyncio"]


def test_tiny_model_for_a_family_and_a_bad_family_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tiny-model --family FOLDER`` writes a model on that family's tokenizer and
    template; a folder that is not a family is refused with exit 2 and the reason."""
    out = tmp_path / "kimi"
    assert main(["tiny-model", str(out), "--family", str(FIXTURES / "kimi_k2")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.chat_template == (FIXTURES / "kimi_k2" / "chat_template.jinja").read_text()
    assert tokenizer.convert_tokens_to_ids("<|tool_call_begin|>") is not None
    assert main(["tiny-model", str(tmp_path / "x"), "--family", str(tmp_path)]) == 2
    assert "no readable family.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "shipped"),
    [(None, SHIPPED_TINY_MODEL), ("--moe", SHIPPED_TINY_MOE), ("--vlm", SHIPPED_TINY_VLM)],
)
def test_tiny_model_shipped_copies_the_shipped_model(
    tmp_path: Path, flag: str | None, shipped: Path
) -> None:
    """``tiny-model --shipped`` (the dev overlay's init container) copies the shipped model
    byte for byte, in seconds, instead of training one."""
    out = tmp_path / "models" / "current"
    assert main(["tiny-model", "--shipped", *([flag] if flag else []), str(out)]) == 0
    files = sorted(f.name for f in shipped.iterdir() if f.is_file())
    assert sorted(f.name for f in out.iterdir()) == files
    for name in files:
        assert (out / name).read_bytes() == (shipped / name).read_bytes(), name


@pytest.mark.parametrize(
    "extra", [["--seed", "3"], ["--no-imprint"], ["--head-dim", "32"], ["--moe", "--vlm"]]
)
def test_tiny_model_shipped_refuses_what_would_change_it(
    tmp_path: Path, extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A flag that asks for other weights than the shipped ones is refused, naming it, and
    so is an output folder that holds something; nothing is written."""
    out = tmp_path / "out"
    assert main(["tiny-model", "--shipped", *extra, str(out)]) == 2
    assert extra[0] in capsys.readouterr().err
    assert not out.exists()
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert main(["tiny-model", "--shipped", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert [f.name for f in out.iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("value", ["0", "-3", "four"])
def test_a_stream_interval_below_one_is_refused(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--stream-interval takes a whole number of tokens, at least 1, or stops with why."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["proxy", "--stream-interval", value])
    assert exited.value.code == 2
    assert "--stream-interval" in capsys.readouterr().err


def test_the_stream_interval_reaches_the_config() -> None:
    args = build_parser().parse_args(
        ["proxy", "--admin-token", "a", "--worker-token", "w", "--stream-interval", "8"]
    )
    config = _secured_config(args)
    assert config is not None
    assert config.stream_interval == 8
    assert build_parser().parse_args(["proxy"]).stream_interval == 1


def test_stream_coalescing_reaches_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    """--stream-coalesce is adaptive unless set to off; another value stops with why."""
    secured = ["proxy", "--admin-token", "a", "--worker-token", "w"]
    config = _secured_config(build_parser().parse_args([*secured, "--stream-coalesce", "off"]))
    assert config is not None
    assert config.stream_coalesce is CoalesceMode.OFF
    default = _secured_config(build_parser().parse_args(secured))
    assert default is not None
    assert default.stream_coalesce is CoalesceMode.ADAPTIVE
    with pytest.raises(SystemExit):
        build_parser().parse_args(["proxy", "--stream-coalesce", "sometimes"])
    assert "--stream-coalesce" in capsys.readouterr().err


def test_a_worker_chat_template_that_is_not_a_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``worker --chat-template FILE`` parses to a path; a file that does not exist stops
    the worker before it starts, with exit 2 and the reason."""
    args = build_parser().parse_args(
        ["worker", "--proxy", "ws://x/", "--model", "m", "--chat-template", "t.jinja"]
    )
    assert args.chat_template == Path("t.jinja")
    missing = tmp_path / "missing.jinja"
    argv = ["worker", "--proxy", "ws://127.0.0.1:9/", "--model", str(tmp_path)]
    assert main([*argv, "--chat-template", str(missing)]) == 2
    assert f"--chat-template {missing}: no such file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("backend", "api", "refused"),
    [
        ("hf", "vllm", "the hf backend reports any MoE it loads"),
        ("vllm", "sglang", "--routed-experts vllm"),
        ("instant", "vllm", "--backend instant reports no routing"),
    ],
)
def test_routed_experts_is_off_by_default_and_refused_where_it_does_not_apply(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str, api: str, refused: str
) -> None:
    """``worker --routed-experts {vllm,sglang}`` asks the vllm and openai engines for
    routing; it is off unless given, and a backend it does not apply to stops the worker
    before it starts."""
    base = ["worker", "--proxy", "ws://127.0.0.1:9/", "--model", str(tmp_path)]
    assert build_parser().parse_args(base).routed_experts is None
    assert build_parser().parse_args([*base, "--routed-experts", "sglang"]).routed_experts == (
        "sglang"
    )
    assert main([*base, "--backend", backend, "--routed-experts", api]) == 2
    assert refused in capsys.readouterr().err


def test_the_tiny_model_is_the_shipped_one_unless_a_model_is_given(tmp_path: Path) -> None:
    """`demo`, `up` and the benchmarks serve the shipped tiny model at once (no training on a
    first run); --model wins over it."""
    from rollout_relay.cli import ensure_tiny_model
    from worker_client.tiny_model import SHIPPED_TINY_MODEL

    said: list[str] = []
    assert ensure_tiny_model(None, said.append) == SHIPPED_TINY_MODEL
    assert (SHIPPED_TINY_MODEL / "model.safetensors").is_file()
    assert ensure_tiny_model(tmp_path, said.append) == tmp_path
    assert said == []


def test_without_the_shipped_model_one_is_written_once_with_progress(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An installation without the shipped files writes the tiny model under the user's
    cache on the first run, saying so and how far its training is, and reuses it after."""
    import rollout_relay.cli as cli
    import worker_client.tiny_model as tiny_model

    monkeypatch.setattr(tiny_model, "SHIPPED_TINY_MODEL", tmp_path / "missing")
    monkeypatch.setattr(tiny_model, "IMPRINT_STEPS", 10)
    monkeypatch.setattr(cli, "DEFAULT_TINY_MODEL", tmp_path / "home-cache")
    said: list[str] = []
    assert cli.ensure_tiny_model(None, said.append) == tmp_path / "home-cache"
    assert (tmp_path / "home-cache" / "model.safetensors").is_file()
    assert said[0].startswith("writing the tiny model to")
    assert said[-1] == "  training its weights on synthetic chats: 100%"
    said.clear()
    assert cli.ensure_tiny_model(None, said.append) == tmp_path / "home-cache"
    assert said == []


def test_freezing_moves_what_is_alive_out_of_later_collections() -> None:
    before = gc.get_freeze_count()
    kept = [[i] for i in range(1000)]  # tracked containers alive now
    try:
        _freeze_alive()
        assert gc.get_freeze_count() >= before + len(kept)
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("backend", ["openai", "instant"])
def test_teacher_is_off_by_default_and_refused_by_a_backend_that_cannot_score(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    """``worker --teacher`` marks the model a teacher; a backend whose engine cannot score
    stops the worker before it starts, naming the backends that can."""
    base = ["worker", "--proxy", "ws://127.0.0.1:9/", "--model", str(tmp_path)]
    assert build_parser().parse_args(base).teacher is False
    assert build_parser().parse_args([*base, "--teacher"]).teacher is True
    assert main([*base, "--backend", backend, "--teacher"]) == 2
    assert f"--teacher needs a backend that scores (hf, vllm), not {backend}" in (
        capsys.readouterr().err
    )
