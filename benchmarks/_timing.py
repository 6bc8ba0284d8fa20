"""Timing helpers shared by the benchmarks: medians of repeated runs, relative to one memory pass."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_seconds(fn: Callable[[], object], repeats: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs (CUDA synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_pass_seconds(tensor: torch.Tensor, repeats: int = 7) -> float:
    """Median time of one copy of ``tensor``: the unit every overhead is expressed in."""
    out = torch.empty_like(tensor)
    return median_seconds(lambda: out.copy_(tensor), repeats)


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """A Markdown table."""
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
