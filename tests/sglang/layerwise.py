"""Layer-group streaming over prfaas_zmq on a real PD pair: the prefill spec and the check, shared by
test_layerwise.py (dense Llama, GDN: a farm of their own) and test_families.py (KDA + MLA, SWA + GQA: a
layer-wise prefill added to the family farm, next to its chunk-path prefill, using its decode and colocated
reference, so those families start one server for it instead of three).

A long prompt's K/V leaves group by group while later layers compute, and the decode's greedy tokens equal
a colocated server's; a prompt under the minimum keeps the chunk path. Layer-wise really happened: the
prefill's transport stats (`layerwise`) count the gates its forward hooks opened inside a forward, and the
group sends staged while that forward still ran."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from prfaas_sgl.tools.launch import ServerSpec, free_port

from .conftest import spec
from .pd import generate_body, pd_generate, post
from .prompts import prompt_ids

NEW = 8
CHUNK = 192  # a multiple of every page size (SGLang requires it)
LONG, SHORT = 1100, 120  # LONG streams (>= MIN_TOKENS) in 6 chunks, the last one ending mid-page; SHORT does not
MIN_TOKENS = 600
ZMQ = ("--prfaas-zmq-timeout-s", "120", "--prfaas-zmq-chunk-bytes", "65536")
FULL_ATTENTION_LAYERS = 2  # every tiny family has 2; one group per layer (layers-per-group 1)


def prefill_spec(log_dir: Path, name: str, model: str, page: int, stats_port: int) -> ServerSpec:
    """A prfaas_zmq prefill that streams prompts >= MIN_TOKENS layer by layer, with its stats on `stats_port`."""
    layerwise = ("--prfaas-layerwise-layers-per-group", "1", "--prfaas-layerwise-min-tokens", str(MIN_TOKENS))
    return spec(log_dir, name, model, mode="prefill", transfer_backend="prfaas_zmq", bootstrap_port=free_port(),
                chunked_prefill_size=CHUNK, page_size=page,
                extra_args=ZMQ + layerwise + ("--prfaas-zmq-stats-port", str(stats_port)))


def counters(stats_url: str) -> dict[str, int]:
    with urllib.request.urlopen(stats_url, timeout=10) as r:
        return json.loads(r.read()).get("layerwise", {})


def check_layerwise(name: str, path: str, prefill, decode, colocated, stats_url: str, page: int) -> None:
    """SHORT then LONG through `prefill` (layer-wise) and `decode`: greedy tokens == `colocated`'s; LONG
    opened every group's gate inside its forwards and streamed every page once, SHORT streamed nothing."""
    before = counters(stats_url)
    for length in (SHORT, LONG):
        body = generate_body(prompt_ids(path, length, seed=length), NEW)
        reference = post(colocated.url + "/generate", body)["output_ids"]
        out = pd_generate(prefill.url, decode.url, prefill.spec.bootstrap_port, body)
        assert out.get("output_ids") == reference, (name, length, out)
        after = counters(stats_url)
        grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        if length == SHORT:
            assert not any(grew.values()), (name, "a short prompt streamed", grew)
            continue
        chunks = -(-LONG // CHUNK)
        assert grew.get("gates_opened_in_forward", 0) == chunks * FULL_ATTENTION_LAYERS, (name, grew)
        assert grew.get("gates_opened_after_forward", 0) == 0, (name, grew)
        assert grew.get("pages_streamed", 0) == -(-LONG // page), (name, grew)
        print(f"{name}: {grew}")
    log = Path(prefill.spec.log_path).read_text(errors="replace")
    assert "layer-wise: " in log and "streaming off" not in log, name
