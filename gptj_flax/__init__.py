"""gptj_flax: GPT-J on current JAX — Flax linen, logical-axis sharding, Orbax checkpoints.

``gptj_flax.load(path)`` loads an Orbax checkpoint or a HuggingFace GPT-J directory for sampling,
scoring and serving: it is :func:`gptj_flax.sampling.load`.
"""

# Imported eagerly: every submodule already imports JAX, so this adds ~0.2 s to any import of the
# package, and it keeps `gptj_flax.load` an ordinary attribute that tools and readers can find.
from gptj_flax.sampling.loading import load

__version__ = "0.1.0"

__all__ = ["__version__", "load"]
