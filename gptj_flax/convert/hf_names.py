"""The mapping between HuggingFace ``GPTJForCausalLM`` tensor names and gptj_flax parameters.

One function per direction and per tensor, so converters can stream tensor by tensor.
Paths here are in the *unrolled* layout (``layer_{i}``); ``model.stack_layers`` turns a whole tree
into the scanned layout. torch Linear weights are (out, in); ours are (in, …, out), with attention
kernels kept 3-D: q/k/v (d_model, heads, head_dim), out (heads, head_dim, d_model).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import numpy as np

from gptj_flax.config import ModelConfig
from gptj_flax.model import stack_layers, unstack_layers

# HF buffers that carry no parameters (causal-mask caches in older transformers versions).
IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias")

_TOP = {
    "transformer.wte.weight": (("wte",), "copy"),
    "transformer.ln_f.weight": (("ln_f", "scale"), "copy"),
    "transformer.ln_f.bias": (("ln_f", "bias"), "copy"),
    "lm_head.weight": (("lm_head", "kernel"), "linear"),
    "lm_head.bias": (("lm_head", "bias"), "copy"),
}
_PER_LAYER = {
    "ln_1.weight": (("ln_1", "scale"), "copy"),
    "ln_1.bias": (("ln_1", "bias"), "copy"),
    "attn.q_proj.weight": (("attn", "q_proj"), "qkv"),
    "attn.k_proj.weight": (("attn", "k_proj"), "qkv"),
    "attn.v_proj.weight": (("attn", "v_proj"), "qkv"),
    "attn.out_proj.weight": (("attn", "out_proj"), "out"),
    "mlp.fc_in.weight": (("mlp", "fc_in", "kernel"), "linear"),
    "mlp.fc_in.bias": (("mlp", "fc_in", "bias"), "copy"),
    "mlp.fc_out.weight": (("mlp", "fc_out", "kernel"), "linear"),
    "mlp.fc_out.bias": (("mlp", "fc_out", "bias"), "copy"),
}
_LAYER = re.compile(r"^transformer\.h\.(\d+)\.(.+)$")


def hf_names(config: ModelConfig) -> list[str]:
    """Every parameter name a GPTJForCausalLM state dict holds for ``config``, in model order."""
    layers = [f"transformer.h.{i}.{rest}" for i in range(config.n_layers) for rest in _PER_LAYER]
    return ["transformer.wte.weight", *layers, *[n for n in _TOP if n != "transformer.wte.weight"]]


def param_path(name: str) -> tuple[tuple[str, ...], str]:
    """HF name → (path in our unrolled tree, how the tensor is laid out)."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER.match(name)
    if not m or m.group(2) not in _PER_LAYER:
        raise KeyError(f"not a GPT-J parameter name: {name!r}")
    path, kind = _PER_LAYER[m.group(2)]
    return (f"layer_{m.group(1)}", *path), kind


def hf_name(path: tuple[str, ...]) -> str:
    """Path in our unrolled tree → HF name (inverse of :func:`param_path`)."""
    for name, (ours, _) in _TOP.items():
        if ours == tuple(path):
            return name
    m = re.match(r"^layer_(\d+)$", path[0])
    if m:
        for rest, (ours, _) in _PER_LAYER.items():
            if ours == tuple(path[1:]):
                return f"transformer.h.{m.group(1)}.{rest}"
    raise KeyError(f"not a GPT-J parameter path: {'/'.join(path)!r}")


def hf_shape(name: str, config: ModelConfig) -> tuple[int, ...]:
    """The shape HF gives tensor ``name`` (torch Linear weights are (out, in))."""
    d, f, v = config.d_model, config.ff_dim, config.vocab_size
    suffix = name.split(".", 3)[-1] if name.startswith("transformer.h.") else name
    shapes = {
        "transformer.wte.weight": (v, d),
        "transformer.ln_f.weight": (d,),
        "transformer.ln_f.bias": (d,),
        "lm_head.weight": (v, d),
        "lm_head.bias": (v,),
        "ln_1.weight": (d,),
        "ln_1.bias": (d,),
        "attn.q_proj.weight": (d, d),
        "attn.k_proj.weight": (d, d),
        "attn.v_proj.weight": (d, d),
        "attn.out_proj.weight": (d, d),
        "mlp.fc_in.weight": (f, d),
        "mlp.fc_in.bias": (f,),
        "mlp.fc_out.weight": (d, f),
        "mlp.fc_out.bias": (d,),
    }
    param_path(name)  # rejects names that are not GPT-J parameters
    return shapes[suffix]


def hf_to_ours(name: str, tensor: np.ndarray, config: ModelConfig) -> tuple[tuple[str, ...], np.ndarray]:
    """One HF tensor → (path in our unrolled params tree, array)."""
    path, kind = param_path(name)
    d, h, k = config.d_model, config.n_heads, config.head_dim
    if kind == "qkv":
        tensor = tensor.T.reshape(d, h, k)
    elif kind == "out":
        tensor = tensor.T.reshape(h, k, d)
    elif kind == "linear":
        tensor = tensor.T
    return path, np.ascontiguousarray(tensor)


def ours_to_hf(name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Our array at the path of HF ``name`` → the HF tensor (inverse of :func:`hf_to_ours`)."""
    _, kind = param_path(name)
    d = config.d_model
    if kind in ("qkv", "out"):
        array = array.reshape(d, d).T
    elif kind == "linear":
        array = array.T
    return np.ascontiguousarray(array)


def params_from_hf(state_dict: Mapping[str, np.ndarray], config: ModelConfig) -> dict:
    """A whole HF state dict (numpy arrays) → our params tree (scanned if ``config.scan_layers``)."""
    params: dict = {}
    for name in hf_names(config):
        if name not in state_dict:
            raise KeyError(f"HF state dict has no {name!r}")
        path, array = hf_to_ours(name, np.asarray(state_dict[name]), config)
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = array
    return stack_layers(params, config.n_layers) if config.scan_layers else params


def hf_from_params(params: Mapping, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Our params tree (either layout) → (HF name, array) pairs, one tensor at a time."""
    if "layers" in params:
        params = unstack_layers(dict(params))
    for name in hf_names(config):
        node = params
        for key in param_path(name)[0]:
            node = node[key]
        yield name, ours_to_hf(name, np.asarray(node), config)
