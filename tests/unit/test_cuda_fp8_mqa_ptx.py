"""What a CPU can check of the CUDA scorer (``sp_kpool/kernels/cuda_fp8_mqa.cu``).

- Every variant (H 32, 64, 128; one or two query blocks per pool tile; dense and no-store;
  E4M3 and BF16) compiles for sm_90a with the host's nvcc, at 96 registers on entry and
  without spills (ptxas' report), and its PTX issues exactly the chained ``wgmma`` steps per
  tile (four m64n128k32 E4M3, or eight m64n128k16 BF16) and no ``mma.sync``; the steps'
  shared-memory descriptors walk the swizzled tiles (32 bytes per step, then the next
  128-byte atom) with the 128-byte swizzle and an 8-row stride.
- Its per-tile arithmetic is DeepGEMM's: DeepGEMM's own SM90 ``fp8_mqa_logits`` template,
  compiled from the headers of the pinned tokenspeed-deepgemm wheel
  (``scripts/reference_wheels.sh`` downloads it; never installed) with the same nvcc and
  flags, stores at H 32 and 64 the same expression for every logit as ours (the dataflow
  of each stored value traced through the PTX to the wgmma accumulators: which products are
  fused and which rounded, the chain order, where the scale applies, the butterfly), which
  is also the module doc's formula at every H (BF16: without the scale); and both machine
  codes have the same FP32 operation counts (so ptxas contracted nothing of DeepGEMM's) and
  no local memory. The mapping of accumulators to pools, the tiles' base addresses and the
  bits of the tensor-core steps are checked on a GPU only: ``tests/gpu/test_cuda_fp8_mqa.py``.
- The debug build (``KPOOL_DEBUG``: a pipeline wait still open after 1 s by ``%globaltimer``
  prints and traps) compiles through ptxas, and only its PTX reads the global timer.
- The Python side: argument errors name the argument; the library is built once per source
  and compiler and reused; its C entry point reports an unknown variant.

Without nvcc the compile tests skip (the reason names it); without the DeepGEMM wheel the
comparison skips, except under CI (``SP_KPOOL_CI`` or ``CI``), where it fails.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from sp_kpool.kernels import cuda_fp8_mqa as m
from sp_kpool.settings import Settings

pytestmark = pytest.mark.xdist_group("nvcc")  # one worker compiles, the others run other tests

DEEPGEMM_VERSION = "2.5.0.post20260629"  # keep equal to scripts/reference_wheels.sh
ROOT = Path(__file__).resolve().parents[2]
IN_CI = bool(os.environ.get("SP_KPOOL_CI") or os.environ.get("CI"))
NVCC = m.nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine (CUDA_HOME, PATH, /usr/local/cuda)")


def _entries(ptx: str) -> dict[str, str]:
    """Each kernel's PTX body by its mangled name."""
    parts = re.split(r"\.entry\s+(\w+)\s*\(", ptx)
    return dict(zip(parts[1::2], parts[2::2]))


def _counts(body: str) -> dict[str, int]:
    """The FP32 operations of a kernel's per-tile arithmetic, by kind (any rounding suffix)."""
    return {
        "fma": len(re.findall(r"\bfma\.rn\.f32\b", body)),
        "mul": len(re.findall(r"\bmul(?:\.rn)?\.f32\b", body)),
        "add": len(re.findall(r"\badd(?:\.rn)?\.f32\b", body)),
        "max": len(re.findall(r"\bmax\.f32\b", body)),
        "shfl": len(re.findall(r"\bshfl\.sync\.bfly\.b32\b", body)),
        "wgmma": len(re.findall(r"\bwgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3\b", body)),
        "wgmma_bf16": len(re.findall(r"\bwgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16\b", body)),
    }


def _instructions(body: str):
    """(opcode, operand text) of each PTX instruction of a kernel body, in order (inline-asm
    braces, labels, directives and guards dropped)."""
    body = re.sub(r"//[^\n]*", "", body)
    for stmt in body.split(";"):
        stmt = re.sub(r"^(\$?\w+:\s*)+", "", stmt.replace("{", " ").replace("}", " ").strip())
        if stmt.startswith("@"):
            stmt = stmt.split(None, 1)[1] if " " in stmt else ""
        if stmt and not stmt.startswith("."):
            op, _, args = stmt.partition(" ")
            yield op, args


