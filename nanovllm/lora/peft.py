"""PEFT LoRA adapters from a directory (adapter_config.json + adapter_model.safetensors), checked against the base
model's shapes before any weight is read. Each target module's update is B @ A scaled by lora_alpha / r (or
lora_alpha / sqrt(r) with use_rslora), r being that module's own rank (so rank_pattern needs nothing more). On the
language model of a multimodal checkpoint (models.MULTIMODAL), an adapter PEFT made on the multimodal model applies:
its language model's layers are ours, its vision tower's and projector's weights are skipped (for text prompts the
tower never runs)."""
import json
import logging
import math
import os
import re
from dataclasses import dataclass

import torch

from nanovllm.lora.request import LoRARequest

logger = logging.getLogger("nanovllm")

# checkpoint module -> (our packed linear, part): q/k/v are parts of qkv_proj, gate/up of gate_up_proj
MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
# Where PEFT names the decoder layers (<prefix>layers.<n>...): a text model's, and a multimodal checkpoint's language
# model (models.MULTIMODAL) under transformers' module trees for it: model.language_model (transformers >= 4.52, and
# 5), language_model.model (earlier: the language model was a ...ForCausalLM of its own)
TEXT_LAYERS = "base_model.model.model."
LANGUAGE_MODEL_LAYERS = ("base_model.model.model.language_model.", "base_model.model.language_model.model.")
# (a layer index as PEFT writes it: "layers.00" would pass here and name no tensor when the weights are read)
_KEY = re.compile(f"({'|'.join(re.escape(p) for p in (*LANGUAGE_MODEL_LAYERS, TEXT_LAYERS))})"
                  r"layers\.(0|[1-9][0-9]*)\.(self_attn|mlp)\.([\w.]+?)\.lora_([AB])\.weight")
# A multimodal model's vision tower and projector, in either tree: on its language model their adapter weights are
# skipped (the tower never runs for a text prompt, so they change nothing)
_TOWER = re.compile(r"base_model\.model\.(?:model\.)?(?:vision_tower|multi_modal_projector)\..*")
# module names of a multimodal model's parts (refused on a text-only base model)
_MULTIMODAL_PARTS = {"language_model": "language model", "vision_tower": "vision tower",
                     "multi_modal_projector": "multimodal projector"}
