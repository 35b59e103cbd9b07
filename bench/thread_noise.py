"""How much a fixed CPU workload's time varies with one torch thread and with two.

The frontier bench pairs methods round by round, which cancels a slow phase
the methods of one round share, but not jitter from one measurement to the
next. On a small shared VM that jitter grows with the thread count: every
OpenMP parallel region waits for its slowest thread, so a vCPU the host takes
away for a moment stalls the whole region. This study times the same matmul
loop (about 2 s, the length of a bench step) again and again at each thread
count and prints the spread of its log time, the quantity the paired
intervals (hilore_compiler/bench/paired.py) are made of. Run from the repository root, on an
otherwise idle machine (about 4 minutes):

    python3 bench/thread_noise.py [--repeats 40] [--seconds 2.0]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch


def time_loop(threads: int, seconds: float, repeats: int) -> tuple[int, list[float]]:
    """(matmuls per loop, seconds of each of ``repeats`` loops), the loop sized to take
    about ``seconds`` at ``threads``."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2048, 2048, generator=gen), torch.randn(2048, 2048, generator=gen)
    start = time.perf_counter()
    a @ b
    per_matmul = time.perf_counter() - start
    count = max(1, round(seconds / per_matmul))

    def loop() -> None:
        for _ in range(count):
            a @ b

    loop()  # warm caches and the thread pool before anything counts
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        loop()
        times.append(time.perf_counter() - start)
    return count, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one timed loop")
    parser.add_argument("--threads", default="1,2", help="thread counts to compare, comma-separated")
    args = parser.parse_args()
    print("threads  median s  sd(log)  min s  max s  matmuls/s")
    for threads in (int(t) for t in args.threads.split(",")):
        count, times = time_loop(threads, args.seconds, args.repeats)
        logs = [math.log(t) for t in times]
        median = statistics.median(times)
        print(f"{threads:7d}  {median:8.3f}  {statistics.stdev(logs):7.4f}  {min(times):5.3f}  {max(times):5.3f}  {count / median:9.2f}")


if __name__ == "__main__":
    main()
