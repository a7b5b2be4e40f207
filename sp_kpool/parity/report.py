"""The report of a parity replay: the text table, ``parity.json``, ``parity.txt`` and plots.

Outputs: :func:`format_table`, a JSON-ready dict, and two PNG plots (per-query Jaccard
overlap vs position; histogram of ``log10 |A - B|`` over valid score slots). For replayed
rollout selections, :func:`write_replay_outputs` writes the per-layer reports of
:func:`sp_kpool.replay.compare` as ``replay.json``, ``replay.txt`` and a PNG per layer.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["format_table", "write_outputs", "replay_table", "write_replay_outputs", "plots_unavailable"]

#: What the plots need, said when it is missing.
_MATPLOTLIB_HINT = "pip install matplotlib, or 'sp-kpool[test]'"


def plots_unavailable() -> str | None:
    """Why the PNG plots cannot be drawn here (matplotlib does not import), or ``None``.

    Asked before the work starts, so that a run without matplotlib writes its JSON and
    text and says the plots were skipped instead of failing after the work is done."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"matplotlib is not importable ({exc}); {_MATPLOTLIB_HINT}"
    return None


def _g(x: Any) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return "0" if x == 0 else f"{x:.4g}"
    return str(x)


#: Said in the table and on the overlap plot when no query of the capture has more visible
#: pools than it selects (e.g. tokens <= topk): every row takes all its pools in both arms.
NO_CHOICE = ("no row of this capture has a Top-K choice (every query sees at most topk // kpool pools, "
             "e.g. tokens <= topk): both arms select all visible pools, so the Top-K sets cannot differ; "
             "use a longer capture")


