# Writes testdata/dynamo/*.txt from a capture directory (capture.py's output).
import json, msgpack, struct, sys
cap, out, date = sys.argv[1], sys.argv[2], sys.argv[3]
subjects = open(f"{cap}/subjects.txt").read().split("\n")
def j(v): return json.dumps(v, separators=(",", ":"))
with open(f"{out}/kv_events_1.6.1.txt", "w") as f:
    f.write(f"# ai-dynamo 1.6.1 mocker, NATS event plane, captured {date} (README.md)\n\n")
    for i in [0, 1, 2, 17]:
        raw = bytes.fromhex(open(f"{cap}/kv_event_{i}.hex").read().strip())
        env = msgpack.unpackb(raw, raw=False)
        env["payload"] = msgpack.unpackb(env["payload"], raw=False)
        f.write(f"### message {i}\nsubject: {subjects[0]}\nhex: {raw.hex()}\ndecoded: {j(env)}\n\n")
with open(f"{out}/worker_kv_query_1.6.1.txt", "w") as f:
    f.write(f"# ai-dynamo 1.6.1 mocker, NATS request plane, captured {date} (README.md)\n")
    f.write(f"# query subject: {subjects[3]}\n\n")
    for name in ["2_3", "dump", "toonew", "inverted", "otherworker"]:
        req = bytes.fromhex(open(f"{cap}/recovery_{name}.request.hex").read().strip())
        hl, bl, _ = struct.unpack(">QQQ", req[:24])
        stream = bytes.fromhex(open(f"{cap}/recovery_{name}.stream.hex").read().strip())
        frames, i = [], 0
        while i < len(stream):
            hl2, bl2, ck = struct.unpack(">QQQ", stream[i:i+24]); i += 24
            h = stream[i:i+hl2].decode() if hl2 else None; i += hl2
            b = msgpack.unpackb(stream[i:i+bl2], raw=False) if bl2 else None; i += bl2
            frames.append({"header": h, "body": b})
        f.write(f"### {name}\nrequest_body: {j(msgpack.unpackb(req[24+hl:], raw=False))}\n")
        f.write(f"stream: {stream.hex()}\nframes: {j(frames)}\n\n")
