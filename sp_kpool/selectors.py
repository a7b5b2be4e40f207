"""Deterministic Top-K selectors and their registry (contract §4: higher score first, ties
toward the lower pool id, ``-0.0`` equal to ``+0.0``, NaN never selected).

Every selector returns the same set for the same scores; they differ in where they run and
how fast. Each is a registered :class:`Selector` that says what it supports and why not
(:meth:`Selector.not_supported_reasons`), as backends do; :func:`select_pools` takes the
first registered selector, by priority, that supports the request (:func:`choose`), and
``python -m sp_kpool info`` lists them (:func:`describe`).

Two kinds are registered:

* **dense** selectors rank a chunk's scores ``[R, N]`` that a backend wrote
  (:func:`select_pools`): ``triton`` (CUDA, exact, no host synchronisation), ``radix``
  (LMDeploy's ``sparse_index_topk`` plus an exactness check: CUDA without Triton, where it is
  3x faster than ``int64-keys`` on smooth scores and 1.5x slower on heavy ties, H200 record
  ``selectors_registered_465ead6.json``), ``int64-keys`` (the reference, any device) and
  ``serving`` (``order="serving"``: LMDeploy's set in its order). An FP32-candidates
  selector (``torch.topk`` of ``k + 8`` plus a tie check) was removed: 39.6 ms and 15.5 GB
  against ``int64-keys``' 31.0 ms and 13.3 GB on that record;
* **fused** selectors score and select a chunk in one step, for one backend and precision
  (:class:`FusedSelector`; :func:`choose_fused`): the pipeline uses one when it supports the
  call and otherwise scores, then selects (:func:`sp_kpool.scoring.select_chunks`). A fused
  kernel is one file under ``kernels/`` plus one :func:`register` call.

The functions that implement the exact rule (int64 keys, FP32 candidates, the radix check,
the serving order, the Triton selector's path) are in :mod:`sp_kpool.topk_rule`; their
names stay importable from here.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from typing import Any

import torch

from . import _device
from ._probe import probe
from .config import UNUSED_FIRST
from .topk_rule import (
    FAST_EXTRA,
    _ascending,
    _mask,
    _radix_selector,
    _select_cuda,
    _triton_select,
    score_keys,
    serving_pools,
    topk_pools,
    topk_pools_fast,
    topk_pools_radix,
)

__all__ = [
    "SelectRequest",
    "Selector",
    "FusedSelector",
    "SELECTORS",
    "register",
    "choose",
    "choose_fused",
    "may_have_short_rows",
    "short_rows_hint",
    "describe",
    "select_pools",
    "reads_row_ranges_only",
    "score_keys",
    "topk_pools",
    "topk_pools_fast",
    "topk_pools_radix",
    "serving_pools",
    "FAST_EXTRA",
]


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class SelectRequest:
    """What one selection asks for: ``k`` pools per row out of rows ``width`` columns wide,
    in ``order``, on ``device``; ``ranges``: each row's visible columns ``[start, end)`` are
    given (:func:`select_pools`'s ``ends``)."""

    k: int
    width: int
    order: str
    device: torch.device
    ranges: bool = True


class Selector:
    """A dense selector: ranks a chunk's ``[R, N]`` FP32 scores.

    Subclasses set ``name``, ``priority`` (higher is tried first) and ``summary``, and
    implement :meth:`not_supported_reasons` and :meth:`select`. ``reads_ranges_only``: the
    selector reads only ``[start, end)`` of each row, so scorers may leave the other cells
    unwritten (no ``-inf`` pass). ``writes_out``: :meth:`select` writes ``out`` itself
    (``order="ascending"``); otherwise :func:`select_pools` copies its result there."""

    name = "?"
    priority = 0
    summary = ""
    kind = "dense"
    reads_ranges_only = False
    writes_out = False

    def not_supported_reasons(self, req: SelectRequest) -> list[str]:
        """Why this selector cannot serve ``req`` (empty: it can)."""
        raise NotImplementedError

    def select(self, scores, visible, k: int, col0, starts, ends, order: str, out=None,
               short_rows: bool | str = True) -> torch.Tensor:  # fmt: skip
        """``[R, min(k, N)]`` global pool ids (``-1`` unused, last) in ``order`` (see
        :func:`select_pools` for the arguments); with ``writes_out``, ``out`` written whole.
        ``short_rows``: :func:`select_pools`'s hint (a selector may ignore it)."""
        raise NotImplementedError


class FusedSelector:
    """Scoring and selection of a chunk in one step, for one backend and its precisions.

    ``backends``: the backend names whose prepared pools and queries it reads;
    ``precisions``: the arithmetics whose scores it reproduces bit for bit.
    :meth:`score_select` writes a chunk's selected pools (ascending pool id, ``-1`` after)
    into ``out`` and returns counters for ``stats`` (candidates, overflow rows)."""

    name = "?"
    priority = 0
    summary = ""
    kind = "fused"
    backends: tuple[str, ...] = ()
    precisions: tuple[str, ...] = ()

    def not_supported_reasons(self, backend, problem) -> list[str]:
        """Why this selector cannot run ``problem`` on ``backend`` (empty: it can)."""
        reasons = []
        if backend.name not in self.backends:
            reasons.append(f"backend {backend.name!r} not in {list(self.backends)}")
        if problem.precision not in self.precisions:
            reasons.append(f"precision {problem.precision!r} not in {list(self.precisions)}")
        return reasons

    def score_select(self, backend, problem, pools, call, out: torch.Tensor) -> dict:
        """Select the pools of ``call``'s rows ``[call.a, call.b)`` into ``out``
        (``[call.b - call.a, k]`` int32, every element written); returns counters."""
        raise NotImplementedError


#: Registered selectors by name (dense and fused), in registration order.
SELECTORS: dict[str, Any] = {}


def register(selector) -> Any:
    """Register ``selector`` (a :class:`Selector` or :class:`FusedSelector` instance) under its
    name; returns it. A name registered twice replaces the first."""
    SELECTORS[selector.name] = selector
    return selector


def _ranked(kind: str) -> list:
    return sorted((s for s in SELECTORS.values() if s.kind == kind), key=lambda s: -s.priority)


def choose(req: SelectRequest) -> Selector:
    """The dense selector of ``req``: the first by priority that supports it (``ValueError``
    with every selector's reasons when none does)."""
    reasons = {}
    for s in _ranked("dense"):
        why = s.not_supported_reasons(req)
        if not why:
            return s
        reasons[s.name] = why
    if req.order == "serving":  # the message users of order="serving" know
        raise ValueError(f"order: 'serving' needs CUDA, lmdeploy and k in (512, 2048) pools, got k = {req.k} "
                         f"on {req.device}")  # fmt: skip
    detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in reasons.items())
    raise ValueError(f"selection: no selector for k = {req.k} of {req.width} columns, order {req.order!r} on "
                     f"{req.device}: {detail}")  # fmt: skip


