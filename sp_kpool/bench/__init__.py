"""One benchmark entry: ``python -m sp_kpool.bench CASE [options]`` (``--help`` after a case
lists its options; ``python -m sp_kpool.bench`` alone lists the cases).

Every case writes one JSON record ``{"environment": ..., "args": ..., <its figures>}``
(:mod:`.record`: command, date, host, CPU/GPU, load, Python, torch, sp_kpool, git commit and
the optional packages' versions), times with :mod:`.timing` and builds its inputs with
:mod:`.inputs`. The cases, one line each, are :data:`sp_kpool.bench.cli.CASES` (``python -m sp_kpool.bench``
prints them); a GPU case needs a CUDA device and, without one, ends after parsing its options
with a one-line message (exit status 1). ``e2e`` runs in one process, spawns ranks here (gloo
on CPU, NCCL with a GPU per rank) or runs under ``torchrun --standalone ... -m sp_kpool.bench
e2e``.

Nothing here is imported by ``import sp_kpool``.
"""
