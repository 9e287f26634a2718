"""Registers, spills and SASS instruction counts of the codec's CUDA kernels, without a GPU.

Compiles a kernel source as CuPy's NVRTC would see it (``-ftz=true``) with nvcc for one
architecture, then counts each kernel's machine instructions by class from
``cuobjdump --dump-sass``. Static counts (every path of a kernel once), so they compare
two versions of a kernel, not its run time::

    python measure/kernel_sass.py                                  # this checkout's kernels
    python measure/kernel_sass.py --rev main                       # the source at a git revision
    python measure/kernel_sass.py --source old.cu --kernels hh_prepare_f32,hh_decode_i32_f32
    python measure/kernel_sass.py --log2b 10 --per 32      # B = 1024 compiled in, per coordinate

``--log2b`` compiles the block size in (every ``a.log2B`` of the source becomes the
constant), so the paths of other sizes drop out; a thread of prepare holds 32 coordinates
and runs its code once, so ``--per 32`` gives its instructions per coordinate, an upper
bound (fallback paths, such as unaligned loads, are counted too; loops, as decode's and
quantize's, once).

cuobjdump: ``$CUOBJDUMP``, else the one on the PATH or beside nvcc.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "hhook" / "codec" / "kernels" / "csrc" / "thc_kernels.cu"
DEFAULT_KERNELS = ("hh_prepare_f32", "hh_quantize_f32_i32", "hh_decode_i32_f32", "hh_prepare_bf16",
                   "hh_quantize_bf16_i32", "hh_decode_i32_bf16", "hh_wq_encode_f32", "hh_wq_decode_f32")
#: Instruction classes by SASS opcode (the part before the first dot).
CLASSES = {
    "fp32": ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK", "MUFU"),
    "int": ("IMAD", "IADD3", "LOP3", "SHF", "IMNMX", "ISETP", "LEA", "SEL", "PRMT", "IABS", "POPC", "FLO", "BREV",
            "VIMNMX", "IADD", "BMSK", "SGXT", "UIADD3", "ULOP3", "USHF", "UIMAD", "ULEA", "UISETP", "USEL", "UMOV",
            "ULDC", "S2R", "S2UR", "CS2R", "MOV", "R2UR", "P2R", "R2P", "PLOP3", "VOTE", "VOTEU"),
    "convert": ("I2F", "F2I", "FRND", "F2F", "I2FP", "F2FP", "I2I"),
    "shared": ("LDS", "STS", "ATOMS", "LDSM"),
    "global": ("LDG", "STG", "ATOMG", "RED", "LD", "ST", "LDC"),
    "shuffle": ("SHFL",),
    "sync": ("BAR", "WARPSYNC", "MEMBAR", "DEPBAR", "NANOSLEEP"),
    "control": ("BRA", "EXIT", "RET", "CALL", "BSSY", "BSYNC", "BPT", "YIELD", "NOP", "JMP", "BRX", "WARPSYNC"),
    "local": ("LDL", "STL"),
}


def _tool(name: str, env: str) -> str:
    found = os.environ.get(env) or shutil.which(name)
    nvcc = shutil.which("nvcc")
    if not found and nvcc:
        beside = Path(os.path.realpath(nvcc)).parent / name
        found = str(beside) if beside.exists() else None
    if not found:
        sys.exit(f"{name} not found: set ${env}")
    return found


def compile_cubin(source: Path, arch: str, out: Path) -> str:
    """ptxas's report (registers, spills) of ``source`` compiled into ``out``."""
    done = subprocess.run([_tool("nvcc", "NVCC"), f"-arch={arch}", "-cubin", "-ftz=true", "-std=c++14", "-Xptxas", "-v",
                           "-o", str(out), str(source)], capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr)
    return done.stderr


def resources(report: str) -> dict:
    """Kernel -> (registers, spill store bytes, spill load bytes) from ptxas -v."""
    found, name, spill = {}, None, (0, 0)
    for line in report.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spill = (int(m.group(1)), int(m.group(2)))
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            found[name] = (int(m.group(1)), *spill)
            name = None
    return found


def sass_counts(cubin: Path) -> dict:
    """Kernel -> Counter of opcodes."""
    text = subprocess.run([_tool("cuobjdump", "CUOBJDUMP"), "--dump-sass", str(cubin)], capture_output=True,
                          text=True).stdout
    counts, name = {}, None
    for line in text.splitlines():
        if m := re.match(r"\s*Function : (\w+)", line):
            name = m.group(1)
            counts[name] = collections.Counter()
        elif name and (m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)):
            counts[name][m.group(1)] += 1
    return counts


def classify(counter: collections.Counter) -> dict:
    row = {"total": sum(counter.values())}
    for cls, names in CLASSES.items():
        row[cls] = sum(v for k, v in counter.items() if k in names)
    row["other"] = row["total"] - sum(row[c] for c in CLASSES)
    return row


def measure(source: Path, arch: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        regs = resources(compile_cubin(source, arch, cubin))
        return {k: (regs.get(k), classify(v)) for k, v in sass_counts(cubin).items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=None, help="a .cu file (default: this checkout's kernels)")
    ap.add_argument("--rev", default=None, help="the kernels at this git revision instead")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--kernels", default=",".join(DEFAULT_KERNELS), help="comma-separated; 'all' for every kernel")
    ap.add_argument("--log2b", type=int, default=None, help="compile this log2 of the block size in")
    ap.add_argument("--per", type=float, default=1.0, help="divide the counts by this (coordinates)")
    args = ap.parse_args(argv)
    source = args.source or SOURCE
    if args.rev:
        at = SOURCE.relative_to(ROOT).as_posix()
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.rev}:{at}"], capture_output=True, text=True)
        if shown.returncode:  # a revision from before the src layout
            shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.rev}:{at.removeprefix('src/')}"],
                                   capture_output=True, text=True, check=True)
        text = shown.stdout
        source = Path(tempfile.mkdtemp()) / "thc_kernels.cu"
        source.write_text(text)
    if args.log2b is not None:
        text = source.read_text()
        fixed = text.replace("a.log2B", f"({args.log2b})")
        if fixed == text:
            sys.exit(f"{source} has no a.log2B to fix")
        source = Path(tempfile.mkdtemp()) / "thc_kernels.cu"
        source.write_text(fixed)
    rows = measure(source, args.arch)
    names = sorted(rows) if args.kernels == "all" else args.kernels.split(",")
    cols = ["total", *CLASSES, "other"]
    print(f"# {source} ({args.arch}): static SASS instructions per kernel, by class")
    print(f"{'kernel':28s} {'regs':>4} {'spill':>5} " + " ".join(f"{c:>7}" for c in cols))
    for name in names:
        # decode kernels were named by their source dtype too (hh_decode_i32_f32_f32): the first of those
        found = name if name in rows else next((k for k in sorted(rows) if k.startswith(name + "_")), None)
        if found is None:
            print(f"{name:28s} (not in this source)")
            continue
        regs, row = rows[found]
        r, st, ld = regs or (0, 0, 0)
        print(f"{name:28s} {r:>4} {st + ld:>5} " + " ".join(f"{row[c] / args.per:>7.4g}" for c in cols))


if __name__ == "__main__":
    main()