def choose_fused(backend, problem) -> FusedSelector | None:
    """The fused selector for ``problem`` on ``backend`` (``None``: score, then select). Decided
    from the call's host-side description only (the same on every rank)."""
    for s in _ranked("fused"):
        if not s.not_supported_reasons(backend, problem):
            return s
    return None


def describe(device: torch.device, k: int = 512, width: int = 32768) -> list[tuple[str, str, str, list[str]]]:
    """``(name, kind, summary, reasons)`` of every registered selector for an ascending
    selection of ``k`` of ``width`` columns on ``device`` (fused selectors: the reasons that do
    not depend on a call), for ``python -m sp_kpool info``."""
    rows = []
    for s in _ranked("dense") + _ranked("fused"):
        if s.kind == "dense":
            why = s.not_supported_reasons(SelectRequest(k, width, "ascending", device))
        else:
            why = s.static_reasons(device) if hasattr(s, "static_reasons") else []
        rows.append((s.name, s.kind, s.summary, why))
    return rows


def short_rows_hint(real_cu_seq_lens: list[int], a: int, b: int, k: int, kpool: int) -> bool | str:
    """:func:`select_pools`'s ``short_rows`` hint for the global rows ``[a, b)``: ``"all"``
    when every real row of them sees at most ``k`` pools (the ``j``-th token of a document
    sees ``(j + 1) // kpool``, so each document's last row in the range decides), else
    :func:`may_have_short_rows`. Host arithmetic on the document boundaries only."""
    cu = real_cu_seq_lens
    b = min(b, cu[-1])
    if a >= b:
        return False
    d0, d1 = bisect.bisect_right(cu, a) - 1, bisect.bisect_left(cu, b)  # documents d0 .. d1 - 1 meet [a, b)
    # their lengths, the last one's up to b (map over list slices: no Python loop per document)
    longest = max(max(map(operator.sub, cu[d0 + 1 : d1], cu[d0 : d1 - 1]), default=0), b - cu[d1 - 1])
    if longest // kpool <= k:
        return "all"
    return may_have_short_rows(cu, a, b, k, kpool)


def may_have_short_rows(real_cu_seq_lens: list[int], a: int, b: int, k: int, kpool: int) -> bool:
    """Whether a real row of the global rows ``[a, b)`` of a packed sequence (document
    boundaries ``real_cu_seq_lens``, host ints) sees at most ``k`` pools (``(j + 1) // kpool``
    for the ``j``-th token of its document): the row ``a`` does, or a document starts inside
    the range (its first row sees none). Host arithmetic only: :func:`select_pools`'s hint."""
    cu = real_cu_seq_lens
    b = min(b, cu[-1])
    if a >= b:
        return False
    d = bisect.bisect_right(cu, a) - 1
    return (a - cu[d] + 1) // kpool <= k or cu[d + 1] < b


