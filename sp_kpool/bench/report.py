"""Reports of ``python -m sp_kpool.bench e2e`` runs: the per-rank results summarized,
ratios, one line per run, the fit of the balance work model, JSON, markdown and plots;
the case ``report`` re-draws or merges finished runs with them::

    python -m sp_kpool.bench report RUN.json [RUN2.json ...] [--out BASE] [--no-plot]

(several files: their results are merged, e.g. single-GPU runs of different backends; the
environment of the first is shown).

:func:`summarize`, :func:`add_ratios`, :func:`one_line`, :func:`fit_row_cost`,
:func:`write_outputs`, :func:`markdown`, :func:`draw`, :func:`main`; :data:`STAGES`, the
stages a run times. The timing itself is :mod:`.timing`'s.

Nothing here is imported by ``import sp_kpool``; matplotlib is imported only by
:func:`draw`.
"""

from __future__ import annotations

import json
import os

import torch

__all__ = ["STAGES", "summarize", "add_ratios", "one_line", "fit_row_cost", "write_outputs", "markdown", "draw", "main"]


STAGES = ("gather", "seam", "pool", "balance_exchange", "score", "select", "balance_route", "expand")
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def summarize(args, cfg: dict, per_rank: list[dict], ceilings: dict, device: torch.device) -> dict:
    """Max over ranks (a step is as slow as its slowest rank) and rates against ceilings."""
    if any("skipped" in r for r in per_rank):
        return {"skipped": per_rank[0].get("skipped") or next(r["skipped"] for r in per_rank if "skipped" in r)}
    H, D, K = args.heads, args.head_dim, args.kpool
    es = _DTYPE_BYTES[args.dtype]
    s: dict = {"time_ms": 1e3 * max(r["time_s"] for r in per_rank)}
    s["stage_ms"] = {st: 1e3 * max(r["stage_s"].get(st, 0.0) for r in per_rank) for st in STAGES}
    s["stage_ms"] = {k: v for k, v in s["stage_ms"].items() if v > 0}
    s["instrumented_total_ms"] = 1e3 * max(r["instrumented_total_s"] for r in per_rank)
    s["bytes_sent_max"] = max(r["bytes"]["sent"] for r in per_rank)
    s["bytes_received_max"] = max(r["bytes"]["received"] for r in per_rank)
    tags = {}
    for r in per_rank:
        for t, v in r["bytes"]["by_tag"].items():
            e = tags.setdefault(t, {"sent_max": 0, "received_max": 0})
            e["sent_max"] = max(e["sent_max"], v["sent"])
            e["received_max"] = max(e["received_max"], v["received"])
    s["bytes_by_tag"] = tags
    data_tags = ("gather_keys", "gather_pools", "seam")
    s["gather_bytes_received_max"] = max(
        sum(r["bytes"]["by_tag"].get(t, {}).get("received", 0) for t in data_tags) for r in per_rank
    )
    s["gather_bytes_sent_max"] = max(
        sum(r["bytes"]["by_tag"].get(t, {}).get("sent", 0) for t in data_tags) for r in per_rank
    )
    pairs = [r["causal_pairs"] for r in per_rank]
    s["causal_pairs"] = pairs
    s["pairs_imbalance"] = max(pairs) / (sum(pairs) / len(pairs)) if sum(pairs) else 1.0
    cells = [r.get("scored_cells", 0) for r in per_rank]  # the chunk grid's cells, zero rows included
    s["scored_cells"] = cells
    s["cells_imbalance"] = max(cells) / (sum(cells) / len(cells)) if sum(cells) else 1.0
    s["cells_per_causal_pair"] = sum(cells) / sum(pairs) if sum(pairs) else 1.0
    part = per_rank[0]["partition"]
    if part is not None:
        s["partition"] = {k: part[k] for k in ("applied", "bounds", "imbalance", "contiguous_imbalance", "block")}
    s["balance_decision_same_on_all_ranks"] = len({json.dumps(r["partition"]) for r in per_rank}) == 1
    s["equal_to_baseline"] = all(r["equal_to_baseline"] in (None, True) for r in per_rank)
    s["deterministic"] = all(r["deterministic"] for r in per_rank)
    s["peak_memory_bytes_max"] = max(r["peak_memory_bytes"] for r in per_rank)
    s["peak_memory_kind"] = per_rank[0]["peak_memory_kind"]
    # rates of the slowest rank of each stage; model bytes are stated
    worst = max(per_rank, key=lambda r: r["stage_s"].get("score", 0.0))
    score_s = worst["stage_s"].get("score", 0.0)
    flops = 2.0 * H * D * worst["causal_pairs"]
    if device.type == "cuda" and cfg["backend"] != "torch":
        ceiling_name = "fp8_matmul_tflops" if cfg["precision"] == "fp8" else "bf16_matmul_tflops"
    else:
        ceiling_name = "fp32_matmul_tflops"  # the torch backend scores in FP32
    rates: dict = {"score_ceiling": ceiling_name}
    if score_s > 0:
        rates["score_tflops"] = flops / score_s / 1e12
        ceiling = ceilings.get(ceiling_name)
        if isinstance(ceiling, float):
            rates["score_fraction_of_ceiling"] = rates["score_tflops"] / ceiling
    copy = ceilings.get("copy_gbps")
    pool_row = D + 4 if cfg["precision"] == "fp8" else D * (2 if cfg["precision"] == "bf16-serving" else es)
    model = {
        # keys and gates of the pools built, read once; the pooled rows written once
        "pool": lambda r: r["pools_built"] * (K * D * 2 * es + pool_row),
        # FP32 scores of the causal pairs, read once by the selector
        "select": lambda r: 4 * r["causal_pairs"],
        # int32 output rows of the owned shard written once
        "expand": lambda r: 4 * r["owned_rows"] * _width(args),
    }
    for st, nbytes in model.items():
        r = max(per_rank, key=lambda r: r["stage_s"].get(st, 0.0))
        t = r["stage_s"].get(st, 0.0)
        if t > 0:
            rates[f"{st}_gbps"] = nbytes(r) / t / 1e9
            if copy:
                rates[f"{st}_fraction_of_copy"] = rates[f"{st}_gbps"] / copy
    g = max(per_rank, key=lambda r: r["stage_s"].get("gather", 0.0) + r["stage_s"].get("seam", 0.0))
    tg = g["stage_s"].get("gather", 0.0) + g["stage_s"].get("seam", 0.0)
    recv = sum(g["bytes"]["by_tag"].get(t, {}).get("received", 0) for t in data_tags)
    if tg > 0 and recv:
        rates["gather_recv_gbps"] = recv / tg / 1e9
        if isinstance(ceilings.get("all_gather_recv_gbps"), float):
            rates["gather_fraction_of_all_gather"] = rates["gather_recv_gbps"] / ceilings["all_gather_recv_gbps"]
    rates["model_bytes"] = ("pool: pools_built * (K*D*2*dtype + pooled row); select: 4 B per causal pair; "
                            "expand: 4 B per output cell of the owned rows; gather: instrumented bytes received")
    s["rates"] = rates
    return s


