"""TileLang BF16 pool scorer (contract §3): ``ReLU(q.k)`` x head weight, summed over heads.

One thread block owns ``BQ = max(1, 128 // H)`` query rows, i.e. a ``[BQ*H, D]`` BF16 tile
of queries that stays in shared memory, and streams the pooled keys of the union of its
rows' ranges in ``[BN, D]`` tiles::

    S[BN, BQ*H] = K_tile @ Q_tile^T                (tensor cores, FP32 accumulate)
    S <- max(S, 0) * w'[bq, h]                      (w' = w * H^-0.5 * D^-0.5, FP32)
    logits[bq, n] = sum_h S[n, bq, h]               (FP32)
    out[row, n] = logits if start[row] <= n < end[row] else -inf

``D^-0.5`` is folded into the head weights (ReLU is positively homogeneous), so this is
the model score up to FP32 rounding, not bit for bit.
"""

# no `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations

import functools

import torch

__all__ = ["tilelang_scores", "SUPPORTED_HEADS", "SUPPORTED_DIMS", "default_config"]

SUPPORTED_HEADS = (16, 32, 64, 128)
SUPPORTED_DIMS = (64, 128)


def default_config(heads: int, dim: int) -> tuple[int, int, int, int]:
    """``(block_n, num_stages, threads, block_q)`` for ``heads`` (the fastest of H200
    sweeps); ``Settings.tilelang_config`` (``$SP_KPOOL_TILELANG_CONFIG``) overrides it."""
    if heads == 64:  # 256 query-head rows per block, four warpgroups of consumers
        return 64, 4, 512, 4
    if heads > 64:
        return 128, 2, 512, max(1, 256 // heads)
    return 256, 2, 256, max(1, 128 // heads)


@functools.lru_cache(maxsize=None)
def _kernel(heads: int, dim: int, block_n: int, num_stages: int, threads: int, block_q: int, warp_specialized: bool = True,
            mask: bool = True):
    import tilelang
    import tilelang.language as T

    configs = {} if warp_specialized else {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}

    @tilelang.jit(pass_configs=configs)
    def build(heads=heads, dim=dim, block_n=block_n, num_stages=num_stages, threads=threads, block_q=block_q):
        rows = T.dynamic("rows")
        cols = T.dynamic("cols")

        @T.prim_func
        def pool_scores(
            Q: T.Tensor([rows * heads, dim], "bfloat16"),
            K: T.Tensor([cols, dim], "bfloat16"),
            W: T.Tensor([rows, heads], "float32"),
            Starts: T.Tensor([rows], "int32"),
            Ends: T.Tensor([rows], "int32"),
            BlockLo: T.Tensor([T.ceildiv(rows, block_q)], "int32"),
            BlockHi: T.Tensor([T.ceildiv(rows, block_q)], "int32"),
            Out: T.Tensor([rows, cols], "float32"),
        ):
            with T.Kernel(T.ceildiv(rows, block_q), threads=threads) as bx:
                q_s = T.alloc_shared([block_q * heads, dim], "bfloat16")
                k_s = T.alloc_shared([block_n, dim], "bfloat16")
                s = T.alloc_fragment([block_n, block_q * heads], "float32")
                s3 = T.reshape(s, (block_n, block_q, heads))
                acc = T.alloc_fragment([block_n, block_q], "float32")
                w_f = T.alloc_fragment([block_q, heads], "float32")
                r0 = bx * block_q
                T.copy(Q[r0 * heads, 0], q_s)
                T.copy(W[r0, 0], w_f)
                for nb in T.Pipelined(T.ceildiv(BlockHi[bx] - BlockLo[bx], block_n), num_stages=num_stages):
                    T.copy(K[BlockLo[bx] + nb * block_n, 0], k_s)
                    T.gemm(k_s, q_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                    for i, j, h in T.Parallel(block_n, block_q, heads):
                        s3[i, j, h] = T.max(s3[i, j, h], 0) * w_f[j, h]
                    T.reduce_sum(s3, acc, dim=-1, clear=True)
                    if mask:
                        for j, i in T.Parallel(block_q, block_n):
                            c = BlockLo[bx] + nb * block_n + i
                            if c < BlockHi[bx]:
                                Out[r0 + j, c] = T.if_then_else(
                                    c >= Starts[r0 + j],
                                    T.if_then_else(c < Ends[r0 + j], acc[i, j], -T.infinity("float32")),
                                    -T.infinity("float32"),
                                )
                    else:  # the reader ignores cells outside [start, end)
                        for j, i in T.Parallel(block_q, block_n):
                            c = BlockLo[bx] + nb * block_n + i
                            if c < BlockHi[bx]:
                                Out[r0 + j, c] = acc[i, j]

        return pool_scores

    return build(), block_q


def tilelang_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    config: tuple[int, ...] | None = None,
    clean: bool = True,
) -> torch.Tensor:
    """Scores of every query row against its pool range.

    Args:
        q: ``[R, H, D]`` bfloat16 (CUDA); weights: ``[R, H]`` float32, already scaled by
            ``H^-0.5 * D^-0.5``; keys: ``[N, D]`` bfloat16 pooled keys;
            starts, ends: ``[R]`` int32, each row's visible columns ``[start, end)``.
        clean: ``True``: ``-inf`` in every cell outside each row's range. ``False``, for
            readers that read only ``[start, end)`` of each row: no ``-inf`` fill pass (a
            4-byte write per cell) and no masking in the kernel; cells outside the row's
            range are unspecified.

    Returns:
        ``[R, N]`` float32 scores, ``-inf`` outside each row's range (``clean=True``).
    """
    R, H, D = q.shape
    cfg = tuple(config or default_config(H, D))
    bn, st, th = cfg[:3]
    block_q = cfg[3] if len(cfg) > 3 else max(1, 128 // H)
    Rp = -(-R // block_q) * block_q
    if Rp != R:  # whole row groups: pad with empty ranges
        pad = Rp - R
        q = torch.cat([q, q.new_zeros((pad, H, D))])
        weights = torch.cat([weights, weights.new_zeros((pad, H))])
        starts = torch.cat([starts, starts.new_zeros(pad)])
        ends = torch.cat([ends, ends.new_zeros(pad)])
    if clean:
        out = torch.full((Rp, keys.shape[0]), -float("inf"), dtype=torch.float32, device=q.device)
    else:
        out = torch.empty((Rp, keys.shape[0]), dtype=torch.float32, device=q.device)
    # per block: the union of its rows' ranges (empty ranges do not widen it)
    nonempty = ends > starts
    big = torch.iinfo(torch.int32).max
    blo = torch.where(nonempty, starts, big).view(-1, block_q).amin(1)
    bhi = torch.where(nonempty, ends, 0).view(-1, block_q).amax(1)
    blo = torch.minimum(blo, bhi).to(torch.int32)
    args = (q.reshape(Rp * H, D).contiguous(), keys.contiguous(), weights.contiguous(), starts.contiguous(),
            ends.contiguous(), blo.contiguous(), bhi.to(torch.int32).contiguous(), out)  # fmt: skip
    _compiled(H, D, bn, st, th, block_q, clean)(*args)
    return out[:R]


@functools.lru_cache(maxsize=None)
def _compiled(H, D, bn, st, th, bq, mask=True):
    """The kernel, warp-specialized if this TileLang build compiles it so, else without."""
    try:
        return _kernel(H, D, bn, st, th, bq, True, mask)[0]
    except Exception:  # noqa: BLE001 - a compiler failure of the specialized form
        return _kernel(H, D, bn, st, th, bq, False, mask)[0]
