import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.checkpoint.loader import check_weight_shape
from nanovllm.distributed.group import all_reduce, get_tp_group, get_tp_rank, get_tp_size
from nanovllm.layers.context import get_context
from nanovllm.layers.linear import linear


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; other ranks' tokens embed to zero."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_group = get_tp_rank(), get_tp_size(), get_tp_group()
        self.num_embeddings = num_embeddings
        self.shard_size = num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        check_weight_shape(loaded, (self.num_embeddings, *param.shape[1:]))
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.shard_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # (on the GPU, F.embedding's index_select kernel is the slower for several ids,
            # plain indexing the slower for one)
            return self.weight[x] if x.is_cuda and x.numel() > 1 else F.embedding(x, self.weight)
        mask = (x >= self.vocab_start) & (x < self.vocab_start + self.shard_size)
        y = F.embedding((x - self.vocab_start) * mask, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(y, self.tp_group)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the hidden rows the step asks for (Context.logits_indices; every row when None); rank 0 gathers."""
    packs_on_cpu = True  # layers/cpu_weights.py; tied to the embedding, the head packs a copy (self.packed)

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False):
        super().__init__(num_embeddings, embedding_dim)
        if bias:
            raise ValueError("LM heads with a bias are not supported")
        self.packed: torch.Tensor | None = None  # a tied head's oneDNN copy on CPU (layers/cpu_weights.py)

    def forward(self, x: torch.Tensor, all_rows: bool = False) -> torch.Tensor | None:
        indices = None if all_rows else get_context().logits_indices
        if indices is not None:
            x = x[indices]
        logits = linear(x, self.weight if self.packed is None else self.packed)
        if self.tp_size == 1:
            return logits
        parts = self.tp_group.gather(logits, 0)
        return torch.cat(parts, -1) if parts is not None else None
