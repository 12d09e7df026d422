"""`rollout-relay deploy render` and the deploy arguments."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from deploy.render import DeployOptions, default_manifest_dir, render
from rollout_relay.cli import main


def test_render_prints_what_apply_would_send(capsys: pytest.CaptureFixture[str]) -> None:
    """render prints the overlay with the options applied, as multi-document YAML."""
    assert (
        main(["deploy", "render", "--overlay", "dev", "--namespace", "rl", "--workers", "2"]) == 0
    )
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    expected = render(
        default_manifest_dir() / "overlays" / "dev", DeployOptions(namespace="rl", workers=2)
    )
    assert printed == expected
    assert not any(obj["kind"] == "Secret" for obj in printed)


def test_overlay_by_path_and_manifests_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--overlay takes a directory; --manifests a deploy/ tree elsewhere."""
    shutil.copytree(default_manifest_dir(), tmp_path / "deploy")
    assert main(["deploy", "render", "--overlay", str(tmp_path / "deploy" / "base")]) == 0
    by_path = capsys.readouterr().out
    assert (
        main(["deploy", "render", "--manifests", str(tmp_path / "deploy"), "--overlay", "base"])
        == 0
    )
    assert capsys.readouterr().out == by_path


def test_unknown_overlay_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A name that is neither an overlay nor a directory: exit 2, saying where it looked."""
    assert main(["deploy", "render", "--overlay", "staging"]) == 2
    err = capsys.readouterr().err
    assert "no overlay 'staging'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("flag", "value", "complaint"),
    [
        ("--proxy-memory", "lots", "not a Kubernetes quantity"),
        ("--storage", "10GB!", "not a Kubernetes quantity"),
        ("--workers", "-1", "not a count"),
        ("--worker-gpus", "two", "not a count"),
        ("--replicas", "0", "at least one replica"),
    ],
)
def test_bad_option_values_are_refused(
    flag: str, value: str, complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Quantities and counts are checked before anything is rendered."""
    with pytest.raises(SystemExit) as exit_info:
        main(["deploy", "render", flag, value])
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


def test_render_scales_the_proxy(capsys: pytest.CaptureFixture[str]) -> None:
    """--replicas sets the StatefulSet and the peer list together."""
    assert main(["deploy", "render", "--replicas", "2"]) == 0
    out = capsys.readouterr().out
    assert "replicas: 2" in out
    assert "rollout-relay-proxy-1.rollout-relay-proxy." in out
