"""CPU stand-ins for the GPU kernels, so the GPU backends' host code runs in CPU tests.

The ``deepgemm``, ``tilelang`` and ``triton`` backends hold host logic that no CPU test reached: chunk
planning from the logits budget, row padding to ``128 / H``, DeepGEMM's legacy / compact
column handling and the kv shift by ``lo % 4``, the storage-budget check, argument
marshalling and the selector's launch rules. :func:`install` replaces only what needs a
GPU, and nothing else:

* DeepGEMM: a fake ``deep_gemm`` module whose ``fp8_mqa_logits`` / ``fp8_fp4_mqa_logits``
  (:func:`fp8_mqa_logits`, :func:`fp8_fp4_mqa_logits`) follow the real kernel's contract
  in torch, storage included (padded rows, the legacy stride with guard columns, the
  compact stride, garbage in the cells the real kernel leaves uninitialised);
* the CUDA scorer (``Settings.cuda_scorer``): :func:`sp_kpool.kernels.cuda_fp8_mqa.score`
  (:func:`cuda_fp8_mqa_score`: the arithmetic it computes in each row's range, garbage
  elsewhere) and its ``nvcc`` lookup;
* TileLang: the compiled kernel behind :func:`sp_kpool.kernels.tilelang_score.tilelang_scores`
  (:func:`tilelang_kernel`; the real host function around it still pads the rows and
  computes each row group's column range); :func:`tilelang_scores` states the whole
  function's contract in torch;
* the probes (``cuda_reason`` and ``probe("deep_gemm" | "tilelang")`` of the three
  backends) and the choice of the GPU path (:func:`sp_kpool._device.on_gpu`);
* the Triton kernels (pools, queries, ``prepare_fp8``, ranges, selector, expansion, the
  scorer of the ``triton`` backend and of ``deepgemm`` at H 128) are the real ones, run by
  Triton's CPU interpreter
  (:func:`sp_kpool.testing.triton_interp.interpreted_module`).

Triton reads ``TRITON_INTERPRET`` when it is first imported, so the process must set
``TRITON_INTERPRET=1`` before importing triton (the tests run these cases in a child
process, as ``tests/unit/test_triton_interpreter.py`` does).

Where modules move, only :func:`install` changes.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from typing import Any

import torch

from ..backends.deepgemm_logits import align
from ..serving_scores import mqa_logits_fp8_reference

__all__ = ["GARBAGE", "fp8_mqa_logits", "fp8_fp4_mqa_logits", "fake_deep_gemm", "cuda_fp8_mqa_score", "tilelang_kernel",
           "tilelang_scores", "install", "Installed"]  # fmt: skip

#: What the stand-ins write into cells the real kernels leave uninitialised: a large
#: finite score, so a host step that reads such a cell selects it (NaN would be skipped).
GARBAGE = 3.0e38


def _check(q, kv, weights, starts, ends):
    k8, k_scale = kv
    R, H, D = q.shape
    assert q.dtype == torch.float8_e4m3fn and k8.dtype == torch.float8_e4m3fn, (q.dtype, k8.dtype)
    assert k_scale.dtype == torch.float32 and weights.dtype == torch.float32, (k_scale.dtype, weights.dtype)
    assert k8.shape == (k_scale.shape[0], D) and weights.shape == (R, H), (k8.shape, k_scale.shape, weights.shape)
    assert starts.dtype == torch.int32 and ends.dtype == torch.int32, (starts.dtype, ends.dtype)
    assert starts.shape == (R,) and ends.shape == (R,), (starts.shape, ends.shape)
    # TMA wants 16-byte aligned scale pointers: the backend slices kv at multiples of 4 pools
    assert k_scale.storage_offset() % 4 == 0, f"k_scale slice starts at {k_scale.storage_offset()}, not a multiple of 4"
    assert k8.stride(1) == 1 and k8.stride(0) == D and k_scale.stride(0) == 1


def fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True, max_seqlen_k=0,
                   *, legacy_align: int = 64, extra_rows: int = 0):  # fmt: skip
    """DeepGEMM's ``fp8_mqa_logits`` in torch (CPU or any device).

    Args:
        q: ``[R, H, D]`` float8_e4m3fn queries; kv: ``(k8 [N, D] float8_e4m3fn, k_scale [N]
            float32)``; weights: ``[R, H]`` float32 (folded); cu_seq_len_k_start /
            cu_seq_len_k_end: ``[R]`` int32, row ``r`` sees kv rows ``[start, end)``.
        clean_logits: legacy layout: ``-inf`` in every cell of ``[R, N]`` outside the row's
            range (else those cells hold :data:`GARBAGE`).
        max_seqlen_k: ``0``: legacy layout; ``M > 0``: compact layout.
        legacy_align: the legacy stride's alignment ``a`` (stride ``align(N + 256, a)``).
        extra_rows: allocate that many more padded rows than the kernel does (tests of the
            backend's storage check).

    Returns:
        FP32 logits, values ``k_scale[n] * sum_h w[r, h] * relu(<q[r, h], k8[n]>)``
        (:func:`sp_kpool.serving_scores.mqa_logits_fp8_reference`, bit for bit), stored as the
        real kernel stores them: ``align(R, 128 / H) (+ extra_rows)`` rows of stride
        ``align(N + 256, a)`` (legacy) or ``align(M, 256)`` (compact).

        * legacy: an ``[R, N]`` view, column ``n`` = kv row ``n`` (guard columns and padded
          rows behind it hold :data:`GARBAGE`);
        * compact: an ``[R, M]`` view, column ``c`` of row ``r`` = kv row ``start[r] + c``
          for ``c < end[r] - start[r]``, :data:`GARBAGE` past it (uninitialised in the
          real kernel; it never writes ``-inf`` there, whatever ``clean_logits`` says).
    """
    starts, ends = cu_seq_len_k_start, cu_seq_len_k_end
    _check(q, kv, weights, starts, ends)
    k8, k_scale = kv
    R, H, _ = q.shape
    N = k8.shape[0]
    rows = align(R, max(1, 128 // H)) + extra_rows
    values = mqa_logits_fp8_reference(q, weights, k8, k_scale, chunk_rows=max(1, R)) if R and N else None
    cols = torch.arange(N, device=q.device)
    if max_seqlen_k == 0:
        store = torch.full((rows, align(N + 256, legacy_align)), GARBAGE, dtype=torch.float32, device=q.device)
        out = store[:R, :N]
        if values is not None:
            inside = (cols[None] >= starts[:, None].long()) & (cols[None] < ends[:, None].long())
            out.copy_(torch.where(inside, values, -float("inf") if clean_logits else GARBAGE))
        return out
    M = int(max_seqlen_k)
    store = torch.full((rows, align(M, 256)), GARBAGE, dtype=torch.float32, device=q.device)
    out = store[:R, :M]
    if values is not None:
        c = torch.arange(M, device=q.device)
        src = starts[:, None].long() + c[None]  # kv row of column c
        inside = (src < ends[:, None].long()) & (src < N)
        got = values.gather(1, src.clamp(0, N - 1))
        out.copy_(torch.where(inside, got, GARBAGE))
    return out


def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=False, max_seqlen_k=0,
                       **kw):  # fmt: skip
    """The newer API: ``q`` is ``(q8 [R, H, D] float8_e4m3fn, None)`` (no FP4 scales); compact
    layout only (``max_seqlen_k > 0``); otherwise as :func:`fp8_mqa_logits`."""
    q8, q_sf = q
    assert q_sf is None and max_seqlen_k > 0, (q_sf, max_seqlen_k)
    return fp8_mqa_logits(q8, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, max_seqlen_k, **kw)


def fake_deep_gemm(api: str = "fp8", **kw) -> types.ModuleType:
    """A ``deep_gemm`` module: ``api="fp8"``: ``fp8_mqa_logits`` with ``max_seqlen_k``
    (both layouts); ``"fp8-legacy"``: an ``fp8_mqa_logits`` without it (an old build: legacy
    only); ``"fp8_fp4"``: only ``fp8_fp4_mqa_logits`` (compact only). ``kw`` go to the
    stand-in (``legacy_align``, ``extra_rows``)."""
    mod = types.ModuleType("deep_gemm")
    mod.__sp_kpool_standin__ = True
    if api == "fp8":
        def fp8_mqa_logits_(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True, max_seqlen_k=0):
            return fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, max_seqlen_k, **kw)

        fp8_mqa_logits_.__name__ = "fp8_mqa_logits"
        mod.fp8_mqa_logits = fp8_mqa_logits_
    elif api == "fp8-legacy":
        def fp8_mqa_logits_(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True):
            return fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, 0, **kw)

        fp8_mqa_logits_.__name__ = "fp8_mqa_logits"
        mod.fp8_mqa_logits = fp8_mqa_logits_
    elif api == "fp8_fp4":
        def fp8_fp4_mqa_logits_(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=False,
                                max_seqlen_k=0):  # fmt: skip
            return fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits,
                                      max_seqlen_k, **kw)  # fmt: skip

        fp8_fp4_mqa_logits_.__name__ = "fp8_fp4_mqa_logits"
        mod.fp8_fp4_mqa_logits = fp8_fp4_mqa_logits_
    else:
        raise ValueError(f"api: expected 'fp8', 'fp8-legacy' or 'fp8_fp4', got {api!r}")
    return mod


def tilelang_kernel(heads: int, dim: int, block_q: int, mask: bool = True):
    """The compiled TileLang kernel of :mod:`sp_kpool.kernels.tilelang_score` in torch: a
    callable ``(Q [Rp * H, D] bf16, K [N, D] bf16, W [Rp, H] fp32, Starts [Rp] int32, Ends
    [Rp] int32, BlockLo [Rp / BQ] int32, BlockHi [Rp / BQ] int32, Out [Rp, N] fp32)`` that
    writes, for each row group ``b`` of ``block_q`` rows, the columns ``[BlockLo[b],
    BlockHi[b])`` of its rows: ``sum_h relu(<q, k>) * w`` in FP32 (``-inf`` outside the
    row's ``[start, end)`` when ``mask``); other cells are left as they are, or (without
    ``mask``, where the host allocated ``Out`` uninitialised) set to :data:`GARBAGE`."""

    def kernel(Q, K, W, Starts, Ends, BlockLo, BlockHi, Out):
        Rp, N = Out.shape
        assert Q.dtype == K.dtype == torch.bfloat16 and W.dtype == Out.dtype == torch.float32
        assert Q.shape == (Rp * heads, dim) and K.shape == (N, dim) and W.shape == (Rp, heads)
        assert Rp % block_q == 0 and BlockLo.shape == BlockHi.shape == (Rp // block_q,)
        for t in (Q, K, W, Starts, Ends, BlockLo, BlockHi, Out):
            assert t.is_contiguous()
        for b in range(Rp // block_q):
            r0, lo, hi = b * block_q, int(BlockLo[b]), int(BlockHi[b])
            if not mask:
                Out[r0 : r0 + block_q, :lo] = GARBAGE
                Out[r0 : r0 + block_q, max(lo, hi) :] = GARBAGE
            if hi <= lo:
                continue
            s = K[lo:hi].float() @ Q[r0 * heads : (r0 + block_q) * heads].float().t()  # [n, BQ * H]
            s = torch.relu(s).view(hi - lo, block_q, heads) * W[r0 : r0 + block_q][None]
            acc = s.sum(-1).t()  # [BQ, n]
            if mask:
                c = torch.arange(lo, hi, device=Out.device)
                inside = (c[None] >= Starts[r0 : r0 + block_q, None]) & (c[None] < Ends[r0 : r0 + block_q, None])
                acc = torch.where(inside, acc, -float("inf"))
            Out[r0 : r0 + block_q, lo:hi] = acc

    return kernel


def tilelang_scores(q, wq, keys, starts, ends, clean: bool = True) -> torch.Tensor:
    """The contract of :func:`sp_kpool.kernels.tilelang_score.tilelang_scores` in torch.

    q: ``[R, H, D]`` bfloat16; wq: ``[R, H]`` float32 (already times ``H^-0.5 D^-0.5``);
    keys: ``[N, D]`` bfloat16; starts, ends: ``[R]`` int32. Returns ``[R, N]`` float32
    ``sum_h relu(<q[r, h], keys[n]>) * wq[r, h]`` (FP32 products and sums) for ``n`` in
    ``[start, end)``; ``-inf`` elsewhere when ``clean``, else :data:`GARBAGE` there (the
    real kernel leaves those cells unspecified; it may also write scores there)."""
    R, H, D = q.shape
    s = torch.einsum("rhd,nd->rnh", q.float(), keys.float())
    vals = (torch.relu(s) * wq[:, None, :]).sum(-1)
    n = torch.arange(keys.shape[0], device=q.device)
    inside = (n[None] >= starts[:, None]) & (n[None] < ends[:, None])
    return torch.where(inside, vals, -float("inf") if clean else GARBAGE)


def cuda_fp8_mqa_score(q, weights, keys, scales, ks, ke, *, mode="dense", q_blocks=1, out=None, grid=None,
                       debug=False):  # fmt: skip
    """:func:`sp_kpool.kernels.cuda_fp8_mqa.score` on any device: in each row's range the
    values of the arithmetic it computes (E4M3: :func:`fp8_mqa_logits`; BF16: the Triton
    kernel's dense mode, under the interpreter), :data:`GARBAGE` in the other columns (the
    real kernel writes scores of pools the row does not see there, or nothing). Asserts the
    layouts the real kernel needs."""
    S, H, _ = q.shape
    P = keys.shape[0]
    assert q.is_contiguous() and weights.is_contiguous() and ks.is_contiguous() and ke.is_contiguous()
    assert ks.dtype == ke.dtype == torch.int32 and keys.stride(1) == 1
    assert (scales is None) == (q.dtype == torch.bfloat16), "scales: E4M3 only"
    assert scales is None or (scales.is_contiguous() and scales.data_ptr() % 16 == 0)
    assert q_blocks in (1, 2) and mode in ("dense", "nostore")
    if scales is not None:
        vals = fp8_mqa_logits(q, (keys, scales), weights, ks, ke, clean_logits=False)[:, :P]
    else:
        from ..kernels.triton_fp8_fused import score_select

        vals = score_select(q, weights, keys, None, ks, ke, 1, dense=True, fill=None)
    n = torch.arange(P, device=q.device)
    inside = (n[None] >= ks[:, None].long()) & (n[None] < ke[:, None].long())
    vals = torch.where(inside, vals, GARBAGE)
    if mode == "nostore":
        return None
    if out is None:
        out = torch.full((S, P), float("-inf"), dtype=torch.float32, device=q.device)
    out[:, :P] = vals
    return out


@dataclasses.dataclass
class Installed:
    """What :func:`install` put in place: the fake ``deep_gemm`` module, the interpreted
    Triton kernel modules, and the :class:`~sp_kpool.settings.Settings` to pass to the
    calls (the column layout asked for)."""

    deep_gemm: types.ModuleType
    kernels: dict
    settings: Any


def install(monkeypatch, *, layout: str | None = None, api: str = "fp8", legacy_align: int = 64, extra_rows: int = 0,
            triton_selector: bool = True) -> Installed:  # fmt: skip
    """Install every stand-in for one test (undone by ``monkeypatch`` at its end).

    ``layout``: ``"legacy"`` / ``"compact"``: ``Settings.mqa_layout`` of the returned
    settings, which the calls must be given (``None``: the backend detects it from ``api``,
    see :func:`fake_deep_gemm`); ``legacy_align``,
    ``extra_rows``: for :func:`fp8_mqa_logits`; ``triton_selector=False``: the GPU path
    selects without the Triton selector (as where its limits are exceeded), so the scorers
    must write ``-inf`` outside the rows' ranges (``clean``).

    Needs ``TRITON_INTERPRET=1`` before triton was first imported in this process. The
    GPU path (:func:`sp_kpool._device.on_gpu`) is then taken for every device, so compute
    torch-backend references before installing.
    """
    from .. import _device, selectors
    from ..backends import deepgemm_backend as dgb, tilelang_backend as tlb, triton_backend as trb
    from ..kernels import cuda_fp8_mqa, tilelang_score
    from ..settings import Settings
    from .triton_interp import interpreted_module

    kernels = {name: interpreted_module(f"sp_kpool.kernels.{name}")
               for name in ("triton_topk", "triton_expand", "triton_ranges", "triton_serving")}  # fmt: skip
    fake = fake_deep_gemm(api, legacy_align=legacy_align, extra_rows=extra_rows)
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    tilelang_mod = types.ModuleType("tilelang")
    monkeypatch.setitem(sys.modules, "tilelang", tilelang_mod)

    real_probe = dgb.probe
    fakes = {"deep_gemm": fake, "tilelang": tilelang_mod}

    def probe(module):
        return (fakes[module], None) if module in fakes else real_probe(module)

    for mod in (dgb, tlb, trb):  # (tilelang's device check is triton_backend's bf16_gpu_reasons)
        monkeypatch.setattr(mod, "probe", probe)
        if hasattr(mod, "cuda_reason"):
            monkeypatch.setattr(mod, "cuda_reason", lambda device: None)
    monkeypatch.setattr(_device, "on_gpu", lambda device: True)
    if not triton_selector:
        monkeypatch.setattr(selectors, "_triton_select", lambda k, width: None)

    # the cached API probes: fresh cached copies for this test (the originals' caches are
    # cleared too, so nothing found here outlives it)
    dgb.mqa_api.cache_clear()
    dgb.legacy_alignment.cache_clear()
    monkeypatch.setattr(dgb, "mqa_api", functools.lru_cache(maxsize=1)(dgb.mqa_api.__wrapped__))

    @functools.lru_cache(maxsize=None)
    def legacy_alignment(device_index: int) -> int:
        # the real probe's arithmetic on CPU tensors (it builds CUDA ones): stride(N=1) - 256
        fn, _ = dgb.mqa_api()
        q = torch.zeros((1, 64, 128), dtype=torch.float8_e4m3fn)
        kv = torch.zeros((1, 128), dtype=torch.float8_e4m3fn)
        z = torch.zeros((1,), dtype=torch.int32)
        out = fn(q, (kv, torch.zeros(1)), torch.zeros((1, 64)), z, z + 1, clean_logits=True)
        return max(1, out.stride(0) - 256)

    monkeypatch.setattr(dgb, "legacy_alignment", legacy_alignment)

    def compiled(H, D, bn, st, th, bq, mask=True):
        return tilelang_kernel(H, D, bq, mask)

    monkeypatch.setattr(tilelang_score, "_compiled", compiled)
    # the CUDA scorer (Settings.cuda_scorer): the stand-in above, and an nvcc that is never run
    monkeypatch.setattr(cuda_fp8_mqa, "score", cuda_fp8_mqa_score)
    monkeypatch.setattr(cuda_fp8_mqa, "nvcc", lambda: "stand-in nvcc")
    return Installed(deep_gemm=fake, kernels=kernels, settings=Settings(mqa_layout=layout))