def reads_row_ranges_only(k: int, width: int, order: str) -> bool:
    """Whether :func:`select_pools` on CUDA selects ``k`` of ``width`` columns with a selector
    that reads only ``[start, end)`` of each row: scorers may then leave the other cells
    unwritten (no ``-inf`` pass). The one place that decides it, for the selectors and the
    scorers alike."""
    order = "ascending" if order == UNUSED_FIRST else order  # selected ascending (expansion.assemble)
    try:
        return choose(SelectRequest(k, width, order, torch.device("cuda"))).reads_ranges_only
    except ValueError:
        return False


def select_pools(
    scores, visible, k: int, col0, ends=None, order: str = "", starts=None, out=None, short_rows: bool | str = True
) -> torch.Tensor:
    """Deterministic Top-K of one scoring chunk: ``[R, min(k, N)]`` global pool ids, ``-1``.

    ``scores``: ``[R, N]`` float32 for pools ``col0 + column`` (``col0`` an int or ``[R, 1]``
    int64); ``visible``: ``[R, N]`` bool, or ``None`` when ``scores`` already holds ``-inf``
    at invisible cells; ``starts``/``ends``: ``[R]`` the columns that may be visible
    (optional; cells outside are ignored).

    Order of each row: ``order="ascending"`` (and ``"ascending-unused-first"``, whose
    layout :func:`sp_kpool.expansion.assemble` makes): ascending pool id, ``-1`` last;
    ``"serving"``: the serving selector's; otherwise score order. The selector is :func:`choose`'s for the request; all
    return the same sets (on CUDA the Triton selector when it supports the request; on CPU
    the int64-key path).

    ``out``: optional ``[R, k]`` int32 destination (unit column stride, e.g. rows of the
    pipeline's output): the row is written whole, ``-1`` past ``min(k, N)``, and ``out`` is
    returned. A selector with ``writes_out`` writes into it directly; the others copy.

    ``short_rows``: a speed hint (:func:`short_rows_hint` from host-side lengths): ``False``
    when no row's range holds at most ``k`` columns, so the Triton selector compiles without
    its step for such rows (on an H200 that step cost 0.25-0.46 ms on rows that never take
    it, 32768 rows of 24.6K-32.8K pools, ``benchmarks/results/h200-cu130-torch2.11/``); rows
    that do hold at most ``k`` are then ranked like the others: the same ids, more slowly.
    ``"all"``: every row's range holds at most ``k`` columns (a guarantee, not a guess: the
    Triton selector then runs only the step that takes every visible cell).
    """
    if order == UNUSED_FIRST:  # selected ascending; the expansion moves the unused slots first
        order = "ascending"
    R, n = scores.shape
    if out is not None and (out.shape != (R, k) or out.dtype != torch.int32 or out.device != scores.device):
        raise ValueError(f"out: expected an int32 tensor of shape {(R, k)} on {scores.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")  # fmt: skip
    device = torch.device("cuda") if _device.on_gpu(scores.device) else scores.device
    sel = choose(SelectRequest(k, n, order, device, ends is not None))
    if out is not None and sel.writes_out and order == "ascending":
        return sel.select(scores, visible, k, col0, starts, ends, order, out, short_rows=short_rows)
    pools = sel.select(scores, visible, k, col0, starts, ends, order, short_rows=short_rows)
    if out is None:
        return pools
    out[:, : pools.shape[1]] = pools
    out[:, pools.shape[1] :] = -1
    return out


class _Int64Keys(Selector):
    name = "int64-keys"
    priority = 0
    summary = "exact int64 (score, -column) keys and torch.topk; any device (the reference)"

    def not_supported_reasons(self, req):
        return ["order 'serving' needs the serving selector"] if req.order == "serving" else []

    def select(self, scores, visible, k, col0, starts, ends, order, out=None, short_rows=True):
        if visible is None:
            visible = scores > -float("inf")
        pools = topk_pools(scores, visible, k, col0)[0]
        return _ascending(pools) if order == "ascending" else pools


