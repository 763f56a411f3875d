import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync, existsSync } from 'node:fs';
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';
import { builds, repo, rng, node } from './load.mjs';

const vectorsText = readFileSync(join(repo, 'testdata/vectors/hash_contract.json'), 'utf8');
const vectors = JSON.parse(vectorsText);
// Seeds above 2^53 lose bits in JSON.parse: read them from the text, in case order.
const seeds = [...vectorsText.matchAll(/"seed":\s*(\d+)/g)].map((m) => BigInt(m[1]));

const big = (strings) => strings.map((s) => BigInt(s));

for (const [name, kv] of builds) {
  test(`${name}: every contract vector, bit for bit`, () => {
    assert.ok(vectors.cases.length >= 10);
    assert.equal(seeds.length, vectors.cases.length);
    vectors.cases.forEach((c, i) => {
      const tokens = Uint32Array.from(c.tokens);
      const lora = c.lora_name ?? undefined;
      const salt = c.cache_salt ?? undefined;
      assert.equal(kv.hashSeed(lora, salt), seeds[i], `${c.name}: seed`);
      const blocks = kv.blockHashes(tokens, c.block_size, lora, salt);
      assert.ok(blocks instanceof BigUint64Array);
      assert.deepEqual([...blocks], big(c.block_hashes), `${c.name}: block hashes`);
      const seqs = kv.sequenceHashes(tokens, c.block_size, lora, salt);
      assert.deepEqual([...seqs], big(c.sequence_hashes), `${c.name}: sequence hashes`);
      assert.deepEqual([...kv.sequenceHashesOfBlocks(blocks)], [...seqs], `${c.name}: chained`);
    });
  });

  test(`${name}: a bad block size throws with a message`, () => {
    const t = new Uint32Array([1, 2, 3, 4]);
    for (const bad of [0, -1, 1.5, NaN, Infinity, 2 ** 32]) {
      assert.throws(() => kv.sequenceHashes(t, bad), /blockSize must be an integer from 1 to 4294967295/, `${bad}`);
      assert.throws(() => kv.blockHashes(t, bad), /blockSize/, `${bad}`);
    }
    // Null and empty names are no names, as in the core.
    assert.equal(kv.hashSeed(null, ''), 1337n);
    assert.notEqual(kv.hashSeed('a'), kv.hashSeed(undefined, 'a'));
  });
}

function hashCli() {
  const candidates = [
    process.env.KVROUTE_HASH_CLI,
    join(process.env.CARGO_TARGET_DIR ?? join(repo, 'target'), 'debug/examples/hash_cli'),
  ].filter(Boolean);
  const found = candidates.find((p) => existsSync(p));
  assert.ok(found, `native hash_cli not built (cargo build -p kvroute --example hash_cli); looked at ${candidates}`);
  return found;
}

const NAMES = [undefined, '', 'adapter-1', 'sql-lora', 'ünïcödé 🦀', 'x'.repeat(300)];

test('the Node build equals the native core on 200 random cases', () => {
  const seed = Number(process.env.KVROUTE_JS_SEED ?? 20261201);
  const rand = rng(seed);
  const pick = (xs) => xs[Math.floor(rand() * xs.length)];
  const cases = [];
  for (let i = 0; i < 200; i++) {
    const n = Math.floor(rand() * 5001);
    // Small ids, full-range ids and the edges of u32.
    const range = pick([100, 2 ** 17, 2 ** 32]);
    const tokens = Array.from({ length: n }, () => (rand() < 0.01 ? pick([0, 4294967295]) : Math.floor(rand() * range)));
    const nameOrRandom = () => (rand() < 0.3 ? `r${Math.floor(rand() * 1e9)}` : pick(NAMES));
    cases.push({ tokens, block_size: 1 + Math.floor(rand() * 64), lora_name: nameOrRandom() ?? null, cache_salt: nameOrRandom() ?? null });
  }
  const input = cases.map((c) => JSON.stringify(c)).join('\n') + '\n';
  const run = spawnSync(hashCli(), [], { input, maxBuffer: 1 << 30, encoding: 'utf8' });
  assert.equal(run.status, 0, run.stderr);
  const answers = run.stdout.trim().split('\n').map((l) => JSON.parse(l));
  assert.equal(answers.length, cases.length);
  let blocksCompared = 0;
  cases.forEach((c, i) => {
    const where = `case ${i} (seed ${seed}): ${c.tokens.length} tokens, block ${c.block_size}, lora ${c.lora_name}, salt ${c.cache_salt}`;
    const a = answers[i];
    assert.equal(a.error, undefined, where);
    const tokens = Uint32Array.from(c.tokens);
    const lora = c.lora_name ?? undefined;
    const salt = c.cache_salt ?? undefined;
    assert.deepEqual([...node.blockHashes(tokens, c.block_size, lora, salt)], big(a.block_hashes), where);
    assert.deepEqual([...node.sequenceHashes(tokens, c.block_size, lora, salt)], big(a.sequence_hashes), where);
    blocksCompared += a.sequence_hashes.length;
  });
  // The cases must hash something: lengths up to 5,000 in blocks up to 64.
  assert.ok(blocksCompared > 10_000, `${blocksCompared} blocks compared`);
});
