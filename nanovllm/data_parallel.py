"""Data parallelism on one host: `LLM(model, data_parallel_size=N)` runs N independent engine replicas, each a
spawned process with an ordinary LLM on its own tensor_parallel_size GPUs (or its share of the CPU cores).

Requests are split across replicas by the hash of their first KV block (prompts that share a prefix land together,
so the prefix cache still serves them) and balanced by tokens (prompt + n * max_tokens); results come back in input
order, as one engine would return them. Each replica talks to this process over a pipe: it validates its share
first and says so, so a bad request raises here before any replica generates, and the replicas stay usable.
"""
import atexit
import logging
import os
import time
import traceback
import weakref
from collections.abc import Iterator
from multiprocessing import connection, get_context

from nanovllm.chat import ChatMixin
from nanovllm.config import Config
from nanovllm.engine.llm_engine import as_request_lists
from nanovllm.engine.tensor_parallel import SPAWN_HINT
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_outputs import require_xgrammar
from nanovllm.utils.process import leave_now

logger = logging.getLogger("nanovllm")
EXIT_TIMEOUT_S = 30.0


class ReplicaError(RuntimeError):
    """A data-parallel replica failed (died, or raised something other than a bad-request error)."""


def route(tokens: list[int], keys: list, num_replicas: int) -> list[list[int]]:
    """Request indices per replica: requests with the same key stay together; groups go, heaviest first, to the
    least loaded replica (weights in tokens). Each replica's indices stay in input order."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    load, shares = [0] * num_replicas, [[] for _ in range(num_replicas)]
    for members in sorted(groups.values(), key=lambda m: -sum(tokens[i] for i in m)):
        r = load.index(min(load))
        shares[r] += members
        load[r] += sum(tokens[i] for i in members)
    return [sorted(share) for share in shares]


def replica_main(rank: int, model: str, kwargs: dict, conn: connection.Connection, gpus: list[int] | None,
                 threads: int, log_level: int):
    """One replica: build an LLM, then serve ("generate" | "stream", indices, prompts, params) until ("exit",)."""
    if gpus is not None:  # before CUDA is initialized: this process sees only its GPUs
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    import torch

    from nanovllm.engine.llm_engine import LLMEngine
    torch.set_num_threads(threads)
    logger.setLevel(log_level)
    llm = None
    try:
        llm = LLMEngine(model, **kwargs)
        conn.send(("ready", llm.num_kvcache_blocks))
        while True:
            message = conn.recv()
            if message[0] == "exit":
                break
            if message[0] in ("go", "cancel"):  # a stream that ended before the parent's word arrived
                continue
            kind, indices, prompts, params = message
            try:
                if kind == "generate":
                    start = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    conn.send(("result", outs, time.perf_counter() - start))
                else:
                    _serve_stream(llm, conn, indices, prompts, params)
            except (ValueError, TypeError) as e:  # a bad request: the engine is unharmed
                conn.send(("raise", e))
    except (EOFError, BrokenPipeError):
        pass  # the parent is gone
    except BaseException as e:
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
                       e if isinstance(e, (ValueError, TypeError)) else None))
        except Exception:
            pass
        os._exit(1)
    finally:
        if llm is not None:
            llm.exit()
    leave_now(0)  # the engine is shut down: no interpreter teardown (utils/process.py)


def _serve_stream(llm, conn: connection.Connection, indices: list[int], prompts, params):
    items = llm.stream(prompts, params)  # validates now
    conn.send(("accepted",))
    if conn.recv()[0] != "go":  # another replica refused its share
        items.close()
        return
    try:
        for item in items:
            item["index"] = indices[item["index"]]
            conn.send(("item", item))
            if conn.poll() and conn.recv()[0] == "cancel":  # the caller stopped reading
                break
    finally:
        items.close()  # aborts what is unfinished
    conn.send(("done",))


def _stop_replicas(conns: list, processes: list):
    """Ask every replica to exit (each shuts its own engine down), then make sure none is left."""
    for conn, process in zip(conns, processes):
        if process.is_alive():
            try:
                conn.send(("exit",))
            except (OSError, BrokenPipeError):
                pass
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()


class DataParallelLLM(ChatMixin):
    """N replicas behind one LLM-shaped object: generate, stream, chat, exit."""

    def __init__(self, model: str, **kwargs):
        self.config = config = Config.from_kwargs(model, **kwargs)  # every option checked before a process starts
        n, tp = config.data_parallel_size, config.tensor_parallel_size
        gpus = None
        if config.device == "cuda":
            import torch
            if n * tp > torch.cuda.device_count():
                raise ValueError(f"data_parallel_size={n} x tensor_parallel_size={tp} needs {n * tp} GPUs but only "
                                 f"{torch.cuda.device_count()} are visible")
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = [int(x) for x in visible.split(",")] if visible else list(range(n * tp))
            gpus = [ids[r * tp : (r + 1) * tp] for r in range(n)]
        from nanovllm.utils.loader import load_tokenizer
        try:
            self.tokenizer = load_tokenizer(config.model)
        except (OSError, ValueError):
            if config.load_format != "dummy":
                raise
            self.tokenizer = None
        self.num_replicas, self.failure, self._closed = n, None, False
        self.last_stats: list[dict] = []  # per replica, of the last generate: requests, output tokens, seconds
        replica_kwargs = {k: v for k, v in kwargs.items() if k != "data_parallel_size"}
        threads = max(1, (os.cpu_count() or 1) // n)
        ctx = get_context("spawn")
        self.processes, self.conns = [], []
        # stops the replicas when this object is garbage-collected without exit() (it holds the lists, not self:
        # `del llm` frees the GPUs), and at interpreter exit before multiprocessing's own hook joins them (atexit
        # runs last-registered first; weakref.finalize's exit hook may have been registered before that one)
        self._finalizer = weakref.finalize(self, _stop_replicas, self.conns, self.processes)
        atexit.register(self._finalizer)
        try:
            for rank in range(n):
                parent_end, child_end = ctx.Pipe()
                process = ctx.Process(target=replica_main, name=f"nanovllm-dp{rank}", daemon=False,
                                      args=(rank, model, replica_kwargs, child_end, gpus[rank] if gpus else None,
                                            threads, logger.getEffectiveLevel()))
                process.start()
                child_end.close()
                self.processes.append(process)
                self.conns.append(parent_end)
            self.num_kvcache_blocks = [self._receive(r, "ready")[1] for r in range(n)]
        except BaseException:
            self.exit()
            raise
        logger.info("data parallel: %d replicas, %s", n, f"GPUs {gpus}" if gpus else f"{threads} CPU threads each")

    # ---- talking to replicas ----------------------------------------------------------------------
    def _receive(self, rank: int, *expected: str) -> tuple:
        """The next message of replica `rank`; a death or a crash report becomes ReplicaError (and a shutdown)."""
        conn, process = self.conns[rank], self.processes[rank]
        while True:
            ready = connection.wait([conn, process.sentinel])
            if conn in ready:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    message = None
                if message is not None and message[0] != "error":
                    if expected and message[0] not in expected + ("raise",):
                        raise ReplicaError(f"replica {rank} sent {message[0]!r}, expected {expected}")
                    return message
                if message is not None:
                    self._fail(f"data-parallel replica {rank} raised:\n{message[1]}", message[2])
                process.join(5.0)  # the pipe closed: the replica is exiting
            elif not (process.sentinel in ready and not conn.poll()):
                continue
            process.join(1.0)
            hint = SPAWN_HINT if "ready" in expected else ""  # it died before it could start
            self._fail(f"data-parallel replica {rank} exited unexpectedly (exit code {process.exitcode}){hint}")

    def _fail(self, text: str, user_error: BaseException | None = None):
        self.failure = text
        logger.error("%s", text)
        self.exit()
        if user_error is not None:  # e.g. a bad checkpoint: every replica fails alike; raise the original
            raise user_error
        raise ReplicaError(f"the engine was shut down after a failure: {text}")

    def _check(self):
        if self.failure is not None:
            raise ReplicaError(f"the engine was shut down after a failure: {self.failure}")
        if self._closed:
            raise RuntimeError("this LLM has been shut down")

    def _dispatch(self, kind: str, prompts, sampling_params) -> list[list[int]]:
        """Validate the call's shape, route the requests, send each replica its share; returns the shares."""
        self._check()
        # None stays None: each replica applies the checkpoint's defaults (generation_config.json), as one engine does
        prompts, params = as_request_lists(prompts, sampling_params)
        if any(isinstance(sp, SamplingParams) and sp.structured_outputs is not None for sp in params):
            require_xgrammar()  # here: a replica takes only bad requests (ValueError, TypeError) in its stride
        ids = [self.tokenizer.encode(p) if isinstance(p, str) and self.tokenizer is not None else p for p in prompts]
        block = self.config.kvcache_block_size
        keys, tokens = [], []
        for i, (p, sp) in enumerate(zip(ids, params)):
            prefix = tuple(p[:block]) if isinstance(p, (list, tuple)) and len(p) > block else ("alone", i)
            keys.append(hash(prefix))
            sp = sp if isinstance(sp, SamplingParams) else SamplingParams()
            n, max_tokens = sp.n, sp.max_tokens
            tokens.append((len(p) if isinstance(p, (list, tuple)) else 0) + n * max_tokens)
        shares = route(tokens, keys, self.num_replicas)
        self._prompts = ids
        for rank, share in enumerate(shares):
            self.conns[rank].send((kind, share, [ids[i] for i in share],
                                   None if sampling_params is None else [params[i] for i in share]))
        return shares

    # ---- the LLM interface --------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, stream: bool = False):
        """As LLM.generate: one dict per prompt, in input order (or, with stream=True, an iterator of deltas)."""
        if stream:
            return self.stream(prompts, sampling_params, use_tqdm=use_tqdm)
        shares = self._dispatch("generate", prompts, sampling_params)
        results, error, stats = [None] * len(self._prompts), None, []
        for rank, share in enumerate(shares):  # every replica answers, so the pipes stay in step
            message = self._receive(rank, "result")
            if message[0] == "raise":
                error = error or message[1]
                continue
            _, outs, seconds = message
            for i, out in zip(share, outs):
                results[i] = out
            stats.append({"replica": rank, "requests": len(share), "seconds": seconds,
                          "output_tokens": sum(len(o["token_ids"]) for out in outs for o in out["outputs"])})
        if error is not None:
            raise error
        self.last_stats = stats
        return results

    def stream(self, prompts, sampling_params=None, use_tqdm: bool = False) -> Iterator[dict]:
        """As LLM.stream: deltas from every replica as they come, "index" being the prompt's position in the call."""
        self._dispatch("stream", prompts, sampling_params)
        answers = [self._receive(rank, "accepted") for rank in range(self.num_replicas)]
        errors = [a[1] for a in answers if a[0] == "raise"]
        for rank, answer in enumerate(answers):
            if answer[0] == "accepted":
                self.conns[rank].send(("cancel",) if errors else ("go",))
        if errors:
            raise errors[0]
        return self._items()

    def _items(self) -> Iterator[dict]:
        running = set(range(self.num_replicas))
        try:
            while running:
                ready = connection.wait([self.conns[r] for r in running] +
                                        [self.processes[r].sentinel for r in running])
                for rank in list(running):
                    if self.conns[rank] in ready or self.processes[rank].sentinel in ready:
                        message = self._receive(rank, "item", "done")
                        if message[0] == "done":
                            running.discard(rank)
                        else:
                            yield message[1]
        finally:
            if running and self.failure is None and not self._closed:  # the caller stopped early
                for rank in running:
                    self.conns[rank].send(("cancel",))
                for rank in running:
                    while self._receive(rank, "item", "done")[0] != "done":
                        pass

    def exit(self):
        """Stop every replica (each shuts its own engine down) and leave no process behind. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        atexit.unregister(self._finalizer)

    def __enter__(self) -> "DataParallelLLM":
        return self

    def __exit__(self, *exc):
        self.exit()
