"""Arms of a parity replay: ``precision[:backend]`` and one arm's run on a capture.

An *arm* is ``precision[:backend]`` (``fp8``, ``bf16-serving:torch``, ``bf16:auto``); the
backend defaults to ``auto`` and is resolved by name through
:func:`sp_kpool.backends.resolve_backend`. One arm's run is steps 1-3 of
:mod:`sp_kpool.parity.replay`: the gathered inputs prepared under the captured autocast
state, then the operator's real pipeline after the gather (pools, ids, the plan).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..backends import backend_names
from ..pipeline import run_gathered
from ..precision import PRECISIONS
from .load import Capture

__all__ = ["Arm", "gathered_inputs", "schedule_of"]


@dataclass(frozen=True)
class Arm:
    """``precision[:backend][+decode]``; ``backend`` defaults to ``auto``. ``+decode``
    (``all_decode``): every pool in the decode order, ignoring the captured prompt lengths
    (the comparison ``fp8`` vs ``fp8+decode`` shows what the compression schedule changes)."""

    precision: str
    backend: str = "auto"
    all_decode: bool = False

    @classmethod
    def parse(cls, text: str) -> "Arm":
        body, plus, suffix = str(text).partition("+")
        if plus and suffix != "decode":
            raise ValueError(f"arm {text!r}: expected the suffix '+decode' or none, got '+{suffix}'")
        precision, _, backend = body.partition(":")
        if precision not in PRECISIONS:
            raise ValueError(
                f"arm: expected precision[:backend] with precision in {list(PRECISIONS)}, got {text!r}"
            )
        backend = backend or "auto"
        if backend not in backend_names():
            raise ValueError(f"arm {text!r}: backend expected one of {backend_names()}, got {backend!r}")
        return cls(precision, backend, bool(plus))

    def __str__(self) -> str:
        return f"{self.precision}:{self.backend}" + ("+decode" if self.all_decode else "")


# --------------------------------------------------------------------------- arms


@dataclass
class _ArmRun:
    """One arm's run: the pipeline's :class:`~sp_kpool.pipeline.Computed` (ids, pools,
    prepared queries, plan) on the gathered inputs, and how to run it again."""

    arm: Arm
    inputs: dict
    seq: Any
    config: Any
    options: Any
    settings: Any
    computed: Any

    @property
    def backend(self):
        return self.computed.call.backend

    @property
    def problem(self):
        return self.computed.call.problem

    @property
    def pooled(self):
        return self.computed.pools

    @property
    def ids(self) -> torch.Tensor:
        return self.computed.ids

    def rerun(self):
        return run_gathered(self.inputs, self.seq, self.config, self.options, self.settings)


def _autocast(capture: Capture, device: torch.device):
    state = capture.meta["autocast"]
    if state == "off":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=getattr(torch, state))


def gathered_inputs(captures: list[Capture], target: Capture, indexer, precision: str, device) -> dict:
    """The inputs that rank ``target.rank`` of the live call had after its all-gather:
    ``q``, ``head_weights``, ``ape`` of its rows, ``k`` and ``gates`` of the whole sequence."""
    k_parts, g_parts, local = [], [], None
    with _autocast(target, device):
        for c in captures:
            p = indexer.prepare(c.hidden.to(device), c.q_resid.to(device), precision)
            k_parts.append(p["k"])
            g_parts.append(p["gates"])
            if c is target:
                local = p
    return {**local, "k": torch.cat(k_parts), "gates": torch.cat(g_parts)}


def _run_arm(captures, target, indexer, arm: Arm, device, say) -> _ArmRun:
    say(f"arm {arm}: preparing {len(captures)} rank file(s)")
    inputs = gathered_inputs(captures, target, indexer, arm.precision, device)
    config = target.config().replace(precision=arm.precision)
    options = target.options().replace(backend=arm.backend)
    seq = target.seq()
    if arm.all_decode:
        seq = dataclasses.replace(seq, prompt_lens=None)
    say(f"arm {arm}: pooling and selecting")
    computed = run_gathered(inputs, seq, config, options, indexer.settings)
    return _ArmRun(arm, inputs, seq, config, options, indexer.settings, computed)


def schedule_of(run: _ArmRun, capture: Capture) -> str:
    """How the arm's pools were compressed, in words (for the report)."""
    if run.arm.precision == "bf16":
        return "model definition (one order)"
    if capture.prompt_lens is None:
        return "all decode order (the capture has no prompt lengths: a call without them, or an older capture)"
    if run.arm.all_decode:
        return "all decode order (+decode: the captured prompt lengths ignored)"
    ext = run.computed.plan.extend
    n = int(ext.sum()) if ext is not None else 0
    return f"prompt pools in extend order ({n} of {run.computed.plan.num_pools} pools), the rest decode"


def _device(device) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
