"""The prepare half of the GPU check: the wheels our GPU-side code imports that a bare GPU machine lacks
(CPython 3.12, manylinux x86_64, torch 2.11 already there), downloaded here with `--no-deps` into one
folder that travels with the working tree (the device tool carries at most 64 MiB in all).

What such a machine has and lacks was read from the device tool's package list (numpy, xxhash, pytest,
pytest-xdist, pytest-timeout, hypothesis, einops, ninja, requests, tqdm, click, tabulate, nvidia-ml-py and
cuda-bindings are there): our transport needs pyzmq and msgspec; FlashInfer 0.7.2 needs apache-tvm-ffi.
FlashInfer's own wheel is 65 MB: it ships the CUDA sources of every kernel family it JIT-builds, so it is
repacked here without the source trees that its paged prefill/decode never include (`TRIM`), which
keeps the whole set near 20 MiB. Its Python modules are all kept: `import flashinfer` imports them all.
Its optional dependencies (cutlass-dsl, cudnn-frontend, cuda-tile, nccl4py: hundreds of MB) are not
brought: `import flashinfer` works without them and the FA2 paged kernels do not use them.

Run:  python3 scripts/gpu_wheels.py --dest .gpu_wheels      (or: bash scripts/gpu_check.sh prepare)
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

WHEELS = ("pyzmq==27.3.0", "msgspec==0.22.0", "apache-tvm-ffi==0.1.11", "flashinfer-python==0.7.2")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
# Paths inside flashinfer's wheel that its FA2 batch prefill/decode JIT never reads: source trees of other
# kernel families under data/csrc/<dir>/ (the FA2 sources are files directly in data/csrc and include only
# data/include, tvm_ffi, spdlog and CUTLASS's include/ and tools/util/include/: the Hopper (FA3) prefill that
# FlashInfer picks on sm_90 includes cutlass/util/command_line.h from the latter), and CUTLASS's examples,
# Python and docs.
KEEP_CSRC_DIRS = ()  # no data/csrc subfolder is read by the paged FA2 kernels
TRIM_PREFIXES = ("flashinfer/data/cutlass/examples/", "flashinfer/data/cutlass/python/",
                 "flashinfer/data/cutlass/docs/", "flashinfer/data/cutlass/test/",
                 "flashinfer/data/cutlass/media/")


def trimmed(name: str) -> bool:
    """Whether a member of flashinfer's wheel is dropped."""
    if name.startswith(TRIM_PREFIXES):
        return True
    parts = name.split("/")
    return (len(parts) > 4 and parts[:3] == ["flashinfer", "data", "csrc"]
            and parts[3] not in KEEP_CSRC_DIRS)


def repack(wheel: Path) -> tuple[int, int]:
    """Rewrite `wheel` in place without the trimmed members, with a RECORD that lists what is left."""
    tmp = wheel.with_suffix(".tmp")
    kept = dropped = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        for info in src.infolist():
            if info.filename == record_name:
                continue
            if trimmed(info.filename):
                dropped += 1
                continue
            data = src.read(info)
            dst.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{info.filename},sha256={digest},{len(data)}")
            kept += 1
        dst.writestr(record_name, "\n".join(rows + [f"{record_name},,"]) + "\n")
    tmp.replace(wheel)
    return kept, dropped


def download(dest: Path, spec: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", str(dest), spec]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", default=".gpu_wheels")
    args = ap.parse_args()
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for spec in WHEELS:
        name = spec.split("==")[0].replace("-", "_")
        if not list(dest.glob(f"{name}-{spec.split('==')[1]}-*.whl")):
            download(dest, spec)
    fi = next(dest.glob("flashinfer_python-*.whl"))
    if fi.stat().st_size > 40 << 20:
        kept, dropped = repack(fi)
        print(f"{fi.name}: kept {kept} files, dropped {dropped} (sources the paged FA2 kernels never read)")
    total = sum(p.stat().st_size for p in dest.glob("*.whl"))
    for p in sorted(dest.glob("*.whl")):
        print(f"{p.stat().st_size / 2**20:7.1f} MiB  {p.name}")
    print(f"{total / 2**20:7.1f} MiB  in {dest}")
    if total > 48 << 20:
        sys.exit(f"{dest} holds {total / 2**20:.0f} MiB: over the 48 MiB left for wheels in a 64 MiB working tree")


if __name__ == "__main__":
    main()
