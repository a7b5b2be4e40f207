"""Driver for Nsight Compute: three calls of the Triton selector on the logits of the
``select`` case (16384 rows x 32768 pools, k 512); nothing timed or written.

    ncu -k regex:select_kernel -s 2 -c 1 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats python -m sp_kpool.bench ncu-select "dict(maxnreg=64)"

The optional argument is a Python dict of keyword arguments of ``topk_ascending``
(``--help`` prints this text).
"""

import ast

import torch

from .inputs import selector_logits
from .record import require_cuda


def main(argv=None) -> int:
    argv = list(argv or [])
    kw = {}
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv:  # "dict(a=1)" or "{'a': 1}"
        text = argv[0]
        if text.startswith("dict("):
            node = ast.parse(text, mode="eval").body
            kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        else:
            kw = ast.literal_eval(text)
    require_cuda("ncu-select")
    from ..kernels.triton_topk import topk_ascending

    s, ends = selector_logits(16384, 32768, 0, 0)
    starts = torch.zeros_like(ends)
    base = torch.zeros(16384, dtype=torch.int64, device="cuda")
    for _ in range(3):
        topk_ascending(s, starts, ends, base, 512, **kw)
    torch.cuda.synchronize()
    return 0
