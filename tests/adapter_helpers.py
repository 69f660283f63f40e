"""LoRA adapters for the serving model of ``tests/test_serving_support.py``, made as users make them:
LoRA runs of this project (a checkpoint of adapters that records its base) and a HuggingFace PEFT
directory written by PEFT itself. Their weights are random and large enough to change the tokens."""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import numpy as np

from gptj_flax import checkpoint
from gptj_flax.checkpoint import Checkpointer
from gptj_flax.config import Config, LoraConfig, ModelConfig, TrainConfig
from gptj_flax.convert import lora as lora_lib
from gptj_flax.model import abstract_adapters
from tests.helpers import hf_gptj_config


def lora_run(directory: str, base: str, config: ModelConfig, lora: LoraConfig, seed: int) -> str:
    """A LoRA run's checkpoint of random adapters for the base at ``base`` (its identity recorded)."""
    shapes = nn.meta.unbox(abstract_adapters(config, lora))
    rng = np.random.default_rng(seed)
    adapters = jax.tree.map(lambda s: rng.normal(0, 0.3, s.shape).astype(np.float32), shapes)
    identity = lora_lib.identify_base(base)
    run = Config(model=config, train=TrainConfig(batch_size=2, lora=lora))
    saver = Checkpointer(directory)
    saver.save(1, params=adapters, config=run, meta={checkpoint.LORA_BASE_KEY: identity.to_json()})
    saver.close()
    return directory


def peft_adapter(directory: str, config: ModelConfig, seed: int, **settings) -> str:
    """A PEFT LoRA directory made by PEFT on a GPT-J of ``config``'s shape, its weights random."""
    from transformers import GPTJForCausalLM

    return save_peft_adapter(GPTJForCausalLM(hf_gptj_config(config)).float(), directory, seed, **settings)


def save_peft_adapter(model, directory, seed: int, **settings) -> str:
    """PEFT's own LoRA (``settings``: its ``LoraConfig``) over the HF GPT-J ``model``, its weights random
    and large enough to change the tokens, saved by PEFT to ``directory``."""
    import peft as hf_peft
    import torch

    adapted = hf_peft.get_peft_model(model, hf_peft.LoraConfig(**settings))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, weight in adapted.named_parameters():
            if "lora_" in name:
                weight.copy_(torch.randn_like(weight) * 0.3)
    adapted.save_pretrained(directory)
    assert os.path.isfile(os.path.join(directory, lora_lib.PEFT_CONFIG))
    return directory


def three_adapters(root: str, base: str, config: ModelConfig) -> dict[str, str]:
    """Three adapters of different ranks and projections: two LoRA runs and one PEFT directory."""
    return {
        "qv4": lora_run(os.path.join(root, "qv4"), base, config, LoraConfig(rank=4, alpha=8.0), seed=1),
        "mlp2": lora_run(
            os.path.join(root, "mlp2"),
            base,
            config,
            LoraConfig(rank=2, alpha=4.0, targets=("fc_in", "out_proj")),
            seed=2,
        ),
        "peft": peft_adapter(
            os.path.join(root, "peft"),
            config,
            seed=3,
            r=3,
            lora_alpha=6,
            target_modules=["k_proj", "fc_out"],
            rank_pattern={"fc_out": 2},
        ),
    }
