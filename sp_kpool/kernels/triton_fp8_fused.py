"""FP8 scoring with DeepGEMM's per-logit arithmetic, fused with the exact Top-K (Triton); the
same kernel on BF16 queries and keys (the ``triton`` backend's scorer).

:func:`score_select` scores query rows against pools with the arithmetic of DeepGEMM's SM90
``fp8_mqa_logits`` (contract §6) and either stores the logits (``dense=True``: the bitwise
test vehicle) or never stores them and selects, per row, the ``k`` best visible pools by
the rule of :func:`sp_kpool.selectors.topk_pools` (higher score first, ties toward the
lower pool id, ``-0.0`` equal to ``+0.0``, NaN and ``-inf`` never selected), written in
ascending pool id with ``-1`` after.

**Per logit** (row ``i``, pool ``p``; ``a_h`` the FP8 tensor-core product of query head
``h`` and the pool over the 128 channels, as four chained ``k32`` steps of one ``tl.dot``;
``r_h = a_h`` if ``a_h > 0`` else ``0``, so NaN gives 0 as ``max.f32`` does; ``w_h`` the
folded FP32 head weight; ``s`` the pool's FP32 scale)::

    c_j   = fma(r_j, w_j, RN(r_{8+j} w_{8+j})), then c_j = fma(r_{8m+j}, w_{8m+j}, c_j),
            m = 2 .. H/8 - 1 in order                       (eight chains, j = 0..7)
    P_q   = RN(RN(c_{2q} + c_{2q+1}) * s)                    (q = 0..3)
    logit = RN(RN(P_0 + P_1) + RN(P_2 + P_3))

**BF16.** Given ``bfloat16`` queries and pools and no scales (``k_scale=None``), ``a_h`` is
the BF16 tensor-core product over the 128 channels (exact products, FP32 accumulation, in
the order of the instruction) and the formula runs without ``s``: ``P_q = RN(c_{2q} +
c_{2q+1})``, what a scale of 1.0 gives. The BF16 modes' score (contract §3) up to FP32
rounding, by a fixed order that depends on nothing but the row, the pool and the heads.

The heads of one chain step ``m`` of ``BQ`` rows are the ``N = 8 BQ`` columns of one
``tl.dot`` (``[BP, 128] x [128, N]``), so every step is one dot and no accumulator is split.
The kernel is compiled without FP contraction (``enable_fp_fusion=False``): every fused
multiply-add is an explicit ``tl.fma``. Whether these values equal DeepGEMM's bit for bit is
a property of the GPU's FP8 tensor-core instruction (the tests on a GPU check it, and that
the compiled kernel uses ``wgmma`` and no ``mma.sync``); on CPU (Triton's interpreter) the
same code checks the selection logic.

**Selection without stored logits.** One program owns ``BQ`` rows and streams their pools in
ascending id, in blocks of ``BP``. Per row it keeps a threshold key ``tau`` (the monotone
int32 key of :func:`sp_kpool.kernels.triton_topk_search.row_keys`) and appends every visible
cell whose key is ``> tau`` to a candidate buffer of ``cap`` entries (key and pool id). The
slot of a passing cell comes, by default, from one relaxed atomic per passing cell (the buffer
in no particular order; compaction needs no order); ``slots="scan"`` takes the row's count (in
registers) plus the cells passing before it in the block (a prefix count down the block's
pools) instead: no atomic, the buffer in ascending pool id. Every
``CHECK`` blocks (one barrier) a row holding more than ``cap - CHECK BP`` entries is
compacted: ``T`` = its ``k``-th largest buffered key; kept are the keys ``> T`` and, of the
keys ``== T``, the ones with the lowest pool ids, ``k`` in all: exactly the row's Top-K of
the pools seen so far; ``tau = T``. Exact because pools come in ascending id: a later cell
with key ``<= T`` ranks below ``k`` kept cells (equal keys lose to lower ids), and a dropped
cell ranks below ``k`` kept ones; ``tau`` only rises. After a compaction ``k`` entries
remain and ``cap >= k + CHECK BP``, so the buffer never overflows (no fallback is needed;
the launcher checks the bound). At the end a last compaction leaves the answer, sorted to
ascending pool id.

The kernels and their ``@triton.jit`` helpers are in
:mod:`sp_kpool.kernels.triton_fp8_fused_kernels`; this module holds the launcher.

Imports Triton: import this module only where Triton is available.
"""

