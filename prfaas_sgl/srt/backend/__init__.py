"""`prfaas_zmq`: an SGLang PD transfer backend whose KV data plane is `prfaas_sgl.transfer` (ZeroMQ/TCP).

Control plane = SGLang's common one (`disaggregation/common/conn.py`: bootstrap registry, registration,
heartbeats, abort); data plane = `ZmqSender` on the prefill server, `ZmqReceiver` on the decode server.

    decode                                              prefill
    ──────                                              ───────
    rx = ZmqReceiver(kv pool memory)                    tx = ZmqSender(kv pool memory)
    Register{data address, layout}    ──control──▶      remember peer, compare layouts
    rx.expect(tid, all suffix pages + state + aux)
    Metadata{pages, state slots, aux} ──control──▶      room → WaitingForInput
                                      ◀──data────       tx.send(tid, chunk pages) per prefill chunk
                                      ◀──data────       tx.send(tid, pages + state + aux, last=True)
    rx verifies every chunk, Done     ──data────▶       tx DONE → status Success ──control──▶
    poll() = Success only when rx DONE as well

Modules: `sglang_backend` (hooks), `memory` (KVArgs → layout, ids → ItemBatch), `control` (typed control
messages), `manager`/`prefill`/`decode` (KV managers), `conn` (sender/receiver/bootstrap classes),
`settings` (config and the one environment variable).
"""
