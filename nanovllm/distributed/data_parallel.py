"""Data parallelism on one host: `LLM(model, data_parallel_size=N)` runs N independent engine replicas, each a
spawned process with an ordinary LLM on its own tensor_parallel_size GPUs (or its share of the CPU cores).

Requests are split across replicas by the hash of their first KV block (prompts that share a prefix land together,
so the prefix cache still serves them) and balanced by tokens (prompt + n * max_tokens); results come back in input
order, as one engine would return them. Every request is checked here, with the engine's own checks, before any
replica sees the call: a bad one raises and no replica works.

The protocol, over one pipe per replica: every message carries the id of its call. A call ends on every replica
before the next one starts: when it fails, is interrupted (KeyboardInterrupt) or is abandoned (a stream closed or
dropped), the replicas still on it are told to cancel, and their messages for it are read and dropped until each
says it is done. So no answer of one call can reach another.
"""
import atexit
import itertools
import logging
import os
import pickle
import signal
import time
import traceback
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import connection, get_context

from nanovllm.config import Config
from nanovllm.distributed.process import leave_now
from nanovllm.distributed.tensor_parallel import SPAWN_HINT
from nanovllm.engine.call_guard import CallGuard, Stream, interrupt_after
from nanovllm.engine.llm_engine import StreamDeltas, check_awake, default_sampling_params
from nanovllm.engine.requests import RequestChecker, as_request_lists
from nanovllm.frontend import Frontend
from nanovllm.inputs import call_prompts, prompt_parts
from nanovllm.sampling_params import SamplingParams
from nanovllm.vllm_options import HUB_OPTIONS

logger = logging.getLogger("nanovllm")
EXIT_TIMEOUT_S = 30.0
FINAL = ("result", "done", "value", "raise")  # a replica's last message of a call
# the engine methods the front runs on every replica (the weight and memory calls of RL loops)
REPLICA_METHODS = ("update_weights", "sleep", "wake_up", "collective_rpc", "reset_prefix_cache", "add_lora",
                   "remove_lora")


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


# ---- the replica's side ---------------------------------------------------------------------------------
def replica_main(rank: int, model: str, kwargs: dict, conn: connection.Connection, gpus: list[int] | None,
                 threads: int, log_level: int):
    """One replica: build an engine, then serve (call id, kind, payload) messages until an "exit"."""
    if gpus is not None:  # before CUDA is initialized: this process sees only its GPUs
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the parent's to handle
    import torch

    from nanovllm.engine.llm_engine import LLMEngine
    torch.set_num_threads(threads)
    logger.setLevel(log_level)
    llm = None
    try:
        llm = LLMEngine(model, **kwargs)
        if rank:  # unseeded requests: each replica its own draws (the same seed would repeat replica 0's)
            llm.collective_rpc("seed_sampler", (llm.config.seed + rank,))
        conn.send((0, "ready", llm.num_kvcache_blocks))
        Replica(llm, conn).serve()
    except (EOFError, BrokenPipeError):
        pass  # the parent is gone
    except BaseException as e:
        try:
            conn.send((0, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
                       _sendable(e) if isinstance(e, (ValueError, TypeError)) else None))
        except Exception:
            pass
        os._exit(1)
    finally:
        if llm is not None:
            llm.exit()
    leave_now(0)  # the engine is shut down: no interpreter teardown (distributed/process.py)


