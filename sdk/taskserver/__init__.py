"""Task servers: where an agent run for one trial is executed.

``base.py`` is the one protocol every task server speaks (submit → handle; wait → result;
cancel). Implementations:

- ``runs_api.RunsApiTaskServer``: the run-submission API (``POST /api/v1/runs``, multipart
  with the task as a tar.gz), for existing deployments and for the embedded server;
- ``harbor.HarborLauncherTaskServer``: a real Harbor (0.24.0) through the launcher in
  ``harbor view``;
- ``inprocess.InProcessTaskServer``: the agent is an async Python callable in the
  trainer's own process (``sdk.train``'s tool agent);
- ``server``: the embedded one-machine server (``rollout-relay task-server``), which
  speaks the run-submission API and runs Harbor-format tasks (``tasks``) as local
  processes (``local``).
"""
