"""The ``rollout-relay`` command line and the glue that runs several parts together.

This is the one package that wires the others: the service (``proxy``), the worker client
(``worker_client``), the trainer-side SDK (``sdk``) and the Kubernetes command (``deploy``).
``cli`` is the entry point; ``embedded`` runs the proxy and an in-process worker in one
event loop (``up``, ``demo``, ``train`` and the tests); ``demo`` and ``train`` are the
commands of the same names."""
