"""What was alive at the moment of peak allocated memory, from a CUDA allocator snapshot.

Reads a `torch.cuda.memory._snapshot()` pickle (gzip'd or not: benchmark_prefill.py
--memory-snapshot DIR writes one per prefill case), replays the allocator trace of one device
(`device_traces`: `alloc` and `free_completed` events in time order) and prints the allocations
alive when the replayed allocated total is highest, grouped by the innermost stack frame inside
the `vllm/` package (file:line function), largest group first, with the total.

The trace is a ring buffer: its oldest events may be gone. The live set at the start of the
window is rebuilt from what the window shows: a block alive at the end (the snapshot's
`segments`) that the window never allocates or frees was alive all along, and an address whose
first event in the window is a free was alive from the start. Sizes are the trace's sizes (the
caller's request; torch.cuda.memory_allocated counts blocks rounded up to 512 bytes).

Usage:
  python scripts/memory_at_peak.py out/prefill_snap/mem_L131072_b8192.pickle.gz [--top 25]
      [--device 0] [--json out.json]
"""
from __future__ import annotations

import argparse
import gzip
import json
import pickle
import sys
from collections import defaultdict
from dataclasses import dataclass, field

GiB = float(1 << 30)
PACKAGE = "vllm"


@dataclass
class Allocation:
    addr: int
    size: int
    frames: list = field(default_factory=list)


@dataclass
class PeakReport:
    device: int
    peak_bytes: int
    event_index: int          # events replayed when the peak was reached (-1: before any)
    num_events: int
    time_us: int | None
    live: list[Allocation]
    groups: list[tuple[str, int, int]]   # (site, bytes, count), largest first

    def as_dict(self) -> dict:
        return {"device": self.device, "peak_bytes": self.peak_bytes,
                "event_index": self.event_index, "num_events": self.num_events,
                "time_us": self.time_us, "num_live": len(self.live),
                "groups": [{"site": s, "bytes": b, "count": c} for s, b, c in self.groups]}


def load_snapshot(path: str) -> dict:
    with open(path, "rb") as f:
        head = f.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        snapshot = pickle.load(f)
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
        raise ValueError(f"{path}: not a torch.cuda.memory._snapshot() dict with device_traces "
                         "(record it with torch.cuda.memory._record_memory_history() first)")
    return snapshot


def _frame_fields(frame) -> tuple[str, int, str]:
    if isinstance(frame, dict):
        return str(frame.get("filename", "?")), int(frame.get("line", 0)), str(frame.get("name", "?"))
    return str(getattr(frame, "filename", "?")), int(getattr(frame, "line", 0)), \
        str(getattr(frame, "name", "?"))


def package_path(filename: str, package: str = PACKAGE) -> str | None:
    """'.../vllm/v1/x.py' -> 'vllm/v1/x.py' (the last '/vllm/' in the path: a checkout named
    vllm holds the package one level down); None outside the package."""
    name = filename.replace("\\", "/")
    if name.startswith(package + "/"):
        return name
    marker = f"/{package}/"
    at = name.rfind(marker)
    return None if at < 0 else name[at + 1:]


def site_of(frames, package: str = PACKAGE) -> str:
    """The innermost frame inside the package as 'file:line function' (frames are innermost
    first, as torch records them); else the innermost frame, marked as outside."""
    for frame in frames or []:
        filename, line, name = _frame_fields(frame)
        rel = package_path(filename, package)
        if rel is not None:
            return f"{rel}:{line} {name}"
    if frames:
        filename, line, name = _frame_fields(frames[0])
        return f"(outside {package}/) {filename}:{line} {name}"
    return "(no stack recorded)"


def _block_frames(block: dict) -> list:
    if block.get("frames"):
        return block["frames"]
    history = block.get("history") or []  # older torch: per-block allocation history
    return history[-1].get("frames", []) if history else []


def live_at_end(snapshot: dict, device: int) -> dict[int, Allocation]:
    """Blocks allocated when the snapshot was taken (address -> allocation)."""
    live = {}
    for segment in snapshot.get("segments", []):
        if int(segment.get("device", 0)) != device:
            continue
        addr = int(segment.get("address", 0))
        for block in segment.get("blocks", []):
            baddr = int(block.get("address", addr))
            size = int(block.get("requested_size", block.get("size", 0)))
            if str(block.get("state", "")).startswith("active"):
                live[baddr] = Allocation(baddr, size, _block_frames(block))
            addr = baddr + int(block.get("size", 0))
    return live


