"""The run half of the GPU check: everything our code does only on CUDA, in one command of ~6 minutes, on a
machine that has torch but no SGLang and no network (the wheels come from `scripts/gpu_check.sh prepare`).

Sections, each a child process with its own time limit, so a CUDA fault in one cannot hide the others:
  env            python, torch, CUDA, the card (nvidia-smi), the carried wheels import
  attention      started first, in the background (FlashInfer JIT-builds its kernels on the CPUs while
                 `transport` runs; the benchmarks wait for both, so their CPUs are quiet):
                 the FlashInfer kernel tests (tests/fast/test_kernels_paged_attention.py: prefill and decode
                 vs the torch reference, pool views) and FlashInfer reading the unified slab's strided K/V
                 views as SGLang's flashinfer backend calls it (tests/gpu/test_slab_devices.py)
  transport      the staged path between CUDA pools (tests/gpu/: packed and strided/slab, page sizes 1 and
                 64, state byte runs, GPU<->host both ways, corrupt chunk, abort, goodput beside matmuls,
                 layer-group sends gated on a forward stream's events)
  cachepool      scripts/bench_cachepool_device.py: the pool's operations at 500K/2M slots, host vs CUDA blocks
  send_path      scripts/bench_send_device.py: the send path on CUDA pools vs host pools
  paged_bench    scripts/bench_paged_attention.py on CUDA (reuses the kernels `attention` built)
Writes gpu_check.json (one entry per section: rc, seconds, pytest summary or the bench's JSON) and
gpu_check.log (every child's output) into --out. Without a CUDA device it says so and stops (exit 0).

Run (on the GPU machine, after the wheels are installed): bash scripts/gpu_check.sh run
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = "no CUDA device: nothing here for the GPU check to run (dry run ends)"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--import-mode=importlib",
          f"--rootdir={ROOT}", "--timeout=240"]
ENV_PROBE = """
import json, subprocess, sys, torch
out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
       "device": torch.cuda.get_device_name(0), "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
       "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                    "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
for mod in ("zmq", "msgspec", "xxhash", "tvm_ffi", "flashinfer"):
    try:
        m = __import__(mod)
        out[mod] = getattr(m, "__version__", "ok")
    except Exception as e:
        out[mod] = f"FAILED: {type(e).__name__}: {e}"
print(json.dumps(out))
"""


def package_links(dest: Path) -> Path:
    """`prfaas_sgl` as setup.py installs it (its ROOTS map router/, cachepool/, kernels/, ... into the
    namespace), as a tree of links to this checkout: no build step, and the tests run the working tree."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    roots = next(ast.literal_eval(n.value) for n in tree.body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "ROOTS")
    pkg = dest / "prfaas_sgl"
    pkg.mkdir(parents=True)
    for entry in (ROOT / roots["prfaas_sgl"]).iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name, path in roots.items():
        if name != "prfaas_sgl":
            (pkg / name.split(".", 1)[1]).symlink_to(ROOT / path)
    return dest


def child_env(links: Path, workspace: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(links), *filter(None, [env.get("PYTHONPATH")]), str(ROOT)])
    env["PYTHONSAFEPATH"] = "1"  # the checkout's own prfaas_sgl/ (without router/, cachepool/...) must not shadow
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("FLASHINFER_WORKSPACE_BASE", str(workspace))  # JIT cache
    env.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")  # H100/H200: build for this card only
    return env


class Section:
    def __init__(self, name: str, cmd: list[str], limit_s: int, env: dict, out: Path, result: Path | None = None):
        self.name, self.cmd, self.limit_s, self.result = name, cmd, limit_s, result
        self.log = out / f"{name}.out"
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self) -> dict:
        try:
            rc = self.proc.wait(max(1.0, self.limit_s - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            rc = self.proc.wait()
            rc = f"killed after {self.limit_s} s"
        text = self.log.read_text(errors="replace")
        with (self.log.parent / "gpu_check.log").open("a") as log:  # one log: the tool brings back 8 files
            log.write(f"===== {self.name} (rc {rc}, {time.monotonic() - self.t0:.0f} s)\n{text}\n")
        self.log.unlink()
        print(f"[gpu_check] {self.name}: rc {rc} after {time.monotonic() - self.t0:.0f} s", flush=True)
        entry = {"rc": rc, "seconds": round(time.monotonic() - self.t0, 1), "command": " ".join(self.cmd[1:])}
        summary = re.findall(r"^=*\s*(\d+ (?:passed|failed|error).*?)\s*=*$", text, re.M)
        if summary:
            entry["pytest"] = summary[-1]
            entry["failures"] = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)[:20]
        if self.result is not None and self.result.exists():
            entry["result"] = json.loads(self.result.read_text())
        elif self.name == "env" and rc == 0:
            entry["result"] = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
        else:
            entry["tail"] = text.strip().splitlines()[-8:]
        return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT", "out/gpu_check"))
    ap.add_argument("--quick", action="store_true", help="smaller benchmarks (a rerun with little time left)")
    ap.add_argument("--only", nargs="+", help="run only these sections (env always runs)")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": _commit()}
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA)
        report["cuda"] = False
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    env = child_env(package_links(scratch / "links"), scratch / "flashinfer")
    py, sizes = sys.executable, (["--kv-tokens", "500000"] if args.quick else ["--kv-tokens", "500000", "2000000"])
    report["sections"] = {"env": Section("env", [py, "-c", ENV_PROBE], 60, env, out).wait()}
    # FlashInfer's JIT builds keep the CPUs busy: the correctness tests overlap them, the benchmarks wait.
    want = set(args.only or ["transport", "attention", "cachepool", "send_path", "paged_bench"])
    bg = Section("attention", PYTEST + ["-n", "8", "tests/fast/test_kernels_paged_attention.py",
                                        "tests/gpu/test_slab_devices.py"], 300, {**env, "MAX_JOBS": "2"}, out) if "attention" in want else None
    if "transport" in want:
        report["sections"]["transport"] = Section("transport", PYTEST + [
            "tests/gpu/test_staging_gpu.py", "tests/gpu/test_transport_devices.py",
            "tests/gpu/test_layer_groups_devices.py"], 150, env, out).wait()
        _save(out, report)
    if bg is not None:
        report["sections"]["attention"] = bg.wait()
        _save(out, report)
    benches = [
        ("cachepool", [py, "scripts/bench_cachepool_device.py", *sizes, "--devices", "cpu", "cuda"], 100),
        ("send_path", [py, "scripts/bench_send_device.py", "--devices", "cpu", "cuda", "--tokens", "4096", "16384"], 100),
        ("paged_bench", [py, "scripts/bench_paged_attention.py", "--device", "cuda", "--head-dim", "128"], 60),
    ]
    for name, cmd, limit in [b for b in benches if b[0] in want]:
        result = out / f"{name}.json"
        report["sections"][name] = Section(name, cmd + ["--out", str(result)], limit, env, out, result).wait()
        _save(out, report)
    bad = [n for n, s in report["sections"].items() if s["rc"] != 0]
    print(json.dumps({n: {k: s.get(k) for k in ("rc", "seconds", "pytest", "failures")} for n, s in report["sections"].items()},
                     indent=1))
    print("GPU check:", "all sections passed" if not bad else f"sections failed: {bad}")
    return 1 if bad else 0


def _commit() -> str:
    # GPU_CHECK_COMMIT first: a `git archive` snapshot has no .git, so git answers for whatever repository
    # encloses the copy on the device machine (its metadata was stale there: it named an old commit)
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() or "unknown"
    except OSError:  # no git on the machine
        return "unknown"


def _save(out: Path, report: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
