"""vllm/utils/cuda_streams.py: the cached current-stream lookup names the stream that
torch.cuda.current_stream() names (looked up at every call; only the Python wrapper is reused),
falls back to the public call where the C API is missing, and record_event records there."""
import pytest
import torch

from vllm.utils import cuda_streams


class _FakeStream:
    made = 0

    def __init__(self, stream_id, device_index, device_type):
        _FakeStream.made += 1
        self.key = (stream_id, device_index, device_type)


def test_the_lookup_follows_the_current_stream_and_reuses_wrappers(monkeypatch):
    current = {"device": 0, "stream": (7, 0, 1)}
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current["device"], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream",
                        lambda device: (current["stream"][0], device, 1), raising=False)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(cuda_streams, "_WRAPPERS", {})
    _FakeStream.made = 0
    first = cuda_streams.current_stream()
    assert first.key == (7, 0, 1) and cuda_streams.current_stream() is first
    current["stream"] = (9, 0, 1)  # e.g. inside torch.cuda.stream(side)
    side = cuda_streams.current_stream()
    assert side.key == (9, 0, 1) and side is not first
    current["device"] = 1
    assert cuda_streams.current_stream().key == (9, 1, 1)
    current.update(device=0, stream=(7, 0, 1))
    assert cuda_streams.current_stream() is first
    assert _FakeStream.made == 3  # one wrapper per distinct stream, never one per call


def test_without_the_c_api_it_asks_torch(monkeypatch):
    monkeypatch.delattr(torch._C, "_cuda_getCurrentStream", raising=False)
    sentinel = object()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: sentinel)
    assert cuda_streams.current_stream() is sentinel
    recorded = []
    event = type("E", (), {"record": lambda self, stream: recorded.append(stream)})()
    cuda_streams.record_event(event)
    assert recorded == [sentinel]


@pytest.mark.gpu
def test_on_gpu_it_names_torch_current_stream_and_records_there():
    assert cuda_streams.current_stream() == torch.cuda.current_stream()
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(side):
        assert cuda_streams.current_stream() == side == torch.cuda.current_stream()
        event = torch.cuda.Event()
        x.add_(1)
        cuda_streams.record_event(event)
    event.synchronize()
    assert side.query() and event.query()
    assert cuda_streams.current_stream() == torch.cuda.current_stream()
    assert float(x[0]) == 1.0
