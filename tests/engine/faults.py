"""A step that fails, for the step API's fault tests. Not collected (no test_ prefix)."""
from unittest import mock

import pytest


def fail_a_step_then_finish(llm, method: str):
    """One step() with the executor's `method` raising KeyboardInterrupt (a Ctrl-C mid-step), then step() until
    every request is done."""
    with mock.patch.object(llm.executor, method, side_effect=KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            llm.step()
    while not llm.is_finished():
        llm.step()


def fail_after_sampling(llm, method: str, at: int):
    """step() until every request is done, the `at`-th call of the runner's `method` ("_to_host": copying sampled
    tokens to the host; "settle": waiting for them) raising KeyboardInterrupt once, after the sampler drew them."""
    runner, calls = llm.executor.runner, []
    original = getattr(runner, method)

    def failing(*args):
        calls.append(args)
        if len(calls) == at:
            raise KeyboardInterrupt
        return original(*args)
    with mock.patch.object(runner, method, side_effect=failing):
        while not llm.is_finished():
            try:
                llm.step()
            except KeyboardInterrupt:
                pass
    assert len(calls) > at
