"""Minimal SGLang PD client for tests: the same body to prefill and decode, as SGLang's PD protocol wants."""
from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request


def post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"http_status": e.code, "error": e.read().decode(errors="replace")}


def generate_body(input_ids: list[int], max_new_tokens: int) -> dict:
    return {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    }


def pd_generate(prefill_url: str, decode_url: str, bootstrap_port: int, body: dict,
                host: str = "127.0.0.1", timeout: float = 300.0) -> dict:
    """Posts to both servers at once; returns decode's response (prefill's is in ['prefill'])."""
    pd_body = {**body, "bootstrap_host": host, "bootstrap_port": bootstrap_port,
               "bootstrap_room": random.getrandbits(63)}
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(prefill=post(prefill_url + "/generate", pd_body, timeout)))
    t.start()
    result = post(decode_url + "/generate", pd_body, timeout)
    t.join(timeout)
    result["prefill"] = out.get("prefill")
    return result
