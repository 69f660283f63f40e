"""gptj_flax: GPT-J on current JAX — Flax linen, logical-axis sharding, Orbax checkpoints."""

__version__ = "0.1.0"
