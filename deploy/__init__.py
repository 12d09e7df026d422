"""``rollout-relay deploy``: the manifests under ``deploy/`` rendered (``render``) and applied
to a cluster with the official Kubernetes client (``kube``); ``command`` is the CLI glue."""
