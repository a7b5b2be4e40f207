"""Replay a captured indexer call in two arithmetic/backend arms and compare them.

An *arm* is ``precision[:backend]`` (``fp8``, ``bf16-serving:torch``, ``bf16:auto``); the
backend defaults to ``auto`` and is resolved by name through
:func:`sp_kpool.backends.resolve_backend`. For each arm, on identical inputs:

1. preparation: ``KPoolIndexer.prepare(hidden, q_resid, precision)`` per rank file, under the
   captured autocast state (so keys and head gates are FP32-prepared in the serving modes);
   keys and gates of all ranks are concatenated (what the live all-gather returns),
   queries and head weights are this rank's;
2. pools: the backend's (BF16 modes ``[P, D]``; ``fp8`` E4M3 ``[P, D]`` with scales ``[P]``);
3. ids: the operator's real pipeline after the gather
   (:func:`sp_kpool.pipeline.run_gathered`);
4. scores: the very ``backend.score`` calls the pipeline makes (each arm on its own chunk
   plan, aligned to global rows: :func:`sp_kpool.scoring.chunk_calls`), so they are the
   values its Top-K ranked; compared on the **valid causal slots** only, fixed by the sequence metadata
   (row ``t`` at document position ``j`` sees the ``(j + 1) // K`` complete pools of its
   document), never by which outputs are finite. Request-local (compact) score columns
   are mapped back to absolute pool ids.

Differences are ``A - B``; relative L2 is ``||A - B|| / ||B||``. Pools are compared after
dequantizing FP8 (``k8.float() * k_scale``); FP8 pools live in the Hadamard-rotated basis,
so they are compared both rotated back (``hadamard`` is orthonormal and its own inverse:
"model space") and with the other arm rotated ("rotated space"). Top-K sets are the
selected **history pools** of a row (the tail is the same in every arm); only rows with a
choice (more visible pools than ``topk // K``) can differ. With ``repeat`` every arm's
pools, scores and ids are computed twice and checked bitwise equal (determinism).

Arms and one arm's run (steps 1-3) are in :mod:`sp_kpool.parity.arms`; the report's table,
JSON and plots in :mod:`sp_kpool.parity.report`.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Callable

import torch

from ..backends.base import ChunkScores, PoolInputs, Pools
from ..pooling import pool_table
from ..scoring import chunk_calls, score_chunk
from ..selection import row_meta
from ..serving import hadamard
from .arms import Arm, _ArmRun, _device, _run_arm, schedule_of
from .load import load_capture_set
from .rebuild import rebuild_indexer

__all__ = ["replay", "selected_pool_sets", "stderr_progress", "HIST_EDGES"]

#: Bin edges of the ``log10 |A - B|`` histogram (exact zeros are counted apart).
HIST_EDGES = (-12.0, 4.0, 160)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A view of the raw bits (so NaN == NaN and -0.0 != +0.0)."""
    t = t.contiguous()
    size = t.element_size()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def _bitwise_equal(a, b) -> bool:
    if isinstance(a, Pools) or isinstance(b, Pools):
        return isinstance(a, Pools) and isinstance(b, Pools) and _bitwise_equal(tuple(a.parts()), tuple(b.parts()))
    if isinstance(a, tuple) or isinstance(b, tuple):
        return (
            isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)
            and all(_bitwise_equal(x, y) for x, y in zip(a, b))
        )  # fmt: skip
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _pools_differing(a: Pools | None, b: Pools | None) -> int | None:
    """Pools whose stored bits (values, scales) differ, when both arms store them alike."""
    if a is None or b is None or len(a) != len(b) or (a.scales is None) != (b.scales is None):
        return None
    if a.keys.dtype != b.keys.dtype:
        return None
    diff = (_bits(a.keys) != _bits(b.keys)).any(-1)
    if a.scales is not None:
        diff |= _bits(a.scales) != _bits(b.scales)
    return int(diff.sum())


