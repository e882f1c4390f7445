"""The shared-memory RPC channel between rank 0 and its tensor-parallel workers."""
from __future__ import annotations

import os
import pickle
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Event

_HEADER = struct.Struct("<QH")  # message length, length of the data segment's name (the name follows)
_CONTROL_BYTES = 256


@dataclass
class ChannelEnd:
    """What one worker needs to attach to the channel; travels to it through spawn."""
    prefix: str
    ready: Event  # rank 0 -> worker: a message is waiting
    consumed: Event  # worker -> rank 0: the worker has read it; the buffer may be reused


class RpcChannel:
    """Rank 0 `send`s one pickled (method, args) message at a time; every worker `recv`s it.

    A small control segment holds the message length and the name of the data segment holding the
    message. A message larger than the data segment moves to a new segment (twice its size, with a
    fresh name, announced in the control segment), so message size has no fixed cap. Segment names
    are unique to the engine: `nanovllm_<pid>_<random>_c` and `..._d<n>`.
    """

    initial_bytes = 1 << 20

    def __init__(self, prefix: str, ends: list[ChannelEnd], owner: bool):
        self.prefix, self.ends, self.owner = prefix, ends, owner
        self.control = SharedMemory(prefix + "_c", create=owner, size=_CONTROL_BYTES if owner else 0)
        self.data: SharedMemory | None = None
        self._generation = 0

    @classmethod
    def create(cls, ctx, num_workers: int) -> RpcChannel:
        prefix = f"nanovllm_{os.getpid()}_{secrets.token_hex(4)}"
        ends = [ChannelEnd(prefix, ctx.Event(), ctx.Event()) for _ in range(num_workers)]
        for end in ends:
            end.consumed.set()
        channel = cls(prefix, ends, owner=True)
        try:
            channel._new_data_segment(cls.initial_bytes)
        except BaseException:
            channel.close()
            raise
        return channel

    @classmethod
    def attach(cls, end: ChannelEnd) -> RpcChannel:
        return cls(end.prefix, [end], owner=False)

    def _new_data_segment(self, size: int):
        old = self.data
        self._generation += 1
        self.data = SharedMemory(f"{self.prefix}_d{self._generation}", create=True, size=size)
        if old is not None:  # workers that still map it keep their mapping until they move on
            old.close()
            old.unlink()

    def send(self, method: str, *args, check: Callable[[], None] | None = None, timeout: float | None = None):
        """Rank 0. `check` runs while waiting for a worker and may raise to give up."""
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        deadline = None if timeout is None else time.monotonic() + timeout
        for end in self.ends:  # never overwrite a message a worker has not read yet
            while not end.consumed.wait(0.05):
                if check is not None:
                    check()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"a worker did not read the previous message within {timeout}s")
        if len(payload) > self.data.size:
            self._new_data_segment(2 * len(payload))
        self.data.buf[: len(payload)] = payload
        name = self.data.name.encode()
        _HEADER.pack_into(self.control.buf, 0, len(payload), len(name))
        self.control.buf[_HEADER.size : _HEADER.size + len(name)] = name
        for end in self.ends:
            end.consumed.clear()  # before `ready`, so the worker's `consumed.set` cannot be lost
            end.ready.set()

    def recv(self, check: Callable[[], None] | None = None) -> tuple[str, tuple]:
        """A worker. `check` runs about once a second while idle and may raise to give up."""
        end = self.ends[0]
        while not end.ready.wait(1.0):
            if check is not None:
                check()
        end.ready.clear()
        length, name_length = _HEADER.unpack_from(self.control.buf, 0)
        name = bytes(self.control.buf[_HEADER.size : _HEADER.size + name_length]).decode()
        if self.data is None or self.data.name != name:  # rank 0 moved to a larger segment
            if self.data is not None:
                self.data.close()
            self.data = SharedMemory(name)
        method, args = pickle.loads(self.data.buf[:length])
        end.consumed.set()
        return method, args

    def close(self):
        """Unmap the segments; the owner (rank 0) also removes them."""
        for shm in (self.data, self.control):
            if shm is None:
                continue
            shm.close()
            if self.owner:
                try:
                    shm.unlink()
                except FileNotFoundError:
                    pass
        self.data = self.control = None
