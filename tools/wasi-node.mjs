// Runs a wasm32-wasip1 program (a `cargo test` binary) in Node's V8, as Envoy runs the filter
// (liftoff off, SIMD on): the cargo runner of `make test-wasm-simd`.
// Usage: node --no-liftoff tools/wasi-node.mjs <program.wasm> [args...]
import fs from 'fs';
import { WASI } from 'wasi';

const [file, ...args] = process.argv.slice(2);
const wasi = new WASI({
  version: 'preview1',
  args: [file, ...args],
  env: { RUST_BACKTRACE: '0', PROPTEST_CASES: process.env.PROPTEST_CASES ?? '' },
  // The test vectors are read from the checkout by their absolute paths.
  preopens: { '/': '/' },
  returnOnExit: true,
});
const module = await WebAssembly.compile(fs.readFileSync(file));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
// Exit at once: Node has been seen to crash tearing down a long-run WASI instance.
process.exit(wasi.start(instance) ?? 0);
