"""Weight conversion: HuggingFace GPT-J and legacy mesh-transformer-jax checkpoints, streamed tensor by tensor.

``from_hf`` / ``to_hf`` / ``from_legacy`` / ``slim`` / ``quantize`` (int8) write complete outputs atomically;
``open_weights`` resolves any source and ``place_weights`` puts it on a mesh, for ``gptj_flax.load`` and for
``load_init_params`` (a training run's ``--init-from``); ``load_init_opt_state`` (built on
``load_legacy_opt_state`` and ``insert_adam_moments``) carries its optimiser state into an optax one.
"""

from gptj_flax.convert.common import ConversionError
from gptj_flax.convert.hf import HF_PREFIX, HFCheckpoint, from_hf, is_hf_source, to_hf
from gptj_flax.convert.hf_names import hf_from_params, hf_names, hf_to_ours, ours_to_hf, params_from_hf
from gptj_flax.convert.init_from import insert_adam_moments, load_init_opt_state, load_init_params
from gptj_flax.convert.layout import check_mesh, param_targets
from gptj_flax.convert.legacy import (
    LegacyAdamState,
    LegacyCheckpoint,
    config_for_legacy,
    from_legacy,
    load_legacy_opt_state,
)
from gptj_flax.convert.orbax_io import load_params
from gptj_flax.convert.quantize import quantize
from gptj_flax.convert.slim import slim
from gptj_flax.convert.weights import Placed, WeightSource, open_weights, parse_init_spec, place_weights

__all__ = [
    "ConversionError",
    "HFCheckpoint",
    "HF_PREFIX",
    "is_hf_source",
    "LegacyAdamState",
    "LegacyCheckpoint",
    "check_mesh",
    "config_for_legacy",
    "from_hf",
    "from_legacy",
    "hf_from_params",
    "hf_names",
    "hf_to_ours",
    "insert_adam_moments",
    "load_init_opt_state",
    "load_init_params",
    "load_legacy_opt_state",
    "load_params",
    "open_weights",
    "ours_to_hf",
    "param_targets",
    "Placed",
    "place_weights",
    "params_from_hf",
    "parse_init_spec",
    "quantize",
    "slim",
    "to_hf",
    "WeightSource",
]
