"""nanovllm.outputs helpers that the result shapes (test_examples.py) do not show."""
import gc
import threading

import nanovllm.outputs as outputs


def test_collector_paused_in_two_threads_leaves_the_collector_on(monkeypatch):
    """Two engines' threads building logprobs at once: B enters while A's block has the collector paused, and A's
    block ends before B's. The collector must be on again once both have ended (saving and restoring it in each
    block, B read it off, A turned it back on, then B turned it off and left it off)."""
    b_inside, a_done = threading.Event(), threading.Event()

    class SwitchingGC:  # the gc module, with a thread switch inside B's reading of the collector's state
        def __getattr__(self, name):
            return getattr(gc, name)

        def isenabled(self):
            enabled = gc.isenabled()
            if threading.current_thread().name == "B":
                b_inside.set()
                a_done.wait(5)
            return enabled

    def a():
        with outputs.collector_paused():
            b.start()
            b_inside.wait(5)
        a_done.set()

    def b_body():
        with outputs.collector_paused():
            b_inside.set()
            a_done.wait(5)

    b = threading.Thread(target=b_body, name="B")
    monkeypatch.setattr(outputs, "gc", SwitchingGC())
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        thread_a = threading.Thread(target=a, name="A")
        thread_a.start()
        thread_a.join(10)
        b.join(10)
        assert gc.isenabled()
    finally:
        gc.enable() if was_enabled else gc.disable()


def test_collector_paused_restores_the_state_it_found():
    was_enabled = gc.isenabled()
    try:
        for enabled in (True, False):
            gc.enable() if enabled else gc.disable()
            with outputs.collector_paused():
                with outputs.collector_paused():
                    assert not gc.isenabled()
                assert not gc.isenabled()
            assert gc.isenabled() == enabled
    finally:
        gc.enable() if was_enabled else gc.disable()
