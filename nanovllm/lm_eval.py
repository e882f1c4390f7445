"""lm-evaluation-harness on nanovllm: the model type "nanovllm" (pip install "nanovllm[lm_eval]").

    python -m nanovllm.lm_eval run --model nanovllm --model_args pretrained=PATH --tasks ...

runs lm-eval's own command line with this module imported (which registers the model type); in Python,
`import nanovllm.lm_eval` and then `lm_eval.simple_evaluate(model="nanovllm", ...)`. model_args are `pretrained`
(a checkpoint directory or .gguf file; with `gguf_file`, a file in that directory, as the transformers backend
takes it), lm-eval's usual max_gen_toks, max_length, add_bos_token, prefix_token_id, think_end_token,
enable_thinking and chat_template_args (variables for the chat template), `lora_local_path` (a PEFT adapter every
request runs under), as lm-eval's vLLM backend takes them, and any LLM(...) option. Scoring uses prompt_logprobs
on the vLLM-shaped API, as lm-eval's vLLM backend does."""
import os

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    _add_special_kwargs,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from nanovllm.llm import LLM
from nanovllm.lora.request import LoRARequest
from nanovllm.sampling_params import SamplingParams

# (flat: a context's positions become no objects; only the continuation's are read)
_SCORE = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, detokenize=False, flat_logprobs=True)


