"""One caller at a time. An engine's state (its queues, its KV blocks, a data-parallel call's messages) belongs to
the call that is running; a second caller meanwhile, from another thread or from the same thread while its stream is
open, would interleave with it. The second caller is refused at once: waiting could deadlock a thread on its own
stream."""
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def interrupt_after():
    """A KeyboardInterrupt (SIGINT) that comes inside the block is raised when the block ends, not half-way: for work
    that must be done whole (a message read from or written to a pipe; a step's tokens applied to its requests).
    Only the main thread receives SIGINT: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, caught[0])
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


class Busy(RuntimeError):
    """Refused at once: another call holds the engine."""


class CallGuard:
    """`with guard("generate"):` holds the engine for one call; RuntimeError when another call holds it or the engine
    has been shut down."""

    def __init__(self):
        self._lock = threading.Lock()
        self.closed = False

    @contextmanager
    def __call__(self, what: str):
        if self.closed:
            raise RuntimeError(f"{what}(): this LLM has been shut down")
        if not self._lock.acquire(blocking=False):
            raise Busy(f"{what}() called while another call is using this engine (another thread, or a "
                               "stream that has started and is not finished or closed). One LLM serves one caller "
                               "at a time: finish or close the stream first, or give each thread its own LLM, or use "
                               "data_parallel_size for replicas behind one LLM")
        try:
            yield
        finally:
            self._lock.release()

    def shut_down_meanwhile(self) -> RuntimeError:
        """The error of a call during which exit() ran (from another thread): its requests were cancelled."""
        return RuntimeError("this LLM was shut down (exit(), from another thread or while a stream was open) while the "
                            "call ran; its requests were cancelled")


class Stream:
    """What stream() returns: its items, from a generator made by `start`. A first read refused because another call
    holds the engine leaves the stream as it was made, so a later read starts it. Any other error ends the stream:
    every later read raises RuntimeError naming it (the generator itself would just stop, and a retry would have
    yielded nothing, silently)."""

    def __init__(self, start: Callable[[], Iterator[dict]]):
        self._start, self._items, self._started = start, start(), False
        self._error: BaseException | None = None

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> dict:
        if self._error is not None:
            raise RuntimeError(f"this stream ended with {type(self._error).__name__}: {self._error}; its requests "
                               "were cancelled: make a new stream") from self._error
        try:
            item = next(self._items)
        except StopIteration:
            raise
        except BaseException as e:
            if isinstance(e, Busy) and not self._started:  # (refused before anything was queued)
                self._items = self._start()
            else:
                self._error = e
            raise
        self._started = True
        return item

    def close(self):
        self._items.close()
