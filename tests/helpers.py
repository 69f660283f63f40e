"""Shared test helpers: tiny configs and HuggingFace reference models with the same weights."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from benchmarks.common import hf_gptj_config
from gptj_flax.config import ModelConfig
from gptj_flax.convert.hf_names import params_from_hf
from gptj_flax.losses import loss_sums

# A few kinds of short text, repeated: enough for a small local BPE tokenizer and prompts.
CORPUS = [
    "def add(a, b):\n    return a + b\n\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. ",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
] * 20


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        n_layers=2,
        d_model=64,
        n_heads=4,
        rotary_dim=8,
        vocab_size=128,
        max_len=64,
        dtype="float32",
        param_dtype="float32",
    )
    base.update(overrides)
    return ModelConfig(**base)


def hf_model(config: ModelConfig, seed: int = 0):
    """A random HuggingFace GPTJForCausalLM (float32, eval mode) of ``config``'s shape.

    Every tensor, LayerNorms and biases included, is drawn at random so a mis-mapped tensor shows.
    """
    import torch
    from transformers import GPTJForCausalLM

    torch.manual_seed(seed)
    model = GPTJForCausalLM(hf_gptj_config(config)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.2 if p.ndim > 1 else 0.5
            p.copy_(
                torch.randn_like(p) * scale
                + (1.0 if name.endswith("ln_1.weight") or name.endswith("ln_f.weight") else 0.0)
            )
    return model


def hf_state_numpy(model) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def params_matching(model, config: ModelConfig) -> dict:
    """Our params tree holding exactly ``model``'s weights."""
    return {"params": params_from_hf(hf_state_numpy(model), config)}


def with_(config: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(config, **changes)


def mean_loss(logits, targets, weights=None, z_loss: float = 0.0):
    """Token-weighted mean of :func:`gptj_flax.losses.loss_sums`'s objective, and the total weight."""
    weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights
    objective, _, total = loss_sums(logits, targets, weights, z_loss)
    return objective / jnp.maximum(total, 1.0), total
