"""Weight conversion: HuggingFace GPT-J and legacy mesh-transformer-jax checkpoints."""

from gptj_flax.convert.hf_names import hf_from_params, hf_names, hf_to_ours, ours_to_hf, params_from_hf

__all__ = ["hf_from_params", "hf_names", "hf_to_ours", "ours_to_hf", "params_from_hf"]
