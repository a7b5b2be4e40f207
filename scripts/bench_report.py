"""Re-draw the reports of ``scripts/bench.py`` runs: the JSON, a Markdown table, a PNG of
time per stage vs sequence length, and the fit of the balance work model.

    python scripts/bench_report.py RUN.json [RUN2.json ...] [--out BASE]

re-draws the table and the plot from one or several result files (several: their results
are merged, e.g. single-GPU runs of different backends; the environment of the first is
shown). The reporting functions live in :mod:`sp_kpool.testing.bench_report` (``scripts/bench.py``
calls its ``write_outputs`` after every configuration).

Runs with the package installed (``pip install -e .`` from the repository root).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sp_kpool.testing.bench_report import fit_row_cost, write_outputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Re-draw bench.py reports from result JSON files.")
    ap.add_argument("runs", nargs="+", help="bench_*.json files")
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


if __name__ == "__main__":
    sys.exit(main())