from __future__ import annotations

import torch
import triton

from .triton_fp8_fused_kernels import _dense_pairs_kernel, _fused_kernel

__all__ = ["score_select", "scores_probe", "supports", "capacity"]

#: Pools per block (the ``M`` of each dot; a multiple of 64 for wgmma).
BLOCK_P = 64

#: The last compiled kernel of each ``(H, block_q, block_p, dense, one_dot, query dtype)`` launched,
#: ``+ ("pairs",)`` for the two-block dense kernel (its ``asm`` holds the PTX the tests check for
#: ``wgmma`` and no ``mma.sync``).
compiled: dict = {}


#: Heads whose default launch is one ``[BP, 128] x [128, block_q H]`` dot per block (``one_dot``,
#: ``block_q`` = ``max(2, 128 / H)``; otherwise one dot per chain step of 4 rows). At H 128 on
#: an H200 (2026-12-04, W: 32768 rows x 32768 pools): dense mode 118.8 ms one dot per chain
#: step (255 registers, 142 spills), 31.3 ms one dot of 1 row, 30.7 ms of 2 rows; fused
#: (k 512) 166.1 / 60.9 / 48.5 ms; the three bit for bit equal.
ONE_DOT_HEADS = (32, 64, 128)

#: Blocks between two compaction checks (each check is one barrier).
CHECK = 8

#: How a passing cell gets its candidate slot by default (:func:`score_select`'s ``slots``). The
#: kernel alone on an H200 (2026-12-04, ``scripts/bench_fused.py``, now ``python -m sp_kpool.bench fused``), "atomic" / "scan": W 26.7 /
#: 28.6 ms (H 32), 37.7 / 34.8 ms (H 64); 262144 tokens 88.7 / 94.7, 131.0 / 124.6 ms; 64 packed
#: documents 0.85 / 0.65, 1.16 / 0.74 ms. The default stays the one the whole-call GPU tests ran.
SLOTS = "atomic"


def capacity(k: int, block_p: int = BLOCK_P, check: int = CHECK) -> int:
    """Candidate entries per row: the power of two ``>= 2 k + check * block_p``. A check
    compacts a row holding more than ``cap - check * block_p`` to ``k``, so the ``check``
    blocks before the next one never overflow it."""
    return 1 << max(0, 2 * k + check * block_p - 1).bit_length()


def supports(heads: int, dim: int, k: int) -> list[str]:
    """Why :func:`score_select` cannot run this shape (empty: it can)."""
    why = []
    if heads not in (32, 64, 128):
        why.append(f"H = {heads} not in [32, 64, 128]")
    if dim != 128:
        why.append(f"D = {dim} != 128")
    if not 1 <= k <= 2048:
        why.append(f"k = {k} pools outside [1, 2048]")
    return why


