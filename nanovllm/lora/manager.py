"""The engine's side of LoRA: the adapters it knows (each checked once, when first named), and which adapter each of
the max_loras device slots holds. The scheduler asks for a slot when it admits a request: an adapter already in one
takes it; otherwise the least recently used slot that no running sequence uses is refilled (the step's
ScheduledBatch.lora_loads tells every rank); with none free the request waits."""
import itertools
from collections import OrderedDict

from nanovllm.lora.peft import Adapter, read_adapter
from nanovllm.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, config):
        self.hf_config, self.max_rank = config.hf_config, config.max_lora_rank
        self.adapters: dict[int, Adapter] = {}
        self.owner: list[int | None] = [None] * config.max_loras  # slot -> adapter id
        self.recent: OrderedDict[int, None] = OrderedDict.fromkeys(range(config.max_loras))  # least recent first
        self.generations = itertools.count(1)
        self.stale = False  # after a failed step: the running sequences' adapters must be loaded again

    def register(self, requests: list[LoRARequest | None]) -> list[Adapter | None]:
        """The checked adapter of each request (None for None), each read the first time its id is named. All or
        nothing: ValueError for a bad adapter or an id already naming another adapter, and then none is kept."""
        new: dict[int, Adapter] = {}
        adapters = []
        for request in requests:
            if request is None:
                adapters.append(None)
                continue
            if not isinstance(request, LoRARequest):
                raise TypeError(f"lora_request must be a nanovllm.lora.LoRARequest or None, got "
                                f"{type(request).__name__}")
            known = self.adapters.get(request.lora_int_id) or new.get(request.lora_int_id)
            if known is None:
                known = new[request.lora_int_id] = read_adapter(request, self.hf_config, self.max_rank)
            elif known.request.lora_path != request.lora_path:
                raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {known.request.lora_name!r} "
                                 f"({known.request.lora_path}); give {request.lora_path} another id, or remove_lora "
                                 "the first")
            adapters.append(known)
        for lora_id, adapter in new.items():
            adapter.generation = next(self.generations)
            self.adapters[lora_id] = adapter
        return adapters

    def remove(self, lora_id: int) -> bool:
        if self.adapters.pop(lora_id, None) is None:
            return False
        for slot, owner in enumerate(self.owner):
            if owner == lora_id:
                self.owner[slot] = None
                self.recent.move_to_end(slot, last=False)  # the first to refill
        return True

    def acquire(self, lora_id: int, in_use: set[int]) -> tuple[int, Adapter | None] | None:
        """A slot for adapter `lora_id` and the adapter to load into it (None: it holds the adapter already), or
        None when every slot holds an adapter in use."""
        if lora_id in self.owner:
            slot = self.owner.index(lora_id)
            self.recent.move_to_end(slot)
            return slot, None
        for slot in self.recent:
            if slot not in in_use:
                self.owner[slot] = lora_id
                self.recent.move_to_end(slot)
                return slot, self.adapters[lora_id]
        return None

    def forget(self):
        """After a failed step: no slot's content is certain any more (a load may not have run); the scheduler loads
        the running sequences' adapters again before their next step."""
        self.owner = [None] * len(self.owner)
        self.stale = True

