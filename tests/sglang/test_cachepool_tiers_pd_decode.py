"""prfaas_hybrid's tiers on a PD decode server, real CPU SGLang servers (tiny GDN hybrid), prfaas_zmq:

- a decode with a 1,024-token device pool and a host tier: a prompt its device pool evicted is loaded back
  from the host tier when it comes again with an extension; the decode's hit (decode_prefix_len) covers it,
  and the prefill sends only the KV past it (its transport's byte counter);
- a decode with a file tier only: the stored entries are read ahead by the prefetch worker from the
  request's arrival; a corrupt one is refused (counted, removed), the hit ends at the block before it, and
  the prefill sends the rest.
Sent bytes follow bytes = k * (prompt - decode hit) + c exactly (test_cachepool_pd.py), with k and c fitted
on two cold prompts; a decode without a tier would have hit 0 on the evicted prompt: k * prompt + c.
Greedy tokens equal a colocated server with prefix caching off on every prompt; pool integrity is checked
after every release (PRFAAS_CACHEPOOL_CHECK=1)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from prfaas_sgl.cachepool.hashing import block_hashes
from prfaas_sgl.tools.launch import free_port

from .conftest import HYBRID, farm_for, reference_spec, spec
from .pd import generate_body, pd_generate, post
from .prompts import prompt_ids
from .scrape import acked_bytes, settled_bytes, stats_url_of, wait_metric

pytestmark = pytest.mark.sglang
BS = 16  # the decode cache's index block
NEW = 8
ZMQ = ("--prfaas-zmq-timeout-s", "120")
CHECK = {"PRFAAS_CACHEPOOL_CHECK": "1"}
# SGLang reserves 512 decode tokens per admitted request by default: a 600-token prompt would never fit a
# 1,024-token pool (the request waits in the prealloc queue for good); 8 new tokens need far fewer
DECODE = ("--radix-cache-backend", "prfaas_hybrid", "--enable-cache-report", "--enable-metrics",
          "--disaggregation-decode-enable-radix-cache", "--num-reserved-decode-tokens", "64")
LENGTHS = (600, 560, 640)  # three cold prompts: 1,800 tokens through a 1,024-token decode pool


def _specs(log_dir):
    store = log_dir / "decode-store"
    store.mkdir(mode=0o700, exist_ok=True)
    stats = free_port()
    decode = dict(mode="decode", transfer_backend="prfaas_zmq", max_running_requests=1, env=CHECK,
                  max_total_tokens=1024, max_mamba_slots=8)
    return {
        "prefill": spec(log_dir, "tiers-dec-prefill", HYBRID, mode="prefill", transfer_backend="prfaas_zmq",
                        bootstrap_port=free_port(), chunked_prefill_size=64, max_total_tokens=4096,
                        max_mamba_slots=24, extra_args=ZMQ + ("--radix-cache-backend", "prfaas_hybrid",
                                                              "--prfaas-zmq-stats-port", str(stats))),
        "host": spec(log_dir, "tiers-dec-host", HYBRID, **decode,
                     extra_args=ZMQ + DECODE + ("--prfaas-tier-host-bytes", str(64 << 20))),
        "file": spec(log_dir, "tiers-dec-file", HYBRID, **decode,
                     extra_args=ZMQ + DECODE + ("--prfaas-tier-storage", "file", "--prfaas-tier-storage-path",
                                                str(store))),
        "nocache": reference_spec(log_dir, HYBRID),
    }


farm = farm_for(_specs, shared=("nocache",))


def _pd(farm, decode: str, ids: list[int]) -> tuple[dict, int]:
    """(decode's answer, bytes the prefill sent for it); tokens checked against the no-cache server."""
    p = farm["prefill"]
    url = stats_url_of(p)
    before = acked_bytes(url)
    out = pd_generate(p.url, farm[decode].url, p.spec.bootstrap_port, generate_body(ids, NEW))
    assert "output_ids" in out and not out.get("error"), out
    assert out["output_ids"] == post(farm["nocache"].url + "/generate", generate_body(ids, NEW))["output_ids"]
    return out, settled_bytes(url, before) - before


def _cold(farm, decode: str, path: str, seed: int) -> tuple[list[list[int]], int, int]:
    """Three distinct prompts through `decode` (the first is evicted from its device pool by the other two);
    returns them and the byte model (k per sent token, c per request) fitted on the first two, checked on
    the third."""
    prompts = [prompt_ids(path, n, seed=seed + i) for i, n in enumerate(LENGTHS)]
    sent = [_pd(farm, decode, ids)[1] for ids in prompts]
    k = (sent[0] - sent[1]) // (LENGTHS[0] - LENGTHS[1])
    c = sent[0] - LENGTHS[0] * k
    assert k > 0 and c > 0 and sent[2] == LENGTHS[2] * k + c, sent
    return prompts, k, c


def _log(farm, name: str) -> str:
    return Path(farm[name].log_path).read_text(errors="replace")


def test_a_prefix_the_decode_evicted_comes_back_from_its_host_tier_and_is_not_sent_again(farm, model_paths):
    path = model_paths["hybrid"]
    prompts, k, c = _cold(farm, "host", path, seed=2800)
    again = prompts[0] + prompt_ids(path, 20, seed=2850)
    out, sent = _pd(farm, "host", again)
    hit = len(prompts[0]) // BS * BS  # the prompt's 37 whole blocks (592 of 600 tokens)
    assert sent == (len(again) - hit) * k + c, (sent, k, c)
    assert sent < len(again) * k + c - 500 * k  # what a decode without the tier (hit 0) makes it send
    log = _log(farm, "host")
    m = re.search(r"hit extended from (\d+) to 592 tokens \(.*host_hits=(\d+)", log)
    assert m and int(m.group(2)) == (592 - int(m.group(1))) // BS, m
    assert wait_metric(farm["host"].url, "prfaas_tier_hits_total", 1, tier="host") >= int(m.group(2))
    assert out["meta_info"]["cached_tokens"] >= hit
    assert "AssertionError" not in log and log.count("prfaas_hybrid integrity ok") >= 4


def test_a_corrupt_stored_entry_on_decode_is_refused_and_the_prefill_sends_it(farm, model_paths):
    path = model_paths["hybrid"]
    prompts, k, c = _cold(farm, "file", path, seed=2900)
    store = Path(farm["file"].spec.extra_args[farm["file"].spec.extra_args.index("--prfaas-tier-storage-path") + 1])
    bad = 10  # block 10 of the evicted prompt: the hit must end at 160 tokens
    h = block_hashes(prompts[0], BS, 0)[bad]
    (entry,) = store.glob(f"*-kv-{h:016x}*.bin")
    blob = bytearray(entry.read_bytes())
    blob[-5] ^= 0x40  # a payload byte: the CRC no longer matches
    entry.write_bytes(bytes(blob))
    again = prompts[0] + prompt_ids(path, 20, seed=2950)
    _, sent = _pd(farm, "file", again)
    assert sent == (len(again) - bad * BS) * k + c, (sent, k, c)
    log = _log(farm, "file")
    m = re.search(r"hit extended from (\d+) to 160 tokens \(.*storage_hits=(\d+).*corrupt=1", log)
    assert m and int(m.group(2)) == (160 - int(m.group(1))) // BS, m
    # read on the prefetch worker from the request's arrival (DecodePreallocQueue.add), refused there
    assert re.search(r"tier prefetch for \S+: 10 entries staged in [\d.]+ ms \(ended: refused\)", log)
    assert not entry.exists()  # the refused entry was removed from the store
    assert "AssertionError" not in log
