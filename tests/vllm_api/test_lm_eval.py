"""lm-evaluation-harness through nanovllm's "nanovllm" model type (nanovllm/lm_eval.py) and through lm-eval's own
transformers backend, on the bundled model and three local tasks (no downloads): a multiple choice (loglikelihood),
a generation (generate_until) and a perplexity (loglikelihood_rolling). The scores are equal."""
import json
import os

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # (lm-eval's transformers backend)

CAPITALS = [("France", "Paris", ["Paris", "London", "Berlin", "Madrid"]),
            ("Germany", "Berlin", ["Rome", "Berlin", "Paris", "Vienna"]),
            ("Italy", "Rome", ["Madrid", "Lisbon", "Rome", "Athens"]),
            ("Japan", "Tokyo", ["Beijing", "Seoul", "Tokyo", "Bangkok"]),
            ("Spain", "Madrid", ["Madrid", "Porto", "Paris", "Rome"]),
            ("Egypt", "Cairo", ["Nairobi", "Cairo", "Lagos", "Tunis"])]
SUMS = [(2, 3), (10, 5), (7, 1), (4, 4)]
TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Paris is the capital and largest city of France. It is known for the Eiffel Tower.",
         "Water boils at one hundred degrees Celsius at sea level."]


def _task(folder, name: str, rows: list[dict], spec: str) -> None:
    data = os.path.join(folder, f"{name}.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
        f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                f"test_split: test\n{spec}")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    _task(folder, "nano_capitals", [{"country": c, "choices": ch, "answer": ch.index(a)} for c, a, ch in CAPITALS],
          'output_type: multiple_choice\ndoc_to_text: "Question: What is the capital of {{country}}?\\nAnswer:"\n'
          'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
          "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    _task(folder, "nano_sums", [{"a": a, "b": b, "answer": str(a + b)} for a, b in SUMS],
          'output_type: generate_until\ndoc_to_text: "Q: What is {{a}} plus {{b}}?\\nA:"\ndoc_to_target: "{{answer}}"\n'
          'generation_kwargs:\n  until: ["\\n"]\n  do_sample: false\n  max_gen_toks: 12\n'
          "metric_list:\n  - metric: exact_match\n"
          'filter_list:\n  - name: last_number\n    filter:\n      - function: regex\n'
          '        regex_pattern: "(-?[0-9]+)(?!.*[0-9])"\n      - function: take_first\n')
    _task(folder, "nano_text", [{"text": t} for t in TEXTS],
          'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
          "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    return str(folder)


def _evaluate(model: str, model_args: str, tasks: str) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import nanovllm.lm_eval  # noqa: F401  (registers "nanovllm")
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["nano_capitals", "nano_sums",
                                                                               "nano_text"],
                                  task_manager=TaskManager(include_path=tasks), log_samples=True)
    return out


@pytest.fixture(scope="module")
def hf_scores(bundled, tasks) -> dict:
    """lm-eval's transformers backend on the bundled model in float32: the reference both tests compare with (run
    once: it is the slowest evaluation here)."""
    folder, name = os.path.split(bundled)
    return _evaluate("hf", f"pretrained={folder},gguf_file={name},dtype=float32,device=cpu", tasks)


def test_scores_equal_the_transformers_backend(bundled, tasks, hf_scores):
    folder, name = os.path.split(bundled)
    ours = _evaluate("nanovllm", f"pretrained={folder},gguf_file={name},max_model_len=2048", tasks)
    reference = hf_scores
    for task, metrics in reference["results"].items():
        for metric, value in metrics.items():
            if not isinstance(value, float) or "stderr" in metric:
                continue
            if "perplexity" in metric or "bits_per_byte" in metric:
                assert ours["results"][task][metric] == pytest.approx(value, rel=1e-5), (task, metric)
            else:
                assert ours["results"][task][metric] == value, (task, metric)
    assert reference["results"]["nano_capitals"]["acc,none"] > 0.5  # a real model answering, not chance
    assert reference["results"]["nano_sums"]["exact_match,last_number"] > 0
    for task in ("nano_capitals", "nano_text"):  # each scored sample, within float32 rounding
        for a, b in zip(ours["samples"][task], reference["samples"][task], strict=True):
            for (x, *_), (y, *_) in zip(a["resps"], b["resps"]):
                lp_a, lp_b = (x[0], y[0]) if isinstance(x, (list, tuple)) else (x, y)
                assert lp_a == pytest.approx(lp_b, abs=1e-4), task
    responses = [s["filtered_resps"] for s in ours["samples"]["nano_sums"]]
    assert responses == [s["filtered_resps"] for s in reference["samples"]["nano_sums"]]


