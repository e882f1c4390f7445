"""vLLM's offline examples, each written as a vLLM user writes it with `from nanovllm import ...` as the only change,
on the bundled SmolLM2-135M-Instruct (conftest's `llm`): basic, chat, n > 1, seeds, logprobs, prompt_logprobs,
structured outputs, token-id prompts, the model's default sampling parameters, beam search, prefix caching (two LLMs
in one process), the LLMEngine loop."""
import json
import math
import re

import pytest

from nanovllm import SamplingParams, TokensPrompt
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import BeamSearchParams, StructuredOutputsParams

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def test_basic(llm):
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(PROMPTS, sampling_params)
    for prompt, output in zip(PROMPTS, outputs):
        assert isinstance(output, RequestOutput) and output.finished
        assert output.prompt == prompt
        assert output.prompt_token_ids == llm.get_tokenizer().encode(prompt)
        completion = output.outputs[0]
        assert isinstance(completion, CompletionOutput) and isinstance(completion.text, str)
        assert completion.finish_reason in ("stop", "length")
        assert len(completion.token_ids) == 16 or completion.finish_reason == "stop"  # vLLM's max_tokens default
    assert len({o.request_id for o in outputs}) == len(PROMPTS)


def test_chat(llm):
    sampling_params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, top_k=50)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    template = llm.get_tokenizer().apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert len(outputs) == 1 and outputs[0].prompt == template and outputs[0].outputs[0].text
    outputs = llm.chat([conversation for _ in range(3)], sampling_params, use_tqdm=True)
    assert len(outputs) == 3 and all(o.prompt == template for o in outputs)
    # A chat template can be supplied
    chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False, chat_template=chat_template)
    assert outputs[0].prompt.startswith("system: You are a helpful assistant\n")
    assert outputs[0].prompt.endswith("assistant:")


def test_continue_final_message(llm):
    conversation = [{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": "The capital of France is"}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                   add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("The capital of France is")  # the assistant's turn left open
    assert "Paris" in out.outputs[0].text


def test_n_samples(llm):
    outputs = llm.generate(PROMPTS[:2], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))
    for output in outputs:
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_seeds_reproduce(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    other = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=0.9, seed=43, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].text for o in first] == [o.outputs[0].text for o in again]
    assert [o.outputs[0].token_ids for o in first] != [o.outputs[0].token_ids for o in other]


def test_logprobs(llm):
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    tokenizer = llm.get_tokenizer()
    for token, step in zip(out.token_ids, out.logprobs):
        assert token in step and 3 <= len(step) <= 4  # the top 3, and the sampled token
        chosen = step[token]
        assert isinstance(chosen, Logprob) and chosen.rank == 1  # greedy: the most likely token
        assert chosen.decoded_token == tokenizer.decode([token])
        assert sorted(lp.rank for lp in step.values())[:3] == [1, 2, 3]
        assert max(step.values(), key=lambda lp: lp.logprob) is chosen
    assert out.cumulative_logprob == pytest.approx(sum(step[t].logprob for t, step in zip(out.token_ids,
                                                                                         out.logprobs)))


def test_prompt_logprobs(llm):
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for token, step in zip(ids[1:], out.prompt_logprobs[1:]):
        assert token in step and 2 <= len(step) <= 3
        assert all(lp.logprob <= 0 and math.isfinite(lp.logprob) for lp in step.values())
        assert (step[token].rank <= 2) == (list(step).index(token) < 2)  # in the top 2, or ranked past them
    # the prompt token's own rank, asked alone, is its place among the 20 most likely
    alone = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    top = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20))[0]
    for token, own, step in zip(ids[1:], alone.prompt_logprobs[1:], top.prompt_logprobs[1:]):
        assert list(own) == [token]
        ranked = sorted(step.values(), key=float, reverse=True)
        assert own[token].rank == 1 + sum(float(lp) > float(own[token]) for lp in ranked[:20]) or own[token].rank > 20


