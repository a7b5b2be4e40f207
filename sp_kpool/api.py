"""``kpool_topk``: the sequence-parallel KPool indexer selection (``docs/contract.md``).

The data path itself is :func:`sp_kpool.pipeline.run`; this module is its documented
entry point.
"""

from __future__ import annotations

import torch

from . import op as _op
from . import pipeline
from .config import BALANCES, GATHERS, KPoolConfig, RunOptions, split_keywords
from .settings import Settings
from .sharding import ShardedSequence

__all__ = ["kpool_topk", "GATHERS", "BALANCES"]


@torch.no_grad()
def kpool_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    gates: torch.Tensor,
    head_weights: torch.Tensor,
    ape: torch.Tensor,
    seq: ShardedSequence,
    config: KPoolConfig | None = None,
    *,
    options: RunOptions | None = None,
    settings: Settings | None = None,
    rows: torch.Tensor | None = None,
    stats: dict | None = None,
    **keywords,
) -> torch.Tensor:
    """Select pools of keys for every local query row; return global token ids.

    Shapes (``S_local = seq.shard_size``; ``H`` heads, ``D`` head dim, ``K = kpool``):

    ==============  ======================  =============================================
    q               ``[S_local, H, D]``     index queries, float (BF16 in the model)
    k               ``[S_local, D]``        layer-normed index keys of the local rows
    gates           ``[S_local, D]``        per-channel pool gate logits ``x @ gate.T``
    head_weights    ``[S_local, H]``        raw ``weights_proj`` output (``H^-0.5`` applied here)
    ape             ``[K, D]``              ``index_kpool_compress_ape``
    returns         ``[S_local, W]`` int32  stream token ids, ``-1`` unused
    ==============  ======================  =============================================

    Row ``i`` of every input and of the output is the token at stream position
    ``seq.positions[i]`` (any layout: :mod:`sp_kpool.layouts`); ids are stream positions
    (the positions in the padded stream that a gathered K/V in stream order is indexed
    by). ``W = align(topk + kpool - 1, alignment)``. Keys and gates are all-gathered over
    ``seq.group`` before pooling (pools may straddle shard seams); queries and head
    weights stay local. A row at document-local position ``j`` selects the
    ``min(topk // K, (j + 1) // K)`` best complete pools of its own document that end at
    or before it (ties toward the lower pool id), expanded to ``K`` token ids each, plus
    the ``(j + 1) % K`` most recent tokens as its tail. Rows of padding documents are
    all ``-1``, and no id is a padding position.

    The settings come as a :class:`~sp_kpool.config.KPoolConfig` (``config=``, what is
    computed) and :class:`~sp_kpool.config.RunOptions` (``options=``, how), or as keywords
    that build them (``topk=2048, tail="compact", gather="pools"``); not both for one field.

    Args:
        seq: the sharding (:class:`ShardedSequence`); world size 1 needs no process group.
            The pipeline's tables are cached on it: build it once per batch and pass the same
            object to every layer (:mod:`sp_kpool.plan`).
        config, options: the records, or ``None`` to build them from the keywords below.
        settings: the process settings (default :func:`sp_kpool.settings.current_settings`,
            read once from the environment); defaults of ``precision`` and
            ``max_logits_bytes``, the table cache and backend knobs.
        topk: token budget ``T`` (a multiple of ``kpool``); ``topk // kpool`` pools.
        kpool: pool size ``K`` >= 1.
        backend: ``"torch"`` or ``"auto"`` (see ``python -m sp_kpool info``).
        tail: ``"fixed"`` (history in ``[0, T)``, tail in ``[T, T + K - 1)``) or
            ``"compact"`` (tail right after the history).
        order: ``"ascending"`` pool id or ``"score"`` (descending, ties toward lower id),
            both deterministic and identical for every sharding; or ``"serving"``: the set
            and order LMDeploy's ``sparse_index_topk`` returns (CUDA, lmdeploy installed,
            ``topk // kpool`` in {512, 2048}; meant with ``tail="compact"``). Its order is
            **not deterministic** between calls; use it only for parity with the rollout.
        alignment: the output width is rounded up to a multiple of this.
        max_logits_bytes: scratch budget of one scoring chunk (default
            ``settings.max_logits_bytes``, else 2 GiB on CUDA and 256 MiB elsewhere). Every
            rank's rows are bitwise equal to world size 1 computed with the same budget.
        precision: ``"bf16"`` (model definition), ``"bf16-serving"`` or ``"fp8"`` (serving
            parity, ``docs/contract.md``); default ``settings.precision``.
            See :mod:`sp_kpool.precision`. The inputs are used as given: the serving modes
            expect keys and head weights prepared in FP32 (``KPoolIndexer`` does this).
        gather: ``"keys"`` (default): all-gather ``k`` and ``gates`` (``2 * S * D`` values),
            every rank pools everything. ``"pools"``: every rank pools the pools starting
            in its shard (after receiving from the right the at most ``K - 1`` keys and
            gates that complete a pool straddling the seam), then the pooled keys are
            all-gathered (BF16, or FP8 values and scales): about ``1 / (2K)`` of the bytes.
            Pools, hence outputs, are bitwise identical (:mod:`sp_kpool.pool_gather`).
        balance: ``"none"`` (default) or ``"causal"``: query rows are re-cut so that every
            rank scores about the same causal work (visible pools per row, plus a per-row
            constant); queries and head weights move to the computing rank, the selected
            pools come back, the owner expands. Declined (same decision on every rank) when
            it would not lower the maximum work. Outputs are bitwise identical
            (:mod:`sp_kpool.balance`).
        balance_block: boundaries of the balanced split are multiples of this many rows
            (default: the scoring chunk of the backend, so no chunk is scored twice).
        balance_row_cost: the per-row constant of the work model, in (row, pool) scores
            (default: the backend's ``balance_row_cost`` attribute if it has one, else
            :data:`sp_kpool.balance.ROW_COST`). ``python -m sp_kpool.bench e2e`` fits it from a run.
        check_finite: raise (on every rank) if a real row of an input tensor holds a NaN or
            an infinity, naming the tensor, the row and the value (one device-to-host read;
            default ``settings.check_finite``, ``$SP_KPOOL_CHECK_FINITE``, off). Off, such
            values reach the scores, and a NaN score is never selected: the row gets fewer
            ids.
        rows: compute only these local rows: a bool mask ``[S_local]`` or a 1-D integer
            tensor of storage rows in ``[0, S_local)`` (any order, repeats allowed); the
            call stays a collective (every rank calls, each with its own rows, possibly
            none; pass ``rows`` on every rank or on none). The rows asked for are bit for
            bit the full call's; every other row is ``-1``. Only the rows asked for are
            scored, each against its global chunk's pools, where the backend's cells do not
            depend on the call's other rows (``Backend.scores_row_subsets``: ``triton``,
            ``deepgemm``, ``torch`` on the CPU); elsewhere the chunks that hold a row asked
            for are scored whole, as in the full call. The keys are still gathered and
            pooled whole. With ``balance="causal"`` the partition is
            not applied (it balances every row's work; ``stats["balance_applied"]`` is
            ``False``); the scoring chunk stays the balanced call's.
        stats: if a dict, it is filled with this rank's instrumented communication bytes
            (``bytes``: ``sent``, ``received``, ``by_tag``), per-stage wall seconds
            (``time_s``: gather, seam, pool, balance_exchange, score, select,
            balance_route, expand; the device is synchronized around each stage, so the
            call is slower),
            the partition (``partition``), the real rows this rank scored
            (``rows_scored``: ``(lo, hi)``, or a list of ``[lo, hi]`` runs in the
            interleaved layouts), their causal pairs (``causal_pairs``), the cells of the
            scoring calls (``scored_cells``: zero rows included, so more than
            ``causal_pairs`` where a layout leaves rows of a chunk to other ranks; the
            ``deepgemm`` and ``triton`` backends score each span of their rows in chunks
            of their own, the others whole chunks of the global grid; with ``rows=``,
            see ``rows``), ``rows`` (the real
            rows computed here with ``rows=``, ``None`` without; then ``rows_scored`` and
            ``causal_pairs`` are theirs), the
            pools built here (``pools_built``) and the ``layout``. Never compared across
            ranks; only this rank's view.

    Integer arguments accept NumPy integers and 0-d integer tensors.

    Raises ``ValueError``/``TypeError`` naming the argument, the expected and the actual
    value; with several ranks every rank raises the same error (the same type as at world
    size 1, the same message, naming the ranks and their values), before any data moves
    (:func:`sp_kpool.agreement.validate_and_agree`). The agreement waits at most
    ``settings.comm_timeout`` seconds for the other ranks (``TimeoutError``).

    Under ``torch.compile`` the call is one opaque custom operator,
    ``torch.ops.sp_kpool.kpool_topk`` (:mod:`sp_kpool.op`): ``fullgraph=True`` works, dynamic
    shapes do not recompile per sequence, and the ids equal the eager call's (``stats`` is
    eager only).
    """
    if _op.is_traced():  # torch.compile: one opaque custom operator (sp_kpool.op)
        if stats is not None:
            raise ValueError("stats: not available under torch.compile (the operator is opaque); call eagerly")
        config, options = split_keywords(config, options, keywords)
        return _op.kpool_topk_traced(q, k, gates, head_weights, ape, seq, config, options, settings, rows)
    return pipeline.run(q, k, gates, head_weights, ape, seq, config, options, keywords=keywords, settings=settings,
                        stats=stats, rows=rows)