class Replica:
    """Serves one call at a time. Between steps it looks at its pipe: a "cancel" of the running call, or any message
    of another call (the parent only sends one after ending this one), ends it there."""

    def __init__(self, llm, conn: connection.Connection):
        self.llm, self.conn, self.inbox = llm, conn, deque()

    def serve(self):
        while True:
            call, kind, payload = self.inbox.popleft() if self.inbox else self.conn.recv()
            if kind == "exit":
                return
            if kind != "cancel":  # (a cancel of a call this replica has already finished: nothing to do)
                self.run_call(call, kind, payload)

    def ended(self, call: int) -> bool:
        while self.conn.poll():
            message = self.conn.recv()
            if message[1] == "cancel" and message[0] != call:
                continue
            if message[1] != "cancel":
                self.inbox.append(message)  # the next call, or exit: served after this one is wound up
            return True
        return False

    def run_call(self, call: int, kind: str, payload):
        llm, send = self.llm, self.conn.send
        try:
            if kind == "rpc":
                method, args, kwargs = payload
                if method not in REPLICA_METHODS:
                    raise ValueError(f"{method!r} is not a method replicas run; valid: {', '.join(REPLICA_METHODS)}")
                try:
                    value = getattr(llm, method)(*args, **kwargs)
                except Exception as e:
                    # a refusal (a RuntimeError: asleep, requests running) leaves the engine unharmed; so does
                    # whatever a collective_rpc method the caller named raises, which one engine hands back and
                    # serves on. Not so the other methods' errors, nor any that took tensor-parallel workers down.
                    workers = getattr(llm.executor, "workers", None)
                    if (not isinstance(e, RuntimeError) and method != "collective_rpc") or \
                            getattr(workers, "failure", None) is not None:
                        raise
                    send((call, "raise", _sendable(e)))
                    return
                send((call, "value", value))
                return
            prompts, params, loras = payload
            start = time.perf_counter()
            with llm._exclusive(kind):
                requests = llm._make_requests(prompts, params, kind == "stream", loras)
                deltas = StreamDeltas(llm, requests) if kind == "stream" else None
                run = llm._run(requests, use_tqdm=False)
                try:
                    for updated in run:
                        if deltas is not None and updated:
                            send((call, "items", deltas(updated)))
                        if self.ended(call):
                            send((call, "done"))
                            return
                finally:
                    run.close()  # aborts what is unfinished
            if kind == "generate":
                send((call, "result", [llm._output(samples) for samples in requests], time.perf_counter() - start))
            else:
                send((call, "done"))
        except (ValueError, TypeError) as e:  # a bad request or argument: the engine is unharmed
            send((call, "raise", _sendable(e)))


