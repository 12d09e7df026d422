"""Errors of ``rollout-relay deploy``. None reaches the wire: the command prints the message
and exits with status 2.

::

    DeployError     bad manifests or options, no usable cluster configuration, or the
                    cluster refused a change
"""

from __future__ import annotations

__all__ = ["DeployError"]


class DeployError(Exception):
    """``rollout-relay deploy`` cannot go on: manifests or options it cannot render, no
    reachable cluster, or the cluster refused a change. ``message`` says which."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
