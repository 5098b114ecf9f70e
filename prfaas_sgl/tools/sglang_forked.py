"""`python -m sglang.launch_server` with its scheduler and detokenizer processes forked, not spawned.

SGLang 0.5.23 forces the `spawn` start method (entrypoints/engine.py), so each of a server's two child
processes imports SGLang, torch and transformers again: ~17 s of CPU each, on top of the HTTP process's
own import. On a 2-core test machine that starts ~55 servers per CI run, those imports are most of every
server start (measured one server at a time, 13:33-13:36 UTC, load 7.6 -> 3.5: tiny-llama healthy after 60.3 s
spawned vs 22.6 s forked, the hybrid GDN model 52.1 s vs 21.7 s, the same greedy tokens). Forked children
inherit the imported modules.

For test servers only (ServerSpec.fork_children; tests/sglang/conftest.py FORKED names the modules whose
servers use it): the parent has started threads by the time it launches its children (the PD bootstrap
server among them), which fork does not carry over, and state picked at import before SGLang's launch set
its environment stays as picked (prometheus_client's, re-picked below); SGLang was not written for that, so
deployments keep its spawn.
"""
from __future__ import annotations

import multiprocessing
import os
import runpy
import sys


def _fork_instead(method: str | None = None, force: bool = False) -> None:
    multiprocessing.get_context("fork")  # fails loudly on a platform without fork
    _set_start_method("fork", force=True)


_set_start_method = multiprocessing.set_start_method


def _metrics_to_multiprocess_files() -> None:
    """prometheus_client picks its value class when first imported: in the parent, before SGLang set
    PROMETHEUS_MULTIPROC_DIR (engine.py `_set_envs_and_config`). A spawned child imports it again and writes
    its metrics to the multiprocess files the HTTP process's /metrics reads; a forked child must pick again,
    or its metrics stay in its own memory (test_prfaas_zmq's monitoring test saw no scheduler metric)."""
    values = sys.modules.get("prometheus_client.values")
    if values is not None:
        values.ValueClass = values.get_value_class()


def run(module: str) -> None:
    """Runs `module` as __main__ (as `python -m module` would) with every start method request turned into fork."""
    multiprocessing.set_start_method = _fork_instead
    os.register_at_fork(after_in_child=_metrics_to_multiprocess_files)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    run("sglang.launch_server")
