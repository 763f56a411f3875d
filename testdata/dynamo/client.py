# Sends N requests of token ids to the Dynamo mocker through Dynamo's own client.
import asyncio, os, sys, time
from dynamo._core import DistributedRuntime
async def main():
    loop = asyncio.get_running_loop()
    rt = DistributedRuntime(loop, "file", os.environ.get("DYN_REQUEST_PLANE", "nats"), event_plane="nats")
    client = await rt.endpoint("dynamo.backend.generate").client()
    ids = await client.wait_for_instances()
    print("instances", ids, flush=True)
    base = list(range(1000, 1048))
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    off = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    for k in range(off, off + n):
        b = base if os.environ.get("DISTINCT") is None else list(range(5000 + 1000*k, 5048 + 1000*k))
        req = {"token_ids": b + list(range(2000 + 100*k, 2000 + 100*k + 20)),
               "stop_conditions": {"max_tokens": 4}, "sampling_options": {},
               "output_options": {}, "eos_token_ids": []}
        stream = await client.generate(req)
        async for r in stream:
            pass
        print("req", k, "done", flush=True)
    rt.shutdown()
asyncio.run(main())
