"""Benchmarks of rollout-relay's own overhead: ``python -m bench`` (see ``bench/RESULTS.md``).

Nothing here is imported by the proxy, the relay or the worker."""
