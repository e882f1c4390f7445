import math

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3 rope scaling: long wavelengths slowed by `factor`, a smooth ramp in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen's long-context setting, its model cards' rope_scaling): (frequencies, attention factor), as
    transformers computes them. Dimensions that turn more than beta_fast times over the original context keep their
    frequency, those that turn fewer than beta_slow times are slowed by `factor`, a linear ramp between; cos and sin
    are scaled by the attention factor (0.1 ln(factor) + 1 unless the config gives one)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale()

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over the full head_dim with a precomputed cos/sin cache."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type not in ("default", None, "llama3", "linear", "yarn"):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: default, llama3, "
                             "linear, yarn)")
        if torch.get_default_device().type == "meta":  # a layout copy (ModelRunner.check_weights): the shape is
            # enough, and arange on the meta device imports torch._refs (seconds of a CPU RL loop's first weight update)
            cache = torch.empty(max_position, head_dim, dtype=torch.float)
        else:
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            attention = 1.0
            if rope_type == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
            elif rope_type == "linear":  # positions divided by the factor (Gemma 3's global layers)
                inv_freq = inv_freq / rope_scaling["factor"]
            elif rope_type == "yarn":
                inv_freq, attention = _yarn_inv_freq(inv_freq, head_dim, base, rope_scaling)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
            cache = torch.cat([freqs.cos(), freqs.sin()], -1)
            if attention != 1.0:  # (in the table, so the CUDA kernel's fused rotary applies it too)
                cache *= attention
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self._rows: tuple | None = None  # (positions, their cache rows): every layer of a step shares them

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]. (On CUDA the decoder runs the rotary in
        kernels/rope.py, with the q/k norms, where the head size allows; this is the reference and the rest.)"""
        if self._rows is None or self._rows[0] is not positions:  # one gather per step, not per layer
            self._rows = (positions, self.cos_sin_cache[positions])
        return apply_rotary(positions, q, k, self._rows[1], gathered=True)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                 gathered: bool = False):
    """gathered: cos_sin_cache is already the rows of `positions`."""
    cos, sin = (cos_sin_cache if gathered else cos_sin_cache[positions]).unsqueeze(1).chunk(2, -1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