def test_a_lora_adapter_scores_as_the_transformers_backend_with_peft(bundled, tasks, hf_scores, tmp_path):
    """lora_local_path (lm-eval's vLLM backend's name) against the transformers backend's peft=: the same adapter
    of the bundled model, the same scores."""
    from nanovllm.checkpoint.loader import resolve_checkpoint
    from tests.lora.adapters import make_adapter
    folder, name = os.path.split(bundled)
    adapter = make_adapter(resolve_checkpoint(bundled), tmp_path / "adapter", 8,
                           ["q_proj", "v_proj", "gate_proj", "down_proj"], alpha=8, seed=5, scale=0.5)
    ours = _evaluate("nanovllm", f"pretrained={folder},gguf_file={name},max_model_len=2048,"
                                 f"lora_local_path={adapter}", tasks)
    reference = _evaluate("hf", f"pretrained={folder},gguf_file={name},dtype=float32,device=cpu,peft={adapter}",
                          tasks)
    assert reference["results"]["nano_text"] != hf_scores["results"]["nano_text"]  # the adapter matters
    for task, metrics in reference["results"].items():  # (float32 sums in another order: perplexity to 5e-5)
        for metric, value in metrics.items():
            if isinstance(value, float) and "stderr" not in metric:
                assert ours["results"][task][metric] == pytest.approx(value, rel=5e-5), (task, metric)
    for a, b in zip(ours["samples"]["nano_text"], reference["samples"]["nano_text"], strict=True):
        assert a["resps"][0][0] == pytest.approx(b["resps"][0][0], abs=3e-4)


def test_command_line(bundled, tasks):
    """`python -m nanovllm.lm_eval run ...`: lm-eval's own command line, with the model type registered."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-m", "nanovllm.lm_eval", "run", "--model", "nanovllm", "--model_args",
                           f"pretrained={bundled},max_model_len=1024", "--tasks", "nano_capitals", "--include_path",
                           tasks, "--limit", "2"], capture_output=True, text=True, cwd=root, timeout=600,
                          env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "nano_capitals" in done.stdout and "acc" in done.stdout


# ---- the model's methods on a tiny random checkpoint, against lm-eval's vLLM backend's semantics --------------------

@pytest.fixture(scope="module")
def tiny_lm(qwen3_tied):
    import nanovllm.lm_eval
    model = nanovllm.lm_eval.NanoVLLM(pretrained=qwen3_tied, device="cpu", max_model_len=32, kvcache_block_size=16,
                                      num_kvcache_blocks=64)
    yield model
    model.llm.exit()


def _instance(kind: str, args: tuple):
    from lm_eval.api.instance import Instance
    return Instance(kind, {}, args, 0)


def test_rolling_loglikelihood_of_a_text_longer_than_max_length(tiny_lm, qwen3_tied):
    """Windows as lm-eval's vLLM backend cuts them (max_seq_len = max_model_len - 2: a window and its context token
    fit in max_model_len - 1), each scored by transformers. Windows of max_length scored tokens plus their context
    token were one too long: the context token was cut, and the first scored token had no logprob (TypeError)."""
    import torch
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from tests.tiny_models import CORPUS, hf_model
    text = " ".join(CORPUS[:3])
    tokens = tiny_lm.tok_encode(text)
    assert len(tokens) > 2 * tiny_lm.max_length
    expected = 0.0
    for context, scored in map(make_disjoint_window, get_rolling_token_windows(
            token_list=tokens, prefix_token=tiny_lm.prefix_token_id, max_seq_len=32 - 2, context_len=1)):
        window = context + scored
        with torch.no_grad():
            rows = torch.log_softmax(hf_model(qwen3_tied)(torch.tensor([window[:-1]])).logits[0].float(), -1)
        expected += sum(rows[i - 1, window[i]].item() for i in range(len(context), len(window)))
    got = tiny_lm.loglikelihood_rolling([_instance("loglikelihood_rolling", (text,))], disable_tqdm=True)
    assert got[0] == pytest.approx(expected, abs=1e-3)


def test_think_end_token_lets_the_model_think_past_the_stop_strings(tiny_lm):
    """With think_end_token, lm-eval's vLLM backend sends the engine EOS only and applies `until` to the answer
    after the thinking (postprocess_generated_text). Sending `until` to the engine ended generation at the first
    stop inside the thinking: the answer came back empty."""
    from lm_eval.models.utils import postprocess_generated_text

    from nanovllm import SamplingParams
    context = "Hello world! How"
    full = tiny_lm.llm.generate([context], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]["text"]
    # a "think end" marker found once in the greedy text, and a stop string found only before it
    think = next(full[i:i + 3] for i in range(8, len(full) - 8) if full.count(full[i:i + 3]) == 1)
    stop = next(full[i:i + 2] for i in range(full.index(think) - 2) if full[i:i + 2] not in full[full.index(think):])
    expected = postprocess_generated_text(full, [stop, tiny_lm.tokenizer.decode(tiny_lm.eot_token_id)], think)
    assert expected
    tiny_lm.think_end_token = think
    try:
        got = tiny_lm.generate_until([_instance("generate_until", (context, {"until": [stop], "max_gen_toks": 20,
                                                                              "do_sample": False}))],
                                     disable_tqdm=True)
    finally:
        tiny_lm.think_end_token = None
    assert got == [expected]


def test_a_special_token_in_until_stops_generation(tiny_lm):
    """lm-eval's vLLM backend keeps special tokens in the text (skip_special_tokens=False), so an until string that
    is a special token ("<|im_end|>" for a ChatML model whose EOS is another token) stops the generation. Skipped
    from the text, it never matched: the text ran on past it. (allowed_token_ids steers the random model to emit
    <|pad|> second.)"""
    from nanovllm import SamplingParams
    kwargs = {"until": ["<|pad|>"], "max_gen_toks": 16, "do_sample": False, "allowed_token_ids": [1, 199, 390, 217]}
    plain = tiny_lm.llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                 allowed_token_ids=kwargs["allowed_token_ids"]), use_tqdm=False)[0]["token_ids"]
    pad = tiny_lm.tokenizer.convert_tokens_to_ids("<|pad|>")
    assert plain[1] == pad and any(t != pad for t in plain[2:])  # (ordinary tokens follow it)
    got = tiny_lm.generate_until([_instance("generate_until", ("Once upon a time", kwargs))], disable_tqdm=True)
    assert got == [tiny_lm.tokenizer.decode(plain[:1])]


@pytest.mark.parametrize("max_gen_toks", [31, 40])
def test_max_gen_toks_that_leaves_no_room_for_the_context_is_refused(tiny_lm, max_gen_toks):
    """As lm-eval's transformers backend asserts. The context was left-truncated to max_length - max_gen_toks <= 0
    tokens, which as a slice kept all of it (0) or dropped its first tokens (< 0) without a word."""
    from tests.tiny_models import CORPUS
    request = _instance("generate_until", (CORPUS[0], {"until": ["\n"], "max_gen_toks": max_gen_toks}))
    with pytest.raises(ValueError, match=f"max_gen_toks={max_gen_toks} leaves no room for the context within "
                                         "max_length=31"):
        tiny_lm.generate_until([request], disable_tqdm=True)


def test_chat_template_variables_and_a_template_without_a_system_role(tiny_lm):
    """enable_thinking and chat_template_args reach the template (lm-eval's vLLM backend's model args; they were
    refused as unknown LLM options), and a template that refuses the system role (Gemma's raises) renders without
    the system message, as both of lm-eval's backends do (it raised)."""
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
                "{% endif %}{{ m['role'] + ':' + m['content'] + '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'assistant:' }}"
                "{% if enable_thinking is defined and enable_thinking is false %}{{ '<no-think>' }}{% endif %}"
                "{% if style is defined %}{{ style }}{% endif %}{% endif %}")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    saved = tiny_lm.tokenizer.chat_template, getattr(tiny_lm, "chat_template_args", {})
    tiny_lm.tokenizer.chat_template = template
    try:
        assert tiny_lm.apply_chat_template(chat) == "user:Hi\nassistant:"
        tiny_lm.chat_template_args = {"enable_thinking": False, "style": "[terse]"}
        assert tiny_lm.apply_chat_template(chat) == "user:Hi\nassistant:<no-think>[terse]"
    finally:
        tiny_lm.tokenizer.chat_template, tiny_lm.chat_template_args = saved