def _pools_fp32(pooled) -> torch.Tensor | None:
    """Dequantized pools ``[P, D]`` FP32 in the arm's own basis (FP8: rotated)."""
    if pooled is None:
        return None
    if pooled.scales is not None:
        return pooled.keys.float() * pooled.scales[:, None]
    return pooled.keys.float()


def _diff_stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """Max |a - b|, ||a - b|| / ||b|| (float64 sums), elements differing, over finite pairs."""
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    ok = torch.isfinite(a) & torch.isfinite(b)
    d = (a[ok] - b[ok]).double()
    nb = float(b[ok].double().square().sum().sqrt())
    nd = float(d.square().sum().sqrt())
    return {
        "elements": int(a.numel()),
        "non_finite_pairs": int((~ok).sum()),
        "differing": int((a[ok] != b[ok]).sum()),
        "max_abs": float(d.abs().max()) if d.numel() else 0.0,
        "rel_l2": (nd / nb) if nb > 0 else (0.0 if nd == 0 else math.inf),
    }


def _start_to_pool(pool_tok_start: torch.Tensor, num_tokens: int, device) -> torch.Tensor:
    """``[S + 1]`` int64: pool id of a pool's first token, ``-1`` elsewhere (and at index S)."""
    m = torch.full((num_tokens + 1,), -1, dtype=torch.int64, device=device)
    m[pool_tok_start.to(device)] = torch.arange(pool_tok_start.numel(), device=device)
    return m


def selected_pool_sets(ids: torch.Tensor, n_sel: torch.Tensor, start_to_pool: torch.Tensor, topk: int, kpool: int):
    """``[R, topk // K]`` int64 ascending selected history pools (``-1`` for none, first).

    History ids lie in columns ``[0, n_sel * K)`` in both tail layouts, pool by pool; a
    pool's first column holds its first token. An id that is not a pool start maps to -1.
    """
    k_sel = topk // kpool
    first = ids[:, 0 : k_sel * kpool : kpool].to(torch.int64)  # [R, k_sel]
    col = torch.arange(k_sel, device=ids.device)
    live = (col[None] < n_sel[:, None]) & (first >= 0)
    tok = torch.where(live, first, torch.full_like(first, start_to_pool.numel() - 1))
    pools = start_to_pool[tok]
    return torch.sort(pools, dim=1).values


