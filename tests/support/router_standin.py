"""Stand-in SGLang prefill/decode servers for tests and router benchmarks (no model, no GPU).

They speak the PD protocol shape the router relies on: prefill answers after ``delay_s`` and then "hands
over" the KV by setting the request's ``bootstrap_room`` on a shared ``RoomBoard``; decode waits for that
room (as a real decode waits for its KV transfer) and then answers or streams ``n_chunks`` SSE events.
Every received body is kept in ``received`` so tests can compare what prefill and decode got.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

Fail = Literal["none", "http500", "drop", "hang"]


@dataclass(slots=True)
class RoomBoard:
    """bootstrap_room -> event set when the prefill side finished (the KV "arrived")."""

    rooms: dict[int, asyncio.Event] = field(default_factory=dict)

    def event(self, room: int) -> asyncio.Event:
        return self.rooms.setdefault(room, asyncio.Event())


def _chat_chunk(i: int, text: str, finish: str | None) -> dict[str, Any]:
    delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
    return {"id": "standin", "object": "chat.completion.chunk", "created": int(time.time()), "model": "standin",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _completion_chunk(text: str, finish: str | None) -> dict[str, Any]:
    return {"id": "standin", "object": "text_completion", "created": int(time.time()), "model": "standin",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}


def _final(path: str, text: str, n: int) -> dict[str, Any]:
    if path == "/generate":
        return {"text": text, "meta_info": {"completion_tokens": n, "finish_reason": {"type": "length"}}}
    usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
    if path == "/v1/chat/completions":
        msg = {"role": "assistant", "content": text}
        return {"id": "standin", "object": "chat.completion", "created": 0, "model": "standin",
                "choices": [{"index": 0, "message": msg, "finish_reason": "length"}], "usage": usage}
    return {**_completion_chunk(text, "length"), "usage": usage}


def _event(path: str, i: int, n: int) -> dict[str, Any]:
    finish = "length" if i == n - 1 else None
    if path == "/v1/chat/completions":
        return _chat_chunk(i, f"t{i} ", finish)
    if path == "/v1/completions":
        return _completion_chunk(f"t{i} ", finish)
    return {"text": "".join(f"t{j} " for j in range(i + 1)), "meta_info": {"completion_tokens": i + 1}}


class Standin:
    """One stand-in server. ``role`` is "prefill" or "decode"; ``fail`` injects a failure on generation."""

    def __init__(self, role: str, board: RoomBoard, delay_s: float = 0.0, n_chunks: int = 4,
                 kv_wait_s: float = 30.0, keep_bodies: bool = True) -> None:
        self.role, self.board, self.delay_s, self.n_chunks = role, board, delay_s, n_chunks
        self.kv_wait_s, self.keep_bodies = kv_wait_s, keep_bodies
        self.fail: Fail = "none"
        self.healthy = True
        self.received: list[dict[str, Any]] = []
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application()
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/loads", self.loads)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        self.url = f"http://{host}:{self.runner.addresses[0][1]}"
        return self.url

    async def close(self) -> None:
        await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok", status=200 if self.healthy else 503)

    async def loads(self, request: web.Request) -> web.Response:
        return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0,
                                             "num_waiting_uncached_tokens": 0, "num_used_tokens": 0}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.keep_bodies:
            self.received.append(body)
        if self.fail == "http500":
            return web.json_response({"error": {"message": "injected", "type": "server_error"}}, status=500)
        if self.fail == "drop":
            request.transport.close()
            return web.Response()
        if self.fail == "hang":
            await asyncio.sleep(3600)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.role == "prefill":
            self.board.event(body["bootstrap_room"]).set()
            return web.json_response(_final(request.path, "", 1))
        return await self._decode(request, body)

    async def _decode(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        room = body["bootstrap_room"]
        try:
            await asyncio.wait_for(self.board.event(room).wait(), self.kv_wait_s)
        except asyncio.TimeoutError:
            return web.json_response({"error": {"message": "KV transfer timed out"}}, status=500)
        finally:
            self.board.rooms.pop(room, None)
        path, n = request.path, self.n_chunks
        if not body.get("stream"):
            return web.json_response(_final(path, "".join(f"t{i} " for i in range(n)), n))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(n):
            await out.write(b"data: " + json.dumps(_event(path, i, n)).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


TINY_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TINY_CORPUS = ["the quick brown fox jumps over the lazy dog", "prefill as a service moves long prompts",
               "short requests stay on the local cluster", "hello world, how are you today?"]


def build_tiny_tokenizer(directory: str) -> str:
    """Write a byte-level BPE tokenizer.json + tokenizer_config.json (with a chat template) to ``directory``."""
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TINY_CORPUS, trainer)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TINY_TEMPLATE}
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(root)