def score_select(q8: torch.Tensor, w: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor | None,
                 starts: torch.Tensor, ends: torch.Tensor, k: int, *, rows: tuple[int, int] | None = None,
                 pool_base: int = 0, dense: bool = False, fill: float | None = float("nan"),
                 out: torch.Tensor | None = None, block_q: int | None = None, block_p: int = BLOCK_P,
                 num_warps: int = 4, num_stages: int | None = None, one_dot: bool | None = None,
                 cap: int | None = None, check: int = CHECK, slots: str = SLOTS, pairs: bool = False):  # fmt: skip
    """Scores (``dense``) or selected pools of query rows against pools, DeepGEMM's arithmetic.

    Args:
        q8: ``[C, H, 128]`` ``float8_e4m3fn`` prepared queries; w: ``[C, H]`` float32 folded
            head weights; k8: ``[P, 128]`` ``float8_e4m3fn`` pools; k_scale: ``[P]`` float32.
            Or BF16: ``q8`` and ``k8`` ``bfloat16``, ``k_scale`` ``None`` (no pool scale).
        starts, ends: ``[C]`` int32, each row's visible pools ``[starts, ends)`` (of ``k8``).
        k: pools to select per row (``topk // kpool``, at most 2048).
        rows: the rows ``[a, b)`` to compute (default all ``C``).
        pool_base: added to the selected pool indices (global id of ``k8``'s row 0).
        dense: return the ``[b - a, P]`` float32 logits instead (cells outside each row's
            range are never written: they hold ``fill``, or anything with ``fill=None``).
        out: optional ``[b - a, k]`` int32 destination of the selection (written whole).
        block_q, block_p, num_warps, num_stages: launch shape (``block_q`` rows per program,
            default ``max(2, 128 / H)`` with ``one_dot``, else 4; ``block_p`` pools per block, a
            multiple of 64; ``num_stages`` default :data:`STAGES` of the input dtype).
        one_dot: one ``[block_p, 128] x [128, block_q H]`` dot per block (the default for the
            heads of :data:`ONE_DOT_HEADS`) or one ``[block_p, 128] x [128, 8 block_q]`` dot
            per chain step.
        cap, check: candidate entries per row (default :func:`capacity`) and blocks between
            two compaction checks (``cap >= k + check * block_p``).
        slots: how a passing cell gets its buffer slot (default :data:`SLOTS`): ``"scan"`` (a
            prefix count down the block's pools, the row counts in registers; the buffer in
            ascending pool id) or ``"atomic"`` (one relaxed atomic per passing cell). The same
            ids and counts either way.
        pairs: (``dense`` with ``one_dot``) two blocks of ``block_q`` rows per program, each
            pool block loaded once for both: the same logits bit for bit. On an H200
            (2026-12-04, W's 32768 rows x 32768 pools, stores included): FP8 H 32 9.18 against
            9.82 ms (1.10x / 1.18x DeepGEMM alone), H 64 16.41 against 17.63 ms (1.10x /
            1.18x); BF16 H 32 14.86 against 15.05 ms, H 64 30.0 against 27.8 ms, H 128 92 ms
            against 54 ms (255 registers, spills). Off by default: no default path scores FP8
            at H 32 / 64 with this kernel (DeepGEMM does), and BF16 gains nothing.

    Returns:
        ``dense``: logits ``[b - a, P]`` float32. Otherwise ``(pools, emitted)``: ``[b - a,
        k]`` int32 global pool ids ascending, ``-1`` after, and ``[b - a]`` int32, the cells
        each row appended to its candidate buffer (what the gate let through).
    """
    C, H, D = q8.shape
    one_dot, block_q = _shape("score_select", H, D, k, one_dot, block_q)
    default_stages = _stages(q8, k8, k_scale)  # (checks the dtypes, whether or not num_stages is given)
    num_stages = num_stages or default_stages
    q8, w, k8, k_scale, starts, ends = _unit_strides(q8, w, k8, k_scale, starts, ends)
    if slots not in ("scan", "atomic"):
        raise ValueError(f"slots: expected 'scan' or 'atomic', got {slots!r}")
    a, b = rows if rows is not None else (0, C)
    nr = b - a
    dev = q8.device
    P = k8.shape[0]
    cap = cap or capacity(k, block_p, check)
    grid = (max(1, triton.cdiv(nr, block_q)),)
    if pairs and not (dense and one_dot):
        raise ValueError(f"pairs: needs dense=True and one_dot, got dense={dense}, one_dot={one_dot}")
    if dense:
        shape = (C, max(P, 1))  # (the kernel writes row a + i at row a + i)
        logits = torch.empty(shape, dtype=torch.float32, device=dev) if fill is None else \
            torch.full(shape, fill, dtype=torch.float32, device=dev)  # fmt: skip
        if pairs:
            kernel = _dense_pairs_kernel[(max(1, triton.cdiv(nr, 2 * block_q)),)](
                q8, q8.stride(0), q8.stride(1), w, w.stride(0), k8, k8 if k_scale is None else k_scale, starts, ends,
                a, nr, logits, logits.stride(0), H=H, D=D, BQ=block_q, BP=block_p, SCALED=k_scale is not None,
                num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
            )  # fmt: skip
            compiled[(H, block_q, block_p, True, one_dot, q8.dtype, "pairs")] = kernel
            return logits[a:b]
        dummy = torch.empty(1, dtype=torch.int32, device=dev)
        _launch(grid, q8, w, k8, k_scale, starts, ends, a, nr, logits, dummy, dummy, dummy, dummy, dummy, k, pool_base,
                H, D, block_q, block_p, cap, 1, True, num_warps, num_stages, one_dot, check, True, True)  # fmt: skip
        return logits[a:b]
    if out is None:
        out = torch.empty((nr, k), dtype=torch.int32, device=dev)
    elif out.shape != (nr, k) or out.dtype != torch.int32 or out.stride(-1) != 1:
        raise ValueError(f"out: expected an int32 tensor of shape {(nr, k)} with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)}")  # fmt: skip
    n_buf = grid[0] * block_q  # candidate buffers (one per row of the launch grid)
    counts = torch.zeros(n_buf if slots == "atomic" else 1, dtype=torch.int32, device=dev)
    buf_k = torch.empty((n_buf, cap), dtype=torch.int32, device=dev)
    buf_i = torch.empty((n_buf, cap), dtype=torch.int32, device=dev)
    emitted = torch.empty(nr, dtype=torch.int32, device=dev)
    kp = 1 << max(0, k - 1).bit_length()
    _launch(grid, q8, w, k8, k_scale, starts, ends, a, nr, out, out, buf_k, buf_i, counts, emitted, k, pool_base, H, D,
            block_q, block_p, cap, kp, False, num_warps, num_stages, one_dot, check, slots == "scan", True)  # fmt: skip
    return out, emitted


