"""``indexer_kl_loss``: the KL loss of the KPool indexer against the attention, under SP.

The data path (one :class:`torch.autograd.Function`, :class:`_KLLoss`):

1. **validate and agree**: local checks naming the argument, then one small all-gather
   so that every rank raises the same error (:func:`sp_kpool.agreement`), before any data
   moves;
2. **pools**: keys and gates gathered before pooling, every rank holds the ``P`` pooled
   keys (:func:`~sp_kpool.training.pools.gather_pools_for_training`);
3. **chunks**: this rank's real rows on the global grid of ``C`` rows (other ranks' rows
   zero rows): teacher mass, student scores, KL terms and their unit gradients
   (:mod:`~sp_kpool.training.student`), computed once in the forward (as Megatron's cuDNN
   path does) and only scaled by the upstream gradient in the backward;
4. **backward**: ``dq``, ``dw`` row-local; the pooled keys' gradient summed at the pools'
   owners in rank order (or in int64 fixed point, ``determinism="exact"``), the pooling's
   backward there, the halo rows' gradients sent back
   (:func:`~sp_kpool.training.pools.pool_grads_to_owners`,
   :func:`~sp_kpool.training.pools.token_grads_to_owners`).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .._device import to_device
from ..agreement import _agree, _check_seq, tensor_codes
from ..checks import FLOAT_DTYPES, check_choice, check_float_dtype, check_float_tensor
from ..comm import take_rows
from ..config import KPoolConfig, RunOptions, split_keywords
from ..settings import Settings, current_settings
from ..sharding import ShardedSequence
from . import fixed_point as fx
from .balance import to_computers, to_owners, training_partition
from .pools import gather_pools_for_training, pool_block_grads, pool_grads_to_owners, token_grads_to_owners
from .rows import RowTables, SparseCandidates, row_tables, sparse_candidates
from .student import Workspace, dense_chunk, dense_row_terms, sparse_chunk
from .teachers import AttentionTeacher, TokenMass

__all__ = ["indexer_kl_loss", "NORMALIZE", "DETERMINISM", "MAX_CHUNK_ROWS"]

NORMALIZE = ("global_rows", "local_rows")
DETERMINISM = ("ordered", "exact")
#: Upper bound on the rows of one chunk of the global grid.
MAX_CHUNK_ROWS = 512
_TEACHERS = {TokenMass: 0, AttentionTeacher: 1}


@dataclasses.dataclass
class _Plan:
    """One validated call (host tables; the tensors stay with the caller)."""

    seq: ShardedSequence
    config: KPoolConfig
    options: RunOptions
    timeout: float
    teacher: Any
    tables: RowTables
    rows: torch.Tensor  # this rank's real rows, ascending (int64 CPU)
    storage: torch.Tensor  # their storage rows
    dense: bool
    cand: SparseCandidates | None
    mass: torch.Tensor | None  # TokenMass: [n, slots]
    chunk: int
    block: int
    budget: int
    coeff: float
    norm: int
    normalize: str
    exact: bool
    ct: torch.dtype
    partition: Any = None  # balance="causal": the applied partition (None: rows computed where they live)

    @property
    def ranges(self) -> list[tuple[int, int]] | None:
        return self.partition.ranges if self.partition is not None else None


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _chunk_rows(budget: int, dense: bool, tables: RowTables, H: int, D: int, slots: int, teacher, ct) -> tuple[int, int]:
    """Rows of one chunk of the global grid and the dense teacher's pool block, from the
    byte budget and global quantities only (the same on every rank)."""
    b = torch.empty((), dtype=ct).element_size()
    hq, dqk = (teacher.q.shape[1], teacher.q.shape[2]) if isinstance(teacher, AttentionTeacher) else (0, 0)
    K = tables.kpool
    if dense:
        counts = torch.bincount(tables.pool_doc, minlength=1) if tables.num_pools else torch.zeros(1, dtype=torch.int64)
        widest = max(1, int(counts.max()))
        per_row = widest * (4 * H * b + 6 * b + (2 * b if teacher is not None else 0))
    else:
        per_row = slots * (3 * D * b + 4 * H * b + 8 + (K * (dqk + 2 * hq) * b if hq else 0))
    C = max(1, min(MAX_CHUNK_ROWS, budget // max(1, per_row)))
    block = max(1, budget // max(1, 2 * C * max(hq, 1) * K * b))
    return int(C), int(block)


def _plan(q, k, gates, head_weights, ape, seq, teacher, selection, coeff, normalize, determinism, config, options,
          settings, keywords) -> _Plan:  # fmt: skip
    """Local checks, in argument order; raises on the first problem."""
    _check_seq(seq)
    try:
        config, options = split_keywords(config, options, keywords)
    except TypeError as e:
        raise TypeError(str(e).replace("kpool_topk:", "indexer_kl_loss:")) from None
    if settings is None:
        settings = current_settings()
    elif not isinstance(settings, Settings):
        raise TypeError(f"settings: expected a Settings, got {type(settings).__name__}")
    settings.check()
    if config.precision not in (None, "bf16"):
        raise ValueError(f"precision: the training path computes the bf16 model arithmetic only (expected None or "
                         f"'bf16'), got {config.precision!r}; the sparse stage's ids may come from any precision "
                         f"(selection=)")  # fmt: skip
    if options.backend not in ("torch", "auto"):
        raise ValueError(f"backend: the training path runs on torch operations (expected 'torch' or 'auto'), "
                         f"got {options.backend!r}")  # fmt: skip
    check_float_tensor("q", q, (seq.shard_size, None, None), why="rows: seq.shard_size")
    S, H, D = q.shape
    dev = q.device
    check_float_tensor("k", k, (S, D), dev, why="rows: seq.shard_size; D: q.shape[2]")
    check_float_tensor("gates", gates, (S, D), dev, why="rows: seq.shard_size; D: q.shape[2]")
    check_float_tensor("head_weights", head_weights, (S, H), dev, why="rows: seq.shard_size; H: q.shape[1]")
    check_float_tensor("ape", ape, (config.kpool, D), dev, why="rows: kpool; D: q.shape[2]")
    for name, t in (("q", q), ("k", k), ("gates", gates), ("head_weights", head_weights), ("ape", ape)):
        check_float_dtype(name, t, FLOAT_DTYPES)
    if k.dtype != q.dtype:
        raise TypeError(f"k: expected dtype {q.dtype} (the dtype of q; q and k meet in the scores), got {k.dtype}")
    if not isinstance(teacher, (TokenMass, AttentionTeacher)):
        raise TypeError(f"teacher: expected sp_kpool.TokenMass or sp_kpool.AttentionTeacher, got "
                        f"{type(teacher).__name__}")  # fmt: skip
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff != coeff or abs(coeff) == float("inf"):
        raise ValueError(f"coeff: expected a finite float, got {coeff!r}")
    normalize = check_choice("normalize", normalize, NORMALIZE)
    determinism = check_choice("determinism", determinism, DETERMINISM)
    K = config.kpool
    tables = seq.batch.get("training_rows", K, lambda: row_tables(seq.real_cu_seq_lens, K), cache=settings.table_cache)
    rows, storage = seq.real_rows(), seq.storage_index()
    dense = isinstance(selection, str)
    if dense and selection != "dense":
        raise ValueError(f"selection: expected kpool_topk's ids [S_local, width] or 'dense', got {selection!r}")
    if dense and isinstance(teacher, TokenMass):
        raise ValueError("teacher: TokenMass holds the mass of selected ids (the sparse stage); the dense warm-up "
                         "(selection='dense') needs an AttentionTeacher")  # fmt: skip
    slots = config.topk // K
    cand = mass = None
    ct = _compute_dtype(q, k, gates, head_weights, ape)
    if not dense:
        if not isinstance(selection, torch.Tensor) or selection.dtype not in (torch.int32, torch.int64):
            what = type(selection).__name__ if not isinstance(selection, torch.Tensor) else selection.dtype
            raise TypeError(f"selection: expected kpool_topk's ids (int32 or int64 tensor) or 'dense', got {what}")
        if tuple(selection.shape) != (S, config.width):
            raise ValueError(f"selection: expected shape [{S}, {config.width}] (this call's ids: seq.shard_size "
                             f"rows, width of topk={config.topk}, kpool={K}, alignment={config.alignment}), "
                             f"got {list(selection.shape)}")  # fmt: skip
        stream_ids = take_rows(selection, storage).cpu()
        ids = seq.real_ids(stream_ids.to(torch.int64))
        cand = sparse_candidates(ids, rows, tables, slots, columns=isinstance(teacher, TokenMass))
        if isinstance(teacher, TokenMass):
            mass = teacher.candidate_mass(teacher.rows(selection, stream_ids, rows, storage), cand.col_slot, slots, ct)
    if isinstance(teacher, AttentionTeacher):
        teacher.check(seq)
        if teacher.q.device != dev:
            raise ValueError(f"teacher.q: expected device {dev} (the device of q), got {teacher.q.device}")
    budget = config.resolve(settings, dev).max_logits_bytes
    chunk, block = _chunk_rows(budget, dense, tables, H, D, slots, teacher, ct)
    if normalize == "global_rows":
        norm = tables.rows_with_pool
    else:
        norm = int((tables.pos[rows] >= K - 1).sum())
    partition = None
    if options.balance == "causal" and seq.world_size > 1:
        if normalize == "local_rows":
            raise ValueError("balance: 'causal' computes other ranks' rows, and normalize='local_rows' divides by "
                             "this rank's own: use normalize='global_rows' or balance='none'")  # fmt: skip
        part = training_partition(seq, tables, chunk, dense, slots)
        partition = part if part.applied else None
    return _Plan(seq, config, options, settings.comm_timeout, teacher, tables, rows, storage, dense, cand, mass,
                 chunk, block, budget, float(coeff), norm, normalize, determinism == "exact", ct, partition)  # fmt: skip


def _signature(plan: _Plan | None, tensors: dict, teacher, selection, normalize, determinism, coeff) -> list:
    def crc(v) -> int:
        return zlib.crc32(repr(v).encode())

    sig = tensor_codes(tensors) + [
        ("teacher (type)", _TEACHERS.get(type(teacher), -1), {0: "TokenMass", 1: "AttentionTeacher", -1: "other"}),
        ("selection", 1 if isinstance(selection, str) else 0, {0: "ids", 1: repr(selection)}),
        ("normalize (crc32)", crc(normalize)),
        ("determinism (crc32)", crc(determinism)),
        # the exact mode's collectives run only when gradients are asked for
        ("inputs require grad", int(any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors.values()))),
        ("coeff (crc32)", crc(coeff)),
    ]
    if plan is None:
        return sig + [(n, -1) for n in ("config (crc32)", "gather (crc32)", "chunk rows", "teacher heads", "cu_seq_lens (crc32)",
                                        "balance partition (crc32)")]
    t = plan.teacher
    return sig + [
        ("config (crc32)", crc(plan.config.signature())),
        ("gather (crc32)", crc(plan.options.gather)),
        ("chunk rows", plan.chunk),
        ("teacher heads", t.q.shape[1] if isinstance(t, AttentionTeacher) else 0),
        ("cu_seq_lens (crc32)", zlib.crc32(plan.seq.cu_seq_lens.numpy().tobytes())),
        ("balance partition (crc32)", crc(plan.partition.bounds) if plan.partition is not None else 0),
    ]


def indexer_kl_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    gates: torch.Tensor,
    head_weights: torch.Tensor,
    ape: torch.Tensor,
    seq: ShardedSequence,
    *,
    teacher: TokenMass | AttentionTeacher,
    selection: torch.Tensor | str,
    coeff: float = 1.0,
    normalize: str = "global_rows",
    determinism: str = "ordered",
    config: KPoolConfig | None = None,
    options: RunOptions | None = None,
    settings: Settings | None = None,
    stats: dict | None = None,
    **keywords,
) -> torch.Tensor:
    """This rank's share of the indexer's KL loss (``docs/contract.md`` section 13).

    Shapes as :func:`sp_kpool.kpool_topk` (this rank's rows, storage order):

    ==============  ======================  ==========================================
    q               ``[S_local, H, D]``     index queries (gradient)
    k, gates        ``[S_local, D]``        keys, pool gate logits (gradient)
    head_weights    ``[S_local, H]``        raw ``weights_proj`` output (gradient)
    ape             ``[K, D]``              ``index_kpool_compress_ape`` (gradient: a share)
    selection       ``[S_local, width]``    ``kpool_topk``'s ids of this call (int32), or
                                            ``"dense"`` (the warm-up: every visible pool)
    returns         ``[]``                  this rank's share, ``max(FP32, dtype)``
    ==============  ======================  ==========================================

    Candidates of real row ``t``: sparse, the complete pools among its selected ids (tail
    ids excluded; the ids may come from any precision or from ``replay``); dense, the
    ``(j + 1) // K`` visible complete pools of its document. Student: the contract's score
    ``s[t, p]`` (``bf16`` model arithmetic for BF16 inputs, else in ``max(FP32, dtype)``).
    Teacher mass ``m`` per candidate (:class:`TokenMass` or :class:`AttentionTeacher`),
    ``m^ = m / sum_{C_t} m``::

        loss = coeff / N * sum_t sum_{p in C_t} m^ (log m^ - log_softmax_{C_t}(s_t)_p)

    ``N`` (``normalize="global_rows"``): the real rows with a visible complete pool,
    ``sum_d max(0, len_d - K + 1)``: the sum of every rank's share is the world-size-1
    loss. ``"local_rows"``: this rank's such rows (Megatron's and XTuner's convention; the
    shares' sum is then not world size 1's). A row without candidates or mass adds 0.

    Gradients flow to this rank's ``q``, ``k``, ``gates``, ``head_weights`` and to ``ape``
    (a share per rank; the shares' sum is world size 1's); the teacher and the ids get
    none; padding rows get zeros. ``determinism="ordered"``: no float atomics, bitwise
    from run to run; each gradient within ``1e-9 max|g|`` (float64) / ``1e-5 max|g|``
    (FP32) of world size 1's. ``"exact"``: ``q``, ``k``, ``gates`` and ``head_weights``
    gradients bitwise identical for every world size and layout (int64 fixed-point sums
    of the cross-row terms, :mod:`sp_kpool.training.fixed_point`); the loss and ``ape``'s
    gradient whole on rank 0 (zero elsewhere), equal to world size 1's.

    ``config``/``options``/keywords as :func:`sp_kpool.kpool_topk` (``topk``, ``kpool``,
    ``alignment``, ``max_logits_bytes``, ``gather``); ``precision`` ``None`` or ``"bf16"``,
    ``balance="none"`` or ``"causal"`` (the rows move to the ranks that compute them, their
    gradients come back; the same bits; declined on every rank alike when it would not
    lower the largest rank's work; not with ``normalize="local_rows"``). Memory: chunks of
    rows under ``max_logits_bytes``, never ``[S_local, P]`` scores; the dense teacher
    streams over blocks of pools. ``stats``: a dict filled with this rank's view:
    ``chunk_rows`` (of the global grid), ``balance_applied`` and ``rows_computed``.

    A collective over ``seq.group``, and so is its backward: every rank calls it and runs
    the backward (``loss.backward()`` on every rank, as for any loss under SP); a rank that
    does not leaves the others to their ``comm_timeout``. Bad input on any rank raises the
    same ``ValueError``/``TypeError`` on every rank, naming the argument.
    """
    tensors = {"q": q, "k": k, "gates": gates, "head_weights": head_weights, "ape": ape}
    plan = error = None
    try:
        plan = _plan(q, k, gates, head_weights, ape, seq, teacher, selection, coeff, normalize, determinism, config,
                     options, settings, keywords)  # fmt: skip
    except (ValueError, TypeError) as e:
        error = e
    signature = _signature(plan, tensors, teacher, selection, normalize, determinism, coeff)
    if stats is not None and not isinstance(stats, dict) and error is None:
        error = TypeError(f"stats: expected a dict or None, got {type(stats).__name__}")
    _agree(seq, error, signature, settings if isinstance(settings, Settings) else None, None)
    if stats is not None:
        computed = plan.ranges[seq.rank] if plan.ranges is not None else int(plan.rows.numel())
        stats.update(chunk_rows=plan.chunk, balance_applied=plan.partition is not None, rows_computed=computed)
    return _KLLoss.apply(plan, q, k, gates, head_weights, ape)


class _KLLoss(torch.autograd.Function):
    """Forward: the loss share and its unit gradients; backward: scale them, sum the pooled
    keys' gradient at the owners, run the pooling's backward there."""

    @staticmethod
    def forward(ctx, plan: _Plan, q, k, gates, head_weights, ape):
        grads = any(ctx.needs_input_grad[1:])
        value, saved = _forward(plan, q, k, gates, head_weights, ape, grads)
        ctx.plan, ctx.saved = plan, saved
        ctx.meta = [(t.shape, t.dtype, t.device) for t in (q, k, gates, head_weights, ape)]
        return value

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return (None, *_backward(ctx.plan, ctx.saved, ctx.meta, g))


def _chunks(rows: torch.Tensor, C: int):
    """``(chunk index, slice of rows)`` of the ascending ``rows`` on the grid of ``C`` rows."""
    if rows.numel() == 0:
        return
    ids, counts = torch.unique_consecutive(rows // C, return_counts=True)
    a = 0
    for c, n in zip(ids.tolist(), counts.tolist()):
        yield c, slice(a, a + n)
        a += n


def _place(x: torch.Tensor, off: torch.Tensor, C: int) -> torch.Tensor:
    out = x.new_zeros((C, *x.shape[1:]))
    out[off] = x
    return out


def _forward(plan: _Plan, q, k, gates, head_weights, ape, grads: bool):
    seq, tables, ct, C = plan.seq, plan.tables, plan.ct, plan.chunk
    K, dev = plan.config.kpool, q.device
    H, D = q.shape[1], q.shape[2]
    slots = plan.config.topk // K
    pools, owned = gather_pools_for_training(k.detach(), gates.detach(), ape.detach(), seq, tables.pool_tok_start,
                                             plan.options.gather, timeout=plan.timeout)  # fmt: skip
    keys_ct = pools.to(ct)
    rows, data = _row_data(plan, q, head_weights)
    qr, wr = data["q"], data["w"]
    n = rows.numel()
    scale = plan.coeff / max(plan.norm, 1)
    e_pool = 0
    # the pooled keys' partial gradient in int64 fixed point: the exact mode, and the sparse
    # stage on CUDA, whose index_add_ of floats uses atomics (integer ones are order-free)
    fixed = grads and (plan.exact or (dev.type == "cuda" and not plan.dense))
    if fixed:
        mw, mq = fx.global_max([float(wr.abs().max()) if n else 0.0, float(qr.abs().max()) if n else 0.0], seq,
                               plan.timeout)  # fmt: skip
        e_pool = fx.exponent(2 * abs(scale) * H**0.5 * D**-0.5 * mw * mq * max(1, seq.num_real_tokens))
    dpool = torch.zeros((tables.num_pools, D), dtype=torch.int64 if fixed else ct, device=dev) if grads else None
    terms = torch.zeros(n, dtype=ct, device=dev)
    dq = torch.zeros((n, H, D), dtype=ct, device=dev) if grads else None
    dw = torch.zeros((n, H), dtype=ct, device=dev) if grads else None
    teacher, pts = plan.teacher, tables.pool_tok_start
    ws = Workspace()
    for c, part in _chunks(rows, C):
        base = c * C
        off = rows[part] - base
        off_d = to_device(off, dev)
        Qc, Wc = _place(qr[part], off_d, C), _place(wr[part], off_d, C)
        if not plan.dense:
            cand = torch.full((C, slots), -1, dtype=torch.int64)
            cand[off] = data["cand"][part].cpu()
            valid = to_device(cand >= 0, dev)
            keys = torch.index_select(keys_ct, 0, to_device(cand.clamp(min=0).reshape(-1), dev),
                                      out=ws.get("keys", (C * slots, D), ct, dev)).view(C, slots, D)  # fmt: skip
            if isinstance(teacher, TokenMass):
                mass = _place(data["mass"][part], off_d, C)
            else:
                qt, lt = _place(data["tq"][part], off_d, C), _place(data["tlse"][part], off_d, C)
                tokens = pts[cand.clamp(min=0)][:, :, None] + torch.arange(K)
                mass = teacher.sparse_mass(qt, lt, tokens.reshape(C, -1), K).to(ct)
            out = sparse_chunk(Qc, Wc, keys, valid, mass, scale, grads, ws)
            if grads:  # empty slots (pool 0 stands in) add exact zeros: their ds, hence da, are 0
                at = to_device(cand.clamp(min=0).reshape(-1), dev)
                contrib = out.dkeys.reshape(-1, D)
                dpool.index_add_(0, at, fx.to_fixed(contrib, e_pool) if fixed else contrib)
        else:
            every = torch.arange(base, min(base + C, seq.num_real_tokens))
            lo_t, hi_t = tables.vis_lo[every], tables.vis_hi[every]
            seen = hi_t > lo_t
            if not bool(seen.any()):
                continue
            plo, phi = int(lo_t[seen].min()), int(hi_t[seen].max())
            cols = torch.arange(plo, phi)
            mine = torch.zeros(C, dtype=torch.bool)
            mine[off] = True
            lo_c = torch.zeros(C, dtype=torch.int64)
            hi_c = torch.zeros(C, dtype=torch.int64)
            lo_c[: every.numel()], hi_c[: every.numel()] = lo_t, hi_t
            valid = mine[:, None] & (cols[None] >= lo_c[:, None]) & (cols[None] < hi_c[:, None])
            valid = to_device(valid, dev)
            qt, lt = _place(data["tq"][part], off_d, C), _place(data["tlse"][part], off_d, C)
            mass = teacher.dense_mass(qt, lt, pts[plo:phi], K, plan.block, ws).to(ct)
            per_row = 0
            if grads and plan.exact:
                per_row = max(1, plan.budget // (16 * (phi - plo) * D))
            out = dense_chunk(Qc, Wc, keys_ct[plo:phi], valid, mass, scale, grads, per_row=per_row, ws=ws)
            if grads and plan.exact:
                da, qq = out.dkeys
                acc = torch.zeros((phi - plo, D), dtype=torch.int64, device=dev)
                for i in range(0, C, per_row):  # blocks of the grid (one shape on every rank) holding rows here
                    if bool(mine[i : i + per_row].any()):
                        acc += fx.to_fixed(dense_row_terms(da, qq, slice(i, i + per_row)), e_pool).sum(dim=0)
                dpool[plo:phi] += acc
            elif grads:
                dpool[plo:phi] += out.dkeys
        sel = to_device(torch.arange(part.start, part.stop), dev)
        terms.index_copy_(0, sel, out.terms.index_select(0, off_d))
        if grads:
            dq.index_copy_(0, sel, out.dq.index_select(0, off_d))
            dw.index_copy_(0, sel, out.dw.index_select(0, off_d))
    value = _loss_value(plan, terms, scale)
    saved = dict(dq=dq, dw=dw, dpool=dpool, owned=owned, e_pool=e_pool, fixed=fixed, ape=ape.detach())
    return value, saved


def _row_data(plan: _Plan, q, head_weights) -> tuple[torch.Tensor, dict]:
    """The real rows computed here (ascending) and their data: ``q``, ``w`` in the compute
    type, sparse candidates ``cand``, ``TokenMass``'s candidate ``mass`` or the teacher's rows
    ``tq``, ``tlse``; this rank's own rows, or with ``balance="causal"`` its compute range,
    moved from their owners."""
    dev, ct, teacher = q.device, plan.ct, plan.teacher
    data = {"q": take_rows(q.detach(), plan.storage).to(ct), "w": take_rows(head_weights.detach(), plan.storage).to(ct)}
    if plan.cand is not None:
        data["cand"] = to_device(plan.cand.pools, dev)
    if plan.mass is not None:
        data["mass"] = to_device(plan.mass, dev)
    if isinstance(teacher, AttentionTeacher):
        data["tq"], data["tlse"] = teacher.local_rows(plan.storage, ct)
    if plan.ranges is None:
        return plan.rows, data
    rows, moved = to_computers(plan.seq, plan.ranges, list(data.values()), timeout=plan.timeout)
    return rows, dict(zip(data, moved))


def _loss_value(plan: _Plan, terms: torch.Tensor, scale: float) -> torch.Tensor:
    """This rank's share: the sum of its rows' terms times ``coeff / N`` (exact mode with
    ``global_rows``: the int64 sum over every rank, whole on rank 0)."""
    seq = plan.seq
    if not plan.exact:
        return terms.sum() * scale
    top = fx.global_max([float(terms.max()) if terms.numel() else 0.0], seq, plan.timeout)[0]
    e = fx.exponent(top * max(1, seq.num_real_tokens))
    mine = fx.to_fixed(terms, e).sum()
    if plan.normalize == "global_rows":
        total = fx.global_sum(mine.reshape(1), seq, plan.timeout)[0]
        value = fx.from_fixed(total, e, plan.ct) * scale if seq.rank == 0 else torch.zeros((), dtype=plan.ct)
    else:
        value = fx.from_fixed(mine, e, plan.ct) * scale
    return value.to(terms.device)


def _backward(plan: _Plan, saved: dict, meta, g: torch.Tensor):
    seq, ct = plan.seq, plan.ct
    (q_shape, q_dtype, dev), (k_shape, k_dtype, _), (g_shape, g_dtype, _), (w_shape, w_dtype, _), (a_shape, a_dtype, _) = meta
    g = g.detach().to(ct)
    storage = to_device(plan.storage, dev)
    dq = torch.zeros(q_shape, dtype=q_dtype, device=dev)
    dw = torch.zeros(w_shape, dtype=w_dtype, device=dev)
    if saved["dq"] is not None:
        dq_rows, dw_rows = saved["dq"], saved["dw"]
        if plan.ranges is not None:  # computed by other ranks: back to their owners
            dq_rows, dw_rows = to_owners(seq, plan.ranges, [dq_rows, dw_rows], timeout=plan.timeout)
        dq.index_copy_(0, storage, (dq_rows * g).to(q_dtype))
        dw.index_copy_(0, storage, (dw_rows * g).to(w_dtype))
    owned = saved["owned"]
    tables = plan.tables
    d_own = pool_grads_to_owners(saved["dpool"], seq, owned, tables.vis_lo, tables.vis_hi, timeout=plan.timeout,
                                 ranges=plan.ranges)  # fmt: skip
    if saved["fixed"]:
        d_own = fx.from_fixed(d_own, saved["e_pool"], ct).to(dev)
    d_own = d_own * g
    D = k_shape[1]
    dk_o, dg_o, da_o = pool_block_grads(owned.k_own, owned.g_own, saved["ape"], d_own, owned.owners.pools[seq.rank],
                                        tables.num_pools)  # fmt: skip
    dk, dgates = token_grads_to_owners(dk_o.reshape(-1, D), dg_o.reshape(-1, D), seq, owned, (k_shape[0], D),
                                       timeout=plan.timeout)  # fmt: skip
    if plan.exact:
        top = fx.global_max([float(da_o.abs().max()) if da_o.numel() else 0.0], seq, plan.timeout)[0]
        e = fx.exponent(top * max(1, tables.num_pools))
        total = fx.global_sum(fx.to_fixed(da_o, e).sum(dim=0), seq, plan.timeout)
        dape = fx.from_fixed(total, e, a_dtype).to(dev) if seq.rank == 0 else torch.zeros(a_shape, dtype=a_dtype, device=dev)
    else:
        dape = da_o.to(ct).sum(dim=0).to(a_dtype)
    return dq, dk.to(k_dtype), dgates.to(g_dtype), dw, dape
