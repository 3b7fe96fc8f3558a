"""The API server freezes its start-up heap out of the garbage collector's reach while it serves
(upstream's freeze_gc_heap) and hands it back when serving ends."""
import argparse
import gc

from vllm.entrypoints.openai import api_server
from vllm.v1.engine.async_llm import AsyncLLM

from tests.utils.fake_engine import FakeEngine


def test_server_serves_with_a_frozen_start_up_heap(monkeypatch):
    seen = {}

    class RecordingServer:  # stands in for uvicorn.Server: "serves" by recording the heap
        def __init__(self, config):
            self.should_exit, self.started = False, True

        def run(self):
            seen["frozen_while_serving"] = gc.get_freeze_count()

    import uvicorn
    monkeypatch.setattr(uvicorn, "Server", RecordingServer)
    # The server's stdout logging config is process-wide (it stops "vllm" loggers propagating,
    # which later caplog tests read): not part of what this test checks.
    monkeypatch.setattr(api_server, "configure_logging", lambda: None)
    gc.unfreeze()
    llm = AsyncLLM(FakeEngine(max_model_len=64), model_name="fake", max_model_len=64)
    args = argparse.Namespace(host="127.0.0.1", port=0, uvicorn_log_level="warning",
                              disable_log_stats=True)
    assert api_server.run_server(llm, args, "fake") == 0
    assert seen["frozen_while_serving"] > 0
    assert gc.get_freeze_count() == 0  # serving ended: handed back
