"""An agent that sees, end to end on CPU: two Chat Completions turns with a screenshot each,
through the proxy and an ``hf`` worker on the shipped tiny vision-language model, and what
the trainer gets for them.

    .venv/bin/python examples/image_turn.py

It prints where each image sits in the recorded ids, and checks what a trainer would: the
samples' images fetched from the proxy, turned into the model's forward inputs, re-score
every sampled token within 1e-4 (exit status 1 if not).
"""

from __future__ import annotations

import asyncio
import base64
import io
import sys
import tempfile
from pathlib import Path

from openai import AsyncOpenAI

from proxy.config import ProxyConfig
from rollout_relay.embedded import start_hf_worker, start_proxy
from sdk.client import ProxyClient
from sdk.fidelity import check_samples
from sdk.images import VisionScorer
from sdk.samples import build_samples
from worker_client.backends.hf import HFEngine
from worker_client.tiny_vlm import SHIPPED_TINY_VLM


def screenshot(shade: int) -> str:
    """A 1280x800 'screenshot' as a data URL (the tiny VLM gives it 60 image tokens)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (1280, 800), (shade, 240, 250 - shade))
    draw = ImageDraw.Draw(image)
    for row in range(0, 800, 40):
        draw.text((20, row), f"line {row // 40}: build passed in {shade} s", fill=(0, 0, 0))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def user(text: str, image_url: str) -> dict[str, object]:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": image_url}},
        ],
    }


async def main() -> int:
    with tempfile.TemporaryDirectory() as cache:
        running = await start_proxy(ProxyConfig(port=0, max_tokens=12, cache_dir=Path(cache)))
        try:
            start_hf_worker(running, SHIPPED_TINY_VLM, worker_id="example-vlm")
            await running.wait_for_workers()
            async with ProxyClient(running.url) as proxy:
                trial = await proxy.create_session(sampling={"temperature": 1.0, "top_p": 1.0})
                async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key) as agent:
                    history: list[dict[str, object]] = [
                        user("What does the screen say?", screenshot(10))
                    ]
                    first = await agent.chat.completions.create(
                        model="tiny-vlm",
                        messages=history,  # type: ignore[arg-type]
                    )
                    history += [
                        {"role": "assistant", "content": first.choices[0].message.content},
                        user("And now?", screenshot(90)),
                    ]
                    await agent.chat.completions.create(model="tiny-vlm", messages=history)  # type: ignore[arg-type]
                export = await proxy.trajectories(trial.trial_id)
                (trajectory,) = export["trajectories"]
                print(f"trial {trial.trial_id}: {len(trajectory['turns'])} turns, one chain")
                for image in trajectory["multi_modal_data"]["images"]:
                    start, end = image["span"]
                    print(
                        f"  image {image['sha256'][:12]} {image['width']}x{image['height']} "
                        f"{image['mime']}: ids [{start}, {end}) ({end - start} image tokens)"
                    )
                samples = build_samples(export)
                await proxy.fill_images(trial.trial_id, samples)
                engine = HFEngine.load(SHIPPED_TINY_VLM)
                scorer = VisionScorer(engine.model, engine.image_processor)
                report = check_samples(samples, scorer.score)
                await engine.close()
                verdict = "PASS" if report.ok() else "FAIL"
                print(
                    f"fidelity {verdict}: {report.sampled_tokens} sampled tokens re-scored with "
                    f"the {report.images} recorded images, within {report.max_abs_error:.1e}"
                )
                return 0 if report.ok() else 1
        finally:
            await running.stop()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
