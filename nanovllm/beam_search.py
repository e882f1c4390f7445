"""Beam search in vLLM's shapes (BeamSearchParams in, BeamSearchOutput out), built on generate(): each step asks
for one token and the top 2 * beam_width logprobs of every live beam, and keeps the beam_width best extensions. The
prefix cache serves each beam's earlier tokens, so a step computes little more than the new ones."""
from dataclasses import dataclass, field

from nanovllm.outputs import Logprob
from nanovllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: tokens and text cover the prompt and the continuation; logprobs, one dict per new token."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: object = None


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_search(llm, prompts: list, params: BeamSearchParams, lora_request=None,
                concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """The beam search of every prompt, on `llm` (an LLM or its data-parallel front), under one adapter (None: the
    base model; or one per prompt); at most `concurrency_limit` prompts searched at a time (None: all), as vLLM's
    (the beams are the same). Every prompt is checked before any is searched."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not isinstance(concurrency_limit, int)
                                          or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit must be None or an int >= 1, got {concurrency_limit!r}")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    vocab = llm.requests.vocab_size
    if 2 * params.beam_width > vocab:  # each step ranks 2 * beam_width candidates per beam
        raise ValueError(f"beam_width={params.beam_width}: beam search ranks 2 * beam_width candidates a step, more "
                         f"than the vocabulary's {vocab} tokens; use beam_width <= {vocab // 2}")
    if llm.config.logprobs_mode.endswith("logits"):  # (beams are ranked by the sum of their tokens' logprobs)
        raise ValueError(f"beam search ranks beams by logprobs, but this LLM returns logits "
                         f"(logprobs_mode={llm.config.logprobs_mode!r}); use raw_logprobs or processed_logprobs")
    eos = set(llm.config.eos_token_ids)
    loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
    if len(loras) != len(prompts):
        raise ValueError(f"got {len(loras)} lora_request for {len(prompts)} prompts; pass one LoRARequest (or None) "
                         "or exactly one per prompt")
    live = [[BeamSearchSequence(llm.requests.tokenize(p), lora_request=lora)] for p, lora in zip(prompts, loras)]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    limit = concurrency_limit or max(len(prompts), 1)
    for start in range(0, len(prompts), limit):
        _search(llm, live, done, range(start, min(start + limit, len(prompts))), params, eos)
    results = []
    for i in range(len(prompts)):
        for beam in live[i]:
            beam.finish_reason = "length"
        ranked = sorted(done[i] + live[i], key=lambda b: _score(b, eos, params.length_penalty), reverse=True)
        best = ranked[:params.beam_width]
        for beam in best:
            tokens = beam.tokens if params.include_stop_str_in_output or beam.finish_reason != "stop" \
                else beam.tokens[:-1]
            beam.text = llm.tokenizer.decode(tokens) if llm.tokenizer is not None else None
        results.append(BeamSearchOutput(best))
    return results


def _search(llm, live: list[list[BeamSearchSequence]], done: list[list[BeamSearchSequence]], searched: range,
            params: BeamSearchParams, eos: set[int]):
    """The beam search of the prompts `searched` (indices into `live`, their beams, and `done`, their finished
    ones), updated in place."""
    max_len = llm.config.max_model_len
    step_params = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width,
                                 detokenize=False, ignore_eos=True)
    for _ in range(params.max_tokens):
        beams = [(i, beam) for i in searched for beam in live[i]]
        if not beams:
            break
        outs = llm.generate([beam.tokens for _, beam in beams], step_params, use_tqdm=False,
                            lora_request=[beam.lora_request for _, beam in beams])
        candidates: dict[int, list[BeamSearchSequence]] = {i: [] for i in searched}
        for (i, beam), out in zip(beams, outs):
            for token, logprob in out.outputs[0].logprobs[0].items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [out.outputs[0].logprobs[0]],
                                         beam.cum_logprob + float(logprob), lora_request=beam.lora_request)
                if token in eos and not params.ignore_eos:
                    new.finish_reason = "stop"
                    done[i].append(new)
                else:
                    candidates[i].append(new)
        for i, group in candidates.items():
            group.sort(key=lambda b: b.cum_logprob, reverse=True)
            live[i] = []
            for beam in group[:params.beam_width]:  # a beam at max_model_len can grow no more: finished there
                if len(beam.tokens) >= max_len:
                    beam.finish_reason = "length"
                    done[i].append(beam)
                else:
                    live[i].append(beam)


def _score(beam: BeamSearchSequence, eos: set[int], length_penalty: float) -> float:
    length = len(beam.tokens) - (beam.tokens[-1] in eos)
    return beam.cum_logprob / length ** length_penalty