def test_structured_outputs(llm):
    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))
    out = llm.generate("Classify this sentiment: vLLM is wonderful!", choice)[0].outputs[0]
    assert out.text in ("Positive", "Negative")

    email = StructuredOutputsParams(regex=r"[a-z]{2,8}@[a-z]{2,8}\.com\n")
    regex = SamplingParams(structured_outputs=email, stop=["\n"], max_tokens=30, temperature=0)
    out = llm.generate("Generate an email address for Alan Turing, who works in Enigma. End in .com and new line. "
                       "Example result: alan.turing@enigma.com\n", regex)[0].outputs[0]
    assert re.fullmatch(r"[a-z]{2,8}@[a-z]{2,8}\.com", out.text), out.text

    schema = {"type": "object", "properties": {"brand": {"type": "string", "maxLength": 12},
                                               "model": {"type": "string", "maxLength": 12}},
              "required": ["brand", "model"]}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), temperature=0, max_tokens=60)
    out = llm.generate("Generate a JSON with the brand and model of the most iconic car from the 90's",
                       params)[0].outputs[0]
    assert set(json.loads(out.text)) == {"brand", "model"}

    grammar = 'root ::= "SELECT " column " FROM " table\ncolumn ::= "name" | "age"\ntable ::= "users" | "people"'
    params = SamplingParams(structured_outputs=StructuredOutputsParams(grammar=grammar), temperature=0)
    out = llm.generate("Generate an SQL query to show the names from the users table.", params)[0].outputs[0]
    assert out.text.split()[0] == "SELECT" and out.text.split()[2] == "FROM"


def test_token_id_prompts(llm):
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    by_text = llm.generate(PROMPTS, greedy)
    by_ids = llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], greedy)
    by_keyword = llm.generate(prompt_token_ids=ids, sampling_params=greedy, use_tqdm=False, lora_request=None)
    by_dict = llm.generate([{"prompt": p} for p in PROMPTS], greedy)
    texts = [o.outputs[0].text for o in by_text]
    for outs in (by_ids, by_keyword, by_dict):
        assert [o.outputs[0].text for o in outs] == texts
    assert [o.prompt for o in by_ids] == [None] * len(PROMPTS) and [o.prompt for o in by_dict] == PROMPTS
    assert [o.prompt_token_ids for o in by_ids] == ids


def test_model_default_sampling(llm):
    sampling_params = llm.get_default_sampling_params()
    sampling_params.max_tokens = 8  # a copy: the engine's defaults are unchanged
    assert llm.get_default_sampling_params().max_tokens == 16
    outputs = llm.generate(PROMPTS, sampling_params)
    assert all(len(o.outputs[0].token_ids) <= 8 for o in outputs)


def test_outputs_read_as_nano_vllm_dicts(llm):
    """nano-vllm's example.py and bench.py index the outputs as dicts."""
    out = llm.generate(["introduce yourself"], SamplingParams(temperature=0.6, max_tokens=8))[0]
    assert out["text"] == out.outputs[0].text and out["token_ids"] == out.outputs[0].token_ids
    assert out["outputs"][0]["text"] == out.outputs[0].text and "logprobs" not in out


def test_beam_search(llm):
    prompts = [{"prompt": "The capital of France is"}, {"prompt": "Hello, my name is"}]
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6))
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(prompts, outputs):
        assert len(output.sequences) == 3
        scores = [s.cum_logprob / (len(s.tokens) - (s.finish_reason == "stop")) for s in output.sequences]
        assert scores == sorted(scores, reverse=True)
        for seq in output.sequences:
            assert seq.text.startswith(prompt["prompt"])
            assert seq.cum_logprob == pytest.approx(sum(step[t].logprob for t, step in
                                                        zip(seq.tokens[-len(seq.logprobs):], seq.logprobs)))
    # width 1 is greedy decoding
    best = llm.beam_search([prompts[0]], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))[0]
    greedy = llm.generate(prompts[0]["prompt"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert best.sequences[0].tokens == tokenizer.encode(prompts[0]["prompt"]) + greedy.outputs[0].token_ids


def test_nano_vllm_script_calls(llm):
    """The calls nano-vllm's example.py and bench.py make, read as they read them: token-id prompts with one
    SamplingParams each and use_tqdm positional-free, a warm-up with default SamplingParams, output['text'] of
    chat-templated text prompts."""
    from random import randint, seed
    seed(0)
    prompt_token_ids = [[randint(0, 10000) for _ in range(randint(5, 40))] for _ in range(6)]
    sampling_params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(3, 12)) for _ in range(6)]
    llm.generate(["Benchmark: "], SamplingParams())
    outputs = llm.generate(prompt_token_ids, sampling_params, use_tqdm=False)
    assert sum(len(o["token_ids"]) for o in outputs) == sum(sp.max_tokens for sp in sampling_params)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True)
               for p in ("introduce yourself", "list all prime numbers within 100")]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.6, max_tokens=8))
    assert all(isinstance(output["text"], str) and output["text"] for output in outputs)


