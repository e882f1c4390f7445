"""The LoRA shrink/expand kernels (kernels/lora.py) against the torch reference (lora/stack.py): tiles of one
adapter, tiles that mix adapters and the base model, slots between the lowest and highest that no token uses, and
the empty step. Interpreted on CPU; compiled on a GPU (marked gpu)."""
import pytest
import torch

from tests.kernels.helpers import DTYPES, TOLERANCES

# 16-bit: s is rounded to the dtype before the expand's product, and y is stored in bf16
LORA_TOLERANCES = {**TOLERANCES, torch.float16: dict(atol=1e-2, rtol=1e-2), torch.bfloat16: dict(atol=6e-2, rtol=3e-2)}


def check_lora(slots: list[int], k: int, n: int, rank: int, dtype, device="cpu", num_slots: int = 4,
               grouped: bool = True):
    """The kernels against the reference; grouped: the tokens in step_slots' order (else in step order: tiles that
    mix adapters)."""
    from nanovllm.kernels.lora import lora_expand_, lora_shrink
    from nanovllm.lora.stack import lora_reference, step_slots
    t = len(slots)
    order = step_slots(slots, [1] * t)[1] if grouped else list(range(t))
    order = torch.tensor(order, dtype=torch.int32, device=device)
    x = torch.randn(t, k, device=device).to(dtype)
    a = (torch.randn(num_slots, rank, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(num_slots, n, rank, device=device).to(dtype)
    y = torch.randn(t, n, device=device).to(dtype)
    slots = torch.tensor(slots, dtype=torch.int32, device=device)
    expected = lora_reference(x.float(), y.float(), a.float(), b.float(), slots)
    s = lora_shrink(x, a, slots, order)
    torch.testing.assert_close(s[slots < 0], torch.zeros_like(s[slots < 0]))  # the base model's rows: no update
    out = lora_expand_(y.clone(), s, b, slots, order)
    torch.testing.assert_close(out.float(), expected, **LORA_TOLERANCES[dtype])
    assert torch.equal(out[slots < 0], y[slots < 0])


CASES = [
    ([2] * 40, 96, 80, 16),  # a prefill chunk of one adapter: 3 tiles, the last partial; K and N not multiples
    ([-1, 0, 3, 3, -1, 1] * 5, 64, 48, 32),  # decode rows mixing three adapters and the base model, slot 2 unused
    ([-1] * 17, 64, 64, 16),  # no adapter at all
    ([1], 128, 200, 48),  # one row
    ([0] * 300 + [-1] * 20 + [1, 0] * 20, 200, 70, 32),  # prefill-sized (64-token tiles), split-K of 4 uneven parts
    ([], 64, 64, 16),  # an empty step
]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slots,k,n,rank", CASES)
@pytest.mark.parametrize("grouped", [True, False])
def test_lora_kernels(slots, k, n, rank, dtype, grouped):
    check_lora(slots, k, n, rank, dtype, grouped=grouped)


def test_step_slots_groups_tokens_by_adapter():
    from nanovllm.lora.stack import step_slots
    slots, order = step_slots([2, -1, 0, 2], [3, 1, 2, 2])
    assert slots == [2, 2, 2, -1, 0, 0, 2, 2]
    assert order == [3, 4, 5, 0, 1, 2, 6, 7]


@pytest.mark.gpu
def test_gpu_lora_kernels():
    """Qwen3-0.6B's sizes (1024 hidden, 3072 intermediate), rank 16 in three parts, bf16 and float32."""
    import random
    rng = random.Random(0)
    for dtype in (torch.bfloat16, torch.float32):
        for slots, k, n, rank in CASES + [([rng.randrange(-1, 4) for _ in range(256)], 1024, 4096, 48),
                                          ([1] * 1000 + [3] * 24, 3072, 1024, 16)]:
            for grouped in (True, False):
                check_lora(slots, k, n, rank, dtype, device="cuda", grouped=grouped)


@pytest.mark.interpreter
def test_lora_rows_past_int32_offsets():
    """A row whose offset (row x the row stride) passes 2**31 elements, as 64k tokens through Qwen3-14B's gate_up
    output (34816 wide) do: here row 16 of x and y with a stride of 2**28 (a view of 2**32 elements of virtual
    memory, of which the test touches two rows). In 32 bits its offset wraps to row 0's: shrink reads x[0] and expand
    updates y[0], leaving y[16]. Rows 0-15 use no adapter (their tile is skipped)."""
    from nanovllm.kernels.lora import lora_expand_, lora_shrink
    from nanovllm.lora.stack import lora_reference
    t, k, n, rank, stride = 17, 32, 48, 16, 1 << 28
    try:
        storage = torch.empty(16 * stride + k + n, dtype=torch.float16)  # (untouched pages take no memory)
    except RuntimeError:
        pytest.skip("no 8 GiB of address space for the view")
    x = storage.as_strided((t, k), (stride, 1))
    y = storage.as_strided((t, n), (stride, 1), k)
    used = [0, 16]
    x[used] = torch.randn(2, k, dtype=torch.float16)
    y[used] = torch.randn(2, n, dtype=torch.float16)
    a = (torch.randn(2, rank, k) / k ** 0.5).half()
    b = torch.randn(2, n, rank).half()
    slots = torch.tensor([-1] * 16 + [0], dtype=torch.int32)
    before = y[used].clone()
    expected = lora_reference(x[used].float(), before.float(), a.float(), b.float(), slots[used])
    order = torch.arange(t, dtype=torch.int32)
    lora_expand_(y, lora_shrink(x, a, slots, order), b, slots, order)
    assert torch.equal(y[0], before[0])
    torch.testing.assert_close(y[16].float(), expected[1], **LORA_TOLERANCES[torch.float16])
