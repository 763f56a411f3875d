// kvroute's intake and hashing in V8 (Node, `--no-liftoff` as in Envoy): µs per call, the
// best of 7 batches. Usage: node --no-liftoff bench.mjs <kvroute_v8bench.wasm> [more.wasm]
// (several builds are measured interleaved, for a before/after in one run).
import fs from 'fs';
import path from 'path';
import { WASI } from 'wasi';

const files = process.argv.slice(2);
const builds = [];
for (const file of files) {
  const wasi = new WASI({ version: 'preview1' });
  const mod = await WebAssembly.compile(fs.readFileSync(file));
  const inst = await WebAssembly.instantiate(mod, wasi.getImportObject());
  if (inst.exports._initialize) wasi.initialize(inst);
  builds.push({ file, e: inst.exports });
}

// The body bench_latency.py sends: {"model", "prompt": [ids], "max_tokens"}, Python's
// json.dumps separators (", "), ids below 150k (a Qwen-sized vocabulary).
function body(n) {
  let s = 12345;
  const toks = [];
  for (let i = 0; i < n; i++) {
    s = (s * 1103515245 + 12345) % 2147483648;
    toks.push(s % 150000);
  }
  return Buffer.from(JSON.stringify({ model: 'm', prompt: toks, max_tokens: 1 }).replace(/,/g, ', '));
}

const now = () => process.hrtime.bigint();
for (const n of [1024, 8192, 32768]) {
  const bytes = body(n);
  const iters = Math.max(20, Math.round(2_000_000 / n));
  const rows = builds.map((b) => {
    const p = b.e.buffer(bytes.length);
    new Uint8Array(b.e.memory.buffer, p, bytes.length).set(bytes);
    return { b, p, scan: Infinity, bytewise: Infinity, hash: Infinity };
  });
  for (let round = 0; round < 8; round++) {
    for (const r of rows) {
      for (const [key, bw] of [['scan', 0], ['bytewise', 1]]) {
        const t0 = now();
        const c = r.b.e.scan(r.p, bytes.length, iters, bw);
        const t1 = now();
        if (c !== (n * iters) >>> 0) throw new Error(`${path.basename(r.b.file)}: read ${c}`);
        if (round > 0) r[key] = Math.min(r[key], Number(t1 - t0) / iters / 1000);
      }
      const t0 = now();
      r.b.e.hash(iters, 16);
      const t1 = now();
      if (round > 0) r.hash = Math.min(r.hash, Number(t1 - t0) / iters / 1000);
    }
  }
  for (const r of rows) {
    console.log(`${n} tokens, ${bytes.length} B, ${path.basename(r.b.file)}: scan_json ${r.scan.toFixed(1)} µs ` +
      `(${(bytes.length / r.scan / 1000).toFixed(2)} GB/s), byte path alone ${r.bytewise.toFixed(1)} µs, ` +
      `sequence hashes (${n / 16} blocks) ${r.hash.toFixed(1)} µs`);
  }
}