@register_model("nanovllm")
class NanoVLLM(TemplateLM):
    """One engine; every lm-eval request of a kind goes to it in one generate() call (it batches them itself)."""

    def __init__(self, pretrained: str | None = None, gguf_file: str | None = None, max_gen_toks: int = 256,
                 max_length: int | None = None, add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 think_end_token: str | None = None, batch_size=None, max_batch_size=None, device: str | None = None,
                 lora_local_path: str | None = None, enable_thinking: bool | None = None,
                 chat_template_args: dict | None = None, **engine_kwargs):
        super().__init__()
        # the chat template's extra variables (lm-eval's vLLM backend's: enable_thinking always, None when unset; the
        # model argument wins over one in chat_template_args, which lm-eval drops even when the argument is unset:
        # here it is kept then, as given)
        self.chat_template_args = dict(chat_template_args or {})
        if enable_thinking is not None or "enable_thinking" not in self.chat_template_args:
            self.chat_template_args["enable_thinking"] = enable_thinking
        if self.chat_template_args["enable_thinking"] and think_end_token is None:  # (lm-eval's vLLM backend's rule)
            raise ValueError("enable_thinking=True needs think_end_token (e.g. think_end_token='</think>'), to cut the "
                             "thinking from the answer")
        del batch_size, max_batch_size  # (lm-eval's batching: the engine schedules its own batches)
        if device == "cpu":  # lm-eval's --device ("cuda", its default, leaves the engine's choice: CUDA when present;
            engine_kwargs.setdefault("device", "cpu")  # pick a GPU with CUDA_VISIBLE_DEVICES)
        model = os.path.join(pretrained, gguf_file) if gguf_file else pretrained
        self.lora = None  # lora_local_path: every request under that PEFT adapter, as lm-eval's vLLM backend does
        if lora_local_path is not None:
            engine_kwargs.setdefault("enable_lora", True)
            self.lora = LoRARequest("finetuned", 1, lora_local_path)
        if str(engine_kwargs.get("logprobs_mode", "")).endswith("logits"):  # (scores sum the prompt's logprobs)
            raise ValueError(f"lm-eval's scores are sums of logprobs, but logprobs_mode="
                             f"{engine_kwargs['logprobs_mode']!r} returns logits; leave it out (raw_logprobs)")
        self.llm = LLM(model, **engine_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.add_bos_token, self.think_end_token = add_bos_token, think_end_token
        self._max_gen_toks, self._prefix_token_id = int(max_gen_toks), prefix_token_id
        # a prompt must leave the engine room for one token: a scored sequence is at most max_model_len - 1 long
        limit = self.llm.llm_engine.model_config.max_model_len - 1
        self._max_length = min(int(max_length), limit) if max_length else limit

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self._prefix_token_id is not None:
            return self._prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        options = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            options["add_special_tokens"] = False  # (the text already starts with the BOS)
        ids = self.tokenizer.encode(string, **options)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        import jinja2

        def render(messages):
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt,
                                                      **self.chat_template_args)
        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            # a template without a system role (Gemma's raises): without the system message, as lm-eval's vLLM and
            # transformers backends do
            return render([m for m in chat_history if m["role"] != "system"])

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if self.chat_template_args["enable_thinking"]:  # (as lm-eval's vLLM backend refuses them)
            raise ValueError("enable_thinking=True does not go with loglikelihood tasks (nothing is generated to think "
                             "in): run generative tasks, or leave enable_thinking unset")
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether greedy decoding gives the continuation) for each request; a
        sequence longer than max_length loses its oldest context tokens."""
        inputs, starts = [], []
        for _, context, continuation in requests:
            tokens = (context + continuation)[-self.max_length:]
            inputs.append({"prompt_token_ids": tokens})
            starts.append(len(tokens) - len(continuation))
        outputs = self.llm.generate(inputs, _SCORE, use_tqdm=not disable_tqdm, lora_request=self.lora)
        results = []
        for request, start, out in zip(inputs, starts, outputs):
            tokens, scored = request["prompt_token_ids"], out.prompt_logprobs
            chosen = [scored[i][tokens[i]] for i in range(start, len(tokens))]
            results.append((sum(lp.logprob for lp in chosen), all(lp.rank == 1 for lp in chosen)))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of at most max_length tokens."""
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            # a window is its context token plus up to max_seq_len scored ones: max_length - 1 keeps it within
            # max_length (lm-eval's vLLM backend: max_model_len - 2); a longer one would lose its context token
            for window in get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                    max_seq_len=self.max_length - 1, context_len=1):
                windows.append((None, *make_disjoint_window(window)))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, cut at its `until` strings (and EOS)."""
        eos = self.tokenizer.decode(self.eot_token_id)
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_tokens = kwargs.pop("max_gen_toks")
            if max_tokens >= self.max_length:  # (a left_truncate_len <= 0 below kept the whole context, or its end)
                raise ValueError(f"max_gen_toks={max_tokens} leaves no room for the context within max_length="
                                 f"{self.max_length}: lower max_gen_toks or raise max_model_len")
            kwargs.pop("do_sample", None)  # (normalize_gen_kwargs set temperature 0 where it is False)
            # special tokens stay in the text (lm-eval's vLLM backend's defaults), so an `until` such as "<|im_end|>"
            # can match: skipped from the text, it never would, and generation ran on past it
            kwargs = {"skip_special_tokens": False, "spaces_between_special_tokens": False} | kwargs
            prompts.append({"prompt_token_ids": self.tok_encode(context,
                                                                left_truncate_len=self.max_length - max_tokens)})
            # a reasoning model's `until` (often "\n\n") would end it inside its thinking, before any answer: the
            # engine stops at EOS only, and postprocess_generated_text cuts the answer (as lm-eval's vLLM backend)
            stop = [s for s in until if s == eos] if self.think_end_token else until
            try:
                params.append(SamplingParams(max_tokens=max_tokens, stop=stop, **kwargs))
            except TypeError as e:
                raise ValueError(f"a task's generation_kwargs has an option nanovllm's SamplingParams lacks: {e}") \
                    from None
            stops.append(until)
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm, lora_request=self.lora)
        texts = [postprocess_generated_text(out.outputs[0].text, until, self.think_end_token)
                 for out, until in zip(outputs, stops)]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts


def main() -> None:
    """lm-eval's command line, with the "nanovllm" model type registered."""
    from lm_eval.__main__ import cli_evaluate
    cli_evaluate()


if __name__ == "__main__":
    main()
