"""Per-stage wall times of one call, for ``kpool_topk(stats=...)`` and the benchmarks."""

from __future__ import annotations

import time

import torch

__all__ = ["stage"]


class stage:
    """``with stage(problem, "score"):`` adds the stage's wall seconds to
    ``problem.stage_times[name]`` when ``problem.stage_times`` is a dict, synchronizing the
    device before and after (so the call is slower); does nothing otherwise."""

    def __init__(self, problem, name: str):
        self.times, self.name, self.device = problem.stage_times, name, problem.device

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        if self.times is not None:
            self._sync()
            self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.times is not None:
            self._sync()
            self.times[self.name] = self.times.get(self.name, 0.0) + time.perf_counter() - self.t0
