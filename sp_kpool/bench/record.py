"""The record every case of ``python -m sp_kpool.bench`` writes: one JSON document
``{"environment": {...}, "args": {...}, <the case's figures>}``.

The environment block (:func:`environment`): the command, the date (UTC), the host, platform,
CPU model and count, load average, Python, torch, torch threads, sp_kpool and the git commit
of the checkout (``" (tree modified)"`` when tracked files differ), and on a CUDA host the GPU,
CUDA and NCCL versions; the optional GPU packages' versions (triton, tilelang, deep_gemm,
lmdeploy) where the case asks. :func:`save` writes a document (indented JSON, replaced
whole: a crash mid-write leaves the previous one), :func:`log` prints progress lines.

Nothing here is imported by ``import sp_kpool``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys

import torch

__all__ = ["environment", "command_line", "save", "log", "package_versions", "cpu_model", "git_commit",
           "launch_kwargs", "require_cuda", "parser", "parse_call"]


def log(msg) -> None:
    """Print ``msg`` (a dict as JSON) and flush (progress lines of long GPU runs)."""
    print(json.dumps(msg) if isinstance(msg, dict) else msg, flush=True)


def save(doc, out_dir: str, name: str) -> str:
    """Write ``doc`` as ``out_dir/name`` (indented JSON, through a temporary file); returns the path."""
    os.makedirs(out_dir or ".", exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


def package_versions(modules=("triton", "tilelang", "deep_gemm", "lmdeploy")) -> dict:
    """``{module: __version__}`` of the optional packages (``"unavailable (Error)"`` where
    one does not import)."""
    out = {}
    for mod in modules:
        try:
            out[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - a broken build may raise anything
            out[mod] = f"unavailable ({type(exc).__name__})"
    return out


def launch_kwargs(opts) -> dict:
    """``{'name': value}`` of ``['name=value', ...]``: integers where the value is one, else
    the string (``ways=3``, ``tile=1024``)."""
    return {n: int(v) if v.lstrip("-").isdigit() else v for n, v in (o.split("=", 1) for o in opts)}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def git_commit() -> str:
    """``HEAD`` of the checkout this package runs from, ``" (tree modified)"`` appended when
    tracked files differ from it; ``"?"`` outside a git checkout."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)  # fmt: skip
        return out.stdout.strip() + (" (tree modified)" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001
        return "?"


def parser(case: str, doc: str) -> argparse.ArgumentParser:
    """The option parser of ``case``, its help text the case module's docstring ``doc``."""
    return argparse.ArgumentParser(prog=f"python -m sp_kpool.bench {case}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip


def parse_call(ap: argparse.ArgumentParser, argv, backend: str, precision: str, heads: int) -> argparse.Namespace:
    """``ap``'s options and those of one call on the reference slice (``--backend``,
    ``--precision``, ``--heads``, ``--total``; these defaults), parsed, the backend checked."""
    from ..backends import BACKENDS

    ap.add_argument("--backend", default=backend)
    ap.add_argument("--precision", default=precision)
    ap.add_argument("--heads", type=int, default=heads)
    ap.add_argument("--total", type=int, default=131072)
    args = ap.parse_args(argv)
    if args.backend not in BACKENDS:
        ap.error(f"--backend: expected one of {sorted(BACKENDS)}, got {args.backend!r}")
    return args


def require_cuda(case: str) -> None:
    """End the case ``case`` with a one-line message (exit status 1) where there is no CUDA
    device: the GPU cases parse their options first, then call this."""
    if not torch.cuda.is_available():
        raise SystemExit(f"python -m sp_kpool.bench {case}: needs a CUDA GPU (torch.cuda.is_available() is False)")


def command_line(case: str, argv=None) -> str:
    """The command that ran ``case``: ``python -m sp_kpool.bench CASE ARGS`` (``argv``, else
    this process's arguments after the case name)."""
    if argv is None:
        argv = sys.argv[1:]
        if argv and argv[0] == case:
            argv = argv[1:]
    return " ".join(["python -m sp_kpool.bench", case, *map(str, argv)])


def environment(command: str, on: torch.device | str | None = None, packages=(), **extra) -> dict:
    """The environment block of a record: what ran (``command``), when, where and on what
    versions; ``on``, the device the case ran on (default: CUDA device 0 when there is one): a
    CUDA device adds the GPU, CUDA and
    NCCL; ``packages``, the optional packages' versions (:func:`package_versions`); ``extra``,
    the case's own fields (world size, process-group backend, ...)."""
    import sp_kpool

    env = {
        "command": command,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "sp_kpool": sp_kpool.__version__,
        "git_commit": git_commit(),
    }
    dev = torch.device(on) if on is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["cuda"] = torch.version.cuda
        try:
            env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001
            env["nccl"] = "?"
    if packages:
        env["versions"] = package_versions(packages)
    env.update(extra)
    return env
