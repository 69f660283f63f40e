"""gptj_flax: GPT-J on current JAX — Flax linen, logical-axis sharding, Orbax checkpoints.

``gptj_flax.load(path)`` loads a checkpoint for sampling (see :mod:`gptj_flax.sampling`); it is
imported on first use so that ``import gptj_flax.config`` stays light.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "load":
        from gptj_flax.sampling import load

        return load
    raise AttributeError(f"module 'gptj_flax' has no attribute {name!r}")