def _width(args) -> int:
    from sp_kpool.selection import output_width

    return output_width(args.topk, args.kpool, 1)


def add_ratios(results: list[dict]) -> None:
    """Gather bytes of ``pools`` against ``keys`` for the same length/backend/precision/balance."""
    index = {}
    for r in results:
        c = r["config"]
        if "skipped" not in r["summary"]:
            index[(c["seq_len"], c.get("layout"), c["backend"], c["precision"], c["gather"], c["balance"])] = r["summary"]
    for r in results:
        c, s = r["config"], r["summary"]
        if c["gather"] != "pools" or "skipped" in s:
            continue
        k = index.get((c["seq_len"], c.get("layout"), c["backend"], c["precision"], "keys", c["balance"]))
        if k and k["gather_bytes_received_max"]:
            s["gather_bytes_vs_keys"] = s["gather_bytes_received_max"] / k["gather_bytes_received_max"]


def one_line(s: dict, wall: float) -> str:
    if "skipped" in s:
        return f"skipped: {s['skipped']}"
    stages = " ".join(f"{k}={v:.1f}" for k, v in s["stage_ms"].items())
    rates = s["rates"]
    extra = ""
    if "score_tflops" in rates:
        frac = rates.get("score_fraction_of_ceiling")
        extra = f" score {rates['score_tflops']:.3g} TFLOP/s" + (f" ({100 * frac:.0f}% of ceiling)" if frac else "")
    part = s.get("partition")
    bal = ""
    if part:
        bal = f" balance {'applied' if part['applied'] else 'declined'} work max/mean {part['imbalance']:.3f}"
        bal += f" (contiguous {part['contiguous_imbalance']:.3f})"
    ratio = s.get("gather_bytes_vs_keys")
    return (
        f"{s['time_ms']:.1f} ms | {stages} ms | gather recv {s['gather_bytes_received_max']} B"
        + (f" (1/{1 / ratio:.1f} of keys)" if ratio else "")
        + f" | pairs max/mean {s['pairs_imbalance']:.3f} cells max/mean {s['cells_imbalance']:.3f}"
        + f" (cells/pairs {s['cells_per_causal_pair']:.2f}){bal}{extra}"
        + f" | peak {s['peak_memory_bytes_max'] / 2**20:.0f} MiB | equal {s['equal_to_baseline']}"
        + f" | {wall:.1f} s wall"
    )


