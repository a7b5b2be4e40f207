"""Arms of a parity replay: ``precision[:backend]`` and one arm's run on a capture.

An *arm* is ``precision[:backend]`` (``fp8``, ``bf16-serving:torch``, ``bf16:auto``); the
backend defaults to ``auto`` and is resolved by name through
:func:`sp_kpool.backends.resolve_backend`. One arm's run is steps 1-3 of
:mod:`sp_kpool.parity.replay`: the gathered ``Problem`` prepared under the captured
autocast state, the backend's pools, and the ids of the operator's real driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..backends import Problem, backend_names, resolve_backend
from ..capture import Capture
from ..precision import PRECISIONS

__all__ = ["Arm", "gathered_problem"]


@dataclass(frozen=True)
class Arm:
    """``precision[:backend]``; ``backend`` defaults to ``auto``."""

    precision: str
    backend: str = "auto"

    @classmethod
    def parse(cls, text: str) -> "Arm":
        precision, _, backend = str(text).partition(":")
        if precision not in PRECISIONS:
            raise ValueError(
                f"arm: expected precision[:backend] with precision in {list(PRECISIONS)}, got {text!r}"
            )
        backend = backend or "auto"
        if backend not in backend_names():
            raise ValueError(f"arm {text!r}: backend expected one of {backend_names()}, got {backend!r}")
        return cls(precision, backend)

    def __str__(self) -> str:
        return f"{self.precision}:{self.backend}"


# --------------------------------------------------------------------------- arms


@dataclass
class _ArmRun:
    arm: Arm
    backend: Any
    problem: Problem
    pooled: Any
    ids: torch.Tensor


def _autocast(capture: Capture, device: torch.device):
    state = capture.meta["autocast"]
    if state == "off":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=getattr(torch, state))


def gathered_problem(captures: list[Capture], target: Capture, indexer, precision: str, device) -> Problem:
    """The ``Problem`` that rank ``target.rank`` of the live call ran after its all-gather."""
    m = target.meta
    k_parts, g_parts, local = [], [], None
    with _autocast(target, device):
        for c in captures:
            p = indexer.prepare(c.hidden.to(device), c.q_resid.to(device), precision)
            k_parts.append(p["k"])
            g_parts.append(p["gates"])
            if c is target:
                local = p
    return Problem(
        q=local["q"], head_weights=local["head_weights"], k=torch.cat(k_parts), gates=torch.cat(g_parts),
        ape=local["ape"], seq=target.seq(), topk=m["topk"], kpool=m["kpool"], tail=m["tail"], order=m["order"],
        alignment=m["alignment"], max_logits_bytes=m["max_logits_bytes"], precision=precision,
    )  # fmt: skip


def _run_arm(captures, target, indexer, arm: Arm, device, pts_dev, say) -> _ArmRun:
    say(f"arm {arm}: preparing {len(captures)} rank file(s)")
    problem = gathered_problem(captures, target, indexer, arm.precision, device)
    backend = resolve_backend(arm.backend, problem)
    say(f"arm {arm}: pooling and selecting with backend {backend.name}")
    pooled = backend.pool(problem, pts_dev) if pts_dev.numel() else None
    ids = backend.run(problem, pooled)
    return _ArmRun(arm, backend, problem, pooled, ids)


def _device(device) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
