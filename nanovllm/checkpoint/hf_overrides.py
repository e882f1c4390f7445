"""vLLM's `hf_overrides`: changes to a checkpoint's config.json made at load time, without editing the file.

A dict is applied to config.json's fields before any config class reads them, so the class derives what it derives
from them (transformers' rope layout, layer types) as it would from an edited file. A function is vLLM's other form:
it is given the transformers config and returns it."""
import copy
from collections.abc import Callable

# keys under which a config keeps its rope parameters: transformers 5's layout, and the older one beside rope_theta
_ROPE_KEYS = ("rope_parameters", "rope_scaling")


def check_hf_overrides(overrides) -> None:
    """TypeError unless `overrides` is None, a dict with str keys, or a callable."""
    if overrides is None or callable(overrides):
        return
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise TypeError(f"hf_overrides must be a dict of config fields (e.g. {{'rope_scaling': {{...}}}}) or a "
                        f"function of the config, got {overrides!r}")


def merge_overrides(raw: dict, overrides: dict) -> dict:
    """config.json's fields `raw` with `overrides` applied (neither is changed): each key replaces raw's, except that a
    dict merges key by key into raw's dict of that name (a multimodal checkpoint's text_config keeps its other
    fields). A rope dict (under rope_scaling or rope_parameters) replaces the scaling and keeps the checkpoint's
    rope_theta unless it gives one (None there: no scaling, the theta kept), and a rope_theta goes where the
    checkpoint keeps it, each written in the layout the checkpoint uses: transformers 5 given a rope_scaling beside
    the file's rope_parameters silently drops the theta to 10,000, and reads a top-level rope_theta only where
    rope_parameters has none."""
    merged = copy.deepcopy(raw)
    for key, value in overrides.items():
        value = copy.deepcopy(value)
        if key in _ROPE_KEYS and value is None:  # no scaling: the theta stays (transformers 5 keeps a file's
            # rope_parameters beside a null rope_scaling, and a null rope_parameters takes theta 10,000)
            _set_rope(merged, {"rope_type": "default"}, shown="None")
        elif key in _ROPE_KEYS and isinstance(value, dict):
            _set_rope(merged, value)
        elif key == "rope_theta":  # (transformers 5 reads the theta in rope_parameters first: set it there)
            _set_rope(merged, {"rope_theta": value})
        elif key in ("dtype", "torch_dtype"):  # (two names of one field: transformers 5 reads dtype first)
            merged["dtype"] = merged["torch_dtype"] = value
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def _set_rope(merged: dict, rope: dict, shown: str | None = None) -> None:
    """`rope` written into `merged` in its layout; `shown`: what the user passed, for the error (else `rope`)."""
    old = merged.get("rope_parameters")
    if isinstance(old, dict) and old and all(isinstance(v, dict) for v in old.values()):  # per layer type (Gemma 3)
        unknown = sorted(set(rope) - set(old))
        if unknown or not all(isinstance(v, dict) for v in rope.values()):
            raise ValueError(f"this checkpoint's rope_parameters are per layer type ({', '.join(old)}): give "
                             f"hf_overrides={{'rope_parameters': {{'<layer type>': {{...}}}}}}, not "
                             f"{shown or repr(rope)}")
        for kind, params in rope.items():
            old[kind] = _updated(old[kind], params)
    elif isinstance(old, dict):  # transformers 5's layout: one dict holds the theta and the scaling
        merged.pop("rope_scaling", None)
        merged["rope_parameters"] = _updated(old, rope)
    else:  # the older layout: rope_theta beside rope_scaling
        theta = rope.pop("rope_theta", None)
        if theta is not None:
            merged["rope_theta"] = theta
        merged.pop("rope_parameters", None)
        scaling = _updated(merged.get("rope_scaling") or {}, rope)
        merged["rope_scaling"] = scaling or None


def _updated(old: dict, rope: dict) -> dict:
    """A rope dict that names its type replaces the old scaling, keeping the theta (and partial_rotary_factor)
    unless it gives them; one that does not (e.g. {'rope_theta': ...}) changes the keys it gives."""
    if "rope_type" in rope or "type" in rope:
        return {**{k: old[k] for k in ("rope_theta", "partial_rotary_factor") if k in old}, **rope}
    return {**old, **rope}


def apply_function(config, function: Callable):
    """vLLM's hf_overrides function applied to transformers' config: the config it returns. A rope dict without a
    theta that it sets on a transformers 5 config (config.rope_scaling = {...} replaces rope_parameters, theta and
    all; so does config.rope_parameters = {...}) keeps the checkpoint's theta, as for a dict; so does one it clears
    (config.rope_scaling = None: no scaling), at the top level or in the text_config."""
    levels = {name: _theta(getattr(config, name, None) if name else config) for name in ("", "text_config")}
    out = function(config)
    if out is None or isinstance(out, dict):
        raise TypeError(f"the hf_overrides function returned {'None' if out is None else 'a dict'}; it must return "
                        "the config it was given (changed)" + ("; a dict of changes goes as hf_overrides itself"
                                                                 if out is not None else ""))
    for name, theta in levels.items():
        level = getattr(out, name, None) if name else out
        if theta is None or level is None or not hasattr(level, "rope_parameters"):
            continue
        params = level.rope_parameters
        if params is None:
            level.rope_parameters = {"rope_type": "default", "rope_theta": theta}
        elif isinstance(params, dict) and params.get("rope_theta") is None and \
                not any(isinstance(v, dict) for v in params.values()):  # (not per layer type)
            params["rope_theta"] = theta
    return out


def _theta(config) -> float | None:
    """A transformers 5 config's one rope_theta (None for none, or one per layer type)."""
    params = getattr(config, "rope_parameters", None)
    return params.get("rope_theta") if isinstance(params, dict) else None
