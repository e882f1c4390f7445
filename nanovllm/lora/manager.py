"""The engine's side of LoRA: the adapters it knows (each checked once, when first named), and which adapter each of
the max_loras device slots holds. The scheduler asks for a slot when it admits a request: an adapter already in one
takes it; otherwise the least recently used slot that no running sequence uses is refilled (the step's
ScheduledBatch.lora_loads tells every rank); with none free the request waits."""
from collections import OrderedDict

from nanovllm.lora.peft import Adapter, read_adapter
from nanovllm.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, config):
        self.hf_config, self.max_rank = config.hf_config, config.max_lora_rank
        self.adapters: dict[int, Adapter] = {}
        self.owner: list[int | None] = [None] * config.max_loras  # slot -> adapter id
        self.recent: OrderedDict[int, None] = OrderedDict.fromkeys(range(config.max_loras))  # least recent first

    def register(self, request: LoRARequest) -> Adapter:
        """The checked adapter of `request` (read the first time its id is named); ValueError for a bad adapter or
        an id already naming another adapter."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a nanovllm.lora.LoRARequest or None, got {type(request).__name__}")
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if known.request.lora_path != request.lora_path:
                raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {known.request.lora_name!r} "
                                 f"({known.request.lora_path}); give {request.lora_path} another id, or remove_lora "
                                 "the first")
            return known
        adapter = self.adapters[request.lora_int_id] = read_adapter(request, self.hf_config, self.max_rank)
        return adapter

    def remove(self, lora_id: int) -> bool:
        if self.adapters.pop(lora_id, None) is None:
            return False
        for slot, owner in enumerate(self.owner):
            if owner == lora_id:
                self.owner[slot] = None
                self.recent.move_to_end(slot, last=False)  # the first to refill
        return True

    def acquire(self, lora_id: int, in_use: set[int]) -> tuple[int, LoRARequest | None] | None:
        """A slot for adapter `lora_id` and the request to load into it (None: it holds the adapter already), or
        None when every slot holds an adapter in use."""
        if lora_id in self.owner:
            slot = self.owner.index(lora_id)
            self.recent.move_to_end(slot)
            return slot, None
        for slot in self.recent:
            if slot not in in_use:
                self.owner[slot] = lora_id
                self.recent.move_to_end(slot)
                return slot, self.adapters[lora_id].request
        return None

    def forget(self):
        """After a failed step: no slot's content is certain any more (a load may not have run)."""
        self.owner = [None] * len(self.owner)

