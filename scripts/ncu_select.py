"""Driver for Nsight Compute: three calls of the Triton selector on the logits of
``bench_select.py`` (16384 rows x 32768 pools, k 512).

    ncu -k regex:select_kernel -s 2 -c 1 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats python scripts/ncu_select.py "dict(maxnreg=64)"

The optional argument is a Python dict of keyword arguments of ``topk_ascending``
(``--help`` prints this text).

Runs with the package installed (``pip install -e .`` from the repository root).
"""

import ast
import sys

import torch

from sp_kpool.kernels.triton_topk import topk_ascending
from sp_kpool.testing.bench_inputs import selector_logits


def main():
    kw = {}
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    if len(sys.argv) > 1:  # "dict(a=1)" or "{'a': 1}"
        text = sys.argv[1]
        if text.startswith("dict("):
            node = ast.parse(text, mode="eval").body
            kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        else:
            kw = ast.literal_eval(text)
    s, ends = selector_logits(16384, 32768, 0, 0)
    starts = torch.zeros_like(ends)
    base = torch.zeros(16384, dtype=torch.int64, device="cuda")
    for _ in range(3):
        topk_ascending(s, starts, ends, base, 512, **kw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
