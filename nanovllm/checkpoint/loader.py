"""Read checkpoints: config, tokenizer, EOS ids and (hf_name, tensor) pairs.

A model is a Hugging Face checkpoint directory (config.json + *.safetensors) or a .gguf file; a GGUF file
is converted once into a cached directory of the same kind (see nanovllm/checkpoint/gguf.py)."""
import json
import os
from collections.abc import Callable, Iterable, Iterator
from glob import glob

import torch
from torch import nn

from nanovllm.checkpoint.hf_overrides import apply_function, merge_overrides
from nanovllm.checkpoint.plain_config import read_config_json, read_plain_config


def resolve_checkpoint(model: str) -> str:
    """The checkpoint directory for `model`: the directory itself, or the cached conversion of a GGUF file."""
    if not os.path.exists(model):
        raise ValueError(f"model path {model!r} does not exist; pass a checkpoint directory or a .gguf file")
    if os.path.isfile(model):
        from nanovllm.checkpoint.gguf import gguf_checkpoint_dir
        return gguf_checkpoint_dir(model)
    if not os.path.exists(os.path.join(model, "config.json")):
        ggufs = glob(os.path.join(model, "*.gguf"))
        hint = f" (for GGUF, pass the file itself, e.g. {ggufs[0]!r})" if ggufs else ""
        raise ValueError(f"{model!r} has no config.json; pass a Hugging Face checkpoint directory{hint}")
    return model


def load_hf_config(model: str, overrides: dict | Callable | None = None):
    """The checkpoint's config: a PlainConfig read from config.json alone where the plain reader can vouch for every
    field the engine reads (milliseconds, and transformers is not imported), else transformers' AutoConfig.
    `overrides`: vLLM's hf_overrides, a dict applied to config.json's fields before either reads them, or a function
    given transformers' config (checkpoint/hf_overrides.py)."""
    path = resolve_checkpoint(model)
    if callable(overrides):
        from transformers import AutoConfig
        return apply_function(AutoConfig.from_pretrained(path), overrides)
    raw = merge_overrides(read_config_json(path), overrides) if overrides else None
    config = read_plain_config(path, raw)
    if config is not None:
        return config
    from transformers import AutoConfig
    if raw is None:
        return AutoConfig.from_pretrained(path)
    fields = dict(raw)
    return AutoConfig.for_model(fields.pop("model_type", None), **fields)


# the vocabulary files tokenizers are saved with (fast: tokenizer.json; BPE: vocab.json; WordPiece: vocab.txt;
# SentencePiece: tokenizer.model and others; tiktoken; Mistral's tekken)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "tekken.json")


def check_tokenizer_files(model: str) -> None:
    """Raise OSError unless the checkpoint holds a tokenizer's vocabulary (transformers 5 would build an empty
    tokenizer from a directory without one: every text encoded to [])."""
    path = resolve_checkpoint(model)
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES) and not glob(
            os.path.join(path, "*.tiktoken")):
        raise OSError(f"{path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}, *.tiktoken); copy the "
                      "model's tokenizer files into it, or pass load_format='dummy' to run on token ids only")


def load_tokenizer(model: str):
    check_tokenizer_files(model)
    path = resolve_checkpoint(model)
    from nanovllm.checkpoint.gguf import recorded_tokenizer_class
    name = recorded_tokenizer_class(path)
    try:
        if name is not None:
            import transformers
            return getattr(transformers, name).from_pretrained(path)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except ValueError as e:  # (a broken tokenizer.json surfaces as a bare JSONDecodeError)
        raise ValueError(f"the tokenizer files in {path!r} cannot be loaded ({type(e).__name__}: {e}); fix or "
                         "replace them") from e


def load_generation_config(model: str) -> dict:
    """The checkpoint's generation_config.json ({} when it has none)."""
    path = os.path.join(resolve_checkpoint(model), "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); fix or remove it") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}; fix or remove it")
    return config