# state that VeLoRA and MonteCLoRA use only while training (in eval PEFT computes plain B A x with them), saved too
_TRAINING_ONLY = re.compile(r".*\.lora_(velora_embed|monteclora_sampler\.\w+)")
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass
class Adapter:
    """A checked adapter: its request, and per (layer, module) the rank and scaling of its update. generation: which
    registration of its id this is (lora/manager.py): an id removed and added again, its files perhaps rewritten,
    is a new adapter to every cache. layers: the name prefix of its decoder layers' weights (TEXT_LAYERS, or one of
    LANGUAGE_MODEL_LAYERS for an adapter of a multimodal model)."""

    request: LoRARequest
    modules: dict[tuple[int, str], tuple[int, float]]
    path: str  # the adapter's directory: lora_path, or its Hub snapshot where lora_path is a Hub id
    generation: int = 0
    layers: str = TEXT_LAYERS

    @property
    def rank(self) -> int:
        return max(rank for rank, _ in self.modules.values())

    def tensors(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """(A [r, in], B [out, r] with the scaling folded in), float32 on the host, per (layer, module)."""
        from safetensors import safe_open
        out = {}
        with safe_open(os.path.join(self.path, WEIGHTS), "pt") as f:
            for (layer, module), (_, scaling) in self.modules.items():
                prefix = f"{self.layers}layers.{layer}.{_group(module)}.{module}"
                a = f.get_tensor(f"{prefix}.lora_A.weight").float()
                b = f.get_tensor(f"{prefix}.lora_B.weight").float() * scaling
                out[layer, module] = a, b
        return out


def _group(module: str) -> str:
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def read_adapter(request: LoRARequest, hf_config, max_rank: int) -> Adapter:
    """The adapter of `request`, checked: ValueError saying what is wrong (missing files, a target nanovllm cannot
    apply, a rank above max_lora_rank, shapes of another base model)."""
    from nanovllm.checkpoint.hub import resolve_model
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    # (a Hub id, as vLLM takes one: its snapshot in the Hugging Face cache)
    path = resolve_model(request.lora_path, what=f"LoRA adapter {request.lora_name!r}", local=f"the adapter's "
                         f"directory (a PEFT LoRA adapter directory holds {CONFIG} and {WEIGHTS})")
    for name in (CONFIG, WEIGHTS):
        if not os.path.isfile(os.path.join(path, name)):
            raise ValueError(f"{where}: no {name}; a PEFT LoRA adapter directory holds {CONFIG} and {WEIGHTS} "
                             "(PeftModel.save_pretrained writes them)")
    try:
        with open(os.path.join(path, CONFIG)) as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: {CONFIG} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG} must hold a JSON object, got {type(config).__name__}")
    _check_config(config, where, moe=bool(getattr(hf_config, "num_experts", None)
                                          or getattr(hf_config, "num_local_experts", None)))
    alpha, rslora = config.get("lora_alpha", 8), config.get("use_rslora")
    rslora = False if rslora is None else rslora  # (PEFT reads null as false)
    # (JSON as Python writes it may hold Infinity: every update would be inf or NaN, every token garbage)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
        raise ValueError(f"{where}: lora_alpha must be a positive number (finite), got {alpha!r} in {CONFIG}")
    if not isinstance(rslora, bool):
        raise ValueError(f"{where}: use_rslora must be true or false, got {rslora!r} in {CONFIG}")
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(os.path.join(path, WEIGHTS), "pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"{where}: {WEIGHTS} cannot be read ({e}); save the adapter again") from None
    from nanovllm.models import MULTIMODAL
    archs = getattr(hf_config, "architectures", None) or []
    # (the language model of a multimodal checkpoint: language_model_config names its architecture)
    multimodal = any(arch in MULTIMODAL for arch in archs)
    found: dict[tuple[int, str], dict[str, tuple]] = {}
    layer_prefixes: set[str] = set()
    tower: list[str] = []  # the vision tower's and the projector's weights, skipped
    for key, shape in shapes.items():
        if _TRAINING_ONLY.fullmatch(key):
            continue
        if multimodal and _TOWER.fullmatch(key):
            tower.append(key)
            continue
        match = _KEY.fullmatch(key)
        mm_part = next((name for name in _MULTIMODAL_PARTS if f".{name}." in key), None)
        if mm_part is not None and not multimodal:
            raise ValueError(f"{where}: weight {key!r} is a multimodal model's (its {_MULTIMODAL_PARTS[mm_part]}, as "
                             "PEFT names the modules of a ...ForConditionalGeneration), but this base model "
                             f"({', '.join(archs) or 'its config names no architecture'}) is text-only: serve the "
                             f"multimodal checkpoint the adapter was made on ({' or '.join(MULTIMODAL)}, whose "
                             "language model nanovllm serves), or use an adapter of this model's modules "
                             f"({TEXT_LAYERS}layers.<n>...)")
        if match is None:
            raise ValueError(f"{where}: weight {key!r} is not a LoRA A/B matrix of a decoder layer's attention or MLP "
                             "projection; embedding, lm_head and modules_to_save targets and DoRA are not supported")
        layer, group, module, part = int(match[2]), match[3], match[4], match[5]
        if module not in MODULES or _group(module) != group:
            raise ValueError(f"{where}: target {group}.{module} of layer {layer} is not supported; LoRA applies to "
                             "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj and down_proj")
        layer_prefixes.add(match[1])
        found.setdefault((layer, module), {})[part] = shape
    if len(layer_prefixes) > 1:  # (one model's adapter names its layers one way; two would be two models')
        first, second = sorted(layer_prefixes)[:2]
        raise ValueError(f"{where}: {WEIGHTS} names decoder layers both as {first}layers.<n> and as "
                         f"{second}layers.<n>: an adapter of one model names them one way")
    if tower and not found:
        raise ValueError(f"{where}: {WEIGHTS} holds LoRA weights of the vision tower and the multimodal projector "
                         f"only ({len(tower)}, e.g. {tower[0]!r}); nanovllm serves this checkpoint's language model "
                         "for text prompts, where they change nothing: nothing to apply")
    if not found:
        raise ValueError(f"{where}: {WEIGHTS} holds no LoRA weights")
    expected = _shapes(hf_config)
    modules = {}
    for (layer, module), parts in sorted(found.items()):
        name = f"layer {layer} {module}"
        if set(parts) != {"A", "B"}:
            raise ValueError(f"{where}: {name} has lora_{next(iter(parts))} without its pair")
        if layer >= hf_config.num_hidden_layers:
            raise ValueError(f"{where}: {name}, but the base model has {hf_config.num_hidden_layers} layers: an "
                             "adapter made for another base model")
        if _group(module) == "mlp" and _is_moe_layer(hf_config, layer):
            raise ValueError(f"{where}: {name}: that layer's MLP is mixture-of-experts; LoRA on experts is not "
                             "supported (attention targets are)")
        want_out, want_in = expected[module]
        if len(parts["A"]) != 2 or len(parts["B"]) != 2:  # (a damaged or hand-made file: not matrices at all)
            raise ValueError(f"{where}: {name} has A {parts['A']} and B {parts['B']}; LoRA needs the matrices "
                             f"A [r, {want_in}] and B [{want_out}, r]")
        (r, in_a), (out_b, r_b) = parts["A"], parts["B"]
        if r == 0:  # (PEFT refuses r = 0 too; its scaling alpha / r has no value)
            raise ValueError(f"{where}: {name} has rank 0 (A {parts['A']}); a LoRA rank must be at least 1")
        if r != r_b or (in_a, out_b) != (want_in, want_out):
            raise ValueError(f"{where}: {name} has A {parts['A']} and B {parts['B']}; this base model needs "
                             f"A [r, {want_in}] and B [{want_out}, r]: an adapter made for another base model")
        if r > max_rank:
            raise ValueError(f"{where}: {name} has rank {r}, above max_lora_rank={max_rank}; raise max_lora_rank")
        modules[layer, module] = r, alpha / (math.sqrt(r) if rslora else r)
    if tower:
        logger.info("%s: %d LoRA weights of the vision tower and the multimodal projector skipped (%d modules): "
                    "nanovllm serves this checkpoint's language model for text prompts, where the tower never runs, "
                    "so they change nothing", where, len(tower), len({key.rsplit(".lora_", 1)[0] for key in tower}))
    return Adapter(request, modules, path, layers=layer_prefixes.pop())


# LoRA variants whose adapters are not plain B A updates of the base nanovllm serves
VARIANTS = {"use_qalora": "QA-LoRA (its A reads the input pooled in groups, for a GPTQ base)",
            "use_bdlora": "BD-LoRA (block-diagonal A or B factors)",
            "kasa_config": "KaSA (it truncates the base weights' singular values and scales B A by a trained diagonal)",
            "arrow_config": "Arrow (it routes each token among several adapters)",
            "lora_bias": "lora_bias (a trained bias on lora_B)",
            "trainable_token_indices": "trainable_token_indices (trained embedding rows)"}
# the fields of a plain LoRA, and variants that are one at inference (their training or initialisation differs):
# EVA's, CorDA's, LoRA-GA's and LoftQ's configs (init_lora_weights says which needs a refusal), VeLoRA, MonteCLoRA
PLAIN_FIELDS = {"use_rslora", "use_dora", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
                "megatron_config", "runtime_config", "velora_config", "monteclora_config"}
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # an MoE layer's stacked expert weights, as transformers names them


def _check_config(config: dict, where: str, moe: bool):
    # PEFT names stacked experts by their parameters, with "experts" in the path or (on an MoE model) without it
    stacked = [t for t in config.get("target_parameters") or ()
               if "experts" in str(t) or (moe and str(t).rpartition(".")[2] in EXPERT_PARAMETERS)]
    if stacked:
        raise ValueError(f"{where}: target_parameters {stacked!r} are {'this' if moe else 'an'} MoE model's stacked "
                         "expert weights: LoRA on MoE experts is not supported (attention targets are)")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r}; only LoRA adapters are supported")
    refused = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (fully trained modules)",
               "alpha_pattern": "alpha_pattern (per-module lora_alpha)", "fan_in_fan_out": "fan_in_fan_out weights",
               "layer_replication": "layer_replication"}
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(f"{where}: {what} is not supported ({key}={config[key]!r} in {CONFIG})")
    for key, what in VARIANTS.items():
        if config.get(key):
            raise ValueError(f"{where}: {what} is not supported ({key}={config[key]!r} in {CONFIG}); nanovllm applies "
                             "plain LoRA, W x + B A x scaled")
    # PEFT names a LoRA variant use_<name> or <name>_config: one nanovllm does not know may change the product
    unknown = [key for key, value in config.items() if value and key not in PLAIN_FIELDS
               and (key.startswith("use_") or key.endswith("_config"))]
    if unknown:
        raise ValueError(f"{where}: {unknown[0]}={config[unknown[0]]!r} in {CONFIG} selects a LoRA variant nanovllm "
                         "does not know; it applies plain LoRA, W x + B A x scaled")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={config['bias']!r}: trained biases are not supported (bias='none')")
    if config.get("alora_invocation_tokens"):  # (PEFT applies it only from the invocation tokens on)
        raise ValueError(f"{where}: an activated LoRA (alora_invocation_tokens in {CONFIG}) is not supported: "
                         "nanovllm applies an adapter to every token of its requests")
    init = str(config.get("init_lora_weights", True)).lower()
    if init == "loftq":  # (its base is the quantized approximation LoftQ saved with it, not the original weights)
        raise ValueError(f"{where}: init_lora_weights='loftq': a LoftQ adapter applies to the base model LoftQ saved "
                         "with it; serve that model, and the adapter saved with init_lora_weights=True")
    if init.startswith(("pissa", "olora", "corda", "lora_ga")):
        # (these adapters are relative to a base PEFT changes when it loads them: W minus the initial B A)
        raise ValueError(f"{where}: init_lora_weights={config['init_lora_weights']!r}: such an adapter applies to "
                         "a base model PEFT modifies as it loads it; save it with save_pretrained(..., "
                         "path_initial_model_for_weight_conversion=...) to get a plain LoRA of the original model")


def _shapes(hf_config) -> dict[str, tuple[int, int]]:
    """Each target's full (out, in) in the base model."""
    from nanovllm.models.decoder import head_dim_of
    hidden, head_dim = hf_config.hidden_size, head_dim_of(hf_config)
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    inter = hf_config.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def _is_moe_layer(hf_config, layer: int) -> bool:
    from nanovllm.models.decoder import moe_layer
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    return bool(experts) and moe_layer(hf_config, layer)
