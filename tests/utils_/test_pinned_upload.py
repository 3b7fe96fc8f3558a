"""vllm/utils/pinned_upload.py: uploads through the pinned ring arrive intact and in stream
order, a buffer is reused only after its copy completed (the ring never hands out a buffer a
pending copy still reads), and buffers grow for larger arrays. On the CPU an upload is a copy."""
import numpy as np
import pytest
import torch

from vllm.utils.pinned_upload import PinnedUploader


def test_on_the_cpu_an_upload_is_an_independent_copy():
    source = np.arange(10, dtype=np.int64)
    out = PinnedUploader("cpu").upload(source)
    source[:] = -1
    assert out.tolist() == list(range(10)) and out.dtype == torch.int64


@pytest.mark.gpu
def test_uploads_behind_a_long_kernel_keep_their_values():
    """Twenty uploads through a ring of four, enqueued behind a long kernel (a spinning
    kernel): each buffer is rewritten only after its own copy ran, so every device tensor holds
    its array, including one larger than the buffers were made for."""
    uploader = PinnedUploader("cuda", depth=4, min_bytes=64)
    for _ in range(4):  # the ring's page-locked buffers are allocated before the long kernel:
        uploader.upload(np.zeros(8, dtype=np.int32))  # cudaHostAlloc takes milliseconds
    torch.cuda.synchronize()
    waits_before = uploader.waits
    # ~0.2-0.5 s of spinning on the stream (clock-dependent), far longer than the host takes
    # to enqueue twenty uploads (a matmul chain of ~20 ms had finished before the ring wrapped
    # when the first uploads still allocated their buffers: no wait seen, thirty-third session)
    torch.cuda._sleep(500_000_000)
    arrays = [np.full(8 + i, i, dtype=np.int32) for i in range(19)]
    arrays.append(np.arange(5000, dtype=np.int64))  # past min_bytes: the buffer grows
    outs = [uploader.upload(x) for x in arrays]
    torch.cuda.synchronize()
    for x, out in zip(arrays, outs):
        assert out.device.type == "cuda" and out.cpu().numpy().tolist() == x.tolist()
    # the ring wrapped behind the spinning kernel: uploads 5-20 found their buffers pending
    assert uploader.uploads == 24 and uploader.waits - waits_before >= 1


@pytest.mark.gpu
def test_an_upload_captured_in_a_cuda_graph_replays_its_own_values():
    """Inside a capture the copy is replayed later: it reads a source kept for it, so uploads
    after the capture (through the ring) do not change what a replay writes."""
    uploader = PinnedUploader("cuda", depth=2, min_bytes=64)
    uploader.upload(np.zeros(4, dtype=np.int32))  # warm the ring before the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            out = uploader.upload(np.array([5, 6, 7, 8], dtype=np.int32))
    for _ in range(4):
        uploader.upload(np.full(4, -1, dtype=np.int32))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert out.cpu().tolist() == [5, 6, 7, 8]
