import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync, existsSync } from 'node:fs';
import { join } from 'node:path';
import { repo } from './load.mjs';

test('package.json: version of the crate, every export present', () => {
  const pkg = JSON.parse(readFileSync(join(repo, 'js/pkg/package.json'), 'utf8'));
  const crate = readFileSync(join(repo, 'js/Cargo.toml'), 'utf8').match(/^version = "(.*)"/m)[1];
  assert.equal(pkg.name, '@kvroute/core');
  assert.equal(pkg.version, crate);
  assert.equal(pkg.type, 'module');
  const files = [];
  const walk = (v) => (typeof v === 'string' ? files.push(v) : Object.values(v).forEach(walk));
  walk(pkg.exports);
  assert.ok(files.length >= 8);
  for (const f of files) assert.ok(existsSync(join(repo, 'js/pkg', f)), f);
  const dts = readFileSync(join(repo, 'js/pkg/node/kvroute_js.d.ts'), 'utf8');
  for (const name of ['sequenceHashes(tokens: Uint32Array', 'BigUint64Array', 'readBody', 'RouteDecision', 'parseTokenHeader']) {
    assert.ok(dts.includes(name), name);
  }
});

test('collector/ui/pkg is the browser build of js/pkg', () => {
  for (const f of ['kvroute_js.js', 'kvroute_js_bg.wasm', 'kvroute_js.d.ts', 'kvroute_js_bg.wasm.d.ts']) {
    assert.deepEqual(readFileSync(join(repo, 'collector/ui/pkg', f)), readFileSync(join(repo, 'js/pkg/web', f)), f);
  }
});