class _Radix(Selector):
    name = "radix"
    priority = 20
    summary = "LMDeploy's sparse_index_topk plus an exactness check (CUDA, k in 512, 2048)"

    def not_supported_reasons(self, req):
        why = []
        if req.device.type != "cuda":
            why.append(f"needs CUDA, got {req.device}")
        if req.order == "serving":
            why.append("order 'serving' needs the serving selector")
        if not req.ranges:
            why.append("needs the rows' ranges")
        if not why and _radix_selector(req.k) is None:
            why.append(f"needs lmdeploy's sparse_index_topk and k in (512, 2048), got k = {req.k}")
        return why

    def select(self, scores, visible, k, col0, starts, ends, order, out=None, short_rows=True):
        pools = topk_pools_radix(_mask(scores, visible), ends, k, col0, _radix_selector(k), ordered=order != "ascending")[0]
        return _ascending(pools) if order == "ascending" else pools


class _Triton(Selector):
    name = "triton"
    priority = 30
    summary = "exact Triton selector (sp_kpool.kernels.triton_topk), no host synchronisation (CUDA)"
    reads_ranges_only = True
    writes_out = True

    def not_supported_reasons(self, req):
        why = []
        if req.device.type != "cuda":
            why.append(f"needs CUDA, got {req.device}")
        if req.order == "serving":
            why.append("order 'serving' needs the serving selector")
        if not why and _triton_select(req.k, req.width) is None:
            m, reason = probe("triton")
            why.append(reason if m is None else f"k = {req.k} of {req.width} columns is outside the kernel's limits")
        return why

    def select(self, scores, visible, k, col0, starts, ends, order, out=None, short_rows=True):
        return _select_cuda(scores, visible, k, col0, ends, order, starts, out, short_rows)


class _Serving(Selector):
    name = "serving"
    priority = 40
    summary = "order='serving': LMDeploy's sparse_index_topk, its set and (non-deterministic) order (CUDA)"

    def not_supported_reasons(self, req):
        if req.order != "serving":
            return ["only for order 'serving'"]
        why = [] if req.device.type == "cuda" else [f"needs CUDA, got {req.device}"]
        if not req.ranges:
            why.append("needs the rows' ranges")
        if not why and _radix_selector(req.k) is None:
            why.append(f"needs lmdeploy's sparse_index_topk and k in (512, 2048), got k = {req.k}")
        return why

    def select(self, scores, visible, k, col0, starts, ends, order, out=None, short_rows=True):
        if visible is not None:
            scores = scores.masked_fill(~visible, -float("inf"))
        return serving_pools(scores, ends, k, col0, _radix_selector(k))


for _s in (_Int64Keys(), _Radix(), _Triton(), _Serving()):
    register(_s)


class _TritonFused(FusedSelector):
    """:mod:`sp_kpool.kernels.triton_fp8_fused` for the prepared pools and queries of the
    ``deepgemm`` backend (FP8) and of the ``triton`` backend (BF16): off unless
    ``Settings.fused`` (``SP_KPOOL_FUSED=1``) until it is measured faster than the scorer plus
    the Triton selector."""

    name = "triton-fused"
    priority = 10
    summary = ("the Triton scorer (DeepGEMM's per-logit arithmetic; FP8 or BF16) and a streaming exact Top-K in one "
               "kernel, logits never stored (deepgemm and triton backends, order 'ascending'; opt-in: "
               "SP_KPOOL_FUSED=1)")  # fmt: skip
    backends = ("deepgemm", "triton")
    precisions = ("fp8", "bf16", "bf16-serving")

    def static_reasons(self, device) -> list[str]:
        why = [] if device.type == "cuda" else [f"needs CUDA, got {device}"]
        m, reason = probe("triton")
        return why + ([reason] if m is None else [])

    def not_supported_reasons(self, backend, problem) -> list[str]:
        why = super().not_supported_reasons(backend, problem)
        if why:  # another backend or arithmetic: nothing else to say
            return why
        if not problem.settings.fused:
            why.append("off by default (SP_KPOOL_FUSED=1 turns it on)")
        if problem.order not in ("ascending", UNUSED_FIRST):
            why.append(f"order {problem.order!r}: writes ascending pool ids only")
        dev = torch.device("cuda") if _device.on_gpu(problem.device) else problem.device
        why += self.static_reasons(dev)
        if not why:
            from .kernels.triton_fp8_fused import supports

            why += supports(problem.heads, problem.head_dim, problem.topk // problem.kpool)
        return why

    def score_select(self, backend, problem, pools, call, out):
        from .kernels.triton_fp8_fused import score_select

        c = call.chunk
        scales = None if pools.scales is None else pools.scales[c.pool_lo : c.pool_hi]  # (BF16: none)
        _, emitted = score_select(
            call.q, call.w, pools.keys[c.pool_lo : c.pool_hi], scales, call.starts, call.ends,
            problem.topk // problem.kpool, rows=(call.rows.start, call.rows.stop), pool_base=c.pool_lo, out=out,
        )  # fmt: skip
        return {"candidates": emitted.sum(), "candidates_max": emitted.max(), "overflow_rows": 0}


register(_TritonFused())
