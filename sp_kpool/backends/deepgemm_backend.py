"""``backend="deepgemm"``: the FP8 serving arithmetic on Hopper GPUs (SPEC 6, 8).

Pools and queries by the Triton kernels of :mod:`sp_kpool.kernels.triton_serving`
(bitwise equal to :mod:`sp_kpool.serving`; one launch for both when the driver pools),
scores by DeepGEMM's ``fp8_mqa_logits``
(``(q8, (k8, k_scale), weights', ks, ke)``), query rows chunked so that the real logits
storage never exceeds ``max_logits_bytes`` (checked on every call).

Column layouts, detected from the installed API: ``legacy`` (absolute columns, guard
columns, ``clean_logits`` writes ``-inf`` outside ``[ks, ke)``) where ``fp8_mqa_logits``
exists; ``compact`` (request-local columns, ``max_seqlen_k``; columns past a row's
length are uninitialised and masked here) where only ``fp8_fp4_mqa_logits`` exists or
``$SP_KPOOL_MQA_LAYOUT=compact``.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch

from .._probe import cuda_reason, probe
from ..logits_budget import logits_bytes, logits_chunk_rows
from ..selection import reads_row_ranges_only
from .base import Backend, Problem, round_rows

__all__ = ["DeepGemmBackend", "mqa_api"]

_ENV_LAYOUT = "SP_KPOOL_MQA_LAYOUT"


@functools.lru_cache(maxsize=1)
def mqa_api():
    """``(function, layouts supported, legacy alignment or None)`` of the installed DeepGEMM."""
    dg, why = probe("deep_gemm")
    if dg is None:
        raise RuntimeError(why)
    fn = getattr(dg, "fp8_mqa_logits", None)
    if fn is not None:
        doc = (getattr(fn, "__doc__", "") or "") + str(_signature(fn))
        layouts = ("legacy", "compact") if "max_seqlen_k" in doc else ("legacy",)
        return fn, layouts
    fn = getattr(dg, "fp8_fp4_mqa_logits", None)
    if fn is not None:
        return fn, ("compact",)
    raise RuntimeError("deep_gemm has neither fp8_mqa_logits nor fp8_fp4_mqa_logits")


def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return ""


@functools.lru_cache(maxsize=None)
def legacy_alignment(device_index: int) -> int:
    """Column alignment ``a`` of the legacy layout, probed once: stride(N=1) = align(257, a)."""
    fn, _ = mqa_api()
    dev = torch.device("cuda", device_index)
    q = torch.zeros((1, 64, 128), dtype=torch.float8_e4m3fn, device=dev)
    kv = torch.zeros((1, 128), dtype=torch.float8_e4m3fn, device=dev)
    ks = torch.zeros((1,), dtype=torch.float32, device=dev)
    w = torch.zeros((1, 64), dtype=torch.float32, device=dev)
    z = torch.zeros((1,), dtype=torch.int32, device=dev)
    out = fn(q, (kv, ks), w, z, z + 1, clean_logits=True)
    return max(1, out.stride(0) - 256)


def _layout() -> str:
    _, layouts = mqa_api()
    want = os.environ.get(_ENV_LAYOUT, "").strip()
    if want:
        if want not in ("legacy", "compact"):
            raise ValueError(f"{_ENV_LAYOUT}: expected 'legacy' or 'compact', got {want!r}")
        if want not in layouts:
            raise ValueError(f"{_ENV_LAYOUT}: the installed deep_gemm supports {list(layouts)}, not {want!r}")
        return want
    return layouts[0]


class DeepGemmBackend(Backend):
    name = "deepgemm"
    precisions = ("fp8",)
    priority = 20
    masks_scores = True
    max_chunk_rows = 1 << 16
    #: Per-row constant of the balance work model (see TileLangBackend): b / a ~ 11500.
    balance_row_cost = 11500
    heads_supported = (32, 64)
    dims_supported = (128,)

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        why = cuda_reason(problem.device)
        if why:
            reasons.append(why)
        if problem.heads not in self.heads_supported:
            reasons.append(f"H = {problem.heads} not in {list(self.heads_supported)}")
        if problem.head_dim not in self.dims_supported:
            reasons.append(f"D = {problem.head_dim} not in {list(self.dims_supported)}")
        if not reasons:
            for mod in ("triton", "deep_gemm"):
                _, why = probe(mod)
                if why:
                    reasons.append(why)
        if not reasons:
            try:
                mqa_api()
            except RuntimeError as exc:
                reasons.append(str(exc))
        return reasons

    def pool(self, problem: Problem, pool_tok_start: torch.Tensor):
        from ..kernels.triton_serving import pools_serving

        return pools_serving(problem.k, problem.gates, problem.ape, pool_tok_start, fp8=True)

    def _layout_args(self, problem: Problem):
        layout = _layout()
        a = legacy_alignment(problem.device.index or 0) if layout == "legacy" else 64
        return layout, a

    def chunk_rows(self, problem: Problem, num_pools: int) -> int:
        layout, a = self._layout_args(problem)
        rows = logits_chunk_rows(problem.max_logits_bytes, max(1, num_pools), problem.heads, layout, a)
        return round_rows(min(rows, self.max_chunk_rows, problem.seq.num_real_tokens))

    #: the query kernel writes the zero rows around the prepared ones itself
    pads_prepared = True

    def prepare_queries(self, problem, q, w, before: int = 0, after: int = 0):
        """Rotated E4M3 queries ``[before + R + after, H, D]`` and folded FP32 head weights
        ``[before + R + after, H]``, zero rows around the ``R`` rows of ``q``, ``w``."""
        from ..kernels.triton_serving import queries_fp8

        return queries_fp8(q, w, before=before, after=after)

    #: pools and queries in one kernel launch (``triton_serving.prepare_fp8``)
    pools_with_queries = True

    def pool_and_prepare(self, problem, pool_tok_start, q, w, before: int = 0, after: int = 0):
        """:meth:`pool` and :meth:`prepare_queries` in one kernel launch (bit for bit the same
        values): ``((k8 [P, D], k_scale [P]), q8 [before + R + after, H, D], w [before + R +
        after, H])``."""
        from ..kernels.triton_serving import prepare_fp8

        pooled, (q8, wq) = prepare_fp8(q, w, problem.k, problem.gates, problem.ape, pool_tok_start, before=before,
                                       after=after)  # fmt: skip
        return pooled, q8, wq

    def score(self, problem, pooled, q, w, lo, hi, starts, ends):
        q8, wq = self.prepare_queries(problem, q, w)
        return self.score_prepared(problem, pooled, q8, wq, lo, hi, starts, ends)

    def score_prepared(self, problem, pooled, q8, wq, lo, hi, starts, ends):
        fn, _ = mqa_api()
        layout, a = self._layout_args(problem)
        k8, k_scale = pooled
        # the kernel's TMA wants 16-byte aligned scale pointers: start the kv slice at a
        # multiple of 4 pools and shift the row ranges and the returned columns to match
        shift = lo % 4
        kv = (k8[lo - shift : hi], k_scale[lo - shift : hi])
        n = hi - lo
        ks, ke = (starts + shift, ends + shift) if shift else (starts, ends)
        # -inf outside the row ranges only where a reader needs it: the Triton selector reads
        # [start, end) of each row itself; the serving selector and the fallbacks read more
        clean = not reads_row_ranges_only(problem.topk // problem.kpool, n, problem.order)
        if layout == "legacy":
            logits = fn(q8, kv, wq, ks, ke, clean_logits=clean)
            width = n
        else:
            lens = ends - starts
            width = max(1, int(lens.max()))
            if fn.__name__ == "fp8_fp4_mqa_logits":
                logits = fn((q8, None), kv, wq, ks, ke, clean_logits=False, max_seqlen_k=width)
            else:
                logits = fn(q8, kv, wq, ks, ke, clean_logits=False, max_seqlen_k=width)
        have = logits.untyped_storage().nbytes()
        bound = logits_bytes(q8.shape[0], width if layout == "compact" else n + shift, problem.heads, layout, a)
        if have > problem.max_logits_bytes or have > bound:
            raise RuntimeError(
                f"deepgemm: logits storage {have} bytes exceeds the budget {problem.max_logits_bytes} "
                f"or the predicted {bound} ({layout} layout, {q8.shape[0]} rows x {width} columns)"
            )
        if layout == "legacy":
            return logits[:, shift : shift + n]
        scores = logits[:, :width]
        if clean:
            cols = torch.arange(width, device=q8.device)
            scores = scores.masked_fill(cols[None] >= lens[:, None], -float("inf"))
        return scores, starts.to(torch.int64)
