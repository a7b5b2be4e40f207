"""Comparison of two selections of the same rows (:func:`sp_kpool.replay.compare`, the
training/rollout mismatch monitor; ``docs/contract.md`` §12): per real row the two id sets,
totals over every rank."""

from __future__ import annotations

from typing import Any

import torch

from ._device import to_device
from .agreement import _agree, _check_seq
from .pooling import pool_table
from .selection import row_meta
from .settings import Settings
from .sharding import ShardedSequence

__all__ = ["compare"]

_BIG = torch.iinfo(torch.int64).max


def _local_real(ids: torch.Tensor, seq: ShardedSequence, storage: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's real rows of ``ids`` (storage order -> real-row order), as real-row ids int64;
    ``storage``: only these storage rows (default: every real row's, ``seq.storage_index()``)."""
    at = seq.storage_index() if storage is None else storage
    return seq.real_ids(ids.index_select(0, to_device(at, ids.device)).to(torch.int64))


def _pool_of(ids: torch.Tensor, meta, cu: torch.Tensor, kpool: int, doc: torch.Tensor) -> torch.Tensor:
    """Global pool ids of history ids (real rows) of each row, ``-2`` for tail ids, ``-1`` unused."""
    start = cu.to(ids.device)[doc][:, None]
    local = ids - start
    hist = (ids >= 0) & (local < (meta.n_visible[:, None] * kpool))
    pool = meta.pool_lo[:, None] + torch.div(local, kpool, rounding_mode="floor")
    return torch.where(hist, pool, torch.where(ids >= 0, -2, -1))


@torch.no_grad()
def compare(
    replayed: torch.Tensor,
    computed: torch.Tensor,
    seq: ShardedSequence,
    *,
    scores: torch.Tensor | None = None,
    kpool: int | None = None,
    rel_tol: float = 1e-4,
    settings: Settings | None = None,
    rows: torch.Tensor | None = None,
) -> dict[str, Any]:
    """How far two selections of this rank's rows differ, totalled over every rank (a collective).

    Args:
        replayed, computed: ``[S_local, W]`` integer ids (stream positions, ``-1`` unused),
            e.g. :func:`shard`'s and ``kpool_topk``'s; compared per row as **sets** (the
            column layout does not matter), padding rows excluded.
        seq: the sharding of both.
        scores: optional ``[S_local, P]`` float scores of every (real, global) pool for the
            local rows (storage order; ``P`` the real documents' complete pools); with it,
            ``kpool`` is needed and differing rows are classified as near-ties when every
            pool in the symmetric difference scores within ``rel_tol * max|score|`` (over
            the pools of both sets, ``+ 1e-9``) of the boundary, the lowest score among
            ``computed``'s pools; a differing tail is never a tie.
        settings: the agreement's timeout (:class:`~sp_kpool.settings.Settings`).
        rows: compare only these storage rows (1-D integer tensor, e.g. :func:`sample_rows`);
            ``None``: every real row.

    Returns (equal on every rank, JSON-able): ``rows`` (real rows compared), ``rows_differing``,
    ``fraction_differing``, ``jaccard_mean``, ``jaccard_min`` (1.0 without rows),
    ``ids_only_replayed``, ``ids_only_computed`` (totals), ``first_difference`` (``None``,
    or the lowest differing real row: ``{"real_row", "document", "row", "stream_position",
    "rank", "only_replayed", "only_computed"}`` with up to 8 ids of each, stream positions),
    and with ``scores``: ``rows_near_ties`` and ``rows_beyond_ties``.
    """
    error = a = b = real = None
    try:
        _check_seq(seq)
        real, storage = seq.real_rows(), seq.storage_index()
        for name, t in (("replayed", replayed), ("computed", computed)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != seq.shard_size:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected a [S_local = {seq.shard_size}, W] tensor, got {got}")
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise TypeError(f"{name}: expected integer ids, got {t.dtype}")
        if scores is not None:
            if kpool is None:
                raise ValueError("kpool: needed with scores (to map ids to pools), got None")
            if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.shape[0] != seq.shard_size:
                got = list(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
                raise ValueError(f"scores: expected a [S_local = {seq.shard_size}, P] tensor, got {got}")
        if rows is not None:  # the sample only (its rows in real-row order): nothing else is read
            keep = torch.isin(storage, rows.cpu())
            real, storage = real[keep], storage[keep]
        dev = replayed.device
        for name, t in (("replayed", replayed), ("computed", computed)):
            try:
                mapped = _local_real(t.to(dev), seq, storage)
            except ValueError:
                raise ValueError(f"{name}: an id is the stream position of a padding token") from None
            a, b = (mapped, b) if name == "replayed" else (a, mapped)
    except Exception as exc:  # noqa: BLE001
        error = exc
    sig = [("compare: scores given", int(scores is not None))]
    _agree(seq, error, sig, settings, None)
    rows = real
    R = rows.numel()
    sa = torch.sort(torch.where(a >= 0, a, _BIG), dim=1).values
    sb = torch.sort(torch.where(b >= 0, b, _BIG), dim=1).values
    na, nb = (sa != _BIG).sum(1), (sb != _BIG).sum(1)
    if sa.shape[1] and R:
        idx = torch.searchsorted(sa, sb).clamp_max_(sa.shape[1] - 1)
        inter = ((sa.gather(1, idx) == sb) & (sb != _BIG)).sum(1)
    else:
        inter = torch.zeros(R, dtype=torch.int64, device=dev)
    union = na + nb - inter
    jac = torch.where(union > 0, inter.double() / union.clamp_min(1).double(), 1.0)
    differ = (inter != na) | (inter != nb)
    n_diff = int(differ.sum())
    first = int(torch.nonzero(differ).flatten()[0]) if n_diff else -1
    local = {
        "rows": R, "rows_differing": n_diff, "jaccard_sum": float(jac.sum()) if R else 0.0,
        "jaccard_min": float(jac.min()) if R else 1.0, "only_replayed": int((na - inter).sum()),
        "only_computed": int((nb - inter).sum()), "first_row": int(rows[first]) if first >= 0 else -1,
    }  # fmt: skip
    if first >= 0:
        ra, rb = set(sa[first][sa[first] != _BIG].tolist()), set(sb[first][sb[first] != _BIG].tolist())
        to_stream = seq.stream_ids
        local["first_only_replayed"] = to_stream(torch.tensor(sorted(ra - rb)[:8], dtype=torch.int64)).tolist()
        local["first_only_computed"] = to_stream(torch.tensor(sorted(rb - ra)[:8], dtype=torch.int64)).tolist()
    if scores is not None:
        ties = 0
        if n_diff:
            cu = seq.real_cu_seq_lens
            doc = (torch.searchsorted(cu, rows, right=True) - 1).to(dev)
            meta = row_meta(to_device(rows, dev), cu, pool_table(cu, kpool)[1], kpool)
            pa, pb = _pool_of(a, meta, cu, kpool, doc), _pool_of(b, meta, cu, kpool, doc)
            local_scores = scores.index_select(0, to_device(storage, scores.device)).to(dev).double()
            ties = _near_ties(pa[differ], pb[differ], local_scores[differ], rel_tol)
        local["rows_near_ties"] = ties
    totals = _gather_json(local, seq, settings)
    rows_all = sum(t["rows"] for t in totals)
    diff_all = sum(t["rows_differing"] for t in totals)
    report: dict[str, Any] = {
        "rows": rows_all,
        "rows_differing": diff_all,
        "fraction_differing": diff_all / rows_all if rows_all else 0.0,
        "jaccard_mean": sum(t["jaccard_sum"] for t in totals) / rows_all if rows_all else 1.0,
        "jaccard_min": min(t["jaccard_min"] for t in totals),
        "ids_only_replayed": sum(t["only_replayed"] for t in totals),
        "ids_only_computed": sum(t["only_computed"] for t in totals),
        "first_difference": None,
    }
    firsts = [(t["first_row"], r) for r, t in enumerate(totals) if t["first_row"] >= 0]
    if firsts:
        real_row, r = min(firsts)
        cu = seq.real_cu_seq_lens
        d = int(torch.searchsorted(cu, torch.tensor([real_row]), right=True)[0]) - 1
        report["first_difference"] = {
            "real_row": real_row, "document": d, "row": real_row - int(cu[d]),
            "stream_position": int(seq.stream_ids(torch.tensor([real_row]))[0]), "rank": r,
            "only_replayed": totals[r]["first_only_replayed"], "only_computed": totals[r]["first_only_computed"],
        }  # fmt: skip
    if scores is not None:
        near = sum(t["rows_near_ties"] for t in totals)
        report["rows_near_ties"] = near
        report["rows_beyond_ties"] = diff_all - near
    return report


def _near_ties(pa: torch.Tensor, pb: torch.Tensor, scores: torch.Tensor, rel_tol: float) -> int:
    """Rows (of differing rows) whose symmetric difference lies within the tolerance of the boundary."""
    count = 0
    for ra, rb, s in zip(pa.tolist(), pb.tolist(), scores):
        A, B = {p for p in ra if p != -1}, {p for p in rb if p != -1}
        if -2 in A ^ B or (-2 in A) != (-2 in B):
            continue
        A.discard(-2)
        B.discard(-2)
        diff = A ^ B
        if not B or not diff or max(diff | B) >= s.numel():
            continue
        boundary = min(float(s[p]) for p in B)
        tol = rel_tol * max(abs(float(s[p])) for p in A | B) + 1e-9
        if all(abs(float(s[p]) - boundary) <= tol for p in diff):
            count += 1
    return count


def _gather_json(local: dict, seq: ShardedSequence, settings: Settings | None) -> list[dict]:
    """Every rank's ``local`` dict, in rank order (world size 1 or no group: ``[local]``)."""
    from .agreement import _ranks_of

    ranks = _ranks_of(seq)
    if ranks is None:
        return [local]
    import json

    from .comm import _all_gather_timed, comm_device
    from .settings import current_settings

    timeout = (settings if isinstance(settings, Settings) else current_settings()).comm_timeout
    data = json.dumps(local, sort_keys=True).encode()
    dev = comm_device(seq)
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = _all_gather_timed(n, ranks, timeout, "replay.compare").cpu().flatten().tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    allb = _all_gather_timed(buf.to(dev), ranks, timeout, "replay.compare").cpu()
    return [json.loads(bytes(allb[r, : sizes[r]].tolist()).decode()) for r in range(len(sizes))]