def fit_row_cost(results: list[dict]) -> dict:
    """Per backend/precision, fit ``score + select seconds = a * pairs + b * rows`` over every
    rank of every run (least squares, no intercept): ``b / a`` is the per-row constant of the
    balance work model (``balance_row_cost``) that this machine and backend suggest."""
    groups: dict = {}
    for r in results:
        if "skipped" in r["summary"]:
            continue
        key = f"{r['config']['backend']}/{r['config']['precision']}"
        for p in r["per_rank"]:
            scored = p["rows_scored"]  # (lo, hi), or [lo, hi] runs in the interleaved layouts
            runs = scored if scored and isinstance(scored[0], (list, tuple)) else [scored]
            rows = sum(b - a for a, b in runs)
            t = p["stage_s"].get("score", 0.0) + p["stage_s"].get("select", 0.0)
            if rows > 0:
                groups.setdefault(key, []).append((float(p["causal_pairs"]), float(rows), t))
    out = {}
    for key, pts in groups.items():
        x = torch.tensor([[p, n] for p, n, _ in pts], dtype=torch.float64)
        y = torch.tensor([[t] for *_, t in pts], dtype=torch.float64)
        if len(pts) < 2 or torch.linalg.matrix_rank(x) < 2:
            out[key] = {"points": len(pts), "fit": "needs runs with different rows per pair (2+ ranks or lengths)"}
            continue
        a, b = torch.linalg.lstsq(x, y).solution.flatten().tolist()
        resid = float((x @ torch.tensor([[a], [b]], dtype=torch.float64) - y).abs().max())
        fit = {"points": len(pts), "seconds_per_pair": a, "seconds_per_row": b, "max_abs_residual_s": resid}
        if a > 0 and b >= 0:
            fit["suggested_balance_row_cost"] = int(round(b / a))
        out[key] = fit
    return out


# ------------------------------------------------------------------------------ output


def write_outputs(path_base: str, doc: dict, plot: bool) -> None:
    os.makedirs(os.path.dirname(path_base) or ".", exist_ok=True)
    tmp = path_base + ".json.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path_base + ".json")
    with open(path_base + ".md", "w") as f:
        f.write(markdown(doc))
    if plot:
        try:
            draw(doc, path_base + ".png")
        except Exception as exc:  # noqa: BLE001 - the JSON is what counts
            print(f"plot failed: {type(exc).__name__}: {exc}", flush=True)


def markdown(doc: dict) -> str:
    env = doc["environment"]
    lines = [
        f"# kpool_topk benchmark, {env['date_utc']}",
        "",
        f"- command: `{env['command']}`",
        f"- machine: {env['host']}, {env.get('gpu', env['cpu'])}, {env['cpu_count']} CPUs, {env['platform']}",
        f"- versions: python {env['python']}, torch {env['torch']}, sp_kpool {env['sp_kpool']} ({env['git_commit']})"
        + (f", CUDA {env.get('cuda')}, NCCL {env.get('nccl')}" if "gpu" in env else ""),
        f"- ranks: {env['world_size']} ({env['dist_backend'] or 'single process'}), device {env['device']}",
        "- ceilings (rank 0, this run): "
        + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in doc["ceilings"].items()),
        "",
        "| S | layout | backend | precision | gather | balance | ms (max rank) | stages ms (max rank)"
        " | gather B recv/rank | pools/keys | max/mean pairs | balance | cells/pairs | equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        c, s = r["config"], r["summary"]
        head = (f"| {c['seq_len']} | {c.get('layout', 'contiguous')} | {c['backend']} | {c['precision']} | "
                f"{c['gather']} | {c['balance']} ")  # fmt: skip
        if "skipped" in s:
            lines.append(head + f"| skipped: {s['skipped'][:80]} | | | | | | | |")
            continue
        part = s.get("partition")
        bal = "" if not part else ("applied" if part["applied"] else "declined")
        stages = ", ".join(f"{k} {v:.1f}" for k, v in s["stage_ms"].items())
        ratio = s.get("gather_bytes_vs_keys")
        lines.append(
            head + f"| {s['time_ms']:.1f} | {stages} | {s['gather_bytes_received_max']} | "
            f"{'' if ratio is None else f'1/{1 / ratio:.1f}'} | {s['pairs_imbalance']:.3f} | {bal} | "
            f"{s.get('cells_per_causal_pair', float('nan')):.2f} | {'yes' if s['equal_to_baseline'] else 'NO'} |"
        )
    for key, fit in doc.get("balance_fit", {}).items():
        if "suggested_balance_row_cost" in fit:
            lines.append(f"\nBalance work model fit, {key}: score + select = {fit['seconds_per_pair']:.3g} s/pair + "
                         f"{fit['seconds_per_row']:.3g} s/row over {fit['points']} rank runs: suggested "
                         f"balance_row_cost = {fit['suggested_balance_row_cost']}")  # fmt: skip
    return "\n".join(lines) + "\n"


