"""One real `vllm serve` (tiny model + its DSpark drafter, CPU) shared by the suite's modules."""
import pytest

from tests.utils.reliability import GREEDY, completion_text
from tests.utils.server_process import ServerProcess

MAX_MODEL_LEN = 128
# The fixed greedy request run after every fault: its text must never change.
CANARY = {"prompt": "The capital of France is", "max_tokens": 8, **GREEDY}


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    proc = ServerProcess(["--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
                          "--disable-log-stats", "--disable-uvicorn-access-log"],
                         str(tmp_path_factory.mktemp("logs") / "serve.log"))
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def canary_text(server):
    return completion_text(server.base_url, CANARY)
