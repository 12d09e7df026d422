"""A small real agent: the official openai client against the trial's base URL.

It reads the task's instruction, asks the model twice (the second request extends the
first conversation, as an agent loop does), writes the last reply to ``answer.txt`` in ``$TASK_WORKSPACE`` (or ``$RUN_DIR``)
and exits 0. Knobs (environment): ``AGENT_FAIL_ONCE=<marker file>`` makes the first run
that finds no marker create it and exit 1 after one model call; ``AGENT_HANG=1`` makes it
wait forever after one call.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from openai import OpenAI


def main() -> int:
    client = OpenAI(
        base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0
    )
    model = os.environ.get("OPENAI_MODEL", "policy")
    # the embedded task server's variables, or the SDK tests' own task server's
    instruction_file = os.environ.get("TASK_INSTRUCTION_FILE") or str(
        Path(os.environ["TASK_DIR"]) / "instruction.md"
    )
    instruction = Path(instruction_file).read_text()
    messages: list[dict[str, str]] = [{"role": "user", "content": instruction}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=12)  # type: ignore[arg-type]
    reply = first.choices[0].message.content or ""
    marker = os.environ.get("AGENT_FAIL_ONCE")
    if marker and not Path(marker).exists():
        Path(marker).write_text("failed once")
        print("agent: failing on purpose", file=sys.stderr)
        return 1
    if os.environ.get("AGENT_HANG"):
        while True:
            time.sleep(1)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=12)  # type: ignore[arg-type]
    out = Path(os.environ.get("TASK_WORKSPACE") or os.environ["RUN_DIR"], "answer.txt")
    out.write_text(second.choices[0].message.content or "-")
    return 0


if __name__ == "__main__":
    sys.exit(main())