def draw(doc: dict, path: str) -> None:
    """Time per stage (slowest rank) vs sequence length: one row per backend/precision, one
    column per gather/balance combination; the black line is the uninstrumented total."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in doc["results"] if "skipped" not in r["summary"]]
    if not results:
        return
    first = {}
    for r in results:
        c = r["config"]
        first.setdefault(("row", c["backend"], c["precision"]), len(first))
        first.setdefault(("col", c["gather"], c["balance"]), len(first))
    rows = sorted((k[1:] for k in first if k[0] == "row"), key=lambda k: first[("row", *k)])
    cols = sorted((k[1:] for k in first if k[0] == "col"), key=lambda k: first[("col", *k)])
    colors = dict(zip(STAGES, plt.get_cmap("tab10").colors))
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(4.2 * len(cols), 3.2 * len(rows) + 0.6), squeeze=False)
    for i, (backend, precision) in enumerate(rows):
        for j, (gather, balance) in enumerate(cols):
            ax = axes[i][j]
            sel = sorted(
                (r for r in results if (r["config"]["backend"], r["config"]["precision"]) == (backend, precision)
                 and (r["config"]["gather"], r["config"]["balance"]) == (gather, balance)),
                key=lambda r: r["config"]["seq_len"],
            )  # fmt: skip
            if not sel:
                ax.set_visible(False)
                continue
            xs = [r["config"]["seq_len"] for r in sel]
            ax.plot(xs, [r["summary"]["time_ms"] for r in sel], "k-o", lw=2, label="total (uninstrumented)")
            for st in STAGES:
                ys = [r["summary"]["stage_ms"].get(st, float("nan")) for r in sel]
                if any(y == y for y in ys):
                    ax.plot(xs, ys, "-", marker=".", color=colors[st], label=st)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{backend} {precision} | gather={gather} balance={balance}", fontsize=8)
            ax.set_xlabel("sequence length S")
            ax.set_ylabel("ms (slowest rank)")
            ax.grid(True, which="both", alpha=0.3)
    handles = [plt.Line2D([], [], color="k", marker="o", lw=2, label="total (uninstrumented)")]
    handles += [plt.Line2D([], [], color=colors[st], marker=".", label=st) for st in STAGES]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    env = doc["environment"]
    fig.suptitle(f"kpool_topk per stage, {env['world_size']} rank(s) {env['dist_backend'] or ''}, "
                 f"{env.get('gpu', env['cpu'])}, {env['date_utc']}", fontsize=9)  # fmt: skip
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    """The case ``report``: re-draw the table and the plot of ``e2e`` result files (merged)."""
    from .record import parser

    ap = parser("report", __doc__)
    ap.add_argument("runs", nargs="+", help="bench_*.json files of the e2e case")
    ap.add_argument("--out", default=None, help="output base path (default: the first file without .json)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    docs = [json.load(open(p)) for p in args.runs]
    doc = dict(docs[0])
    doc["results"] = [r for d in docs for r in d["results"]]
    doc["balance_fit"] = fit_row_cost(doc["results"])
    if len(docs) > 1:
        doc["merged_from"] = [os.path.basename(p) for p in args.runs]
    base = args.out or (args.runs[0][: -len(".json")] if args.runs[0].endswith(".json") else args.runs[0])
    write_outputs(base, doc, plot=not args.no_plot)
    print(f"wrote {base}.json, .md" + ("" if args.no_plot else ", .png"))
    return 0
