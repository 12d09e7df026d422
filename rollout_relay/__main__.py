"""``python -m rollout_relay``: the same as the ``rollout-relay`` command."""

import sys

from rollout_relay.cli import main

sys.exit(main())