def format_table(report: dict[str, Any]) -> str:
    """The report as an aligned text table."""
    c, arms, d = report["capture"], report["arms"], report["diff"]
    A, B = arms["A"], arms["B"]
    lines = [
        f"sp_kpool parity: {Path(c['path']).name}  (rank {c['rank']}/{c['world_size']}, rows "
        f"[{c['shard'][0]}, {c['shard'][1]}), {c['real_rows']:,} real, {c['num_pools']:,} pools, "
        f"H={c['heads']} D={c['head_dim']} K={c['kpool']} T={c['topk']})",
        f"captured: {c['precision']} on backend {c['backend']} ({c['source']}, {c['device']}, autocast {c['autocast']}); "
        f"replayed on {report['replay']['device']} ({report['replay']['device_name']})",
        f"A = {A['arm']} -> backend {A['backend']};  B = {B['arm']} -> backend {B['backend']}",
        *([f"note: the capture's head gate was {c['head_gate']} (written before the FP32 head gate): "
           "its serving-arm ids need not reproduce"] if c.get("head_gate", "fp32") != "fp32" else []),
        f"pools of A: {A.get('schedule', '?')}",
        f"pools of B: {B.get('schedule', '?')}",
        "",
    ]
    rows: list[tuple[str, str, str]] = [
        ("per arm", "A", "B"),
        ("valid causal score slots (from cu_seq_lens)", _g(A["valid_slots"]), _g(B["valid_slots"])),
        ("NaN in valid slots", _g(A["nan_in_valid_slots"]), _g(B["nan_in_valid_slots"])),
        ("Inf in valid slots", _g(A["inf_in_valid_slots"]), _g(B["inf_in_valid_slots"])),
    ]
    if "repeat_bitwise_equal" in A:
        for part in ("pools", "scores", "ids"):
            rows.append(
                (f"same arm repeated: {part} bitwise equal", _g(A["repeat_bitwise_equal"][part]), _g(B["repeat_bitwise_equal"][part]))
            )  # fmt: skip
    rows.append(("replay reproduces the captured ids", _g(A["reproduces_captured_ids"]), _g(B["reproduces_captured_ids"])))
    rows.append(("", "", ""))
    rows.append(("A vs B", "value", ""))

    def stat(label: str, s: dict | None) -> None:
        if s is None:
            rows.append((label, "n/a", ""))
            return
        rows.append((f"{label}: max |A-B|", _g(s["max_abs"]), ""))
        rows.append((f"{label}: rel L2 ||A-B||/||B||", _g(s["rel_l2"]), ""))
        rows.append((f"{label}: elements differing", f"{_g(s['differing'])} / {_g(s['elements'])}", ""))

    stat("keys k (all rows)", d["keys"])
    stat("head weights", d["head_weights"])
    rows.append(("queries q bitwise equal", _g(d["queries_bitwise_equal"]), ""))
    fp8_arm = d["pools_rotated_space"] is not None
    stat("pools, model space" + (" (fp8 rotated back)" if fp8_arm else ""), d["pools_model_space"])
    if fp8_arm:
        stat("pools, rotated space (as fp8 stores them)", d["pools_rotated_space"])
    rows.append(("pools bitwise equal (as stored)", _g(d["pools_bitwise_equal"]), ""))
    if d.get("pools_differing") is not None:
        rows.append(("pools whose stored bits differ", f"{_g(d['pools_differing'])} / {_g(c['num_pools'])}", ""))
    s = d["scores"]
    rows.append(("scores on valid slots: rel L2 ||A-B||/||B||", _g(s["rel_l2"]), ""))
    rows.append(("scores on valid slots: max |A-B|", _g(s["max_abs"]), ""))
    rows.append(("scores on valid slots: bitwise equal", f"{_g(s['bitwise_equal_slots'])} / {_g(s['compared'])}", ""))
    t = d["topk"]
    rows.append(("rows with a Top-K choice (visible pools > T/K)", f"{_g(t['rows_with_choice'])} / {_g(t['rows'])}", ""))
    rows.append(
        (
            "queries whose Top-K pool sets differ",
            f"{_g(t['rows_differing'])} ({100 * t['fraction_of_rows']:.3g}% of rows, "
            f"{100 * t['fraction_of_rows_with_choice']:.3g}% of rows with a choice)",
            "",
        )
    )
    j = t["jaccard_rows_with_choice"]
    if not t["rows_with_choice"]:
        rows.append(("note", NO_CHOICE, ""))
    if j:
        rows.append(
            (
                "Jaccard overlap, rows with a choice",
                f"min {j['min']:.4f}  p1 {j['p1']:.4f}  p5 {j['p5']:.4f}  p10 {j['p10']:.4f}  "
                f"p50 {j['p50']:.4f}  mean {j['mean']:.4f}",
                "",
            )
        )
    bad = t["selected_ids_not_pool_starts"]
    if bad["A"] or bad["B"]:
        rows.append(("rows with ids that are not whole pools (A, B)", f"{bad['A']}, {bad['B']}", ""))
    rows.append(("ids bitwise equal (whole output)", _g(d["ids_bitwise_equal"]), ""))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows if r[2])  # the per-arm columns are right-aligned
    w2 = max(len(r[2]) for r in rows)
    for label, x, y in rows:
        lines.append(f"{label:<{w0}}  {x:>{w1}}  {y:>{w2}}" if y else f"{label:<{w0}}  {x}".rstrip())
    lines.append(f"({report['replay']['seconds']:.1f} s)")
    return "\n".join(lines)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_outputs(report: dict[str, Any], out_dir: str | os.PathLike, *, plots: bool = True) -> list[Path]:
    """Write ``parity.json``, ``parity.txt`` and (with matplotlib) the two PNG plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    p = out / "parity.json"
    p.write_text(json.dumps(_jsonable(report), indent=1) + "\n")
    written.append(p)
    p = out / "parity.txt"
    p.write_text(format_table(report) + "\n")
    written.append(p)
    if plots:
        written += _plots(report, out)
    return written


def _plots(report: dict[str, Any], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(f"the parity plots need matplotlib ({_MATPLOTLIB_HINT})") from None
    arms = report["arms"]
    title = f"A = {arms['A']['arm']} ({arms['A']['backend']}) vs B = {arms['B']['arm']} ({arms['B']['backend']})"
    pq = report["per_query"]
    fig, ax = plt.subplots(figsize=(9, 4))
    x = [r for r, c in zip(pq["row"], pq["has_choice"]) if c]
    y = [v for v, c in zip(pq["jaccard"], pq["has_choice"]) if c]
    ax.scatter(x, y, s=2, lw=0)
    if not x:  # an empty axis would look like a broken plot
        ax.text(0.5, 0.5, NO_CHOICE, ha="center", va="center", transform=ax.transAxes, fontsize=9, wrap=True)
    ax.set_xlabel("query position (global token id)")
    ax.set_ylabel("Jaccard overlap of Top-K pool sets")
    ax.set_ylim(min([*y, 0.9]) - 0.02, 1.01)
    ax.set_title(f"{title}\nrows with a choice: {len(x):,}, differing: {report['diff']['topk']['rows_differing']:,}", fontsize=9)
    fig.tight_layout()
    p1 = out / "overlap_vs_position.png"
    fig.savefig(p1, dpi=120)
    plt.close(fig)

    h = report["histogram"]
    e, cnt = h["log10_abs_diff_edges"], h["counts"]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.stairs(cnt, e, fill=True)
    used = [i for i, v in enumerate(cnt) if v]
    if used:
        ax.set_xlim(e[used[0]] - 0.5, e[used[-1] + 1] + 0.5)
    ax.set_xlabel("log10 |score A - score B| on valid causal slots")
    ax.set_ylabel("slots")
    s = report["diff"]["scores"]
    ax.set_title(
        f"{title}\n{s['compared']:,} slots, exact zeros {h['exact_zero']:,}, rel L2 {_g(s['rel_l2'])}, max {_g(s['max_abs'])}",
        fontsize=9,
    )
    fig.tight_layout()
    p2 = out / "score_diff_hist.png"
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [p1, p2]


def replay_table(layers: list[dict[str, Any]]) -> str:
    """Per-layer :func:`sp_kpool.replay.compare` reports as an aligned text table."""
    head = ("layer", "rows", "differing", "fraction", "jaccard mean", "jaccard min", "near ties", "first difference")
    rows = [head]
    for i, r in enumerate(layers):
        f = r.get("first_difference")
        first = "-" if f is None else f"doc {f['document']} row {f['row']} (stream {f['stream_position']})"
        rows.append((str(i), _g(r["rows"]), _g(r["rows_differing"]), _g(float(r["fraction_differing"])),
                     _g(float(r["jaccard_mean"])), _g(float(r["jaccard_min"])), _g(r.get("rows_near_ties")), first))  # fmt: skip
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)).rstrip() for row in rows)


def write_replay_outputs(layers: list[dict[str, Any]], out_dir: str | os.PathLike, *, plots: bool = True) -> list[Path]:
    """Write ``replay.json`` (the list), ``replay.txt`` (:func:`replay_table`) and, with
    matplotlib, ``replay_layers.png`` (fraction of rows differing and mean Jaccard per layer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "replay.json", out / "replay.txt"]
    written[0].write_text(json.dumps(_jsonable(layers), indent=1) + "\n")
    written[1].write_text(replay_table(layers) + "\n")
    if plots:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("the replay plot needs matplotlib (pip install matplotlib)") from None
        x = list(range(len(layers)))
        fig, ax = plt.subplots(figsize=(9, 4))
        ax.plot(x, [r["fraction_differing"] for r in layers], "o-", label="fraction of rows differing")
        ax.plot(x, [r["jaccard_mean"] for r in layers], "s-", label="mean Jaccard")
        ax.set_xlabel("layer")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=8)
        ax.set_title("replayed (rollout) vs computed selections", fontsize=9)
        fig.tight_layout()
        p = out / "replay_layers.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)
    return written
