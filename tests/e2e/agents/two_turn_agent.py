"""A minimal agent for task-server tests: two chat turns through the official ``openai``
client at the trial's endpoint (OPENAI_BASE_URL / OPENAI_API_KEY, as a task server sets
them), then it writes the model's last answer into the workspace."""

from __future__ import annotations

import os
from pathlib import Path

from openai import OpenAI


def main() -> None:
    client = OpenAI(max_retries=0, timeout=120.0)  # reads OPENAI_BASE_URL and OPENAI_API_KEY
    model = os.environ["TASK_MODEL"]
    messages = [
        {"role": "system", "content": "You solve small tasks."},
        {"role": "user", "content": os.environ["TASK_INSTRUCTION"]},
    ]
    answer = ""
    for step in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, seed=step)
        answer = reply.choices[0].message.content or ""
        print(f"turn {step}: {len(answer)} characters, finish {reply.choices[0].finish_reason}")
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": "Check your answer once more."})
    Path("answer.txt").write_text(answer or "(empty)")


if __name__ == "__main__":
    main()
