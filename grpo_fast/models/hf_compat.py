"""The few transformers names that changed inside 5.x, in one place.

We support transformers 5.17 to 5.x (pyproject.toml; CI tests the oldest and the pinned one). 5.24 renamed the
KV cache argument and output field `past_key_values` to `cache`; versions before it take `cache=` into
`**kwargs` without a word and run without a cache, which silently garbles generation. So the cache is always
passed under the name the model's own `forward` declares.
"""

import functools
import inspect

import torch

from .model_parts import hf_model_of


@functools.lru_cache(maxsize=None)
def _cache_name_of(model_type: type) -> str:
    params = inspect.signature(model_type.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(
        f"{model_type.__name__}.forward takes neither `cache` nor `past_key_values`: not a transformers "
        "causal LM with a KV cache"
    )


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """`{name: cache}` for `model(...)`, under the keyword its forward declares; `{}` when cache is None."""
    if cache is None:
        return {}
    return {_cache_name_of(type(hf_model_of(model))): cache}


def cache_of(model_output):
    """The KV cache of a transformers output (`cache` from 5.24 on, `past_key_values` before)."""
    cache = getattr(model_output, "cache", None)
    return cache if cache is not None else model_output.past_key_values
