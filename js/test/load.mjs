// The package's two builds, loaded the way their users load them: the Node entry as is, the
// browser build (the one committed in collector/ui/pkg) initialised from its .wasm bytes.
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

export const repo = fileURLToPath(new URL('../../', import.meta.url));

export const node = await import('../pkg/node/kvroute_js.js');

const webModule = await import('../pkg/web/kvroute_js.js');
webModule.initSync({ module: readFileSync(new URL('../pkg/web/kvroute_js_bg.wasm', import.meta.url)) });
export const web = webModule;

/** Both builds, for tests that must hold in each. */
export const builds = [
  ['node', node],
  ['web', web],
];

/** A seeded generator (mulberry32), so a failing random case can be replayed. */
export function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