def _events(snapshot: dict, device: int) -> list[dict]:
    traces = snapshot.get("device_traces") or []
    if device >= len(traces):
        raise ValueError(f"--device {device}: the snapshot has traces for {len(traces)} devices")
    events = [e for e in traces[device] if e.get("action") in ("alloc", "free_completed")]
    if events and all("time_us" in e for e in events):
        events.sort(key=lambda e: e["time_us"])  # stable: ties keep the recorded order
    return events


def peak_live_set(snapshot: dict, device: int = 0, package: str = PACKAGE) -> PeakReport:
    events = _events(snapshot, device)
    end = live_at_end(snapshot, device)
    touched = {int(e["addr"]) for e in events}
    live: dict[int, Allocation] = {a: b for a, b in end.items() if a not in touched}
    first: dict[int, str] = {}
    for e in events:
        first.setdefault(int(e["addr"]), e["action"])
    for e in events:  # freed inside the window before any alloc of it: alive at its start
        addr = int(e["addr"])
        if first[addr] == "free_completed" and addr not in live:
            live[addr] = Allocation(addr, int(e.get("size", 0)), e.get("frames") or [])
    total = sum(a.size for a in live.values())
    peak, peak_index, peak_live = total, -1, dict(live)
    for i, e in enumerate(events):
        addr = int(e["addr"])
        if e["action"] == "alloc":
            old = live.pop(addr, None)  # a lost free (ring buffer) would leave a stale block
            total -= old.size if old is not None else 0
            live[addr] = Allocation(addr, int(e.get("size", 0)), e.get("frames") or [])
            total += live[addr].size
            if total > peak:
                peak, peak_index, peak_live = total, i, dict(live)
        else:
            old = live.pop(addr, None)
            total -= old.size if old is not None else 0
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for alloc in peak_live.values():
        g = groups[site_of(alloc.frames, package)]
        g[0] += alloc.size
        g[1] += 1
    ordered = sorted(((s, b, c) for s, (b, c) in groups.items()), key=lambda x: (-x[1], x[0]))
    time_us = events[peak_index].get("time_us") if peak_index >= 0 else None
    return PeakReport(device, int(peak), peak_index, len(events), time_us,
                      sorted(peak_live.values(), key=lambda a: -a.size), ordered)


def format_report(report: PeakReport, top: int | None = None) -> str:
    where = ("before the first event" if report.event_index < 0 else
             f"after event {report.event_index + 1} of {report.num_events}")
    lines = [f"device {report.device}: peak allocated {report.peak_bytes / GiB:.3f} GiB "
             f"({report.peak_bytes} bytes) {where}; {len(report.live)} allocations alive",
             f"{'GiB':>9} {'share':>6} {'count':>6}  site (innermost frame in {PACKAGE}/)"]
    shown = report.groups if top is None else report.groups[:top]
    for site, size, count in shown:
        share = size / report.peak_bytes if report.peak_bytes else 0.0
        lines.append(f"{size / GiB:9.3f} {share:6.1%} {count:6d}  {site}")
    rest = report.groups[len(shown):]
    if rest:
        size = sum(b for _, b, _ in rest)
        lines.append(f"{size / GiB:9.3f} {size / max(report.peak_bytes, 1):6.1%} "
                     f"{sum(c for _, _, c in rest):6d}  ({len(rest)} more sites)")
    lines.append(f"{report.peak_bytes / GiB:9.3f} {1.0:6.1%} {len(report.live):6d}  total")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> PeakReport:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("snapshot", help="torch.cuda.memory._snapshot() pickle (.gz or plain)")
    p.add_argument("--device", type=int, default=None,
                   help="device trace to replay (default: the first with events)")
    p.add_argument("--top", type=int, default=30, help="sites shown (0: all)")
    p.add_argument("--package", default=PACKAGE, help="package whose frames name the sites")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    args = p.parse_args(argv)
    if args.top < 0:
        p.error(f"--top {args.top} must be >= 0")
    snapshot = load_snapshot(args.snapshot)
    device = args.device
    if device is None:
        traces = snapshot.get("device_traces") or []
        device = next((i for i, t in enumerate(traces) if t), 0)
    report = peak_live_set(snapshot, device, args.package)
    print(format_report(report, args.top or None))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