def scores_probe(q8, w, k8, k_scale, starts, ends, **launch) -> torch.Tensor:
    """The dense mode **without its stores** (a benchmark probe: the scorer's own cost): per row the
    largest in-range logit (``[C]`` float32, ``-inf`` for an empty row; NaN logits may or may not
    propagate), one value stored per row. ``launch``: ``block_q``, ``block_p``, ``num_warps``,
    ``num_stages``, ``one_dot`` as :func:`score_select`."""
    C, H, D = q8.shape
    one_dot, block_q = _shape("scores_probe", H, D, 1, launch.get("one_dot"), launch.get("block_q"))
    default_stages = _stages(q8, k8, k_scale)  # (checks the dtypes)
    stages = launch.get("num_stages") or default_stages
    q8, w, k8, k_scale, starts, ends = _unit_strides(q8, w, k8, k_scale, starts, ends)
    block_p = launch.get("block_p", BLOCK_P)
    out = torch.empty((C, 1), dtype=torch.float32, device=q8.device)
    dummy = torch.empty(1, dtype=torch.int32, device=q8.device)
    _launch((max(1, triton.cdiv(C, block_q)),), q8, w, k8, k_scale, starts, ends, 0, C, out, dummy, dummy, dummy, dummy,
            dummy, 1, 0, H, D, block_q, block_p, capacity(1, block_p), 1, True, launch.get("num_warps", 4),
            stages, one_dot, CHECK, True, False)  # fmt: skip
    return out[:, 0]


#: Pipeline stages of the pool loads by input dtype. On an H200 (2026-12-04, W: 32768 rows x
#: 32768 pools, the dense mode): FP8 3 (the sweep of 7d34d18); BF16 at H 32 2 / 3 / 4 stages
#: 14.7 / 15.6 / 15.4 ms, at H 64 28.2 / 28.8 / 29.6 ms (8 warps, or 128-pool blocks: slower).
STAGES = {torch.float8_e4m3fn: 3, torch.bfloat16: 2}