def test_prefix_caching_example(bundled):
    """vLLM's examples/offline_inference/prefix_caching.py: an LLM without prefix caching, `del` and
    cleanup_dist_env_and_memory(), then one with it, warmed up with the shared prefix: the same greedy answers, the
    prefix served from the cache."""
    import weakref

    from nanovllm import LLM
    from nanovllm.distributed import cleanup_dist_env_and_memory
    prefix = ("You are an expert school principal, skilled in effectively managing faculty and staff. Draft 10-15 "
              "questions for a potential first grade Head Teacher for my K-12, all-girls', independent school that "
              "emphasizes community, joyful discovery, and life-long learning. Based on these information, fulfill "
              "the following paragraph: ")
    generating_prompts = [prefix + prompt for prompt in PROMPTS]
    sampling_params = SamplingParams(temperature=0.0, max_tokens=8)
    regular_llm = LLM(model=bundled, enable_prefix_caching=False, gpu_memory_utilization=0.4, max_model_len=1024)
    regular = [o.outputs[0].text for o in regular_llm.generate(generating_prompts, sampling_params)]
    gone = weakref.ref(regular_llm)
    del regular_llm
    cleanup_dist_env_and_memory()
    assert gone() is None
    # (vLLM's block size: nanovllm's 256-token blocks would hold this whole prefix and the prompt in one, which is
    # never served from the cache)
    with LLM(model=bundled, enable_prefix_caching=True, gpu_memory_utilization=0.4, max_model_len=1024,
             block_size=16) as cached:
        cached.generate(generating_prompts[0], sampling_params)
        outputs = cached.generate(generating_prompts, sampling_params)
    assert [o.outputs[0].text for o in outputs] == regular
    assert all(o.num_cached_tokens > 0 for o in outputs)


def test_llm_engine_example(bundled, capsys):
    """vLLM's examples/offline_inference/llm_engine_example.py: EngineArgs from the command line, one request added
    a step, finished outputs printed."""
    from nanovllm import EngineArgs, LLMEngine, RequestOutput
    from nanovllm.utils.argparse_utils import FlexibleArgumentParser

    def create_test_prompts() -> list[tuple[str, SamplingParams]]:
        return [
            ("A robot may not injure a human being", SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1)),
            ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
            ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, top_p=0.95,
                                                            frequency_penalty=0.1)),
        ]

    def process_requests(engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams]]):
        request_id = 0
        print("-" * 50)
        while test_prompts or engine.has_unfinished_requests():
            if test_prompts:
                prompt, sampling_params = test_prompts.pop(0)
                engine.add_request(str(request_id), prompt, sampling_params)
                request_id += 1
            request_outputs: list[RequestOutput] = engine.step()
            for request_output in request_outputs:
                if request_output.finished:
                    print(request_output)
                    print("-" * 50)

    parser = FlexibleArgumentParser(description="Demo on using the LLMEngine class directly")
    parser = EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", bundled, "--max-model-len", "1024"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        process_requests(engine, create_test_prompts())
        printed = capsys.readouterr().out
        assert printed.count("RequestOutput(request_id=") == 3
        assert all(f"request_id='{i}'" in printed for i in range(3))
        greedy = engine.llm.generate("A robot may not injure a human being", SamplingParams(temperature=0.0),
                                     use_tqdm=False)[0].outputs[0]
        assert repr(greedy.text) in printed  # the greedy request's text, as generate() gives it
    finally:
        engine.llm.exit()
