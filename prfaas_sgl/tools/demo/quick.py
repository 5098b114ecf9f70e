"""`make demo`: a real SGLang server on CPU with the prfaas plugin loaded, one chat request, timings.

    python -m prfaas_sgl.tools.demo [--model tiny-qwen35-hybrid]
"""
from __future__ import annotations

import argparse
import json
import time
import urllib.request

from prfaas_sgl.tools.launch import SGLangServer, ServerSpec, free_port
from prfaas_sgl.tools.models.tiny import SPECS, ensure


def chat_stream(url: str, text: str, max_tokens: int = 24) -> tuple[str, float, float]:
    """Returns (answer, ttft_s, total_s) from an OpenAI-style streaming chat request."""
    body = {"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    t0, ttft, parts = time.monotonic(), None, []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            delta = json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
            if delta and ttft is None:
                ttft = time.monotonic() - t0
            parts.append(delta)
    return "".join(parts), ttft or 0.0, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny-qwen35-hybrid", choices=sorted(SPECS))
    args = ap.parse_args(argv)
    path = ensure(args.model)
    spec = ServerSpec(model_path=str(path), port=free_port(), log_path="out/demo-server.log",
                      extra_args=("--prfaas-role", "local"))
    print(f"[demo] model {args.model} ({path})")
    print(f"[demo] starting SGLang on CPU at {spec.url} (log: {spec.log_path}) ...", flush=True)
    t0 = time.monotonic()
    with SGLangServer(spec) as srv:
        print(f"[demo] server healthy after {time.monotonic() - t0:.1f}s", flush=True)
        question = "What does a prefill cluster send to a decode cluster?"
        answer, ttft, total = chat_stream(srv.url, question)
        print(f"[demo] user: {question}")
        print(f"[demo] assistant (tiny random-weight model, so the words are noise): {answer!r}")
        print(f"[demo] TTFT {ttft * 1000:.0f} ms, total {total * 1000:.0f} ms")
    print("[demo] server stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