def load_eos_token_ids(model: str, hf_config) -> list[int]:
    """Every EOS id: the tokenizer's eos_token (vLLM's primary EOS), then those generation_config.json or
    config.json name (either may hold a list)."""
    ids: list[int] = []
    sources = [tokenizer_eos_id(model), load_generation_config(model).get("eos_token_id"),
               getattr(hf_config, "eos_token_id", None)]
    for value in sources:
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def tokenizer_eos_id(model: str) -> int | None:
    """The id of tokenizer_config.json's eos_token, read from the tokenizer files (the engine starts before the
    tokenizer is loaded); None where they name none or cannot be read (the tokenizer's load reports that)."""
    path = resolve_checkpoint(model)
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            config = json.load(f)
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if not isinstance(eos, str):
            return None
        for i, token in (config.get("added_tokens_decoder") or {}).items():
            if token.get("content") == eos:
                return int(i)
        with open(os.path.join(path, "tokenizer.json")) as f:
            tokenizer = json.load(f)
        for token in tokenizer.get("added_tokens") or ():
            if token.get("content") == eos:
                return int(token["id"])
        vocab = (tokenizer.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            return vocab.get(eos)
        if isinstance(vocab, list):  # (Unigram: [piece, score] pairs, the id their index)
            return next((i for i, entry in enumerate(vocab) if entry and entry[0] == eos), None)
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        return None
    return None


def iter_weights(model: str, skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) pairs of a checkpoint directory or a (converted) GGUF file; tensors whose name `skip` takes
    are not read."""
    return iter_safetensors(resolve_checkpoint(model), skip)


INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def iter_safetensors(model: str, skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint directory, from the files transformers reads: model.safetensors where there is
    one (re-saving a sharded model unsharded leaves the old index beside it); else the files
    model.safetensors.index.json maps, each mapped tensor from its mapped file (stale shards of an earlier save, or
    Mistral's consolidated.safetensors, may sit beside them); else every *.safetensors. ValueError for an index that
    maps no tensors, names an absent file or a tensor its file lacks, and for a tensor in two files that no index
    tells apart. A tensor whose name `skip` takes is not read (nor yielded)."""
    from safetensors import safe_open
    index, weight_map = os.path.join(model, INDEX), {}
    if os.path.isfile(os.path.join(model, SINGLE)):
        files = [SINGLE]
    elif os.path.isfile(index):
        with open(index) as f:
            weight_map = {name: os.path.normpath(file) for name, file in (json.load(f).get("weight_map") or {}).items()}
        if not weight_map:
            raise ValueError(f"{index} maps no tensors (its weight_map is empty): restore it from the checkpoint, or "
                             "remove it to read every *.safetensors file")
        files = sorted(set(weight_map.values()))
        absent = [file for file in files if not os.path.isfile(os.path.join(model, file))]
        if absent:
            raise ValueError(f"{index} maps tensors to {', '.join(absent[:3])}, not in {model!r}: the checkpoint is "
                             "incomplete (download it again)")
    else:
        files = sorted(os.path.relpath(file, model) for file in glob(os.path.join(model, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model!r}")
    seen: dict[str, str] = {}
    for file in files:
        with safe_open(os.path.join(model, file), "pt", "cpu") as f:
            for name in f.keys():
                if weight_map.get(name, file) != file:
                    continue  # (the index reads this tensor from another of its files)
                if name in seen:
                    raise ValueError(f"checkpoint tensor {name!r} is in both {seen[name]} and {file} in {model!r}"
                                     + (f", and {INDEX} names neither for it: restore the index" if weight_map else
                                        f": remove the stale file (or add the checkpoint's {INDEX}, which names the "
                                        "file each tensor is read from)"))
                seen[name] = file
                if skip is None or not skip(name):
                    yield name, f.get_tensor(name)
    unread = [name for name in weight_map if name not in seen]
    if unread:
        raise ValueError(f"{index} maps {unread[0]!r} to {weight_map[unread[0]]}, which lacks it"
                         + (f" ({len(unread) - 1} more like it)" if len(unread) > 1 else "")
                         + ": the checkpoint is incomplete (download it again)")


def check_weight_shape(loaded: torch.Tensor, expected) -> None:
    """Weight loaders call this before copying: a wrong shape must never be broadcast or narrowed into place."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor):
    check_weight_shape(loaded, param.shape)
    param.data.copy_(loaded)


def route_weight(name: str, packed: dict) -> tuple[str, object | None]:
    """(parameter name, shard id or None) for a checkpoint tensor name. A mapping key is a dotted module path matched
    against whole trailing segments of the tensor's module, whose last segment becomes the value's module name:
    {"mlp.gate_proj": ("gate_up_proj", 0)} routes `layers.0.mlp.gate_proj.weight` into shard 0 of
    `layers.0.mlp.gate_up_proj.weight`, but never `mlp.experts.3.gate_proj.weight` nor `mlp.gate_proj_x.weight`."""
    module, _, leaf = name.rpartition(".")
    segments = module.split(".")
    for src, (dst, shard_id) in packed.items():
        path = src.split(".")
        if segments[-len(path):] == path:
            return ".".join(segments[:-1] + [dst, leaf]), shard_id
    return name, None


def route_expert_weight(name: str, experts: dict) -> tuple[str, tuple[int, int]] | None:
    """(stacked parameter name, (expert, shard)) for one expert's projection, or None for any other tensor.
    {"gate_proj": ("gate_up_proj", 0)} routes `layers.0.mlp.experts.3.gate_proj.weight` into shard (3, 0) of
    `layers.0.mlp.experts.gate_up_proj`: the module path must end in `experts.<number>.<projection>`. Another
    tensor of the projection (an fp8 weight's scale) goes to the stacked parameter named with its leaf:
    `...gate_proj.weight_scale` into `experts.gate_up_proj_weight_scale`."""
    module, _, leaf = name.rpartition(".")
    segments = module.split(".")
    if len(segments) < 3:
        return None
    *parent, container, expert, proj = segments
    if container != "experts" or not expert.isdigit() or proj not in experts:
        return None
    dst, shard = experts[proj]
    return ".".join(parent + [container, dst if leaf == "weight" else f"{dst}_{leaf}"]), (int(expert), shard)


def _expert_source(pname: str, experts: dict, expert: int, shard: int,
                   spelling: tuple[str, set[str]] | None = None) -> str:
    """The checkpoint tensor routed into shard (expert, shard) of stacked parameter `pname` (route_expert_weight's
    inverse), for errors; spelled as the checkpoint's other experts are where `spelling` (their module path, the
    projection names they use) is known (Mixtral's block_sparse_moe.experts and w1/w2/w3)."""
    module, _, dst = pname.rpartition(".")
    theirs, seen = spelling or (module, set())
    fits = [proj for proj, (stacked, s) in experts.items()
            if s == shard and (dst == stacked or dst.startswith(stacked + "_"))]
    if not fits:
        return f"{pname} (expert {expert}, shard {shard})"
    proj = next((p for p in fits if p in seen), fits[0])
    return f"{theirs}.{expert}.{proj}.{dst[len(experts[proj][0]) + 1:] or 'weight'}"


def _packed_sources(pname: str, packed: dict) -> list[tuple[str, object]]:
    """(checkpoint name, shard id) of every shard routed into parameter `pname`; [] when it is not packed."""
    module, _, leaf = pname.rpartition(".")
    *parent, name = module.split(".")
    sources = []
    for src, (dst, shard_id) in packed.items():
        *src_parent, src_name = src.split(".")
        if name == dst and parent[len(parent) - len(src_parent):] == src_parent:
            sources.append((".".join(parent + [src_name, leaf]), shard_id))
    return sources


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# what an fp8 scale tensor that no layer expects says about config.json's quantization_config
_SCALE_HINTS = {
    "weight_scale_inv": ": block scales (Qwen's and transformers' FP8 format); quantization_config needs its "
                        "weight_block_size, e.g. [128, 128] (transformers assumes that where it is absent; vLLM and "
                        "nanovllm read no weight_block_size as one scale per tensor, stored as weight_scale)",
    "weight_scale": ": fp8 weight scales, which this quantization_config does not name (Qwen's block format stores "
                    "weight_scale_inv; a module its ignore list names has none)",
    "input_scale": ": a static activation scale, which only a layer that quantization_config quantizes with static "
                   "activations reads (quant_method 'fp8' with activation_scheme 'static', or compressed-tensors' "
                   "input_activations with dynamic false and strategy 'tensor'); this config's activations are "
                   "dynamic or 16-bit, or its ignore list names this module",
    **dict.fromkeys(("k_scale", "v_scale", "kv_scale", "q_scale", "prob_scale", "output_scale", "prob_output_scale"),
                    ": a static KV-cache scale, which nanovllm reads (checks and does not use) only on the attention "
                    "(self_attn.k_scale, k_proj.output_scale, ...) and where quantization_config has a kv_cache_scheme "
                    "(compressed-tensors' static per-tensor fp8, or AutoFP8's 'static'); kv_cache_dtype='fp8' scales "
                    "each token's keys and values itself"),
}


def _checked_only(name: str, checks: dict):
    """The check of a tensor the model reads only to check (`checked_weights`: a checkpoint name suffix, whole dotted
    segments, -> its check), or None."""
    segments = name.split(".")
    for suffix, check in checks.items():
        path = suffix.split(".")
        if segments[-len(path):] == path:
            return check
    return None


def _checkpoint_prefix(name: str, prefixes: dict[str, str | None]) -> tuple[str, str | None] | None:
    """(checkpoint prefix, our prefix) of the first of a model's `checkpoint_prefixes` that tensor `name` starts
    with (our prefix None: a tensor of another part of the checkpoint, such as a multimodal checkpoint's vision
    tower, which the model does not load), or None."""
    return next(((theirs, ours) for theirs, ours in prefixes.items() if name.startswith(theirs)), None)


def _another_part(name: str, prefixes: dict[str, str | None]) -> bool:
    """Whether tensor `name` is of another part of the checkpoint than the model (not to be read)."""
    prefix = _checkpoint_prefix(name, prefixes)
    return prefix is not None and prefix[1] is None


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]] | str, source: str,
                       require_all: bool = True):
    """Route each (checkpoint name, tensor) to its parameter's weight_loader (packed q/k/v and gate/up too), or to
    the model's check for a tensor it reads only to check (`checked_weights`: a static KV-cache scale; ValueError
    naming a bad one), after which it is dropped. `weights`: the pairs, or a checkpoint path to read them from. Names
    are first read through the model's `checkpoint_prefixes` (_checkpoint_prefix): a tensor that is not the model's is
    skipped, and not read from a path. require_all: every parameter, and every shard of a packed one, must be loaded (a
    checkpoint); otherwise any subset may be (a weight update). `source` names the weights' origin, for errors."""
    prefixes = getattr(model, "checkpoint_prefixes", {})
    if isinstance(weights, str):
        weights = iter_weights(weights, lambda name: _another_part(name, prefixes))
    spelled: dict[str, str] = {}  # our prefix -> the checkpoint's, as its names show (to name a missing tensor)
    packed = getattr(model, "packed_modules_mapping", {})
    experts = getattr(model, "expert_weights_mapping", {})
    aliases = getattr(model, "module_aliases", {})
    params = dict(model.named_parameters())
    skip = set(getattr(model, "skip_weights", ()))
    checks = getattr(model, "checked_weights", {})
    loaded = set()  # parameter names, and (parameter name, shard id) for packed ones
    spellings: dict[str, tuple[str, set[str]]] = {}  # stacked experts -> (the checkpoint's path, projection names)
    for name, tensor in weights:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weights must be (name, tensor) pairs with a str name, got ({name!r:.60}, "
                            f"{type(tensor).__name__})")
        ours, prefix = name, _checkpoint_prefix(name, prefixes) if prefixes else None
        if prefix is not None:
            if prefix[1] is None:
                continue
            ours = prefix[1] + name[len(prefix[0]):]
            spelled.setdefault(prefix[1], prefix[0])
        if ours in skip or ours.split(".")[-2:] == ["rotary_emb", "inv_freq"]:
            continue
        check = _checked_only(ours, checks) if checks else None
        if check is not None:  # (per-tensor scalars: every rank checks the whole tensor)
            try:
                check(tensor)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
            continue
        ours = ".".join(aliases.get(segment, segment) for segment in ours.split(".")) if aliases else ours
        routed = route_expert_weight(ours, experts)
        if routed is not None:  # (how this checkpoint spells the experts, for naming a missing one)
            theirs, proj = name.rsplit(".", 3)[0], name.rsplit(".", 2)[1]
            spellings.setdefault(routed[0].rpartition(".")[0], (theirs, set()))[1].add(proj)
        pname, shard_id = routed or route_weight(ours, packed)
        if pname not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}"
                             f"{_SCALE_HINTS.get(name.rpartition('.')[2], '')}")
        param = params[pname]
        if tensor.dtype in _FP8 and param.dtype not in _FP8:
            raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} but the model's parameter is "
                             f"{param.dtype}: an fp8 checkpoint needs its quantization_config in config.json; with "
                             "one, this module is one nanovllm keeps 16-bit (the embedding, the LM head, MoE routers) "
                             "or one its ignore list names")
        try:
            if shard_id is None:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
        loaded.add(pname if shard_id is None else (pname, shard_id))
    if not require_all:
        return

    def spell(ours: str) -> str:  # one of our names as this checkpoint's names show it
        prefix = next((p for p in spelled if ours.startswith(p)), None)
        return ours if prefix is None else spelled[prefix] + ours[len(prefix):]

    missing = []
    for pname, param in params.items():
        sources = _packed_sources(pname, packed)
        shard_ids = getattr(param, "shard_ids", None)  # stacked experts: loaded whole, or every expert's shards
        if shard_ids is not None:
            if pname not in loaded:
                spelling = spellings.get(pname.rpartition(".")[0])  # (the checkpoint's own, where known)
                missing += [_expert_source(pname, experts, e, s, spelling) if spelling else
                            spell(_expert_source(pname, experts, e, s)) for e, s in shard_ids
                            if (pname, (e, s)) not in loaded]
        elif sources:
            missing += [spell(name) for name, shard_id in sources if (pname, shard_id) not in loaded]
        elif pname not in loaded:
            missing.append(spell(pname))
    if missing:
        raise ValueError(f"checkpoint {source!r} lacks weights for: {', '.join(missing[:8])}")


def load_weights(model: nn.Module, path: str):
    load_named_weights(model, path, path)


def init_dummy_weights(model: nn.Module, seed: int = 0):
    """Random weights for benchmarks: throughput does not depend on their values."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("_scale") or name.endswith("_scale_inv"):
            param.data.fill_(1.0)  # (fp8 weights' scales: the weights hold the values)
            continue
        gen = gens.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        if param.dtype in _FP8:
            param.data.copy_(torch.empty(param.shape, device=param.device).normal_(0.0, 0.02, generator=gen))
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
