"""``backend="deepgemm"``: the FP8 serving arithmetic on Hopper GPUs (contract §6, §8).

Pools and queries by the Triton kernels of :mod:`sp_kpool.kernels.triton_serving`
(bitwise equal to :mod:`sp_kpool.serving`; one launch for both when the pipeline pools),
scores by DeepGEMM's ``fp8_mqa_logits``
(``(q8, (k8, k_scale), weights', ks, ke)``), query rows chunked so that the real logits
storage never exceeds ``max_logits_bytes`` (checked on every call).

**H 128.** DeepGEMM's SM90 host API takes ``num_heads`` 32 and 64 only (2.5, and upstream
through 2026-06), although its kernel template is written for any multiple of 8 heads. At
H 128 the backend scores with the dense mode of :mod:`sp_kpool.kernels.triton_fp8_fused`:
the same per-logit arithmetic (contract §8) instantiated at 128 heads, the kernel whose
logits equal DeepGEMM's bit for bit at H 32 and 64. It needs Triton, not ``deep_gemm``.

Column layouts, detected from the installed API: ``legacy`` (absolute columns, guard
columns, ``clean_logits`` writes ``-inf`` outside ``[ks, ke)``) where ``fp8_mqa_logits``
exists; ``compact`` (request-local columns, ``max_seqlen_k``; columns past a row's
length are uninitialised and masked here) where only ``fp8_fp4_mqa_logits`` exists or
``Settings.mqa_layout = "compact"`` (``$SP_KPOOL_MQA_LAYOUT``).

**CUDA scorer.** With ``Settings.cuda_scorer`` (``SP_KPOOL_CUDA_SCORER=1``) every chunk is
scored by :mod:`sp_kpool.kernels.cuda_fp8_mqa` (the same arithmetic; experimental, see
:mod:`sp_kpool.backends.cuda_scorer`); ``deep_gemm`` is then not needed.
"""

from __future__ import annotations

import functools

import torch

from .._probe import cuda_reason, probe
from ..selectors import reads_row_ranges_only
from . import deepgemm_api
from .base import Backend, ChunkScores, PoolInputs, Pools, Problem, Queries, QueryInputs, round_rows
from .cuda_scorer import cuda_scorer_reasons, score_cuda
from .deepgemm_logits import logits_bytes, logits_chunk_rows
from .triton_backend import score_triton

__all__ = ["DeepGemmBackend", "mqa_api"]


@functools.lru_cache(maxsize=1)
def mqa_api():
    """``(function, layouts supported)`` of the installed DeepGEMM, detected once by the
    rule of :func:`sp_kpool.backends.deepgemm_api.from_module` (its API generation)."""
    dg, why = probe("deep_gemm")
    if dg is None:
        raise RuntimeError(why)
    api = deepgemm_api.from_module(dg)
    return api.function, api.layouts


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


def _layout(settings) -> str:
    """The column layout: ``settings.mqa_layout`` if set (checked against the installed
    build), else the first one the build has."""
    _, layouts = mqa_api()
    want = settings.mqa_layout
    if want:
        if want not in layouts:
            raise ValueError(f"SP_KPOOL_MQA_LAYOUT: the installed deep_gemm supports {list(layouts)}, not {want!r}")
        return want
    return layouts[0]


class DeepGemmBackend(Backend):
    name = "deepgemm"
    precisions = ("fp8",)
    priority = 20
    max_chunk_rows = 1 << 16
    #: Per-row constant of the balance work model (see TileLangBackend): b / a ~ 11500.
    balance_row_cost = 11500
    #: DeepGEMM's and the Triton kernel's logit is one chain per (row, pool) cell (contract §8):
    #: partial chunks are scored as their rows here, and the query kernel writes no zero rows.
    row_local_scores = True
    heads_supported = (32, 64, 128)
    #: Heads that DeepGEMM's ``fp8_mqa_logits`` scores (SM90: 32 and 64; 2.5 refuses 128, measured);
    #: the others are scored by the Triton kernel of the same arithmetic (module doc).
    deepgemm_heads = (32, 64)
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
        cuda = problem.settings.cuda_scorer
        dg = problem.heads in self.deepgemm_heads and not cuda
        if not reasons and cuda:
            reasons += cuda_scorer_reasons(problem)
        if not reasons:
            for mod in ("triton", "deep_gemm") if dg else ("triton",):
                _, why = probe(mod)
                if why:
                    reasons.append(why)
        if not reasons and dg:
            try:
                mqa_api()
            except RuntimeError as exc:
                reasons.append(str(exc))
        return reasons

    def _layout_args(self, problem: Problem):
        layout = _layout(problem.settings)
        a = legacy_alignment(problem.device.index or 0) if layout == "legacy" else 64
        return layout, a

    def chunk_rows(self, problem: Problem, num_pools: int) -> int:
        if problem.heads not in self.deepgemm_heads or problem.settings.cuda_scorer:
            # the Triton kernel or the CUDA scorer: FP32 [rows, pools], no padding
            return super().chunk_rows(problem, num_pools)
        layout, a = self._layout_args(problem)
        rows = logits_chunk_rows(problem.max_logits_bytes, max(1, num_pools), problem.heads, layout, a)
        return round_rows(min(rows, self.max_chunk_rows, problem.seq.num_real_tokens))

    def prepare(self, problem: Problem, pools: PoolInputs | None, queries: QueryInputs | None):
        """Pools (E4M3 values and UE8M0 scales) and queries (rotated E4M3, scales folded into
        FP32 head weights, ``queries.before`` / ``after`` zero rows written around them by
        the kernel: none from the pipeline, ``row_local_scores``), both in one kernel
        launch when both are asked for (``triton_serving.prepare_fp8``: bit for bit the
        values of the two separate kernels)."""
        from ..kernels import triton_serving as ts

        if pools is not None and queries is not None:
            (k8, k_scale), (q8, wq) = ts.prepare_fp8(
                queries.q, queries.w, pools.k, pools.gates, problem.ape, pools.pool_tok_start,
                before=queries.before, after=queries.after, extend=pools.extend,
            )  # fmt: skip
            return Pools(k8, k_scale), Queries(q8, wq, queries.row - queries.before)
        pooled = prepared = None
        if pools is not None:
            pooled = Pools(*ts.pools_serving(pools.k, pools.gates, problem.ape, pools.pool_tok_start, fp8=True,
                                             extend=pools.extend))  # fmt: skip
        if queries is not None:
            q8, wq = ts.queries_fp8(queries.q, queries.w, before=queries.before, after=queries.after)
            prepared = Queries(q8, wq, queries.row - queries.before)
        return pooled, prepared

    def score(self, problem, pools, q8, wq, lo, hi, starts, ends) -> ChunkScores:
        k8, k_scale = pools.keys, pools.scales
        if problem.settings.cuda_scorer:
            return score_cuda(problem, q8, wq, k8[lo:hi], k_scale[lo:hi], starts, ends, self.name)
        if problem.heads not in self.deepgemm_heads:
            return score_triton(problem, q8, wq, k8[lo:hi], k_scale[lo:hi], starts, ends, self.name)
        fn, _ = mqa_api()
        layout, a = self._layout_args(problem)
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
            return ChunkScores(logits[:, shift : shift + n], masked=True)
        scores = logits[:, :width]
        if clean:
            cols = torch.arange(width, device=q8.device)
            scores = scores.masked_fill(cols[None] >= lens[:, None], -float("inf"))
        return ChunkScores(scores, col_offset=starts.to(torch.int64), masked=True)
