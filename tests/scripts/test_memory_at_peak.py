"""scripts/memory_at_peak.py on hand-written snapshots in torch.cuda.memory._snapshot()'s format
(segments with blocks, device_traces with action / addr / size / frames / time_us).

The oracle is brute force over the ground truth of a generated allocation program: every
allocation's [alloc, free) interval is known, and the peak is the maximum, over every event
time, of the summed sizes of the intervals open at that time."""
import gzip
import pickle
import random
from collections import defaultdict

import pytest

from tests.utils.scripts import load_script

MAP = load_script("memory_at_peak.py")

SITES = [
    [{"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 10, "name": "linear"},
     {"filename": "/work/wt/x/vllm/model_executor/layers/linear.py", "line": 42, "name": "forward"},
     {"filename": "/work/wt/x/vllm/v1/worker/gpu/model_runner.py", "line": 500, "name": "_forward"}],
    [{"filename": "/home/u/vllm/vllm/v1/attention/backends/mla/prefill.py", "line": 301,
      "name": "expand_latent"}],
    [{"filename": "/opt/torch/cuda/graphs.py", "line": 7, "name": "capture"}],  # outside vllm
    [{"filename": "vllm/v1/worker/gpu/block_table.py", "line": 9, "name": "__init__"}],
]
SITE_NAMES = ["vllm/model_executor/layers/linear.py:42 forward",
              "vllm/v1/attention/backends/mla/prefill.py:301 expand_latent",
              "(outside vllm/) /opt/torch/cuda/graphs.py:7 capture",
              "vllm/v1/worker/gpu/block_table.py:9 __init__"]


def program(seed: int, n: int = 60):
    """A random allocation program: (allocations with [t_alloc, t_free) and site, trace events).
    Addresses are reused after frees, as the caching allocator does."""
    rng = random.Random(seed)
    allocs, events, live, free_addrs, next_addr, t = [], [], [], [], 1 << 20, 0
    for _ in range(n):
        t += 1
        if live and rng.random() < 0.45:
            a = live.pop(rng.randrange(len(live)))
            a["t_free"] = t
            events.append({"action": "free_requested", "addr": a["addr"], "size": a["size"],
                           "frames": SITES[a["site"]], "time_us": t})
            events.append({"action": "free_completed", "addr": a["addr"], "size": a["size"],
                           "frames": SITES[a["site"]], "time_us": t})
            free_addrs.append(a["addr"])
        else:
            if free_addrs and rng.random() < 0.5:
                addr = free_addrs.pop(rng.randrange(len(free_addrs)))
            else:
                addr, next_addr = next_addr, next_addr + (1 << 24)
            a = {"addr": addr, "size": rng.choice([512, 4096, 1 << 20, 3 << 20, 7 << 19]),
                 "site": rng.randrange(len(SITES)), "t_alloc": t, "t_free": None}
            allocs.append(a)
            live.append(a)
            events.append({"action": "alloc", "addr": addr, "size": a["size"],
                           "frames": SITES[a["site"]], "time_us": t})
            events.append({"action": "segment_alloc", "addr": addr, "size": a["size"],
                           "frames": [], "time_us": t})
    return allocs, events, t


def snapshot_of(allocs, events):
    """Segments = what is alive at the end (one segment per live block, plus a free block)."""
    segments = []
    for a in allocs:
        if a["t_free"] is None:
            segments.append({"device": 0, "address": a["addr"], "total_size": a["size"] + 512,
                             "blocks": [{"address": a["addr"], "size": a["size"],
                                         "requested_size": a["size"], "state": "active_allocated",
                                         "frames": SITES[a["site"]]},
                                        {"address": a["addr"] + a["size"], "size": 512,
                                         "requested_size": 0, "state": "inactive"}]})
    return {"segments": segments, "device_traces": [list(events)]}


def brute_peak(allocs, t_from: int, t_end: int):
    """max over t in [t_from, t_end] of the bytes of intervals open at t (alloc <= t < free);
    the earliest time wins a tie. Returns (peak, sizes per site alive then)."""
    best, best_t = -1, None
    for t in range(t_from, t_end + 1):
        total = sum(a["size"] for a in allocs
                    if a["t_alloc"] <= t and (a["t_free"] is None or t < a["t_free"]))
        if total > best:
            best, best_t = total, t
    sites = defaultdict(int)
    for a in allocs:
        if a["t_alloc"] <= best_t and (a["t_free"] is None or best_t < a["t_free"]):
            sites[SITE_NAMES[a["site"]]] += a["size"]
    return best, dict(sites)


@pytest.mark.parametrize("seed", range(6))
def test_peak_and_live_set_equal_brute_force(seed):
    allocs, events, t_end = program(seed)
    report = MAP.peak_live_set(snapshot_of(allocs, events))
    peak, sites = brute_peak(allocs, 0, t_end)
    assert report.peak_bytes == peak
    assert {s: b for s, b, _ in report.groups} == sites
    assert sum(b for _, b, _ in report.groups) == peak
    sizes = [b for _, b, _ in report.groups]
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("seed", range(6))
def test_a_truncated_trace_keeps_the_allocations_from_before_the_window(seed):
    """The ring buffer dropped the oldest events: blocks alive all along come from the
    segments, blocks freed in the window before any alloc of theirs were alive at its start."""
    allocs, events, t_end = program(seed, n=80)
    cut = len(events) // 3
    window = events[cut:]
    t_from = window[0]["time_us"]
    report = MAP.peak_live_set(snapshot_of(allocs, window))
    # Within the window the replay is exact; the peak is searched from its first event.
    peak, sites = brute_peak(allocs, t_from - 1, t_end)
    assert report.peak_bytes == peak
    assert {s: b for s, b, _ in report.groups} == sites


def test_gzip_pickle_cli_prints_groups_and_total(tmp_path, capsys):
    allocs, events, t_end = program(3)
    path = tmp_path / "snap.pickle.gz"
    with gzip.open(path, "wb") as f:
        pickle.dump(snapshot_of(allocs, events), f)
    report = MAP.main([str(path), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    peak, _ = brute_peak(allocs, 0, t_end)
    assert f"({peak} bytes)" in out
    assert out.strip().splitlines()[-1].endswith("total")
    assert report.groups[0][0] in out
    plain = tmp_path / "snap.pickle"
    plain.write_bytes(pickle.dumps(snapshot_of(allocs, events)))
    assert MAP.main([str(plain)]).peak_bytes == peak


def test_not_a_snapshot_is_named(tmp_path):
    path = tmp_path / "x.pickle"
    path.write_bytes(pickle.dumps({"segments": []}))
    with pytest.raises(ValueError, match="device_traces"):
        MAP.load_snapshot(str(path))


def test_package_path_takes_the_package_inside_a_checkout_named_vllm():
    assert MAP.package_path("/home/u/vllm/vllm/v1/x.py") == "vllm/v1/x.py"
    assert MAP.package_path("/usr/lib/python3/site-packages/torch/x.py") is None