def _canon(op: str, *children: str) -> str:
    """One node of an expression: products and sums are commutative (sorted operands);
    ``fma(a, b, c)``'s addend ``c`` stays apart from its factors."""
    if op == "fma":
        return f"fma({','.join(sorted(children[:2]))};{children[2]})"
    if op in ("mul", "add"):
        return f"{op}({','.join(sorted(children))})"
    return f"{op}({','.join(children)})"


def _stored(body: str) -> list[str]:
    """The expression of every value a kernel stores with ``st.global.f32``, traced back
    through its FP32 operations to the ``wgmma`` accumulators (``d0`` .. ``d63``, by their
    place in the instruction's output list), loads (``ld``: weights, scales) and constants; a shuffle names its lane mask."""
    defs: dict[str, str] = {}
    roots = []

    def val(tok: str) -> str:
        tok = tok.strip()
        return defs.get(tok, "c" + tok[2:] if re.fullmatch(r"0f[0-9A-Fa-f]{8}", tok) else "?")

    for op, args in _instructions(body):
        if op.startswith("wgmma.mma_async"):
            for k, reg in enumerate(re.findall(r"%f\d+", args)[:64]):
                defs[reg] = f"d{k}"
            continue
        ops = [a.strip() for a in args.split(",")]
        if op.startswith("st.global.f32"):
            roots.append(val(ops[-1]))
            continue
        if not ops or not ops[0].startswith("%"):
            continue
        dst, src = ops[0].split("|")[0], [val(a) for a in ops[1:]]
        if op == "max.f32":
            defs[dst] = _canon("relu", src[0]) if src[1] == "c00000000" else _canon("max", *sorted(src))
        elif re.fullmatch(r"(mul|add)(\.rn)?\.f32", op):
            defs[dst] = _canon(op.split(".")[0], *src)
        elif op == "fma.rn.f32":
            defs[dst] = _canon("fma", *src)
        elif op.startswith("shfl.sync.bfly"):  # the lane mask: an immediate or a register holding one
            defs[dst] = _canon("shfl" + (ops[2] if ops[2].lstrip("-").isdigit() else src[1]), src[0])
        elif op in ("mov.b32", "mov.f32", "mov.u32", "mov.s32"):
            defs[dst] = ops[1] if ops[1].lstrip("-").isdigit() else src[0]
        else:
            defs[dst] = "ld" if op.startswith("ld.") else f"?{op}"
    return roots


