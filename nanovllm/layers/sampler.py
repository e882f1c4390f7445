import torch
from torch import nn


class Sampler(nn.Module):
    """Exact temperature sampling without sort or multinomial: argmax(p / E) with E ~ Exp(1)
    picks token i with probability p_i. Rows with temperature 0 take the argmax."""

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator | None = None):
        logits = logits.float()
        greedy = logits.argmax(-1)
        probs = torch.softmax(logits / temperatures.clamp(min=1e-5).unsqueeze(1), -1)
        noise = torch.empty_like(probs).exponential_(1, generator=generator).clamp_(min=1e-10)
        sampled = (probs / noise).argmax(-1)
        return torch.where(temperatures == 0, greedy, sampled)
