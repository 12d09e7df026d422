"""Task servers: where an agent run for one trial is executed.

``base.py`` is the one protocol every task server speaks (submit → handle; wait → result;
cancel). Implementations: the run-submission API (``runs_api``), a Harbor launcher
(``harbor``) and the embedded one-machine server (``server``, ``rollout-relay
task-server``), which speaks the run-submission API.
"""