def _sendable(error: Exception) -> Exception:
    """`error`, or a RuntimeError with its text where it would not survive the pipe (an exception class whose
    arguments do not rebuild it fails to unpickle in the parent, which would then wait forever for the call's end)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _stop_replicas(conns: list, processes: list):
    """Ask every replica to exit (each shuts its own engine down), reading whatever they still send meanwhile (a
    replica blocked on a full pipe could not exit), then make sure none is left."""
    for conn, process in zip(conns, processes):
        if process.is_alive():
            try:
                conn.send((-1, "cancel", None))  # (whatever it serves: a cancel of another call ends it too)
                conn.send((-1, "exit", None))
            except (OSError, BrokenPipeError):
                pass
    try:
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        alive = [i for i, p in enumerate(processes) if p.is_alive()]
        while alive and time.monotonic() < deadline:
            waiting = [conns[i] for i in alive if not conns[i].closed] + [processes[i].sentinel for i in alive]
            for ready in connection.wait(waiting, max(0.0, deadline - time.monotonic())):
                if isinstance(ready, connection.Connection):
                    try:
                        ready.recv()
                    except Exception:  # (EOF; or a message torn by another thread reading the same pipe)
                        ready.close()
            alive = [i for i in alive if processes[i].is_alive()]
    finally:  # whatever happened above, no replica is left running
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(5.0)
            if process.is_alive():
                process.kill()
            process.join()
        for conn in conns:
            conn.close()


# ---- this process's side -----------------------------------------------------------------------------
class DataParallelLLM(Frontend):
    """N replicas behind one LLM's API: generate, stream and chat split the requests over them and merge the results
    in order; update_weights, sleep, wake_up, collective_rpc and reset_prefix_cache run on every replica."""

    def __init__(self, model: str | None = None, **kwargs):
        self.config = config = Config.from_kwargs(model, **kwargs)  # every option checked before a process starts
        if callable(config.hf_overrides):  # (each replica loads the config itself, applying the function)
            try:
                pickle.dumps(config.hf_overrides)
            except Exception as e:
                raise TypeError(f"with data_parallel_size > 1 the hf_overrides function must pickle, as each replica "
                                f"applies it ({e}): define it at a module's top level, or pass a dict") from None
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
        from nanovllm.checkpoint.loader import load_tokenizer
        self.default_sampling_params = default_sampling_params(config.model)  # (a bad file raises here)
        try:
            self.tokenizer = load_tokenizer(config.model)
        except (OSError, ValueError):
            if config.load_format != "dummy":
                raise
            self.tokenizer = None
        self.num_replicas, self.failure = n, None
        self._exclusive = CallGuard()
        self._calls = 0  # the last call id
        self._request_ids = itertools.count()  # RequestOutput.request_id, across the replicas
        self._open: dict[int, int] = {}  # replica -> the call it is still on (until its final message is read)
        self._grammars = None  # structured outputs: a compiler, to refuse a bad spec here
        self.lora = None  # enable_lora: the adapters the replicas know, each checked here first (as one engine does)
        if config.enable_lora:
            from nanovllm.lora.manager import LoRAManager
            self.lora = LoRAManager(config)
        self._asleep: set[str] = set()  # as one engine keeps them (LLMEngine), for every replica at once
        self._weights_discarded: str | None = None
        self.last_stats: list[dict] = []  # per replica, of the last generate: requests, output tokens, seconds
        # (each replica takes the checkpoint's local path, config.model: a Hub id's options, and vLLM's tokenizer
        # option naming the id, were read here)
        replica_kwargs = {k: v for k, v in kwargs.items() if k not in ("data_parallel_size", "tokenizer", *HUB_OPTIONS)}
        threads = max(1, (os.cpu_count() or 1) // n)
        ctx = get_context("spawn")
        self.processes, self.conns = [], []
        # stops the replicas when this object is garbage-collected without exit() (it holds the lists, not self:
        # `del llm` frees the GPUs), and at interpreter exit before multiprocessing's own hook joins them (atexit
        # runs last-registered first; weakref.finalize's own exit hook may have been registered before that one)
        self._finalizer = weakref.finalize(self, _stop_replicas, self.conns, self.processes)
        atexit.register(self._finalizer)
        try:
            for rank in range(n):
                parent_end, child_end = ctx.Pipe()
                process = ctx.Process(target=replica_main, name=f"nanovllm-dp{rank}", daemon=False,
                                      args=(rank, config.model, replica_kwargs, child_end, gpus[rank] if gpus else None,
                                            threads, logger.getEffectiveLevel()))
                process.start()
                child_end.close()
                self.processes.append(process)
                self.conns.append(parent_end)
            self.num_kvcache_blocks = [self._ready(r) for r in range(n)]
        except BaseException:
            self.exit()
            raise
        self.requests = RequestChecker(config.hf_config.vocab_size, config.max_model_len, config.max_num_seqs,
                                       config.kvcache_block_size, min(self.num_kvcache_blocks), self.tokenizer,
                                       config.model, longer=config.longer_prompts,
                                       image_token_ids=config.image_token_ids)  # (grammars: _check_requests)
        logger.info("data parallel: %d replicas, %s", n, f"GPUs {gpus}" if gpus else f"{threads} CPU threads each")

    # ---- talking to replicas ----------------------------------------------------------------------
    def _read(self, rank: int, timeout: float | None = None) -> tuple | None:
        """The next message of replica `rank` (None after `timeout` seconds); a death or a crash report becomes
        ReplicaError (and a shutdown)."""
        conn, process = self.conns[rank], self.processes[rank]
        if self._exclusive.closed:  # exit() from another thread: the pipes are closed or being drained by it
            raise self._exclusive.shut_down_meanwhile()
        with self._pipes():
            ready = connection.wait([conn, process.sentinel], timeout)
        if not ready:
            return None
        if conn in ready:
            try:
                with interrupt_after():  # (half a message left in the pipe would be the next call's garbage)
                    message = conn.recv()
            except (EOFError, OSError):
                message = None
            if message is not None and message[1] != "error":
                return message
            if self._exclusive.closed:  # (exit() from another thread stopped the replica)
                raise self._exclusive.shut_down_meanwhile()
            if message is not None:
                self._fail(f"data-parallel replica {rank} raised:\n{message[2]}", message[3])
            process.join(5.0)  # the pipe closed: the replica is exiting
        process.join(1.0)
        hint = SPAWN_HINT if not hasattr(self, "num_kvcache_blocks") else ""  # it died before it could start
        self._fail(f"data-parallel replica {rank} exited unexpectedly (exit code {process.exitcode}){hint}")

    def _ready(self, rank: int) -> int:
        return self._read(rank)[2]

    def _send(self, rank: int, message: tuple):
        with self._pipes(), interrupt_after():
            self.conns[rank].send(message)

    @contextmanager
    def _pipes(self):
        """A pipe that exit() closed from another thread (after this thread's last look at `closed`) fails as the
        call's shutdown, not as a bare OSError or ValueError."""
        try:
            yield
        except (OSError, EOFError, ValueError):
            if self._exclusive.closed:
                raise self._exclusive.shut_down_meanwhile() from None
            raise

    def _fail(self, text: str, user_error: BaseException | None = None):
        self.failure = text
        logger.error("%s", text)
        self.exit()
        if user_error is not None:  # e.g. a bad checkpoint: every replica fails alike; raise the original
            raise user_error
        raise ReplicaError(f"the engine was shut down after a failure: {text}")

    def _check_alive(self):
        if self.failure is not None:
            raise ReplicaError(f"the engine was shut down after a failure: {self.failure}")

    def _start(self, kind: str, payloads: dict[int, object]) -> int:
        """Send a new call to the replicas in `payloads`; returns its id. Any earlier call is ended first."""
        self._end_calls()
        self._calls += 1
        for rank, payload in payloads.items():
            self._send(rank, (self._calls, kind, payload))
            self._open[rank] = self._calls  # (after the send: a replica the call never reached owes no answer)
        return self._calls

    def _messages(self, call: int) -> Iterator[tuple[int, tuple]]:
        """(rank, message) of `call` as they come, until every replica on it has sent its final message; messages of
        ended calls are dropped."""
        while True:
            if self._exclusive.closed:  # (exit() empties _open: the call would seem to end, its answers cut short)
                raise self._exclusive.shut_down_meanwhile()
            ranks = [r for r, c in self._open.items() if c == call]
            if not ranks:
                return
            with self._pipes():
                connection.wait([self.conns[r] for r in ranks] + [self.processes[r].sentinel for r in ranks])
            for rank in ranks:
                message = self._read(rank, timeout=0)
                if message is None or message[0] != call:
                    continue
                if message[1] in FINAL:
                    self._open.pop(rank, None)  # (exit() from another thread may have emptied it meanwhile)
                yield rank, message

    def _end_calls(self):
        """Cancel what replicas are still on, and read their messages until each says it is done."""
        if not self._open:
            return
        for rank, call in self._open.items():
            self._send(rank, (call, "cancel", None))
        while self._open:
            for rank, call in list(self._open.items()):
                message = self._read(rank, timeout=0.05)
                if message is not None and message[0] == call and message[1] in FINAL:
                    del self._open[rank]

    def _compile_grammar(self, spec):
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError(f"structured outputs need a tokenizer, and {self.config.model!r} has none")
            from nanovllm.sampling.structured_outputs import GrammarCompiler
            self._grammars = GrammarCompiler(self.tokenizer, self.config.hf_config.vocab_size,
                                             self.config.eos_token_ids)
        return self._grammars.compile(spec)

    def _check_requests(self, prompts, sampling_params, lora_request=None) -> list[tuple]:
        """Every request checked as one engine checks it, its adapter too (ValueError/TypeError before any replica
        works): (token ids, SamplingParams, LoRARequest or None, request id) each."""
        self._check_alive()
        if self._exclusive.closed:
            raise RuntimeError("this LLM has been shut down")
        self._check_awake()
        prompts, params, loras = as_request_lists(
            prompts, self.default_sampling_params if sampling_params is None else sampling_params, lora_request)
        checked = []
        for prompt, sp in zip(prompts, params):
            ids, sp = self.requests.check(prompt, sp)
            # its RequestOutput.request_id, drawn where one engine draws it (LLMEngine.make_sequence): when the
            # request is checked, before its grammar is compiled, in stream() too, so that ids go on as one
            # engine's do after a refused call or a stream
            request_id = str(next(self._request_ids))
            if sp.structured_outputs is not None:
                self._compile_grammar(sp.structured_outputs)  # a spec that cannot be enforced raises now
            checked.append((ids, sp, request_id))
        if any(lora is not None for lora in loras):
            if self.lora is None:
                raise ValueError("lora_request given, but LoRA is not enabled: create the LLM with enable_lora=True "
                                 "(and max_loras, max_lora_rank as needed), or pass lora_request=None")
            self.lora.register(loras)
        return [(ids, sp, lora, request_id) for (ids, sp, request_id), lora in zip(checked, loras)]

    def _dispatch(self, kind: str, checked: list[tuple]) -> tuple[int, list[list[int]]]:
        """Route checked requests, send each replica its share; returns the call's id and the shares. Requests that
        share a first block under one adapter (or the base model) go to one replica, where its prefix cache serves
        them."""
        self._check_alive()
        block = self.config.kvcache_block_size
        keys, tokens = [], []
        for i, (ids, sp, lora, _) in enumerate(checked):
            adapter = lora.lora_int_id if lora is not None else 0
            keys.append(hash((adapter, tuple(ids[:block])) if len(ids) > block else ("alone", i)))
            tokens.append(len(ids) + sp.n * sp.max_tokens)
        shares = route(tokens, keys, self.num_replicas)
        payloads = {rank: tuple([checked[i][part] for i in share] for part in range(3))
                    for rank, share in enumerate(shares) if share}
        return self._start(kind, payloads), shares

    # ---- the LLM interface --------------------------------------------------------------------------
    def generate(self, prompts=None, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, stream: bool = False, *, lora_request=None, prompt_token_ids=None,
                 priority=None, tokenization_kwargs=None):
        """As LLM.generate: one RequestOutput per prompt, in input order (or, with stream=True, an iterator of
        deltas)."""
        prompts = call_prompts(prompts, prompt_token_ids, priority, tokenization_kwargs)
        if stream:
            return self.stream(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        self._check_alive()
        with self._exclusive("generate"):
            checked = self._check_requests(prompts, sampling_params, lora_request)
            call, shares = self._dispatch("generate", checked)
            try:
                results, stats = [None] * sum(map(len, shares)), []
                for rank, message in self._messages(call):
                    if message[1] == "raise":
                        raise message[2]
                    _, _, outs, seconds = message
                    for i, out in zip(shares[rank], outs):
                        results[i] = out
                    stats.append({"replica": rank, "requests": len(shares[rank]), "seconds": seconds,
                                  "output_tokens": sum(len(o["token_ids"]) for out in outs for o in out["outputs"])})
            finally:
                self._end_calls()  # (nothing left to end unless this call failed or was interrupted)
            self.last_stats = sorted(stats, key=lambda s: s["replica"])
            for out, prompt, request in zip(results, as_request_lists(prompts, None)[0], checked):
                out.request_id = request[3]  # (replicas saw token ids only, and count ids of their own)
                out.prompt = prompt_parts(prompt)[0]
            return results

    def stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
               use_tqdm: bool = False, lora_request=None) -> Iterator[dict]:
        """As LLM.stream: deltas from every replica as they come, "index" being the prompt's position in the call.
        Requests are checked here; the stream holds the engine from its first item until exhausted or closed."""
        checked = self._check_requests(prompts, sampling_params, lora_request)
        return Stream(lambda: self._stream(checked))

    def _stream(self, checked: list[tuple]) -> Iterator[dict]:
        with self._exclusive("stream"):
            self._check_awake()  # (a stream may have been made before a sleep(), as on one engine)
            # its adapters once more, as one engine's stream does: a remove_lora since stream() forgot one (the
            # replicas read it again, so these books must list it again) or gave its id to another (ValueError)
            loras = [request[2] for request in checked]
            if self.lora is not None and any(lora is not None for lora in loras):
                self.lora.register(loras)
            call, shares = self._dispatch("stream", checked)
            try:
                for rank, message in self._messages(call):
                    if message[1] == "raise":
                        raise message[2]
                    if message[1] == "items":
                        for item in message[2]:
                            item["index"] = shares[rank][item["index"]]
                            yield item
            finally:
                if self.failure is None and not self._exclusive.closed:
                    self._end_calls()

    # ---- one engine's request-at-a-time loop: refused, saying what to use ----------------------------------
    # (llm.llm_engine's add_request, step and abort_request call these too: each says why, and what to call instead)
    def _no_step_api(self, what: str):
        raise NotImplementedError(f"{what}() is not available with data_parallel_size > 1: the replicas serve whole "
                                  "calls; use generate() or stream(), or an LLM with data_parallel_size=1 for "
                                  "add_request / step")

    def add_request(self, prompt=None, sampling_params=None, lora_request=None, **options):
        self._no_step_api("add_request")

    def abort_sequences(self, seqs):
        self._no_step_api("abort_request")

    def step(self):
        self._no_step_api("step")

    def is_finished(self) -> bool:
        self._no_step_api("is_finished")

    # ---- weights and memory: every replica, as one engine ---------------------------------------------
    def _on_every_replica(self, what: str, method: str, *args) -> tuple[list, BaseException | None]:
        """LLMEngine.`method`(*args) on every replica, one call at a time: each replica's result in replica order,
        and the first replica's error (a ValueError, TypeError or RuntimeError: a refusal, the replica unharmed)."""
        self._check_alive()
        with self._exclusive(what):
            return self._rpc_held(method, *args)

    def _rpc_held(self, method: str, *args) -> tuple[list, BaseException | None]:
        """_on_every_replica for a caller that already holds the engine (_exclusive)."""
        call = self._start("rpc", dict.fromkeys(range(self.num_replicas), (method, args, {})))
        results, error = [None] * self.num_replicas, None
        try:
            for rank, message in self._messages(call):
                if message[1] == "raise":
                    error = error or message[2]
                else:
                    results[rank] = message[2]
        finally:
            self._end_calls()
        return results, error

    def _check_awake(self):
        check_awake(self._asleep, self._weights_discarded)

    # ---- LoRA adapters: checked here, known to every replica --------------------------------------------
    # (Both hold the engine before they touch this process's books, as one engine does: refused while a stream is
    # open, they must leave the adapters as they were, or the books and the replicas' would name different ones.)
    def add_lora(self, lora_request) -> bool:
        """As LLMEngine.add_lora: checked here, then added on every replica."""
        self._check_alive()
        with self._exclusive("add_lora"):
            if lora_request is None:
                raise TypeError("add_lora needs a LoRARequest, got None")
            if self.lora is None:
                raise ValueError("add_lora needs LoRA enabled: create the LLM with enable_lora=True")
            self.lora.register([lora_request])
            _, error = self._rpc_held("add_lora", lora_request)
        if error is not None:
            raise error
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """As LLMEngine.remove_lora, on every replica."""
        self._check_alive()
        with self._exclusive("remove_lora"):
            if self.lora is None or not self.lora.remove(lora_id):
                return False
            _, error = self._rpc_held("remove_lora", lora_id)
        if error is not None:
            raise error
        return True

    def list_loras(self) -> set[int]:
        return set(self.lora.adapters) if self.lora is not None else set()

    def update_weights(self, weights) -> None:
        """As LLMEngine.update_weights, on every replica: the pairs are checked here, then each replica checks names
        and shapes before it writes (identical replicas refuse alike: none writes). Tensors travel pickled, on the
        host; a checkpoint directory is read by each replica."""
        from nanovllm.engine.llm_engine import _weight_pairs
        weights = _weight_pairs(weights)
        if not isinstance(weights, str):
            weights = [(name, tensor.detach().cpu()) for name, tensor in weights]
        _, error = self._on_every_replica("update_weights", "update_weights", weights)
        if error is not None:
            if not isinstance(error, (ValueError, TypeError)):  # (those: refused by the checks, nothing written)
                self._weights_discarded = f"an update_weights() failed while writing on a replica ({error})"
            raise error
        self._weights_discarded = None
        self._asleep.discard("weights")

    def sleep(self, level: int = 1) -> None:
        """As LLMEngine.sleep, on every replica."""
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights kept in host memory) or 2 (weights freed), got {level!r}")
        if self._asleep:
            raise RuntimeError(f"the engine is already asleep ({', '.join(sorted(self._asleep))}); call wake_up()")
        _, error = self._on_every_replica("sleep", "sleep", level)
        if error is not None:
            raise error
        self._asleep = {"weights", "kv_cache"}
        if level == 2:
            self._weights_discarded = "the weights were freed by sleep(level=2)"

    def wake_up(self, tags: list[str] | None = None) -> None:
        """As LLMEngine.wake_up, on every replica."""
        _, error = self._on_every_replica("wake_up", "wake_up", tags)
        if error is not None:
            raise error
        self._asleep -= {"weights", "kv_cache"} if tags is None else set(tags)

    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def collective_rpc(self, method: str, args: tuple | None = (), kwargs: dict | None = None) -> list:
        """As LLMEngine.collective_rpc, on every replica: the results of every rank of replica 0, then of replica 1,
        ..."""
        results, error = self._on_every_replica("collective_rpc", "collective_rpc", method, args, kwargs)
        if error is not None:
            raise error
        return [r for replica in results for r in replica]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Every replica's (between calls no replica runs a request, so there is nothing to preempt)."""
        _, error = self._on_every_replica("reset_prefix_cache", "reset_prefix_cache")
        if error is not None:
            raise error
        return True

    def exit(self):
        """Stop every replica (each shuts its own engine down) and leave no process behind. Idempotent."""
        if self._exclusive.closed:
            return
        self._exclusive.closed = True
        self._open.clear()
        self._finalizer()
        atexit.unregister(self._finalizer)

    def __enter__(self) -> "DataParallelLLM":
        return self

    def __exit__(self, *exc):
        self.exit()
