# Captures ai-dynamo 1.6.1's TCP request plane (DYN_REQUEST_PLANE=tcp, file discovery) and writes
# tcp_request_plane_1.6.1.txt (README.md has the command line). Run with the venv's python while
# the mocker runs; DYN_FILE_KV names its discovery root.
#  1. The discovery records of the worker's KV query endpoint and of its kv-events publisher.
#  2. Dynamo's own client asking that endpoint (a tree dump), through a relay that keeps every
#     byte each way: the worker's record is pointed at the relay for the call, then restored.
#  3. Requests sent (client.py), then hand-built queries like Dynamo's over the worker's TCP
#     address, with the answer streams kept whole: events 2..3, a tree dump, and a request for
#     an endpoint path the worker does not serve.
import asyncio, glob, json, os, struct, subprocess, sys, uuid, urllib.parse, msgpack
from dynamo._core import DistributedRuntime

DISC = os.environ["DYN_FILE_KV"]
OUT, DATE = sys.argv[1], sys.argv[2]


def j(v):
    return json.dumps(v, separators=(",", ":"))


def records():
    inst = [f for f in glob.glob(f"{DISC}/v1/instances/*") if "worker%5Fkv%5Fquery" in f]
    src = [f for f in glob.glob(f"{DISC}/v1/event_sources/*") if "kv%2Devents" in f]
    assert len(inst) == 1 and len(src) == 1, (inst, src)
    return inst[0], src[0]


def frames_of(stream):
    out, i = [], 0
    while i < len(stream):
        hl, bl, ck = struct.unpack(">QQQ", stream[i:i + 24]); i += 24
        h = stream[i:i + hl].decode() if hl else None; i += hl
        b = msgpack.unpackb(stream[i:i + bl], raw=False) if bl else None; i += bl
        out.append({"header": h, "body": b})
    return out


async def relay_call(inst_path):
    """Dynamo's client through a relay: its request bytes and the worker's reply bytes."""
    orig = open(inst_path).read()
    rec = json.loads(orig)
    hostport, path = rec["transport"]["tcp"].split("/", 1)
    host, port = hostport.rsplit(":", 1)
    c2s, s2c = bytearray(), bytearray()

    async def handle(r, w):
        ur, uw = await asyncio.open_connection(host, int(port))

        async def pipe(a, b, buf):
            while d := await a.read(65536):
                buf.extend(d); b.write(d); await b.drain()
            b.close()
        await asyncio.gather(pipe(r, uw, c2s), pipe(ur, w, s2c), return_exceptions=True)
    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    moved = dict(rec, transport={"tcp": f"127.0.0.1:{srv.sockets[0].getsockname()[1]}/{path}"})
    tmp = os.path.join(os.path.dirname(inst_path), ".tmp_capture")
    open(tmp, "w").write(json.dumps(moved)); os.rename(tmp, inst_path)
    try:
        rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="nats")
        client = await rt.endpoint(f"{rec['namespace']}.{rec['component']}.{rec['endpoint']}").client()
        await asyncio.wait_for(client.wait_for_instances(), 20)
        req = {"worker_id": rec["instance_id"], "dp_rank": 0, "start_event_id": None,
               "end_event_id": None, "supports_tree_dump_failed": True, "kind": "recovery"}
        async for _ in await client.direct(req, rec["instance_id"]):
            pass
        await asyncio.sleep(0.5)
    finally:
        open(tmp, "w").write(orig); os.rename(tmp, inst_path)
    srv.close()
    return bytes(c2s), bytes(s2c)


async def ask(rec, path, start, end):
    """One query the way Dynamo's client frames it; the ack and the whole answer stream."""
    hostport = rec["transport"]["tcp"].split("/", 1)[0]
    host, port = hostport.rsplit(":", 1)
    raw, done = bytearray(), asyncio.Event()

    async def on_conn(r, w):
        while b := await r.read(65536):
            raw.extend(b)
            if raw.endswith(b'"sentinel"'):
                break
        w.close(); done.set()
    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    ctx = str(uuid.uuid4())
    info = {"address": f"127.0.0.1:{srv.sockets[0].getsockname()[1]}", "subject": str(uuid.uuid4()),
            "context": ctx, "stream_type": "response"}
    ctrl = {"id": ctx, "request_type": "single_in", "response_type": "many_out",
            "payload_codec": "msgpack", "connection_info": {"transport": "tcp_server", "info": json.dumps(info)}}
    body = msgpack.packb({"worker_id": rec["instance_id"], "dp_rank": 0, "start_event_id": start,
                          "end_event_id": end, "supports_tree_dump_failed": True, "kind": "recovery"})
    h = json.dumps(ctrl).encode()
    payload = struct.pack(">QQQ", len(h), len(body), 0) + h + body
    headers = json.dumps({"request-id": ctx, "x-endpoint-path": path}).encode()
    p = path.encode()
    msg = struct.pack(">H", len(p)) + p + struct.pack(">H", len(headers)) + headers + struct.pack(">I", len(payload)) + payload
    r, w = await asyncio.open_connection(host, int(port))
    w.write(msg); await w.drain()
    (n,) = struct.unpack(">I", await r.readexactly(4))
    ack = struct.pack(">I", n) + await r.readexactly(n)
    w.close()
    if n == 0:
        await asyncio.wait_for(done.wait(), 10)
    srv.close()
    return msg, ack, bytes(raw)


async def main():
    inst_path, src_path = records()
    rec = json.loads(open(inst_path).read())
    path = rec["transport"]["tcp"].split("/", 1)[1]
    c2s, s2c = await relay_call(inst_path)
    p = await asyncio.create_subprocess_exec(sys.executable, os.path.join(os.path.dirname(__file__), "client.py"), "3", "0",
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert await p.wait() == 0
    await asyncio.sleep(1)
    asked = [("2_3", path, 2, 3), ("dump", path, None, None), ("unknown_path", path + "x", 1, 2)]
    with open(f"{OUT}/tcp_request_plane_1.6.1.txt", "w") as f:
        f.write(f"# ai-dynamo 1.6.1 mocker, TCP request plane and file discovery, captured {DATE} (README.md)\n\n")
        f.write("### discovery\n")
        f.write(f"instance_file: {os.path.relpath(inst_path, DISC)}\ninstance: {open(inst_path).read().strip()}\n")
        f.write(f"event_source_file: {os.path.relpath(src_path, DISC)}\nevent_source: {open(src_path).read().strip()}\n\n")
        f.write(f"### dynamo_client\nrequest: {c2s.hex()}\nreply: {s2c.hex()}\n\n")
        for name, pth, start, end in asked:
            msg, ack, stream = await ask(rec, pth, start, end)
            f.write(f"### {name}\nrequest: {msg.hex()}\nack: {ack.hex()}\nack_text: {j(ack[4:].decode())}\n")
            f.write(f"stream: {stream.hex()}\nframes: {j(frames_of(stream))}\n\n")
            print(name, "ack", ack[4:][:80], "stream", len(stream))
    print("relay: request", len(c2s), "reply", s2c.hex())

asyncio.run(main())