def test_enable_thinking_is_a_model_arg(qwen3_tied):
    import nanovllm.lm_eval
    model = nanovllm.lm_eval.NanoVLLM(pretrained=qwen3_tied, device="cpu", max_model_len=32, enable_thinking=False,
                                      chat_template_args={"style": "x"})
    try:
        assert model.chat_template_args == {"enable_thinking": False, "style": "x"}
    finally:
        model.llm.exit()
    # lm-eval's vLLM backend's rules: the model argument wins; thinking needs think_end_token and a generative task
    model = nanovllm.lm_eval.NanoVLLM(pretrained=qwen3_tied, device="cpu", max_model_len=32, enable_thinking=True,
                                      think_end_token="</think>", chat_template_args={"enable_thinking": False})
    try:
        assert model.chat_template_args == {"enable_thinking": True}
        from lm_eval.api.instance import Instance
        with pytest.raises(ValueError, match="enable_thinking=True does not go with loglikelihood tasks"):
            model.loglikelihood([Instance("loglikelihood", {}, ("a", " b"), 0)])
    finally:
        model.llm.exit()
    with pytest.raises(ValueError, match="enable_thinking=True needs think_end_token"):
        nanovllm.lm_eval.NanoVLLM(pretrained=qwen3_tied, device="cpu", max_model_len=32, enable_thinking=True)


def test_logits_logprobs_modes_are_refused(qwen3_tied):
    """Scores are sums of prompt logprobs: an engine returning logits would give wrong scores without a word."""
    import nanovllm.lm_eval
    with pytest.raises(ValueError, match="returns logits; leave it out"):
        nanovllm.lm_eval.NanoVLLM(pretrained=qwen3_tied, device="cpu", max_model_len=32, logprobs_mode="raw_logits")
    model = nanovllm.lm_eval.NanoVLLM(pretrained=qwen3_tied, device="cpu", max_model_len=32,
                                      logprobs_mode="processed_logprobs")  # (prompt logprobs stay raw ones)
    model.llm.exit()
