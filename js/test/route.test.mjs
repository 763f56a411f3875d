import { test } from 'node:test';
import assert from 'node:assert/strict';
import { builds } from './load.mjs';

const query = { blocks: 16, blockSize: 16 };

for (const [name, kv] of builds) {
  test(`${name}: the longest prefix wins when loads are equal`, () => {
    const d = kv.route({
      query,
      seed: 1,
      instances: [
        { id: 'a', matched: 4, load: { requests: 1, prefillTokens: 64 } },
        { id: 'b', matched: 12, load: { requests: 1, prefillTokens: 64 } },
        { id: 'c', load: { requests: 1, prefillTokens: 64 } },
      ],
    });
    assert.deepEqual(d, { best: 'b', bestIndex: 1, runnerUp: 'a', runnerUpIndex: 0, dpRank: 0, matchedBlocks: 12 });
  });

  test(`${name}: a loaded instance loses its cache advantage`, () => {
    // b holds 12 blocks more but has 40 blocks of prefill queued: cost 40 + 4 vs 12.
    const d = kv.route({
      query,
      instances: [
        { id: 'a', matched: 4 },
        { id: 'b', matched: 16, load: { requests: 2, prefillTokens: 640 } },
      ],
    });
    assert.equal(d.best, 'a');
    assert.equal(d.runnerUp, 'b');
  });

  test(`${name}: tiers, dp ranks, eligibility, saturation, cold requests`, () => {
    // Disk-tier blocks earn a quarter of GPU ones: 8 GPU blocks beat 12 disk blocks.
    let d = kv.route({ query, instances: [{ id: 'disk', matched: [0, 0, 12] }, { id: 'gpu', matched: 8 }] });
    assert.equal(d.best, 'gpu');
    // The rank with the most credit speaks for its instance.
    d = kv.route({ query, instances: [{ id: 'x', ranks: [{ dpRank: 0, matched: 2 }, { dpRank: 3, matched: 9 }] }, { id: 'y', matched: 5 }] });
    assert.deepEqual([d.best, d.dpRank, d.matchedBlocks], ['x', 3, 9]);
    // An instance not serving the model never wins, however much it holds.
    d = kv.route({
      query,
      model: 'llama',
      instances: [
        { id: 'other', matched: 16, models: [{ model: 'qwen' }] },
        { id: 'mine', matched: 1, models: [{ model: 'llama' }] },
      ],
    });
    assert.equal(d.best, 'mine');
    assert.equal(d.runnerUp, null);
    // A saturated engine gets no cold request while another can take it.
    d = kv.route({ query, seed: 3, instances: [{ id: 'full', load: { engine: { waiting: 9, kvUsage: 0.5 } } }, { id: 'free', load: { requests: 3 } }] });
    assert.equal(d.best, 'free');
    // Cold requests are decided by default and left to the caller under "defer".
    assert.equal(kv.route({ query, instances: [{ id: 'a' }], policy: { cold: 'defer' } }), null);
    assert.equal(kv.route({ query, instances: [{ id: 'a' }] }).best, 'a');
    assert.equal(kv.route({ query, instances: [] }), null);
  });

  test(`${name}: exact ties break by the seed, both ways`, () => {
    const req = (seed) => ({ query, seed, instances: [{ id: 'a', matched: 5 }, { id: 'b', matched: 5 }] });
    const winners = new Set();
    for (let seed = 0; seed < 32; seed++) {
      const d = kv.route(req(seed));
      winners.add(d.best);
      assert.deepEqual(kv.route(req(seed)), d, 'same seed, same answer');
      assert.equal(d.runnerUp, d.best === 'a' ? 'b' : 'a');
    }
    assert.deepEqual([...winners].sort(), ['a', 'b']);
  });

  test(`${name}: over the collector's /query answer, as the filter's remote mode`, () => {
    // Matches in tokens, blocks of 16: e1 holds 8 blocks, e2 4 (its rank 2 the most).
    const answer = {
      block_size: 16,
      query_blocks: 16,
      instances: {
        e1: { address: '10.0.0.1:8000', longest_matched: 128, gpu: 128, cpu: 128, disk: 128, dp: { 0: 128 } },
        e2: { address: '10.0.0.2:8000', longest_matched: 64, gpu: 64, cpu: 64, disk: 64, dp: { 0: 32, 2: 64 } },
      },
    };
    assert.deepEqual(kv.routeQueryResponse(answer, { seed: 1 }), { best: 'e1', bestIndex: 0, runnerUp: 'e2', runnerUpIndex: 1, dpRank: 0, matchedBlocks: 8 });
    // 64 blocks of prefill queued on e1 outweigh its 4 extra cached blocks; e2 answers on rank 2.
    const d = kv.routeQueryResponse(JSON.stringify(answer), { loads: { e1: { prefillTokens: 1024, requests: 4 } } });
    assert.deepEqual([d.best, d.dpRank, d.matchedBlocks, d.runnerUp], ['e2', 2, 4, 'e1']);
    // Nobody holds anything: the filter's remote mode has no contender.
    assert.equal(kv.routeQueryResponse({ block_size: 16, query_blocks: 4, instances: {} }), null);
    assert.throws(() => kv.routeQueryResponse({ query_blocks: 4, instances: {} }), /query response: missing field `block_size`/);
    assert.throws(() => kv.routeQueryResponse(answer, { loads: { e1: { requests: 'many' } } }), /route options: loads\.e1\.requests: invalid type/);
  });

  test(`${name}: JSON text in, and bad requests throw naming the field`, () => {
    const d = kv.route(JSON.stringify({ query, instances: [{ id: 'a', matched: 2 }, { id: 'b', matched: 3 }] }));
    assert.equal(d.best, 'b');
    assert.throws(() => kv.route({ instances: [] }), /route request: missing field `query`/);
    assert.throws(() => kv.route({ query, instances: [{ id: 'a', load: { requests: -1 } }] }), /route request: instances\[0\]\.load\.requests: invalid value/);
    assert.throws(() => kv.route({ query, instances: [{ id: 'a', matched: [3, 2, 1] }] }), /instances\[0\]\.matched: tiers are cumulative/);
    assert.throws(() => kv.route({ query, instances: [{ id: 'a', matched: 1, ranks: [] }] }), /matched or ranks, not both/);
    assert.throws(() => kv.route({ query: { blocks: 1, blockSize: 0 }, instances: [] }), /blockSize: must be at least 1/);
    assert.throws(() => kv.route({ query, instances: [], policy: { cold: 'later' } }), /policy\.cold: unknown variant `later`/);
    assert.throws(() => kv.route({ query, instances: [], policy: { gpu: -1 } }), /policy\.gpu: must be a finite number/);
    assert.throws(() => kv.route({ query, instances: [], policy: { maxKvUsage: 2 } }), /policy\.max_kv_usage: must be between 0 and 1/);
    assert.throws(() => kv.route({ query, instances: [], seed: 1n }), /route request: not a JSON value/);
    assert.throws(() => kv.route('{"query":'), /route request:/);
    assert.throws(() => kv.route(undefined), /route request: missing/);
  });
}