def _stages(q8, k8, k_scale) -> int:
    """The default ``num_stages`` of the inputs' dtype, the dtypes checked (whether or not
    the caller gives ``num_stages``): FP8 queries and pools with float32 scales, or BF16
    queries and pools without."""
    fp8 = (q8.dtype == torch.float8_e4m3fn and k8.dtype == torch.float8_e4m3fn and k_scale is not None
           and k_scale.dtype == torch.float32)  # fmt: skip
    bf16 = q8.dtype == torch.bfloat16 and k8.dtype == torch.bfloat16 and k_scale is None
    if not (fp8 or bf16):
        raise ValueError(f"q8, k8, k_scale: expected float8_e4m3fn queries and pools with float32 scales, or bfloat16 "
                         f"ones and k_scale=None, got {q8.dtype}, {k8.dtype}, "
                         f"{None if k_scale is None else k_scale.dtype}")  # fmt: skip
    return STAGES[q8.dtype]


def _unit_strides(q8, w, k8, k_scale, starts, ends):
    """The kernel's operands laid out as it reads them (a copy only where they are not):
    ``q8 [C, H, D]`` and ``w [C, H]`` with unit stride along the last dim (any row and head
    strides), ``k8 [P, D]`` row-contiguous, ``k_scale``, ``starts``, ``ends`` contiguous."""
    q8 = q8 if q8.stride(-1) == 1 else q8.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    k8 = k8 if k8.is_contiguous() else k8.contiguous()
    k_scale = k_scale if k_scale is None else k_scale.contiguous()
    return q8, w, k8, k_scale, starts.contiguous(), ends.contiguous()


def _shape(caller: str, H: int, D: int, k: int, one_dot: bool | None, block_q: int | None) -> tuple[bool, int]:
    """``(one_dot, block_q)`` of a launch (the defaults where ``None``), checked."""
    why = supports(H, D, k)
    if why:
        raise ValueError(f"{caller}: {'; '.join(why)}")
    one_dot = H in ONE_DOT_HEADS if one_dot is None else one_dot
    block_q = block_q or (max(2, 128 // H) if one_dot else 4)
    if one_dot and block_q * H < 128:
        raise ValueError(f"one_dot: needs block_q * H >= 128, got H = {H}, block_q = {block_q}")
    if not one_dot and block_q < 4:  # N = 8 block_q < 32: Triton may pick mma.sync, not wgmma (measured at N 8)
        raise ValueError(f"block_q: expected at least 4 with one_dot=False, got {block_q}")
    return one_dot, block_q


def _launch(grid, q8, w, k8, k_scale, starts, ends, a, nr, logits, out, buf_k, buf_i, counts, emitted, k, pool_base, H,
            D, block_q, block_p, cap, kp, dense, num_warps, num_stages, one_dot, check, scan, store):  # fmt: skip
    if cap < k + check * block_p:
        raise ValueError(f"cap: expected at least k + check * block_p = {k + check * block_p}, got {cap}")
    kernel = _fused_kernel[grid](
        q8, q8.stride(0), q8.stride(1), w, w.stride(0), k8, k8 if k_scale is None else k_scale, starts, ends, a, nr,
        logits, logits.stride(0), out, out.stride(0), buf_k, buf_i, counts, emitted, k, pool_base,
        H=H, D=D, BQ=block_q, BP=block_p, CAP=cap, KP=kp, DENSE=dense, ONE_DOT=one_dot, CHECK=check, SCAN=scan,
        STORE=store, SCALED=k_scale is not None, num_warps=num_warps, num_stages=num_stages,
        enable_fp_fusion=False,
    )  # fmt: skip
    if store:  # (not the stores-free probe)
        compiled[(H, block_q, block_p, dense, one_dot, q8.dtype)] = kernel
