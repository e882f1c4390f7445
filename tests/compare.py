"""Comparisons of generate() outputs shared by the engine tests."""

LOGPROB_TOL = 1e-4  # float32 rounding: a step's batch (and so its reductions) may differ between the runs compared


def assert_logprobs_close(a: list[dict] | None, b: list[dict] | None):
    """Two runs' per-token logprob dicts: as many, the same token ids each, values within LOGPROB_TOL."""
    a, b = a or [], b or []
    assert len(a) == len(b), (len(a), len(b))
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < LOGPROB_TOL for t in x), (x, y)


def assert_near_float32(model, prompts: list[list[int]], outs: list[dict], tolerance: float):
    """A reduced-precision run against transformers' `model` in float32 (outputs with logprobs=0): on the tokens it
    generated, each is within `tolerance` nats of the best under float32, and its logprob within `tolerance` of
    float32's."""
    import torch
    for prompt, out in zip(prompts, outs):
        tokens = out["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
        reference = torch.log_softmax(logits.float(), -1)
        chosen = reference[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert float((reference.max(-1).values - chosen).max()) < tolerance
        ours = torch.tensor([lp[t] for t, lp in zip(tokens, out["logprobs"])])
        assert float((ours - chosen).abs().max()) < tolerance
