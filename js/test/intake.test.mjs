import { test } from 'node:test';
import assert from 'node:assert/strict';
import { builds } from './load.mjs';

for (const [name, kv] of builds) {
  test(`${name}: header values, decimal and base64`, () => {
    assert.deepEqual([...kv.parseTokenHeader(' 1, 2,3 ')], [1, 2, 3]);
    assert.deepEqual([...kv.parseTokenHeader('4294967295')], [4294967295]);
    const tokens = Uint32Array.from([0, 1, 65535, 4294967295, 42, 7]);
    const b64 = kv.encodeTokenHeader(tokens);
    assert.equal(b64, Buffer.from(tokens.buffer).toString('base64'));
    assert.deepEqual(kv.parseTokenHeader(b64), tokens);
    // URL-safe alphabet without padding reads the same.
    const url = b64.replace(/\+/g, '-').replace(/\//g, '_').replace(/=+$/, '');
    assert.deepEqual(kv.parseTokenHeader(url), tokens);
    assert.ok(kv.parseTokenHeader('1,2') instanceof Uint32Array);
  });

  test(`${name}: bad header values throw with a message`, () => {
    assert.throws(() => kv.parseTokenHeader('   '), /token header: empty value/);
    assert.throws(() => kv.parseTokenHeader('1, -2'), /negative token at byte 3/);
    assert.throws(() => kv.parseTokenHeader('1, 4294967296'), /exceeds u32/);
    assert.throws(() => kv.parseTokenHeader('1, 2.5'), /not an integer/);
    assert.throws(() => kv.parseTokenHeader('AAAA!AAA'), /bad base64/);
    assert.throws(() => kv.parseTokenHeader('1,2,3', 2), /more than 2 tokens/);
    assert.throws(() => kv.parseTokenHeader('1', -1), /maxTokens must be an integer/);
    assert.throws(() => kv.parseTokenHeader(12), /token header: expected a string or a Uint8Array/);
    assert.deepEqual([...kv.parseTokenHeader(new TextEncoder().encode('7,8'))], [7, 8]);
  });

  test(`${name}: JSON bodies, as text and as bytes`, () => {
    const body = JSON.stringify({
      model: 'llama',
      messages: [{ role: 'user', content: 'ignored, "quoted" [1,2]' }],
      prompt: 'text prompt: not tokens',
      prompt_token_ids: [5, 6, 7, 4294967295],
      cache_salt: 'tenant-\u00e9',
      max_tokens: 128,
    });
    for (const input of [body, new TextEncoder().encode(body)]) {
      const r = kv.readBody(input);
      assert.deepEqual([...r.tokens], [5, 6, 7, 4294967295]);
      assert.ok(r.tokens instanceof Uint32Array);
      assert.equal(r.tokenField, 'prompt_token_ids');
      assert.equal(r.model, 'llama');
      assert.equal(r.cacheSalt, 'tenant-é');
      assert.equal(r.tenant, null);
      assert.equal(r.decodeTokens, 128);
    }
    // Escaped strings are unescaped; other field names by option.
    const r = kv.readBody('{"ids":[1,2],"m":"a\\"b","t":"acme"}', { tokenFields: ['ids'], modelField: 'm', tenantField: 't' });
    assert.deepEqual([...r.tokens], [1, 2]);
    assert.equal(r.model, 'a"b');
    assert.equal(r.tenant, 'acme');
    assert.equal(r.cacheSalt, null);
    // No token field: empty tokens, not an error (the filter then fails open).
    const none = kv.readBody('{"model":"m","prompt":"hello"}');
    assert.equal(none.tokens.length, 0);
    assert.equal(none.tokenField, null);
  });

  test(`${name}: bad bodies throw with a message`, () => {
    assert.throws(() => kv.readBody('{"prompt": [1, 2'), /body: invalid JSON at byte/);
    assert.throws(() => kv.readBody('[1,2]'), /body: JSON body is not an object/);
    assert.throws(() => kv.readBody('{"prompt":[1,-2]}'), /body: negative token/);
    assert.throws(() => kv.readBody('{"prompt":[1,2.5]}'), /body: token at byte \d+ is not an integer/);
    assert.throws(() => kv.readBody('{"prompt":[4294967296]}'), /exceeds u32/);
    assert.throws(() => kv.readBody(''), /body: empty value/);
    assert.throws(() => kv.readBody('['.repeat(1000) + ']'.repeat(1000)), /body:/);
    assert.throws(() => kv.readBody('{"prompt":[1,2,3]}', { maxBodyBytes: 10 }), /more than maxBodyBytes \(10\)/);
    // Half the body limit is the token limit, as in the filter.
    assert.throws(() => kv.readBody('{"prompt":[1,2,3,4,5,6,7,8,9]}', { maxBodyBytes: 16 }), /more than maxBodyBytes|more than 8 tokens/);
    assert.throws(() => kv.readBody(42), /expected a string or a Uint8Array/);
    assert.throws(() => kv.readBody('{}', { tokenFeilds: ['x'] }), /body options: tokenFeilds: unknown field `tokenFeilds`/);
  });
}
