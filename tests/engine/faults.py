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
