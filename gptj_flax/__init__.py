"""gptj_flax: GPT-J on current JAX — Flax linen, logical-axis sharding, Orbax checkpoints.

``gptj_flax.load(path)`` loads an Orbax checkpoint or a HuggingFace GPT-J directory for sampling,
scoring and serving (see :mod:`gptj_flax.sampling`). Everything is imported on first use so that
``import gptj_flax.config`` stays light.
"""

import os

__version__ = "0.1.0"


def load(path: str | os.PathLike, mesh=None, dtype=None, **kwargs):
    """A :class:`~gptj_flax.sampling.LanguageModel` from ``path``, ready to generate, stream and score.

    ``path`` is an Orbax checkpoint (a run directory — its latest step — or one step's directory),
    or a HuggingFace GPT-J directory (``hf:DIR``, or any directory with ``config.json`` and
    safetensors / ``pytorch_model.bin`` weights), converted in memory as it loads. ``mesh``: a
    ``Mesh``, a layout name, ``"data,fsdp,model"`` sizes or a 3-tuple (default one device);
    ``dtype`` overrides the parameter and compute dtype. Orbax checkpoints also take ``step=``;
    both take ``tokenizer=`` (an object or a directory) to override the one that comes with them.
    """
    from gptj_flax.convert.hf_load import is_hf_source, load_hf

    if is_hf_source(path):
        return load_hf(path, mesh, dtype, **kwargs)
    from gptj_flax.sampling import load as load_checkpoint

    return load_checkpoint(path, mesh, dtype, **kwargs)
