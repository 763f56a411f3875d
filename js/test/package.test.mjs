import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync, existsSync, mkdtempSync, mkdirSync, symlinkSync, writeFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { spawnSync } from 'node:child_process';
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

test('an installed @kvroute/core resolves to the Node build and its subpaths', () => {
  const dir = mkdtempSync(join(tmpdir(), 'kvroute-js-'));
  try {
    mkdirSync(join(dir, 'node_modules/@kvroute'), { recursive: true });
    symlinkSync(join(repo, 'js/pkg'), join(dir, 'node_modules/@kvroute/core'), 'dir');
    writeFileSync(
      join(dir, 'main.mjs'),
      `import { sequenceHashes } from '@kvroute/core';
       import init, { initSync } from '@kvroute/core/web';
       const t = new Uint32Array([1, 2, 3, 4]);
       console.log(String(sequenceHashes(t, 4)[0]), typeof init, typeof initSync);`,
    );
    const run = spawnSync(process.execPath, ['main.mjs'], { cwd: dir, encoding: 'utf8' });
    assert.equal(run.status, 0, run.stderr);
    // The contract vector "one_block": tokens 1..4 in a block of 4.
    assert.equal(run.stdout.trim(), '14643705804678351452 function function');
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
