// Hashes of 8k-token prompts per second in Node, the loop `hash_cli --bench` times natively:
// sequence hashes of 8,192 tokens in blocks of 16, best of 5 one-second rounds, copies in and
// out of wasm memory included. Run: `make bench-js`.
import { gzipSync } from 'node:zlib';
import { readFileSync } from 'node:fs';
import { sequenceHashes, blockHashes, readBody, parseTokenHeader, encodeTokenHeader } from './pkg/node/kvroute_js.js';

const TOKENS = 8192;
const BLOCK = 16;
const prompt = Uint32Array.from({ length: TOKENS }, (_, i) => (Math.imul(i, 2654435761) + 1) >>> 0);

function best(label, f) {
  for (let i = 0; i < 1000; i++) f(); // warm the JIT and the wasm tiers
  let top = 0;
  for (let round = 0; round < 5; round++) {
    const start = process.hrtime.bigint();
    let n = 0;
    let ns = 0n;
    while (ns < 1_000_000_000n) {
      for (let i = 0; i < 100; i++) f();
      n += 100;
      ns = process.hrtime.bigint() - start;
    }
    top = Math.max(top, n / (Number(ns) / 1e9));
  }
  console.log(`node: ${label}: ${top.toFixed(0)} /s, ${(1e6 / top).toFixed(2)} µs each`);
  return top;
}

const wasm = readFileSync(new URL('./pkg/web/kvroute_js_bg.wasm', import.meta.url));
console.log(`package: kvroute_js_bg.wasm ${wasm.length} bytes, ${gzipSync(wasm, { level: 9 }).length} gzip -9`);
best(`sequence hashes of ${TOKENS} tokens (block ${BLOCK}), prompts`, () => sequenceHashes(prompt, BLOCK));
best(`block hashes of ${TOKENS} tokens (block ${BLOCK}), prompts`, () => blockHashes(prompt, BLOCK));
const header = encodeTokenHeader(prompt);
best(`base64 header of ${TOKENS} tokens parsed`, () => parseTokenHeader(header));
const body = JSON.stringify({ model: 'm', prompt: [...prompt] });
best(`JSON body of ${TOKENS} tokens (${body.length} bytes) read`, () => readBody(body));
