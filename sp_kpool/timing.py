"""What one call records besides its output: per-stage wall times and a fused selector's
counters (:class:`RunRecord`), for ``kpool_topk(stats=...)`` and the benchmarks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

__all__ = ["RunRecord", "stage"]


@dataclass
class RunRecord:
    """The pipeline's state of one call, carried next to its (frozen)
    :class:`~sp_kpool.backends.base.Problem` and filled while the call runs.

    stage_times: when a dict, the pipeline synchronizes the device around each stage and
    adds the seconds spent to it (``{stage name: float seconds}``; benchmarks; see
    ``kpool_topk(stats=)``, ``stats["time_s"]``); ``None``: nothing is timed. counters:
    what a fused selector counted (:func:`sp_kpool.scoring.select_chunks`: ints or 0-d
    tensors on the device; ``stats["selection"]``), ``{}`` when none ran.
    """

    stage_times: dict | None = None
    counters: dict = field(default_factory=dict)


class stage:
    """``with stage(record, "score", device):`` adds the stage's wall seconds to
    ``record.stage_times[name]`` when ``record`` is a :class:`RunRecord` whose
    ``stage_times`` is a dict, synchronizing ``device`` before and after (so the call is
    slower); does nothing otherwise (``record`` ``None`` included)."""

    def __init__(self, record: RunRecord | None, name: str, device: torch.device):
        self.times = record.stage_times if record is not None else None
        self.name, self.device = name, device

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