def _formula(H: int, scaled: bool = True) -> list[str]:
    """The expressions the module doc's formula gives for the 2 pools x 128 / H rows of one
    thread's tile: for row i, pool v (0, 1) and chain b (even, odd heads), accumulator
    ``d[i H/2 + 4 m + 2 v + b]`` is head ``8 m + 2 quad + b``; chain ``fma(r_0 w_0, RN(r_1
    w_1))`` then ``fma(r_m, w_m, c)``; ``P = RN(RN(c_even + c_odd) * s)`` (``scaled``, E4M3)
    or ``RN(c_even + c_odd)`` (BF16); two butterfly sums."""
    out = []
    for i in range(128 // H):
        for v in (0, 1):
            chains = []
            for b in (0, 1):
                r = [_canon("relu", f"d{i * H // 2 + 4 * mm + 2 * v + b}") for mm in range(H // 8)]
                c = _canon("fma", "ld", r[0], _canon("mul", "ld", r[1]))
                for mm in range(2, H // 8):
                    c = _canon("fma", "ld", r[mm], c)
                chains.append(c)
            p = _canon("mul", _canon("add", *chains), "ld") if scaled else _canon("add", *chains)
            p = _canon("add", p, _canon("shfl1", p))
            out.append(_canon("add", p, _canon("shfl2", p)))
    return sorted(out)


def _ours(name: str) -> tuple[int, int, int, int]:
    """(H, NQB, MODE, DT) of one of our mangled kernel names."""
    h, nqb, mode, dt = re.search(r"fp8_mqa_kernelILi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)E", name).groups()
    return int(h), int(nqb), int(mode), int(dt)


#: (H, NQB, MODE, DT) of every compiled kernel
VARIANTS = sorted((h, q, md, dt) for h in m.HEADS for q in (1, 2) for md in m.MODES.values()
                  for dt in m.DTYPES.values())  # fmt: skip


@pytest.fixture(scope="module")
def our_ptx(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("ptx") / "ours.ptx"
    done = subprocess.run(m.compile_command(NVCC, str(out), ptx=True), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _entries(out.read_text())


@needs_nvcc
def test_every_variant_compiles_at_96_registers_without_spills(tmp_path):
    cmd = m.compile_command(NVCC, str(tmp_path / "k.o"), verbose=True)
    cmd[cmd.index("-shared")] = "-c"  # an object file is enough for the resource report
    cmd.remove("-Xcompiler"), cmd.remove("-fPIC")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = done.stderr
    kernels = re.findall(r"Function properties for (\w*fp8_mqa_kernel\w*)\n(.*)\n.*Used (\d+) registers", report)
    assert sorted(_ours(k) for k, _, _ in kernels) == VARIANTS
    for name, spill, regs in kernels:
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in spill, (_ours(name), spill)
        # 96 on entry (640 threads, one CTA per SM); setmaxnreg then moves 128 x 64 registers
        # from the producer warpgroup (down to 32) to the 512 math threads (up to 112)
        assert int(regs) == 96, (_ours(name), regs)
    assert "warning" not in report.lower(), report  # e.g. C7508: setmaxnreg ignored


@needs_nvcc
def test_debug_build_traps_a_stuck_wait_on_a_one_second_deadline(tmp_path):
    # KPOOL_DEBUG: a wait still open 1 s (10^9 ns of %globaltimer) after its first failed try
    # prints and traps; the build compiles through ptxas (an object file), and every kernel
    # reads the global timer (the release PTX does not: test_every_variant_issues_...)
    obj = m.compile_command(NVCC, str(tmp_path / "debug.o"), debug=True)
    obj[obj.index("-shared") : obj.index("-fPIC") + 1] = ["-c"]
    _run(obj)
    out = tmp_path / "debug.ptx"
    _run(m.compile_command(NVCC, str(out), ptx=True, debug=True))
    bodies = _entries(out.read_text())
    assert sorted(_ours(n) for n in bodies) == VARIANTS
    for name, body in bodies.items():
        assert "trap;" in body and "vprintf" in body, _ours(name)
        assert re.search(r"mov\.u64\s+%rd\d+,\s*%globaltimer;", body), _ours(name)
        assert re.search(r"\b1000000000\b", body), _ours(name)  # the deadline, in nanoseconds


@needs_nvcc
def test_every_variant_issues_its_chained_wgmma_steps_and_no_mma_sync(our_ptx):
    # E4M3: four k32 steps over the 128 channels; BF16: eight k16 steps
    assert sorted(_ours(n) for n in our_ptx) == VARIANTS
    for name, body in our_ptx.items():
        c = _counts(body)
        want = (4, 0) if _ours(name)[3] == 0 else (0, 8)
        assert (c["wgmma"], c["wgmma_bf16"]) == want, (_ours(name), c)
        assert "mma.sync" not in body.replace("wgmma.mma_async.sync", ""), _ours(name)
        assert body.count("setmaxnreg.inc.sync.aligned.u32 112") == 1 and body.count("setmaxnreg.dec") == 1
        assert "cp.async.bulk.tensor.2d" in body and "mbarrier.try_wait.parity" in body
        assert "globaltimer" not in body, _ours(name)  # the debug build only


def _descriptors(body: str) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """The (A, B) shared-memory descriptors of each wgmma of a kernel, in order, each as
    (root register, constant added): traced through ``add.s64`` and ``or.b64`` with an
    immediate (an ``or`` into the zero low bits of an aligned address is an addition)."""
    defs = {}
    for op, args in _instructions(body):
        ops = [a.strip() for a in args.split(",")]
        if op in ("add.s64", "or.b64") and len(ops) == 3 and ops[2].lstrip("-").isdigit():
            root, off = defs.get(ops[1], (ops[1], 0))
            defs[ops[0]] = (root, off + int(ops[2]))
    out = []
    for mm in re.finditer(r"wgmma\.mma_async[^}]*\},\s*(%rd\d+),\s*(%rd\d+)", body):
        out.append(tuple(defs.get(r, (r, 0)) for r in mm.groups()))
    return out


@needs_nvcc
def test_wgmma_steps_walk_the_swizzled_tiles(our_ptx):
    # step k reads 32 bytes at (k % 4) * 32 of 128-byte atom k / 4 of the pool tile (A) and of
    # the query block (B): descriptor offsets in 16-byte units from the first step's; every
    # descriptor has the 128-byte swizzle (mode 1) and a stride of 1024 bytes (8 rows)
    for name, body in our_ptx.items():
        h, nqb, mode, dt = _ours(name)
        steps = 4 if dt == 0 else 8
        a_atom, b_atom = (64 * 4 // nqb) * 128 // 16, nqb * 128 * 128 // 16
        descs = _descriptors(body)
        assert len(descs) == steps, (_ours(name), descs)
        (ra, a0), (rb, b0) = descs[0]
        for k, ((rak, ak), (rbk, bk)) in enumerate(descs):
            assert (rak, rbk) == (ra, rb), (_ours(name), k, descs)
            assert (ak - a0, bk - b0) == ((k // 4) * a_atom + 2 * (k % 4), (k // 4) * b_atom + 2 * (k % 4)), (
                _ours(name), k, ak - a0, bk - b0)  # fmt: skip
        for c in (a0, b0):
            assert c >> 62 == 1 and (c >> 32) & 0x3FFF == 1024 // 16 and (c >> 16) & 0x3FFF == 0, (_ours(name), hex(c))


def _deepgemm_wheel() -> Path | None:
    env = os.environ.get("SP_KPOOL_DEEPGEMM_WHEEL")
    if env:
        return Path(env)
    hits = sorted((ROOT / ".cache" / "wheels").glob(f"tokenspeed_deepgemm-{DEEPGEMM_VERSION}-*.whl"))
    return hits[-1] if hits else None


@pytest.fixture(scope="module")
def deepgemm_source(tmp_path_factory) -> list[str]:
    """The nvcc arguments that compile DeepGEMM's SM90 fp8_mqa_logits kernel as its JIT
    instantiates it for legacy FP32 logits at H 32 and 64 (BLOCK_Q = 128 / H, BLOCK_KV 256,
    128 TMA and 512 math threads), from the wheel's headers with our flags (add ``-ptx`` or
    ``-cubin`` and ``-o``)."""
    wheel = _deepgemm_wheel()
    if wheel is None or not wheel.is_file():
        msg = f"needs the tokenspeed-deepgemm {DEEPGEMM_VERSION} wheel: run scripts/reference_wheels.sh"
        if IN_CI:
            pytest.fail(f"{msg} (under CI this test must run)")
        pytest.skip(msg)
    root = tmp_path_factory.mktemp("deepgemm")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(root, [n for n in z.namelist() if n.startswith("deep_gemm/include/")])
    src = root / "instantiate.cu"
    args = "{H}, 128, false, {BQ}, 256, 3, 3, 132, 128, 512, float"
    src.write_text("#include <deep_gemm/impls/sm90_fp8_mqa_logits.cuh>\n" + "".join(
        f"void* kernel_{H}() {{ return reinterpret_cast<void*>(&deep_gemm::sm90_fp8_mqa_logits<"
        f"{args.format(H=H, BQ=128 // H)}>); }}\n" for H in (32, 64)))  # fmt: skip
    return [NVCC, *m.FLAGS, "-std=c++20", "--expt-relaxed-constexpr", f"-I{root / 'deep_gemm' / 'include'}", str(src)]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _deepgemm_heads(name: str) -> int:
    return int(re.search(r"sm90_fp8_mqa_logitsILj(\d+)E", name).group(1))


@pytest.fixture(scope="module")
def deepgemm_ptx_bodies(deepgemm_source, tmp_path_factory) -> dict[int, str]:
    """Per H (32, 64): the PTX of DeepGEMM's kernel."""
    out = tmp_path_factory.mktemp("deepgemm_ptx") / "deepgemm.ptx"
    _run([*deepgemm_source, "-ptx", "-o", str(out)])
    found = {_deepgemm_heads(n): b for n, b in _entries(out.read_text()).items()}
    assert sorted(found) == [32, 64], sorted(found)
    return found


@pytest.fixture(scope="module")
def deepgemm_ptx(deepgemm_ptx_bodies) -> dict[int, dict[str, int]]:
    """Per H (32, 64): the operation counts of DeepGEMM's kernel."""
    return {h: _counts(b) for h, b in deepgemm_ptx_bodies.items()}


@needs_nvcc
def test_per_tile_arithmetic_has_deepgemms_operation_counts(our_ptx, deepgemm_ptx):
    for name, body in our_ptx.items():
        h, nqb, mode, dt = _ours(name)
        ours = _counts(body)
        if h in deepgemm_ptx and dt == 0:
            assert ours == deepgemm_ptx[h], ((h, nqb, mode), ours, deepgemm_ptx[h])
        # the formula's own counts per tile (BQ = 128 / H rows of 4 chains; BF16: no scale)
        bq, steps = 128 // h, h // 8
        want = {"fma": bq * 4 * (steps - 1), "mul": bq * (6 if dt == 0 else 4), "add": bq * 6, "max": bq * h // 2,
                "shfl": bq * 4, "wgmma": 4 if dt == 0 else 0, "wgmma_bf16": 0 if dt == 0 else 8}  # fmt: skip
        assert ours == want, ((h, nqb, mode, dt), ours, want)


@needs_nvcc
def test_stored_logits_are_the_formula_and_deepgemms_expressions(our_ptx, deepgemm_ptx_bodies):
    # the dataflow of every stored logit, traced through the PTX: ours (dense variants) is the
    # formula's at every H, and DeepGEMM's compiled template stores the same expressions at
    # H 32 and 64 (so a changed chain order, rounding or butterfly fails here, on a CPU)
    for h, body in deepgemm_ptx_bodies.items():
        assert sorted(_stored(body)) == _formula(h), h
    for name, body in our_ptx.items():
        h, nqb, mode, dt = _ours(name)
        if mode == m.MODES["dense"]:
            assert sorted(_stored(body)) == _formula(h, scaled=dt == 0), (h, nqb, dt)


def _cuobjdump() -> str | None:
    """The ``cuobjdump`` of Triton's package (the test extra installs Triton; found without
    importing it), else on PATH."""
    spec = importlib.util.find_spec("triton")
    for root in (spec.submodule_search_locations or []) if spec else []:
        cand = Path(root) / "backends" / "nvidia" / "bin" / "cuobjdump"
        if cand.is_file():
            return str(cand)
    return shutil.which("cuobjdump")


def _sass(cubin: Path) -> dict[str, str]:
    """Each function's SASS by its mangled name."""
    done = subprocess.run([_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    parts = re.split(r"Function : (\S+)", done.stdout)
    return dict(zip(parts[1::2], parts[2::2]))


def _sass_counts(body: str) -> dict[str, int]:
    ops = ("QGMMA", "HGMMA", "HMMA", "FFMA", "FMUL", "FADD", "FMNMX", "SHFL.BFLY", "LDL", "STL")
    return {op: len(re.findall(rf"\b{re.escape(op)}\b", body)) for op in ops}


@needs_nvcc
@pytest.mark.skipif(_cuobjdump() is None, reason="no cuobjdump (Triton's package carries one)")
def test_machine_code_has_deepgemms_operations_and_no_local_memory(deepgemm_source, tmp_path):
    # ptxas may contract DeepGEMM's mul.f32 + add.f32 (ours are .rn, never contracted): its
    # SASS having as many FFMA/FMUL/FADD as ours shows it did not, so the PTX expressions
    # compared above are what both kernels run; QGMMA (FP8 wgmma), no HMMA, no local memory
    _run([*deepgemm_source, "-cubin", "-o", str(tmp_path / "deepgemm.cubin")])
    theirs = {_deepgemm_heads(n): _sass_counts(b) for n, b in _sass(tmp_path / "deepgemm.cubin").items()}
    assert sorted(theirs) == [32, 64]
    cmd = m.compile_command(NVCC, str(tmp_path / "ours.cubin"))
    cmd[cmd.index("-shared") : cmd.index("-fPIC") + 1] = ["-cubin"]
    _run(cmd)
    ours = {_ours(n): _sass_counts(b) for n, b in _sass(tmp_path / "ours.cubin").items()}
    assert sorted(ours) == VARIANTS
    for (h, nqb, mode, dt), c in ours.items():
        mma = (4, 0) if dt == 0 else (0, 8)  # QGMMA (FP8) or HGMMA (BF16) steps
        assert (c["QGMMA"], c["HGMMA"]) == mma and c["HMMA"] == 0 and c["LDL"] == c["STL"] == 0, ((h, nqb, mode, dt), c)
        if h in theirs and dt == 0:
            assert c == theirs[h], ((h, nqb, mode), c, theirs[h])


@needs_nvcc
def test_library_is_built_once_and_reports_an_unknown_variant(tmp_path):
    # the cache folder as the settings read it from XDG_CACHE_HOME (this module reads no variable)
    settings = Settings.from_env({"XDG_CACHE_HOME": str(tmp_path)})
    lib = m.build(settings=settings)
    assert lib.parent == tmp_path / "sp_kpool" / "cuda" and lib.is_file()
    stamp = lib.stat().st_mtime_ns
    assert m.build(settings=settings) == lib and lib.stat().st_mtime_ns == stamp  # reused, not rebuilt
    dll = ctypes.CDLL(str(lib))
    err = ctypes.create_string_buffer(256)
    rc = dll.kpool_fp8_mqa(48, 1, 0, 0, None, None, ctypes.c_longlong(128), None, None, None, None, None,
                           ctypes.c_longlong(0), None, 1, 1, 1, None, err, len(err))  # fmt: skip
    assert rc == 1 and err.value.startswith(b"no variant for heads 48, nqb 1, mode 0, dtype 0"), err.value


def test_toolkit_and_cache_folder_come_from_the_settings(tmp_path):
    """CUDA_HOME (else CUDA_PATH) and the cache folder (SP_KPOOL_CACHE_DIR, else
    XDG_CACHE_HOME/sp_kpool, else ~/.cache/sp_kpool) are read by Settings, and the build
    takes them from there."""
    fake = tmp_path / "toolkit" / "bin" / "nvcc"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    home = str(tmp_path / "toolkit")
    assert Settings.from_env({"CUDA_HOME": home, "CUDA_PATH": "/elsewhere"}).cuda_home == home
    assert Settings.from_env({"CUDA_PATH": home}).cuda_home == home
    assert m.nvcc(Settings(cuda_home=home)) == str(fake)
    assert Settings.from_env({"XDG_CACHE_HOME": "/x"}).cache_path() == Path("/x/sp_kpool")
    assert Settings.from_env({"XDG_CACHE_HOME": "/x", "SP_KPOOL_CACHE_DIR": "/y"}).cache_path() == Path("/y")
    assert Settings.from_env({}).cache_path() == Path.home() / ".cache" / "sp_kpool"
    rows = {var: (value, source) for var, value, source in Settings.from_env({"CUDA_PATH": home}).describe()}
    assert rows["CUDA_HOME"] == (home, "set") and rows["SP_KPOOL_CACHE_DIR"][1] == "default"


def test_build_without_nvcc_names_it(monkeypatch):
    monkeypatch.setattr(m, "nvcc", lambda settings=None: None)
    with pytest.raises(RuntimeError, match="no nvcc found"):
        m.build()


def test_argument_errors_name_the_argument():
    q8 = torch.zeros(4, 32, 128).to(torch.float8_e4m3fn)
    w, k8, sc = torch.zeros(4, 32), torch.zeros(8, 128).to(torch.float8_e4m3fn), torch.zeros(8)
    ks = ke = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="mode: expected one of"):
        m.score(q8, w, k8, sc, ks, ke, mode="sparse")
    with pytest.raises(ValueError, match="q_blocks: expected 1 or 2, got 3"):
        m.score(q8, w, k8, sc, ks, ke, q_blocks=3)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got device cpu"):
        m.score(q8, w, k8, sc, ks, ke)
    with pytest.raises(ValueError, match=r"q: expected a tensor \[S, H, 128\]"):
        m.score(q8[0], w, k8, sc, ks, ke)
    with pytest.raises(TypeError, match="q: expected dtype float8_e4m3fn or bfloat16, got torch.float32"):
        m.score(q8.float(), w, k8, sc, ks, ke)
