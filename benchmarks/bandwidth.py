"""Measure this machine's memory bandwidth: a large tensor read (sum, and sgemv), and copy, on 1 thread and on N.

Decoding one token at a small batch reads every weight once, so a server's step time cannot fall below
(bytes of weights) / (read bandwidth): ``quant_peers.py`` reports each configuration as a share of that
limit, with the figure measured here in the same run. The buffer is many times the last-level cache, the
best of ``--repeats`` passes is kept (other load only ever slows a pass down), and a warm-up pass first
touches every page.

    python benchmarks/bandwidth.py                  # 1 thread and every core
    python benchmarks/bandwidth.py --threads 1,2 --mib 512 --result-file bw.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Bandwidth:
    threads: int
    read_gbps: float  # GB/s (1e9 bytes) of a full read: torch.sum over the buffer
    copy_gbps: float  # GB/s counting the bytes read plus the bytes written
    gemv_gbps: float  # GB/s of the buffer read as a matrix times a vector: decode's own access (BLAS sgemv)

    @property
    def best_read_gbps(self) -> float:
        """The fastest read seen: torch.sum alone measured ~30% under sgemv on the 2-core Zen 3 VM."""
        return max(self.read_gbps, self.gemv_gbps)


def _best_seconds(fn: object, repeats: int) -> float:
    assert callable(fn)
    fn()  # warm-up: page faults and thread-pool start stay out of the timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(threads: int, mib: int = 512, repeats: int = 5) -> Bandwidth:
    """Read and copy bandwidth with ``threads`` torch threads over a ``mib`` MiB fp32 buffer."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        nbytes = src.numel() * src.element_size()
        read_s = _best_seconds(lambda: float(src.sum()), repeats)
        copy_s = _best_seconds(lambda: dst.copy_(src), repeats)
        matrix, vector = src.view(-1, 4096), torch.ones(4096)
        gemv_s = _best_seconds(lambda: torch.mv(matrix, vector), repeats)
    finally:
        torch.set_num_threads(previous)
    return Bandwidth(threads, nbytes / read_s / 1e9, 2 * nbytes / copy_s / 1e9, nbytes / gemv_s / 1e9)


def measure_all(thread_counts: list[int], mib: int = 512, repeats: int = 5) -> list[Bandwidth]:
    return [measure(t, mib, repeats) for t in thread_counts]


def format_table(rows: list[Bandwidth]) -> str:
    lines = ["threads  read GB/s  gemv GB/s  copy GB/s", "-------  ---------  ---------  ---------"]
    lines += [f"{r.threads:<7}  {r.read_gbps:9.2f}  {r.gemv_gbps:9.2f}  {r.copy_gbps:9.2f}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default=f"1,{os.cpu_count() or 1}", help="comma list of thread counts")
    p.add_argument("--mib", type=int, default=512, help="buffer size in MiB (well above the last-level cache)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--result-file", default=None, help="also write the figures as JSON")
    args = p.parse_args(argv)
    counts = sorted({int(t) for t in args.threads.split(",") if t})
    rows = measure_all(counts, args.mib, args.repeats)
    print(format_table(rows))
    if args.result_file:
        out = Path(args.result_file)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"mib": args.mib, "bandwidth": [asdict(r) for r in rows]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
