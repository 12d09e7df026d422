"""A local Ray cluster on CPU for the tests that start worker actors (one per session)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import TIMEOUT_FACTOR
from worker_client.ray_actors import WorkerActorGroup


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2,
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    yield ray
    if started:
        ray.shutdown()


async def start_tiny_group(worker_url: str, model_dir: Path) -> WorkerActorGroup:
    """One CPU worker actor (hf on the tiny model, served as ``tiny``) dialing ``worker_url``."""
    return await WorkerActorGroup.start(
        worker_url,
        backend="hf",
        model=str(model_dir),
        num_workers=1,
        gpus_per_worker=0,
        cpus_per_worker=1,
        engine_options={"name": "tiny"},
        within_seconds=180 * TIMEOUT_FACTOR,
    )