def _overlap(pa: torch.Tensor, pb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row ``|A & B|``, ``|A|``, ``|B|`` of sorted pool-id rows (``-1`` = none)."""
    na, nb = (pa >= 0).sum(1), (pb >= 0).sum(1)
    if pa.shape[1] == 0:
        return na, na, nb
    idx = torch.searchsorted(pa, pb).clamp_max_(pa.shape[1] - 1)
    hit = (torch.gather(pa, 1, idx) == pb) & (pb >= 0)
    return hit.sum(1), na, nb


class _Progress:
    def __init__(self, sink: Callable[[str], None] | None, every_s: float = 2.0) -> None:
        self.sink, self.every, self.t0, self.last = sink, every_s, time.perf_counter(), -1e9

    def __call__(self, msg: str, force: bool = True) -> None:
        now = time.perf_counter()
        if self.sink is None or (not force and now - self.last < self.every):
            return
        self.last = now
        self.sink(f"[parity {now - self.t0:7.1f} s] {msg}")


def _pool_diffs(pooled_a, pooled_b) -> dict[str, Any]:
    """Pool differences in model space (FP8 rotated back) and, with an FP8 arm, in the
    rotated space FP8 stores (the other arm rotated)."""
    fa, fb = _pools_fp32(pooled_a), _pools_fp32(pooled_b)
    if fa is None:
        return {"pools_model_space": None, "pools_rotated_space": None}
    rot_a, rot_b = pooled_a.scales is not None, pooled_b.scales is not None
    out = {"pools_model_space": _diff_stats(hadamard(fa) if rot_a else fa, hadamard(fb) if rot_b else fb)}
    out["pools_rotated_space"] = (
        _diff_stats(fa if rot_a else hadamard(fa), fb if rot_b else hadamard(fb)) if rot_a or rot_b else None
    )
    return out


def _absolute_columns(scores: ChunkScores, width: int) -> torch.Tensor:
    """A backend's scores as ``[C, width]`` absolute columns (``lo`` is column 0).

    Request-local results (column ``c`` of row ``r`` is ``col_offset[r] + c``) are
    scattered into place; cells no column maps to are NaN.
    """
    if scores.col_offset is None:
        return scores.scores.float()
    local, offset = scores.scores, scores.col_offset
    C, W = local.shape
    idx = offset.to(torch.int64)[:, None] + torch.arange(W, device=local.device)
    ok = (idx >= 0) & (idx < width)
    out = torch.full((C, width + 1), math.nan, dtype=torch.float32, device=local.device)
    out.scatter_(1, torch.where(ok, idx, torch.full_like(idx, width)), local.float())  # misses -> dump column
    return out[:, :width]


def _valid_scores(r: _ArmRun, repeat: bool, stats: dict):
    """Yield ``(row_lo, row_hi, values)`` over this rank's real rows (and the rows between
    them, without values, when they are not one range), chunk by chunk on the arm's
    **own** plan, making exactly the scoring calls of the pipeline
    (:func:`sp_kpool.scoring.chunk_calls`, in row order), so the values are the ones its
    selection ranked. ``values`` holds the FP32 scores of the rows' valid causal slots,
    row-major (row ``t`` contributes ``(j + 1) // K`` values, pools ascending). Counts
    NaN/Inf into ``stats``; with ``repeat`` scores every chunk twice and clears
    ``stats["same"]`` on any bitwise difference."""
    c = r.computed
    dev = c.call.problem.device
    empty = torch.zeros(0, dtype=torch.float32, device=dev)
    end = None
    for call in (call for plan, queries in c.spans if queries is not None
                 for call in chunk_calls(plan, queries, views_first=False)):  # fmt: skip
        a, e, ch = call.a, call.b, call.chunk
        if end is not None and a > end:  # rows between spans: not this rank's
            yield end, a, empty
        end = e
        if call.q is None:
            yield a, e, empty
            continue
        rows = call.rows
        cols = torch.arange(ch.pool_hi - ch.pool_lo, device=dev)
        r_start, r_end = call.starts[rows].long(), call.ends[rows].long()
        visible = (cols[None] >= r_start[:, None]) & (cols[None] < r_end[:, None])

        def values():
            sc = score_chunk(c.call.backend, c.call.problem, c.pools, call)
            return _absolute_columns(sc, ch.pool_hi - ch.pool_lo)[rows][visible]

        v = values()
        if repeat and stats["same"]:
            stats["same"] = _bitwise_equal(v, values())
        stats["nan_in_valid_slots"] += int(torch.isnan(v).sum())
        stats["inf_in_valid_slots"] += int(torch.isinf(v).sum())
        yield a, e, v


def _score_diffs(runs: dict[str, _ArmRun], seq, offs, n_visible: torch.Tensor, P: int, repeat: bool, say) -> dict[str, Any]:
    """Both arms' scores on the valid causal slots, each on its own chunk grid, compared
    row range by row range as both become available (memory: about one chunk per arm)."""
    dev = runs["A"].computed.call.problem.device
    owned = seq.real_rows()  # ascending; n_visible is theirs
    n = n_visible.numel()
    own_lo = int(owned[0]) if n else 0
    span = int(owned[-1]) + 1 - own_lo if n else 0  # the rows [own_lo, own_lo + span) hold them all
    nv = torch.zeros(span, dtype=torch.int64)
    nv[owned - own_lo] = n_visible.cpu()
    at = torch.full((span,), -1, dtype=torch.int64)  # row -> its index among the owned rows
    at[owned - own_lo] = torch.arange(n)
    cum = torch.zeros(span + 1, dtype=torch.int64)
    cum[1:] = torch.cumsum(nv, 0)
    stats = {name: {"nan_in_valid_slots": 0, "inf_in_valid_slots": 0, "same": True} for name in runs}
    acc = {"sq_d": 0.0, "sq_b": 0.0, "max_abs": 0.0, "compared": 0, "equal": 0, "zero": 0}
    lo_e, hi_e, nbins = HIST_EDGES
    hist = torch.zeros(nbins, dtype=torch.float64, device=dev)
    row_max_abs = torch.zeros(n, dtype=torch.float32, device=dev)
    if n and P:
        gens = {name: _valid_scores(r, repeat, stats[name]) for name, r in runs.items()}
        pend = {name: torch.zeros(0, dtype=torch.float32, device=dev) for name in runs}
        pend_end = {name: own_lo for name in runs}
        done = own_lo
        while done < own_lo + span:
            for name in runs:
                if pend_end[name] <= done:
                    a, e, v = next(gens[name])
                    assert a == pend_end[name], (name, a, pend_end[name])  # chunks tile the rows
                    pend[name], pend_end[name] = torch.cat([pend[name], v]), e
            end = min(pend_end.values())
            cnt = int(cum[end - own_lo] - cum[done - own_lo])
            va, vb = pend["A"][:cnt], pend["B"][:cnt]
            pend = {name: t[cnt:] for name, t in pend.items()}
            ok = torch.isfinite(va) & torch.isfinite(vb)
            d = (va - vb)[ok]
            ad = d.abs()
            acc["sq_d"] += float(d.double().square().sum())
            acc["sq_b"] += float(vb[ok].double().square().sum())
            acc["compared"] += int(ok.sum())
            acc["equal"] += int((_bits(va[ok]) == _bits(vb[ok])).sum())
            acc["max_abs"] = max(acc["max_abs"], float(ad.max()) if ad.numel() else 0.0)
            acc["zero"] += int((ad == 0).sum())
            nz = ad[ad > 0]
            if nz.numel():
                hist += torch.histc(nz.log10().clamp(lo_e, hi_e - 1e-6), bins=nbins, min=lo_e, max=hi_e).double()
            if cnt:
                rows = torch.repeat_interleave(at[done - own_lo : end - own_lo], nv[done - own_lo : end - own_lo])
                per_slot = (va - vb).abs().nan_to_num(nan=math.inf)
                row_max_abs.scatter_reduce_(0, rows.to(dev), per_slot, "amax")
            done = end
            say(f"scores: rows {done - own_lo}/{span} ({100 * (done - own_lo) / span:.0f}%)", force=done == own_lo + span)
    valid_slots = int(cum[-1])
    nb = math.sqrt(acc["sq_b"])
    return {
        "arms": {name: {"valid_slots": valid_slots, **{k: v for k, v in st.items() if k != "same"}} for name, st in stats.items()},
        "repeat": {name: st["same"] for name, st in stats.items()},
        "diff": {
            "valid_slots": valid_slots,
            "compared": acc["compared"],
            "bitwise_equal_slots": acc["equal"],
            "max_abs": acc["max_abs"],
            "rel_l2": math.sqrt(acc["sq_d"]) / nb if nb > 0 else (0.0 if acc["sq_d"] == 0 else math.inf),
        },
        "hist": hist,
        "zero": acc["zero"],
        "row_max_abs": row_max_abs,
    }


def _topk_diffs(ids_a, ids_b, meta, start_to_pool, T: int, K: int):
    """``(stats, choice [R] bool, jaccard [R] float64)`` of the selected history pool sets."""
    n_sel = torch.clamp(meta.n_visible, max=T // K)
    pa = selected_pool_sets(ids_a, n_sel, start_to_pool, T, K)
    pb = selected_pool_sets(ids_b, n_sel, start_to_pool, T, K)
    inter, na, nb = _overlap(pa, pb)
    union = na + nb - inter
    jac = torch.where(union > 0, inter.double() / union.clamp_min(1).double(), torch.ones_like(inter, dtype=torch.float64))
    choice = meta.n_visible > T // K
    differ = (inter != na) | (inter != nb)
    n, n_choice, n_differ = int(ids_a.shape[0]), int(choice.sum()), int(differ.sum())
    jc = jac[choice]
    dist: dict[str, float] = {}
    if jc.numel():
        qs = {"min": 0.0, "p1": 0.01, "p5": 0.05, "p10": 0.10, "p50": 0.50}
        vals = torch.quantile(jc, torch.tensor(list(qs.values()), dtype=jc.dtype, device=jc.device)).tolist()
        dist = {**dict(zip(qs, vals)), "mean": float(jc.mean())}
    stats = {
        "rows": n,
        "rows_with_choice": n_choice,
        "rows_differing": n_differ,
        "fraction_of_rows": n_differ / n if n else 0.0,
        "fraction_of_rows_with_choice": n_differ / n_choice if n_choice else 0.0,
        "selected_ids_not_pool_starts": {
            "A": int(((pa < 0).sum(1) != (T // K - n_sel)).sum()),
            "B": int(((pb < 0).sum(1) != (T // K - n_sel)).sum()),
        },
        "jaccard_rows_with_choice": dist,
    }
    return stats, choice, jac


# --------------------------------------------------------------------------- replay


@torch.no_grad()
def replay(
    path: str | os.PathLike,
    a: Arm | str,
    b: Arm | str,
    *,
    device: torch.device | str | None = None,
    repeat: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Recompute the captured call of ``path``'s rank in arms ``a`` and ``b``; compare.

    Returns a JSON-ready dict (see :func:`format_table` for what it holds); the per-query
    arrays are under ``"per_query"``. ``progress`` receives progress lines (e.g. ``print``).
    Raises :class:`~sp_kpool.capture.CaptureError` for a bad capture, ``ValueError`` for a
    bad arm or a backend that cannot run it.
    """
    a = a if isinstance(a, Arm) else Arm.parse(a)
    b = b if isinstance(b, Arm) else Arm.parse(b)
    dev = _device(device)
    say = _Progress(progress)
    say(f"reading {path}")
    target, captures = load_capture_set(path)
    m = target.meta
    seq = target.seq()
    K, T = m["kpool"], m["topk"]
    real_cu = seq.real_cu_seq_lens
    pts, offs = pool_table(real_cu, K)
    P = pts.numel()
    indexer = rebuild_indexer(target, dev)
    say(
        f"rank {target.rank}/{target.world_size}: {seq.shard_size} rows, {P} pools, H={m['heads']} "
        f"D={indexer.head_dim} K={K} T={T}; {len(captures)} file(s) on {dev}"
    )

    runs: dict[str, _ArmRun] = {}
    arm_info: dict[str, dict[str, Any]] = {}
    for name, arm in (("A", a), ("B", b)):
        t0 = time.perf_counter()
        runs[name] = r = _run_arm(captures, target, indexer, arm, dev, say)
        info = {"arm": str(arm), "precision": arm.precision, "backend": r.backend.name,
                "schedule": schedule_of(r, target)}  # fmt: skip
        captured_arm = (arm.precision == m["precision"] and r.backend.name == m["backend_resolved"]
                        and not (arm.all_decode and target.prompt_lens is not None))  # fmt: skip
        info["reproduces_captured_ids"] = bool(torch.equal(r.ids.cpu(), target.ids)) if captured_arm else None
        if repeat:
            say(f"arm {arm}: repeating pools and ids")
            p, plan = r.problem, r.computed.plan
            again = r.backend.prepare(p, PoolInputs(p.k, p.gates, plan.pool_tok_start), None)[0] if P else None
            info["repeat_bitwise_equal"] = {
                "pools": _bitwise_equal(r.pooled, again),
                "ids": _bitwise_equal(r.ids, r.rerun().ids),
            }
        arm_info[name] = info
        say(f"arm {name} = {arm} (backend {r.backend.name}): pools and ids in {time.perf_counter() - t0:.2f} s")
    ra, rb = runs["A"], runs["B"]

    rows = seq.real_rows().to(dev)  # this rank's real rows, ascending (all rows below are in this order)
    n = rows.numel()
    meta = row_meta(rows, real_cu, offs, K)
    local = seq.storage_index().to(dev)

    def real_ids(ids):  # the rows' ids as real rows (stream positions mapped back)
        return seq.real_ids(ids)[local]

    diff: dict[str, Any] = {
        "keys": _diff_stats(ra.problem.k, rb.problem.k),
        "head_weights": _diff_stats(ra.problem.head_weights[local], rb.problem.head_weights[local]),
        "queries_bitwise_equal": _bitwise_equal(ra.problem.q[local], rb.problem.q[local]),
        "pools_bitwise_equal": _bitwise_equal(ra.pooled, rb.pooled),
        "pools_differing": _pools_differing(ra.pooled, rb.pooled),
        "ids_bitwise_equal": _bitwise_equal(ra.ids, rb.ids),
        **_pool_diffs(ra.pooled, rb.pooled),
    }
    sc = _score_diffs(runs, seq, offs, meta.n_visible, P, repeat, say)
    for name in ("A", "B"):
        arm_info[name].update(sc["arms"][name])
        if repeat:
            rbe = arm_info[name]["repeat_bitwise_equal"]
            rbe["scores"] = sc["repeat"][name]
            rbe["all"] = all(rbe.values())
    diff["scores"] = sc["diff"]
    stp = _start_to_pool(pts, seq.total_length, dev)
    topk, choice, jac = _topk_diffs(real_ids(ra.ids), real_ids(rb.ids), meta, stp, T, K)
    diff["topk"] = topk
    lo_e, hi_e, nbins = HIST_EDGES
    edges = torch.linspace(lo_e, hi_e, nbins + 1).tolist()
    report = {
        "capture": {
            "path": str(target.path),
            "files": [str(c.path) for c in captures],
            "rank": target.rank,
            "world_size": target.world_size,
            "shard": [seq.shard_start, seq.shard_end] if seq.is_contiguous else None,
            "layout": seq.layout,
            "real_rows": n,
            "num_pools": P,
            "heads": m["heads"],
            "head_dim": indexer.head_dim,
            "kpool": K,
            "topk": T,
            "tail": m["tail"],
            "order": m["order"],
            "precision": m["precision"],
            "prompt_lens": target.prompt_lens.tolist() if target.prompt_lens is not None else None,
            "head_gate": m["head_gate"],
            "backend": m["backend_resolved"],
            "device": m["device"],
            "autocast": m["autocast"],
            "source": m["source"],
        },
        "replay": {
            "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "repeat": repeat,
            "seconds": None,
        },
        "arms": arm_info,
        "diff": diff,
        "histogram": {"log10_abs_diff_edges": edges, "counts": sc["hist"].cpu().tolist(), "exact_zero": sc["zero"]},
        "per_query": {
            "row": rows.cpu().tolist(),
            "doc_position": (rows.cpu() - real_cu[torch.searchsorted(real_cu, rows.cpu(), right=True) - 1]).tolist(),
            "has_choice": choice.cpu().tolist(),
            "jaccard": jac.cpu().tolist(),
            "score_max_abs_diff": sc["row_max_abs"].cpu().tolist(),
        },
    }
    report["replay"]["seconds"] = round(time.perf_counter() - say.t0, 3)
    say("done")
    return report


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
