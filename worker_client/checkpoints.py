"""Checkpoints written the way a trainer writes them after an optimizer step.

``perturbed_checkpoint`` moves every parameter of a model by seeded noise and saves the
result with ``save_pretrained`` (config and safetensors, no tokenizer): a new policy
version of a known, reproducible model, for the weight-update tests, the GPU check and
demos. A checkpoint is loaded by a worker through ``POST /weights``.
"""

from __future__ import annotations

from pathlib import Path


def perturbed_checkpoint(base: Path, out: Path, *, seed: int, scale: float = 0.2) -> Path:
    """Write ``base`` with each parameter moved by Gaussian noise of ``scale`` times the
    parameter's own standard deviation (seeded) to ``out``; returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            spread = parameter.std() if parameter.numel() > 1 else torch.tensor(1.0)
            parameter.add_(noise * scale * spread)
    model.save_pretrained(str(out))
    return out
