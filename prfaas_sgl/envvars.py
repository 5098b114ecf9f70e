"""Every environment variable our code reads: its name, what unset means, what it does, and who reads it.

Settings belong in flags (one frozen config per process); the environment carries only what cannot travel
as a flag: secrets kept out of argv (`ps` shows argv), switches read before any flag is parsed (interpreter
start, SGLang's own variables), test hooks, and what a Kubernetes pod is told about itself.
tests/fast/test_envvars.py fails when code in prfaas_sgl/, router/, cachepool/ or kernels/ reads a variable
missing here, or when a reader listed here no longer reads it. Nothing imports this module at run time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    unset: str  # what the reader does when the variable is absent
    meaning: str
    readers: tuple[str, ...]  # repository paths of the modules that read it


REGISTRY: tuple[EnvVar, ...] = (
    EnvVar("PRFAAS_ROUTER_ADMIN_TOKEN", "--admin-token or the --config file decides (without a token, /admin/* "
           "answers on a loopback listener only)",
           "Bearer token for the router's /admin/*, when neither the flag nor the file gives one. `prfaas up` "
           "passes it on from its own environment; a Kubernetes router gets it from a Secret.",
           ("router/config.py",)),
    EnvVar("PRFAAS_SUPERVISOR_TOKEN", "--supervisor-token decides; a supervisor then listens on loopback only",
           "Key the router signs supervisor requests with (one value, or URL=TOKEN pairs), set on every machine: "
           "`prfaas up` hands this machine's to its supervisor and checks the router's before starting.",
           ("router/config.py", "prfaas_sgl/tools/deploy/up.py")),
    EnvVar("PRFAAS_K8S_NAMESPACE", "required unless the K8s actuator is given a namespace (KeyError)",
           "Namespace of the two server Deployments the router's Kubernetes actuator scales; the rendered "
           "router Deployment sets it from the pod's own namespace.",
           ("router/actuators/k8s.py",)),
    EnvVar("PRFAAS_ZMQ_FAULTS", "no faults",
           "Test hook: comma-separated faults a prfaas_zmq sender or receiver injects, e.g. corrupt_chunk=40 or "
           "slow_receiver=0.01; a bad entry stops the server at start-up.",
           ("prfaas_sgl/srt/backend/settings.py",)),
    EnvVar("PRFAAS_CACHEPOOL_CHECK", "off",
           "1: the prfaas_hybrid cache runs check_integrity() after every release (debugging, O(pool)).",
           ("prfaas_sgl/srt/cachepool_backend/config.py",)),
    EnvVar("PRFAAS_SGL_KERNEL_SHIM", "auto: the CPU stand-in serves sgl_kernel only if the real one fails to "
           "import", "off / 0 / false: never install the sgl_kernel stand-in (read at interpreter start).",
           ("prfaas_sgl/srt/cpu/shim.py",)),
    EnvVar("SGLANG_USE_CPU_ENGINE", "GPU engine",
           "SGLang's switch to its CPU engine; 1 also makes the plugin install its CPU fixes and the "
           "interpreter-start hook refuse CUDA-only libraries (srt/cpu/cuda_only.py).",
           ("prfaas_sgl/srt/compat.py", "prfaas_sgl/srt/cpu/cuda_only.py")),
    EnvVar("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "SGLang's default, 300 s",
           "SGLang's decode waiting timeout; a prfaas_zmq prefill keeps a room (and its peer's registration) "
           "this long plus the bootstrap timeout.",
           ("prfaas_sgl/srt/backend/prefill.py",)),
    EnvVar("PROMETHEUS_MULTIPROC_DIR", "no /metrics export: the tier counters stay in the log line",
           "prometheus_client's multiprocess directory, which SGLang sets with --enable-metrics before its "
           "schedulers start; the tier counters register with it only then (tier_metrics.exported).",
           ("prfaas_sgl/srt/cachepool_backend/tier_metrics.py",)),
    EnvVar("PRFAAS_MODEL_CACHE", "~/.cache/prfaas-sgl/models",
           "Where the tiny test models are built and kept (tools/models/tiny.py).",
           ("prfaas_sgl/tools/models/tiny.py",)),
)

BY_NAME = {v.name: v for v in REGISTRY}
