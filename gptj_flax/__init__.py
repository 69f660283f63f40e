"""gptj_flax: GPT-J on current JAX — Flax linen, logical-axis sharding, Orbax checkpoints.

``gptj_flax.load(path)`` loads an Orbax checkpoint or a HuggingFace GPT-J directory for sampling,
scoring and serving: it is :func:`gptj_flax.sampling.load`.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "load"]


def __getattr__(name: str):
    # The one lazy import of a project module: `load` lives at the top of the package graph, and
    # importing it here eagerly would make `import gptj_flax.config` load JAX's whole sampling stack.
    if name == "load":
        from gptj_flax.sampling.loading import load

        return load
    raise AttributeError(f"module 'gptj_flax' has no attribute {name!r}")
