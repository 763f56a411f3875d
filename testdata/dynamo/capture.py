# Records kv-events messages and raw recovery response streams (all TCP bytes) as hex.
import asyncio, json, struct, sys, uuid, msgpack, nats, subprocess, os
OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
async def query(nc, subject, worker_id, start, end, name):
    raw = bytearray(); done = asyncio.Event()
    async def on_conn(r, w):
        while True:
            b = await r.read(65536)
            if not b: break
            raw.extend(b)
            if raw.endswith(b'"sentinel"'): break
        w.close(); done.set()
    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    ctx = str(uuid.uuid4())
    ctrl = {"id": ctx, "request_type": "single_in", "response_type": "many_out", "payload_codec": "msgpack",
            "connection_info": {"transport": "tcp_server", "info": json.dumps(
                {"address": f"127.0.0.1:{port}", "subject": str(uuid.uuid4()), "context": ctx, "stream_type": "response"})}}
    req = {"worker_id": worker_id, "dp_rank": 0, "start_event_id": start, "end_event_id": end,
           "supports_tree_dump_failed": True, "kind": "recovery"}
    h = json.dumps(ctrl).encode(); b = msgpack.packb(req)
    msg = struct.pack(">QQQ", len(h), len(b), 0) + h + b
    ack = await nc.request(subject, msg, timeout=5)
    await asyncio.wait_for(done.wait(), 10)
    srv.close()
    open(f"{OUT}/recovery_{name}.request.hex", "w").write(msg.hex() + "\n")
    open(f"{OUT}/recovery_{name}.stream.hex", "w").write(bytes(raw).hex() + "\n")
    print(name, "ack", len(ack.data), "stream", len(raw))
    i = 0
    while i < len(raw):
        hl, bl, ck = struct.unpack(">QQQ", raw[i:i+24]); i += 24
        print("   frame hl", hl, "bl", bl, "ck", ck, bytes(raw[i:i+hl])[:120], bytes(raw[i+hl:i+hl+bl])[:40].hex()); i += hl + bl
async def main():
    nc = await nats.connect(os.environ["NATS_SERVER"])
    events = []
    async def cb(msg):
        events.append((msg.subject, msg.data))
    await nc.subscribe("namespace.*.component.*.endpoint.*.kv-events", cb=cb)
    await nc.flush()
    p = await asyncio.create_subprocess_exec(sys.executable, "client.py", "3", sys.argv[2], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert await p.wait() == 0
    await asyncio.sleep(1)
    for i, (s, d) in enumerate(events):
        open(f"{OUT}/kv_event_{i}.hex", "w").write(d.hex() + "\n")
        env = msgpack.unpackb(d, raw=False)
        ev = msgpack.unpackb(env["payload"], raw=False)
        print(s, env["publisher_id"], env["sequence"], [e["event"]["event_id"] for e in ev])
        pub = env["publisher_id"]; wid = ev[0]["worker_id"]
    subj = f"dynamo_backend.worker_kv_query_source_{pub:x}-{wid:x}"
    print(subj)
    open(f"{OUT}/subjects.txt", "w").write("\n".join(s for s, _ in events) + "\n" + subj + "\n")
    await query(nc, subj, wid, 2, 3, "2_3")
    await query(nc, subj, wid, None, None, "dump")
    await query(nc, subj, wid, 10, 20, "toonew")
    await query(nc, subj, wid, 3, 2, "inverted")
    await query(nc, subj, wid + 1, 1, 2, "otherworker")
    p = await asyncio.create_subprocess_exec(sys.executable, "client.py", "24", "100", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, DISTINCT="1"))
    assert await p.wait() == 0
    await asyncio.sleep(1)
    for i, (s, d) in enumerate(events):
        open(f"{OUT}/kv_event_{i}.hex", "w").write(d.hex() + "\n")
        env = msgpack.unpackb(d, raw=False)
        ev = msgpack.unpackb(env["payload"], raw=False)
        print(i, env["sequence"], [(e["event"]["event_id"], list(e["event"]["data"])) for e in ev])
    await nc.close()
asyncio.run(main())
