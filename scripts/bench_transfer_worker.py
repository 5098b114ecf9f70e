"""One side of scripts/bench_transfer.py, run as a subprocess (maybe inside a network namespace).

Reads JSON commands on stdin, answers one JSON line each on stdout. CPU time is process-wide
(`time.process_time`, all threads: ZeroMQ I/O threads and Mooncake workers included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import numpy as np
import xxhash

from _legacy_regions import Region, item_regions  # Mooncake's raw addresses and the digests
from prfaas_sgl.transfer import TransferConfig, kv_layout
from prfaas_sgl.transfer.config import PeerInfo
from prfaas_sgl.transfer.items import ItemBatch, Items
from prfaas_sgl.transfer.layout import MemoryLayout

MIB = 1 << 20


@dataclass(frozen=True)
class Payload:
    """One request's KV as prefill produces it: `pieces` chunked-prefill pieces of pages, then tail."""

    layout: MemoryLayout
    pages: int
    pieces: int

    @staticmethod
    def named(name: str) -> "Payload":
        if name == "hybrid":
            # 1T Kimi-Linear-like (paper-notes §3): S_kv ≈ 172 MiB fixed + 17.1 KB/token. 15 MLA layers ×
            # 64 tokens × 576 dims × 2 B = 73,728 B per page (≈ 17.3 KB/token); 46 KDA layers share 172 MiB
            # of state. 8K tokens = 128 pages ≈ 307 MiB, sent as 4 pieces of 2K tokens + states + aux.
            lay = kv_layout(15, 73_728, 160, state_bytes=[172 * MIB // 46] * 46, num_slots=1,
                            aux_bytes=4096, num_aux=2)
            return Payload(_mla(lay), 128, 4)
        if name == "dense":
            # Qwen3-235B-like GQA: 94 layers × K,V × 4 heads × 128 dims × 2 B = 192 KB/token, 1.5K tokens
            return Payload(kv_layout(94, 65_536, 32, aux_bytes=4096, num_aux=2), 24, 3)
        raise ValueError(f"unknown payload {name!r}: use hybrid or dense")

    def src_pages(self) -> list[int]:
        return list(range(self.pages))  # a fresh prefill pool: contiguous

    def dst_pages(self) -> list[int]:
        pool = self.layout.buffers[0].num_items
        return [int(p) for p in np.random.default_rng(0).permutation(pool)[: self.pages]]  # fragmented

    def piece_regions(self, pages: list[int], slot: int, aux: int) -> list[list[Region]]:
        kv = self.layout.ids_of("kv")
        step = -(-self.pages // self.pieces)
        out = [item_regions(self.layout, kv, pages[i: i + step]) for i in range(0, self.pages, step)]
        out[-1] += item_regions(self.layout, self.layout.ids_of("state"), [slot]) if self.layout.ids_of(
            "state") else []
        out[-1] += item_regions(self.layout, self.layout.ids_of("aux"), [aux])
        return out

    def piece_batches(self, pages: list[int], slot: int, aux: int) -> list[ItemBatch]:
        """The same pieces as item ids, what prfaas_zmq's transport moves."""
        kv, state, aux_ids = (tuple(self.layout.ids_of(k)) for k in ("kv", "state", "aux"))
        step = -(-self.pages // self.pieces)
        out = [[Items(kv, np.array(pages[i: i + step]))] for i in range(0, self.pages, step)]
        out[-1] += [Items(state, np.array([slot]))] if state else []
        out[-1].append(Items(aux_ids, np.array([aux])))
        return [ItemBatch(tuple(groups)) for groups in out]

    def whole_batch(self, pages: list[int], slot: int, aux: int) -> ItemBatch:
        """Every piece's items at once (a receiver expects each buffer in one group)."""
        groups = [g for b in self.piece_batches(pages, slot, aux) for g in b.groups]
        merged: dict[tuple[int, ...], list[int]] = {}
        for g in groups:
            merged.setdefault(g.buffer_ids, []).extend(g.index.tolist())
        return ItemBatch(tuple(Items(ids, np.array(index)) for ids, index in merged.items()))

    @property
    def nbytes(self) -> int:
        return sum(r.length for p in self.piece_regions(self.src_pages(), 0, 0) for r in p)


def _mla(lay: MemoryLayout) -> MemoryLayout:
    """kv_layout makes K and V buffers per layer; MLA has one latent buffer per layer: keep half."""
    kv = [b for b in lay.buffers if b.kind == "kv"]
    return MemoryLayout(tuple(kv[: len(kv) // 2]) + tuple(b for b in lay.buffers if b.kind != "kv"))


class Arena:
    """All buffers of a layout carved from one allocation (one Mooncake registration)."""

    def __init__(self, layout: MemoryLayout, fill_seed: int | None) -> None:
        self.offsets, pos = [], 0
        for b in layout.buffers:
            self.offsets.append(pos)
            pos += b.nbytes
        if fill_seed is None:
            self.mem = np.zeros(pos, np.uint8)
            self.mem.fill(1)  # touch every page now: a serving pool is resident, first-touch faults are not
            self.mem.fill(0)
        else:
            self.mem = np.frombuffer(bytearray(np.random.default_rng(fill_seed).bytes(pos)), np.uint8)
        self.views = [memoryview(self.mem)[o: o + b.nbytes] for o, b in zip(self.offsets, layout.buffers)]
        self.base = self.mem.ctypes.data

    def addr(self, r: Region) -> int:
        return self.base + self.offsets[r.buffer_id] + r.offset

    def digest(self, regions: list[Region]) -> str:
        h = xxhash.xxh3_64()
        for r in regions:
            h.update(self.views[r.buffer_id][r.offset: r.offset + r.length])
        return h.hexdigest()


def page_pairs(src: list[Region], dst: list[Region], item_len: dict[int, int]) -> list[tuple[Region, Region]]:
    """Split two equal-length region lists (same buffer order) into matching item-sized pieces."""
    def items(rs: list[Region]) -> list[Region]:
        return [Region(r.buffer_id, r.offset + k, item_len[r.buffer_id])
                for r in rs for k in range(0, r.length, item_len[r.buffer_id])]
    return list(zip(items(src), items(dst)))


class ZmqRecv:
    def __init__(self, p: Payload, host: str, keys_dir: str | None) -> None:
        from prfaas_sgl.transfer.receiver import ZmqReceiver
        self.p, self.arena = p, Arena(p.layout, None)
        cfg = TransferConfig(timeout_s=120)
        self.rx = {False: ZmqReceiver(p.layout, self.arena.views, cfg, host=host)}
        if keys_dir:
            self.rx[True] = ZmqReceiver(p.layout, self.arena.views, cfg.replace(keys_dir=keys_dir), host=host)
        self.dst = [r for piece in p.piece_regions(p.dst_pages(), 0, 1) for r in piece]
        self.batch = p.whole_batch(p.dst_pages(), 0, 1)

    def hello(self) -> dict:
        return {k: [a.address.host, a.address.port, a.address.server_key] for k, a in
                (("plain", self.rx[False]), ("curve", self.rx.get(True, self.rx[False])))}

    def expect(self, tid: int, curve: bool) -> dict:
        self.rx[curve].expect(tid, self.batch)
        return {}

    def wait(self, tid: int, curve: bool) -> dict:
        s = self.rx[curve].wait(tid, 120)
        return {"state": s.state.value, "reason": s.reason, "digest": self.arena.digest(self.dst)}


class ZmqSend:
    """One persistent ZmqSender per configuration, as a serving process keeps its links open."""

    def __init__(self, p: Payload, keys_dir: str | None) -> None:
        self.p, self.arena, self.keys_dir = p, Arena(p.layout, 1), keys_dir
        self.pieces = p.piece_regions(p.src_pages(), 0, 0)
        self.batches = p.piece_batches(p.src_pages(), 0, 0)
        self.senders: dict[tuple, object] = {}

    def send(self, tid: int, peer: list, connections: int, chunk_bytes: int, curve: bool,
             window_bytes: int) -> dict:
        from prfaas_sgl.transfer.sender import ZmqSender
        key = (connections, chunk_bytes, curve, window_bytes)
        if key not in self.senders:
            cfg = TransferConfig(connections=connections, chunk_bytes=chunk_bytes, timeout_s=120,
                                 window_bytes=window_bytes, keys_dir=self.keys_dir if curve else None)
            self.senders[key] = ZmqSender(self.p.layout, self.arena.views, cfg)
        return self._timed(self.senders[key], tid, PeerInfo(peer[0], peer[1], peer[2] if curve else None))

    def _timed(self, tx, tid: int, peer: PeerInfo) -> dict:
        t0, c0 = time.perf_counter(), time.process_time()
        for i, batch in enumerate(self.batches):
            tx.send(tid, peer, batch, last=i == len(self.batches) - 1)
        s = tx.wait(tid, 120)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        tx.release(tid)
        return {"state": s.state.value, "reason": s.reason, "wall": wall, "cpu": cpu,
                "digest": self.arena.digest([r for p in self.pieces for r in p])}

    def close(self) -> None:
        for tx in self.senders.values():
            tx.close()


class MooncakeRecv:
    def __init__(self, p: Payload, host: str) -> None:
        from mooncake.engine import TransferEngine
        self.p, self.arena = p, Arena(p.layout, None)
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake initialize failed")
        self.engine.register_memory(self.arena.base, self.arena.mem.nbytes)
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.dst = [r for piece in p.piece_regions(p.dst_pages(), 0, 1) for r in piece]

    def hello(self) -> dict:
        return {"session": self.session, "dst_pieces": [[list(vars_(r)) for r in piece] for piece in
                                                        self.p.piece_regions(self.p.dst_pages(), 0, 1)],
                "base": self.arena.base, "offsets": self.arena.offsets}

    def wait(self, tid: int, curve: bool) -> dict:
        return {"state": "done", "reason": "", "digest": self.arena.digest(self.dst)}


class MooncakeSend:
    def __init__(self, p: Payload, host: str) -> None:
        from mooncake.engine import TransferEngine
        self.p, self.arena = p, Arena(p.layout, 1)
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake initialize failed")
        self.engine.register_memory(self.arena.base, self.arena.mem.nbytes)
        self.pieces = p.piece_regions(p.src_pages(), 0, 0)

    def send(self, tid: int, peer: dict, **_: object) -> dict:
        item = {i: b.item_len for i, b in enumerate(self.p.layout.buffers)}
        batches = []
        for src, dst in zip(self.pieces, peer["dst_pieces"]):
            pairs = page_pairs(src, [Region(*d) for d in dst], item)
            batches.append(([self.arena.addr(s) for s, _ in pairs],
                            [peer["base"] + peer["offsets"][d.buffer_id] + d.offset for _, d in pairs],
                            [s.length for s, _ in pairs]))
        t0, c0 = time.perf_counter(), time.process_time()
        ret = 0
        for srcs, dsts, lens in batches:  # one synchronous batch per piece, as SGLang's mooncake sender
            ret = ret or self.engine.batch_transfer_sync_write(peer["session"], srcs, dsts, lens)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {"state": "done" if ret == 0 else "failed", "reason": f"ret={ret}", "wall": wall, "cpu": cpu,
                "digest": self.arena.digest([r for p in self.pieces for r in p])}


class TcpRecv:
    """Plain TCP reference (one connection, no framing): the ceiling of this path at this moment."""

    def __init__(self, p: Payload, host: str) -> None:
        import socket
        import threading
        self.p, self.arena, self._threading = p, Arena(p.layout, None), threading
        self.lsock = socket.create_server((host, 0))
        self.thread = None

    def hello(self) -> dict:
        return {"host": self.lsock.getsockname()[0], "port": self.lsock.getsockname()[1]}

    def expect(self, tid: int, curve: bool) -> dict:
        self.thread = self._threading.Thread(target=self._serve)
        self.thread.start()
        return {}

    def _serve(self) -> None:
        conn, _ = self.lsock.accept()
        with conn:
            view, got = memoryview(self.arena.mem)[: self.p.nbytes], 0
            while got < len(view):
                got += conn.recv_into(view[got:])
            conn.sendall(b"k")

    def wait(self, tid: int, curve: bool) -> dict:
        self.thread.join(120)
        digest = xxhash.xxh3_64(self.arena.mem[: self.p.nbytes]).hexdigest()
        return {"state": "done", "reason": "", "digest": digest}


class TcpSend:
    def __init__(self, p: Payload) -> None:
        self.p, self.arena = p, Arena(p.layout, 1)

    def send(self, tid: int, peer: dict, **_: object) -> dict:
        import socket
        t0, c0 = time.perf_counter(), time.process_time()
        with socket.create_connection((peer["host"], peer["port"])) as s:
            s.sendall(memoryview(self.arena.mem)[: self.p.nbytes])
            s.recv(1)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {"state": "done", "reason": "", "wall": wall, "cpu": cpu,
                "digest": xxhash.xxh3_64(self.arena.mem[: self.p.nbytes]).hexdigest()}


def vars_(r: Region) -> tuple[int, int, int]:
    return (r.buffer_id, r.offset, r.length)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", required=True,
                    choices=["zmq-recv", "zmq-send", "mc-recv", "mc-send", "tcp-recv", "tcp-send"])
    ap.add_argument("--payload", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--keys-dir", default=None)
    a = ap.parse_args()
    p = Payload.named(a.payload)
    side = {"zmq-recv": lambda: ZmqRecv(p, a.host, a.keys_dir), "zmq-send": lambda: ZmqSend(p, a.keys_dir),
            "mc-recv": lambda: MooncakeRecv(p, a.host), "mc-send": lambda: MooncakeSend(p, a.host),
            "tcp-recv": lambda: TcpRecv(p, a.host), "tcp-send": lambda: TcpSend(p)}[a.role]()
    _reply(side.hello() if hasattr(side, "hello") else {})
    mark = (0.0, 0.0)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            getattr(side, "close", lambda: None)()
            break
        if op == "mark":
            mark = (time.process_time(), time.perf_counter())
            _reply({})
        elif op == "cpu":
            _reply({"cpu": time.process_time() - mark[0], "wall": time.perf_counter() - mark[1]})
        else:
            _reply(getattr(side, op)(**cmd))


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
