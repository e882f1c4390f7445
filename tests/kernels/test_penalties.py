"""The penalties kernel (kernels/penalties.py: repetition, presence and frequency) against the processor's torch
form. Interpreted on CPU; compiled on a GPU (marked gpu)."""
import pytest
import torch


def check_penalties(batch: int, vocab: int, device="cpu", exact: bool = True):
    """The penalties kernel against the processor's torch form: repetition alone, presence and frequency alone, all
    three; rows reading scattered lines of the history; positive, negative and -inf logits."""
    from nanovllm.kernels.penalties import apply_penalties
    from nanovllm.sampling.logits_processors import PenaltiesProcessor
    processor = PenaltiesProcessor(vocab, torch.device(device))
    lines = batch + 5
    processor.seen = torch.rand(lines, vocab, device=device) < 0.3
    processor.counts = torch.randint(0, 4, (lines, vocab), device=device).float() * processor.seen
    logits = torch.randn(batch, vocab, device=device) * 4
    logits[0, :7] = float("-inf")
    rows = torch.randperm(lines, device=device)[:batch]
    rep = torch.rand(batch, device=device) + 0.6
    rep[-1] = 1.0 if batch > 1 else 1.5  # (a row without repetition penalty beside rows with one)
    pres, freq = torch.rand(batch, device=device) * 2 - 1, torch.rand(batch, device=device) * 2 - 1
    for state in ({"repetition": rep}, {"presence": pres, "frequency": freq},
                  {"repetition": rep, "presence": pres, "frequency": freq}):
        state["lines"] = rows
        ref = processor.apply_torch(logits, state)
        out = apply_penalties(logits, rows, processor.seen, processor.counts, state.get("repetition"),
                              state.get("presence"), state.get("frequency"))
        if exact or "presence" not in state:  # (the division rounds as torch's: tl.div_rn)
            assert torch.equal(out, ref), (out - ref).abs().max()
        else:  # the GPU kernel may fuse a multiply and a subtraction
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-6)
        assert not torch.equal(out, logits)


@pytest.mark.interpreter
def test_penalties_kernel():
    check_penalties(5, 3000)


@pytest.mark.gpu
def test_gpu_penalties():
    # Qwen3's vocabulary
    for batch in (1, 256):
        check_penalties(batch, 151936, device="cuda", exact=False)
