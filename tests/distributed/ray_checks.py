"""nanovllm.ray on a local Ray cluster: a Dataset in, a Dataset out, every row exactly once, outputs equal one
engine's, also when an actor dies mid-run (Ray restarts it and retries the batch).

Run by tests/distributed/test_ray.py in a fresh interpreter: starting Ray forks processes, which a test process grown
large by the rest of the suite may not be allowed to do. Not collected on its own (no test_ prefix)."""
import importlib.util
import os
import sys

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.ray import NanoVLLMActor, build_processor
from tests.tiny_models import CHAT_TEMPLATE, make_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason='needs pip install "nanovllm[ray]"')


class DyingOnceActor(NanoVLLMActor):
    """Exits in the middle of its first batch (the marker file says it already did)."""

    def __call__(self, batch):
        marker = os.environ["NANOVLLM_TEST_MARKER"]
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return super().__call__(batch)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("ray_model"), "qwen3", tie=True, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    if importlib.util.find_spec("ray") is None:
        pytest.skip('needs pip install "nanovllm[ray]"')
    import ray
    marker = str(tmp_path_factory.mktemp("ray") / "died")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([ROOT, *sys.path]),
                                       "NANOVLLM_TEST_MARKER": marker}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield marker
    ray.shutdown()


def _rows() -> list[dict]:
    """Text prompts, chat messages and a per-row override (a column holds one type, as in a real dataset)."""
    rows = [{"id": i, "prompt": f"Hello world! {i}"} for i in range(9)]
    rows += [{"id": 9, "prompt": None, "messages": [{"role": "user", "content": "How are you?"}]},
             {"id": 10, "prompt": None, "messages": [{"role": "user", "content": "Paris?"}]},
             {"id": 11, "prompt": "Paris", "sampling_params": {"max_tokens": 3}}]
    return rows


def _token_rows() -> list[dict]:
    return [{"id": 12 + i, "prompt": [3, 1, 4, 1, 5, 9, 2, 6][: 3 + i]} for i in range(4)]


def _expected(model: str) -> dict[int, list[int]]:
    with LLM(model, **ENGINE) as llm:
        out = {}
        for row in _rows() + _token_rows():
            sp = SamplingParams(**{**GREEDY, **row.get("sampling_params", {})})
            result = llm.chat(row["messages"], sp, use_tqdm=False) if row.get("messages") else \
                llm.generate([row["prompt"]], sp, use_tqdm=False)
            out[row["id"]] = result[0]["token_ids"]
        return out


@needs_ray
def test_every_row_once_and_equal_to_one_engine(ray_cluster, model):
    import ray
    proc = build_processor(model, engine_kwargs=ENGINE, sampling_params=GREEDY, concurrency=2, batch_size=3)
    rows = proc(ray.data.from_items(_rows())).take_all() + proc(ray.data.from_items(_token_rows())).take_all()
    assert sorted(r["id"] for r in rows) == list(range(16))
    assert {r["id"]: list(r["generated_token_ids"]) for r in rows} == _expected(model)
    assert all({"prompt", "generated_text", "finish_reason", "num_cached_tokens"} <= set(r) for r in rows)
    assert {r["id"]: r["finish_reason"] for r in rows}[11] == "length"


@needs_ray
def test_an_actor_that_dies_mid_run_loses_and_repeats_no_row(ray_cluster, model):
    import ray
    proc = build_processor(model, engine_kwargs=ENGINE, sampling_params=GREEDY, concurrency=2, batch_size=2)
    proc.actor_class = DyingOnceActor
    rows = proc(ray.data.from_items(_rows())).take_all()
    assert os.path.exists(ray_cluster)  # an actor did die
    assert sorted(r["id"] for r in rows) == list(range(12))
    expected = _expected(model)
    assert {r["id"]: list(r["generated_token_ids"]) for r in rows} == {i: expected[i] for i in range(12)}


@needs_ray
def test_rows_keep_64_bit_seeds_and_bad_rows_are_named(ray_cluster, model):
    """An int field some rows lack would reach a numpy batch as float64 (2**60 + 1 -> 2**60): batches are Arrow
    tables, so the seed arrives exact. A bad row fails its batch with an error naming it."""
    import ray
    seed = 2**60 + 1
    sampled = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    rows = [{"id": 0, "prompt": "Hello", "sampling_params": {"seed": seed}},
            {"id": 1, "prompt": "Hello", "sampling_params": {"temperature": 0.5}}]
    proc = build_processor(model, engine_kwargs=ENGINE, sampling_params=sampled, batch_size=2)
    out = {r["id"]: list(r["generated_token_ids"]) for r in proc(ray.data.from_items(rows)).take_all()}
    with LLM(model, **ENGINE) as llm:
        exact, rounded = (llm.generate(["Hello"], SamplingParams(**sampled, seed=s), use_tqdm=False)[0]["token_ids"]
                          for s in (seed, 2**60))
    assert exact != rounded and out[0] == exact
    for bad_rows, match in [([{"id": 7, "prompt": [1.9, 2.9]}], "row 0 of its batch \\(id=7\\): a prompt must be"),
                            ([{"id": 8, "prompt": "a"}, {"id": 9, "prompt": None}], "id=9\\): it has neither"),
                            ([{"id": 5, "messages": [{"content": "no role"}]}], "id=5\\): message 0 of conversation 0"),
                            ([{"id": 6, "prompt": "a", "sampling_params": {"top_p": 2.0}}], "id=6\\): top_p")]:
        with pytest.raises(Exception, match=match):
            proc(ray.data.from_items(bad_rows)).take_all()


@needs_ray
def test_unseeded_copies_of_a_prompt_draw_apart_across_actors(ray_cluster, model):
    """One prompt eight times, unseeded, one row a batch over two actors: each actor draws from its own generator
    (one engine seed for every actor repeated the k-th batch's sample on each)."""
    import ray
    proc = build_processor(model, engine_kwargs=ENGINE, sampling_params=dict(temperature=1.0, max_tokens=12,
                                                                             ignore_eos=True),
                           concurrency=2, batch_size=1)
    rows = proc(ray.data.from_items([{"id": i, "prompt": "Hello"} for i in range(8)])).take_all()
    assert len({tuple(r["generated_token_ids"]) for r in rows}) == 8


@needs_ray
def test_max_retries_reaches_ray(ray_cluster, model):
    """max_retries=0: an actor that dies fails the run (the option is Ray's restart and retry count, not ignored)."""
    import ray
    os.remove(ray_cluster) if os.path.exists(ray_cluster) else None
    proc = build_processor(model, engine_kwargs=ENGINE, sampling_params=GREEDY, batch_size=2, max_retries=0)
    proc.actor_class = DyingOnceActor
    with pytest.raises(ray.exceptions.ActorDiedError):
        proc(ray.data.from_items(_rows())).take_all()
    assert os.path.exists(ray_cluster)  # it did die, and nothing brought it back
