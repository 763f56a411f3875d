// The fleet page. Plain ES module, no framework, no build step: it is embedded in the
// collector as is. Every data fetch carries the read token typed into the page (kept in
// sessionStorage, so it leaves with the tab); only GETs and the read-only POST /query,
// /query_by_hash and /v1/explain are ever sent. Data is written with textContent, never parsed as HTML:
// instance names and models come from registrations.

const TOKEN_KEY = "kvroute.readToken";
const FETCH_TIMEOUT_MS = 5000;
// The chart's samples are most of /v1/fleet/overview: fetched at most this often.
const HISTORY_EVERY_MS = 6000;
// The collector's root, relative to the page (/ui/), so a path prefix in front still works.
const ROOT = new URL("../", window.location.href);
const PALETTE = ["#2457c5", "#d9480f", "#2b8a3e", "#ae3ec9", "#e67700", "#0c8599", "#c2255c",
  "#5c7cfa", "#74b816", "#f59f00", "#1098ad", "#7048e8"];

const $ = (id) => document.getElementById(id);
const fmt = new Intl.NumberFormat("en-US");
const num = (n) => (n === null || n === undefined ? "–" : fmt.format(n));

let timer = null;
let busy = false;
let last = null; // the last good refresh: {workers, load, health, overview, at}
let historyAt = 0; // when the chart's samples were last fetched (ms since the epoch)
let core = null; // the promise of kvroute's WebAssembly core (see loadCore)
let kv = null; // the core, once loaded

/** Loads the hashing module once; a failure leaves the fleet tables working. */
function loadCore() {
  if (!core) {
    core = import("./pkg/kvroute_js.js").then(async (m) => {
      await m.default();
      kv = m;
      return m;
    });
    core.catch(() => {
      core = null;
    });
  }
  return core;
}

/** A refusal of the read token: the page then shows no data at all. */
class AuthError extends Error {}

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

async function api(path, init = {}) {
  const headers = { ...(init.headers || {}) };
  const t = token();
  if (t) headers.Authorization = "Bearer " + t;
  const ctl = new AbortController();
  const timeout = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
  let res;
  try {
    res = await fetch(new URL(path, ROOT), { ...init, headers, signal: ctl.signal, cache: "no-store" });
  } catch (e) {
    const why = e.name === "AbortError" ? `no answer within ${FETCH_TIMEOUT_MS / 1000} s` : e.message;
    throw new Error(`/${path}: the collector did not answer (${why})`);
  } finally {
    clearTimeout(timeout);
  }
  const text = await res.text();
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null;
  }
  if (res.status === 401) {
    const why = body && body.error ? body.error : "unauthorized";
    throw new AuthError(t
      ? `The collector refused this read token (401: ${why}). Enter the right one above.`
      : `This collector needs its read token (401: ${why}). Enter it above.`);
  }
  if (!res.ok) {
    throw new Error(`/${path}: ${res.status} ${body && body.error ? body.error : text.slice(0, 200)}`);
  }
  return body;
}

function showError(msg) {
  const el = $("error");
  el.textContent = msg || "";
  el.hidden = !msg;
}

/** Drops every piece of fleet data from the page (a refused token must show none). */
function clearData() {
  last = null;
  historyAt = 0;
  $("data").hidden = true;
  $("engines").tBodies[0].replaceChildren();
  $("gateways").replaceChildren();
  $("probe-bars").replaceChildren();
  $("probe-explain").replaceChildren();
  $("probe-model").replaceChildren();
  $("probe-status").textContent = "";
  for (const id of ["chart-blocks", "chart-events", "legend"]) $(id).replaceChildren();
  $("updated").textContent = "";
}

async function refresh() {
  if (busy) return;
  busy = true;
  try {
    const withHistory = !last || Date.now() - historyAt >= HISTORY_EVERY_MS;
    const [workers, load, health, overview] = await Promise.all([
      api("workers"), api("v1/load"), api("health"),
      api(withHistory ? "v1/fleet/overview" : "v1/fleet/overview?history=false"),
    ]);
    if (withHistory) historyAt = Date.now();
    else overview.history = last.overview.history;
    last = { workers: workers.workers, load, health, overview, at: new Date(), withHistory };
    showError(null);
    render(last);
    $("data").hidden = false;
  } catch (e) {
    if (e instanceof AuthError) {
      clearData();
      setHealth(null);
    } else if (last) {
      $("updated").textContent = `stale since ${last.at.toLocaleTimeString()}`;
    }
    showError(e.message);
  } finally {
    busy = false;
    schedule();
  }
}

function schedule() {
  clearTimeout(timer);
  const every = Number($("refresh").value);
  if (every > 0 && !document.hidden) timer = setTimeout(refresh, every);
}

function setHealth(h) {
  const el = $("health");
  if (!h) {
    el.className = "badge";
    el.textContent = "…";
    el.title = "collector /health";
    setAlarms([], []);
    return;
  }
  el.className = "badge " + (h.status === "ok" ? "ok" : "warn");
  el.textContent = h.status === "ok" ? "collector ok" : "collector degraded";
  el.title = h.reasons && h.reasons.length ? h.reasons.join("\n") : "no problems reported";
  setAlarms(h.alarms, h.reasons);
}

/**
 * The banner: one line per alarm `/health` lists (`{alarm, subject, reason}`), then one per
 * other reason it is degraded (the event bus down, a scrape failing, ...), so a degraded
 * collector says why on the page, not only in the badge's tooltip.
 */
function setAlarms(alarms, reasons) {
  const list = Array.isArray(alarms) ? alarms : [];
  const items = list.map((a) => {
    const li = document.createElement("li");
    li.dataset.alarm = a.alarm;
    li.textContent = a.reason;
    return li;
  });
  const raised = new Set(list.map((a) => a.reason));
  for (const r of Array.isArray(reasons) ? reasons : []) {
    if (raised.has(r)) continue;
    const li = document.createElement("li");
    li.dataset.problem = "";
    li.textContent = r;
    items.push(li);
  }
  $("alarm-list").replaceChildren(...items);
  $("alarms").hidden = items.length === 0;
}

function ago(ms) {
  if (ms === null || ms === undefined) return "–";
  if (ms < 1000) return `${ms} ms`;
  if (ms < 60_000) return `${(ms / 1000).toFixed(1)} s`;
  if (ms < 3_600_000) return `${Math.floor(ms / 60_000)} min ${Math.floor((ms % 60_000) / 1000)} s`;
  return `${(ms / 3_600_000).toFixed(1)} h`;
}

function byKey(list, key) {
  const m = new Map();
  for (const x of list || []) m.set(x[key], x);
  return m;
}

function workerName(w) {
  return w.dp_rank ? `${w.instance_id} dp${w.dp_rank}` : w.instance_id;
}

function render(d) {
  setHealth(d.health);
  $("updated").textContent = `updated ${d.at.toLocaleTimeString()}`;
  renderSummary(d);
  renderEngines(d);
  if (d.withHistory) renderCharts(d);
  renderModels(d.workers);
}

// The event stream and whether the engine is routed: an engine without events is still
// routed (empty cache, by load and text), so "no events" is a warning, not "down".
function streamCell(w) {
  let text, cls, title;
  if (w.routable === false) {
    text = "down";
    cls = "down";
    title = w.metrics_down ? "its /metrics fail after having answered: not routed to"
      : "its event stream dropped longer than keep_disconnected: not routed to";
  } else if (w.connected) {
    text = "connected";
    cls = "up";
    title = "KV events flowing";
  } else {
    text = w.event_stream === "dropped" ? "events dropped" : "no events";
    cls = "noevents";
    title = "no KV event stream: routed with an empty cache, by load and text approximate mode";
  }
  const c = cell(text, null, title);
  c.classList.add("state", cls);
  c.dataset.stream = w.event_stream || "";
  return c;
}

function renderSummary(d) {
  const o = d.overview;
  const up = d.workers.filter((w) => w.connected).length;
  const instances = new Set(d.workers.map((w) => w.instance_id)).size;
  const noEvents = d.workers.filter((w) => !w.connected).length;
  $("sum-engines").textContent = `${up} / ${d.workers.length} connected`;
  if (noEvents) $("sum-engines").textContent += `, ${noEvents} without events`;
  $("sum-engines-sub").textContent = `${instances} instances, ${d.workers.length} dp ranks`;
  $("sum-blocks").textContent = `${num(o.index.blocks)} blocks`;
  $("sum-blocks-sub").textContent = `${num(o.index.holds)} holds, ${num(o.index.scopes)} scopes`;
  const samples = o.history.samples;
  const recent = samples.slice(-5);
  const perSec = recent.length > 1
    ? recent.slice(1).reduce((a, s) => a + s.events, 0) / ((recent.length - 1) * o.history.interval_ms / 1000)
    : 0;
  const total = d.workers.reduce((a, w) => a + w.events, 0);
  const gaps = d.workers.reduce((a, w) => a + w.gaps, 0);
  $("sum-events").textContent = `${perSec.toFixed(1)} /s`;
  $("sum-events-sub").textContent = `${num(total)} applied, ${num(gaps)} gaps`;
  $("sum-feed").textContent = `cursor ${num(o.feed.cursor)}`;
  $("sum-feed-sub").textContent = `epoch ${o.feed.epoch}, ${num(o.feed.log_entries)} log entries; ` +
    `served ${num(o.feed.deltas_served)} deltas, ${num(o.feed.snapshots_served)} snapshots`;
  $("sum-gateways").textContent = `${o.gateways.length}`;
  const list = $("gateways");
  list.replaceChildren(...o.gateways.map((g) => {
    const li = document.createElement("li");
    li.textContent = `${g.id}: last report ${ago(g.report_age_ms)} ago`;
    return li;
  }));
  if (!o.gateways.length) {
    const li = document.createElement("li");
    li.textContent = `none within ${o.gateway_timeout_ms / 1000} s (gateways with load.fleet report here)`;
    list.append(li);
  }
}

function cell(text, cls, title) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  if (title) td.title = title;
  return td;
}

function renderEngines(d) {
  const load = byKey(d.load.workers, "worker");
  const extra = byKey(d.overview.workers, "worker_id");
  const rows = [...d.workers].sort((a, b) =>
    a.instance_id.localeCompare(b.instance_id) || a.dp_rank - b.dp_rank);
  const filter = $("filter").value.trim().toLowerCase();
  const body = $("engines").tBodies[0];
  const out = [];
  let prev = null;
  for (const w of rows) {
    const hay = `${w.instance_id} ${w.model_name} ${w.tenant_id} ${w.address} ${w.lora_name || ""}`.toLowerCase();
    if (filter && !hay.includes(filter)) continue;
    // Only numbers for the same worker: ids are reused after /unregister.
    const x = extra.get(w.worker_id);
    const e = x && x.instance_id === w.instance_id && x.dp_rank === w.dp_rank ? x : null;
    const l = load.get(w.worker_id);
    const tr = document.createElement("tr");
    tr.dataset.workerId = w.worker_id;
    tr.dataset.instance = w.instance_id;
    tr.dataset.dp = w.dp_rank;
    tr.dataset.blocks = w.blocks;
    if (prev !== w.instance_id) tr.className = "group-start";
    const same = prev === w.instance_id;
    prev = w.instance_id;
    tr.append(cell(same ? "" : w.instance_id, null, `endpoint ${w.endpoint}` +
      (w.replay_endpoint ? `\nreplay ${w.replay_endpoint}` : "") +
      (w.registered ? "" : "\nnamed by its publisher's dp rank")));
    tr.append(cell(String(w.dp_rank), "num"));
    tr.append(cell(w.lora_name ? `${w.model_name} (LoRA ${w.lora_name})` : w.model_name,
      null, `block size ${w.block_size}`));
    tr.append(cell(w.tenant_id, "dim"));
    tr.append(streamCell(w));
    const blocks = cell(num(w.blocks), "num");
    blocks.dataset.field = "blocks";
    tr.append(blocks);
    const t = e && e.tiers;
    for (const k of ["gpu", "cpu", "disk"]) tr.append(cell(t ? num(t[k]) : "–", "num"));
    tr.append(cell(num(w.events), "num", `${num(w.batches)} batches, last seq ${w.last_seq ?? "–"}, ` +
      `${num(w.replays)} replays, ${num(w.restarts)} restarts, ${num(w.orphans)} orphans`));
    tr.append(cell(num(w.gaps), w.gaps ? "num warn" : "num"));
    tr.append(cell(e && e.last_event_age_ms !== null ? ago(e.last_event_age_ms) : "–", "num"));
    tr.append(cell(l ? `${num(l.requests)} / ${num(l.prefill_tokens)} / ${num(l.decode_tokens)}` : "–", "num"));
    const eng = l && l.engine;
    tr.append(cell(eng ? `${eng.waiting} / ${eng.running} / ${(eng.kv_usage * 100).toFixed(0)}%` : "–",
      eng && eng.stale ? "num warn" : "num",
      eng ? `scraped ${ago(eng.age_ms)} ago${eng.stale ? " (stale: the engine stopped answering)" : ""}` : "never scraped"));
    tr.append(cell(w.address, "dim"));
    if (w.decode_errors) tr.children[9].classList.add("bad");
    out.push(tr);
  }
  body.replaceChildren(...out);
  const note = $("tiers-note");
  note.hidden = d.overview.tiers_counted;
  note.textContent = d.overview.tiers_counted ? "" :
    `Tier split not counted: the index holds more than ${num(d.overview.tiers_limit)} blocks.`;
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

/** Axes of a chart 600×180 with room for labels; returns the plot's x/y mappers. */
function frame(el, spanMs, maxY, unit) {
  const [x0, x1, y0, y1] = [48, 592, 160, 10];
  el.replaceChildren();
  for (const f of [0, 0.5, 1]) {
    const y = y0 - (y0 - y1) * f;
    el.append(svg("line", { x1: x0, x2: x1, y1: y, y2: y, class: "grid" }));
    el.append(svg("text", { x: x0 - 6, y: y + 4, "text-anchor": "end" }, compact(maxY * f) + (f === 1 ? unit : "")));
  }
  el.append(svg("text", { x: x0, y: 176 }, `−${duration(spanMs)}`));
  el.append(svg("text", { x: (x0 + x1) / 2, y: 176, "text-anchor": "middle" }, `−${duration(spanMs / 2)}`));
  el.append(svg("text", { x: x1, y: 176, "text-anchor": "end" }, "now"));
  return {
    x: (ageMs) => x1 - (x1 - x0) * Math.min(1, ageMs / spanMs),
    y: (v) => y0 - (y0 - y1) * (maxY > 0 ? v / maxY : 0),
    x0, x1, y0,
  };
}

function duration(ms) {
  return ms >= 60_000 ? `${+(ms / 60_000).toFixed(1)} min` : `${Math.round(ms / 1000)} s`;
}

function compact(n) {
  if (n >= 1e6) return (n / 1e6).toFixed(n >= 1e7 ? 0 : 1) + "M";
  if (n >= 1e3) return (n / 1e3).toFixed(n >= 1e4 ? 0 : 1) + "k";
  return n >= 10 || Number.isInteger(n) ? String(Math.round(n)) : n.toFixed(1);
}

function renderCharts(d) {
  const h = d.overview.history;
  const names = new Map(d.workers.map((w) => [w.worker_id, workerName(w)]));
  // The time the samples cover (a collector that just started has little), at least a minute.
  const oldest = h.samples.length ? h.samples[0].age_ms : 0;
  const spanMs = Math.min(h.span_ms, Math.max(60_000, Math.ceil(oldest / 60_000) * 60_000));
  for (const el of document.querySelectorAll(".span")) el.textContent = duration(spanMs);
  // Blocks per engine.
  const series = new Map();
  let maxB = 0;
  for (const s of h.samples) {
    for (const [id, b] of s.blocks) {
      if (!series.has(id)) series.set(id, []);
      series.get(id).push([s.age_ms, b]);
      maxB = Math.max(maxB, b);
    }
  }
  const chart = $("chart-blocks");
  const f = frame(chart, spanMs, niceMax(maxB), "");
  const legend = [];
  [...series.keys()].sort((a, b) => a - b).forEach((id, i) => {
    const color = PALETTE[i % PALETTE.length];
    const pts = series.get(id).map(([age, b]) => `${f.x(age).toFixed(1)},${f.y(b).toFixed(1)}`).join(" ");
    chart.append(svg("polyline", { points: pts, class: "line", stroke: color }));
    const span = document.createElement("span");
    span.textContent = names.get(id) || `worker ${id}`;
    span.style.setProperty("--swatch", color);
    legend.push(span);
  });
  $("legend").replaceChildren(...legend);
  // Events per second, fleet.
  const sec = h.interval_ms / 1000;
  const rates = h.samples.slice(1).filter((s) => s.age_ms <= spanMs).map((s) => [s.age_ms, s.events / sec]);
  const maxE = niceMax(Math.max(0, ...rates.map((r) => r[1])));
  const ev = $("chart-events");
  const g = frame(ev, spanMs, maxE, "/s");
  const w = Math.max(1, (g.x1 - g.x0) * h.interval_ms / spanMs - 1);
  for (const [age, r] of rates) {
    if (r <= 0) continue;
    const y = g.y(r);
    ev.append(svg("rect", { x: (g.x(age) - w).toFixed(1), y: y.toFixed(1), width: w.toFixed(1), height: (g.y0 - y).toFixed(1), class: "bar" }));
  }
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

/** The probe's model list: every (tenant, model) the workers serve, with its block size. */
function renderModels(workers) {
  const sel = $("probe-model");
  const seen = new Map();
  for (const w of workers) seen.set(`${w.tenant_id}\u0000${w.model_name}`, w);
  const keep = sel.value;
  const opts = [...seen.entries()].sort().map(([key, w]) => {
    const o = document.createElement("option");
    o.value = key;
    o.textContent = w.tenant_id === "default" ? w.model_name : `${w.model_name} (tenant ${w.tenant_id})`;
    o.dataset.blockSize = w.block_size;
    return o;
  });
  const same = opts.length === sel.options.length && opts.every((o, i) => o.value === sel.options[i].value);
  if (!same) {
    sel.replaceChildren(...opts);
    if (opts.some((o) => o.value === keep)) sel.value = keep;
  }
}

/** Token ids of the probe's input, read by the core as the filter reads them: a JSON body
 * (with its model and cache_salt, when present) or a header value. */
function probeTokens(raw) {
  if (raw.startsWith("{")) {
    const b = kv.readBody(raw, undefined);
    if (!b.tokenField) throw new Error("no token ids in the body (prompt, prompt_token_ids or input_ids)");
    return { tokens: b.tokens, model: b.model, cacheSalt: b.cacheSalt };
  }
  // The header form is a comma list or base64; a pasted JSON array or a space-separated list
  // is made a comma list first.
  let list = raw.startsWith("[") && raw.endsWith("]") ? raw.slice(1, -1) : raw;
  if (!list.includes(",") && /^[\d\s]+$/.test(list)) list = list.trim().split(/\s+/).join(",");
  return { tokens: kv.parseTokenHeader(list), model: null, cacheSalt: null };
}

function probeStatus(msg, cls) {
  const el = $("probe-status");
  el.textContent = msg;
  el.className = cls || "muted";
}

async function runProbe(ev) {
  ev.preventDefault();
  $("probe-bars").replaceChildren();
  $("probe-explain").replaceChildren();
  probeStatus("Probing…");
  const raw = $("probe-input").value.trim();
  if (!raw) return probeStatus("Paste token ids or a JSON body first.", "bad");
  const sel = $("probe-model");
  if (!sel.value) return probeStatus("No model is registered.", "bad");
  let [tenant, model] = sel.value.split("\u0000");
  const lora = $("probe-lora").value.trim() || undefined;
  let salt = $("probe-salt").value.trim() || undefined;
  try {
    await loadCore();
    const parsed = probeTokens(raw);
    const tokens = parsed.tokens;
    // A body's own cache_salt counts, as it does for the filter, unless one is typed in.
    if (!salt && parsed.cacheSalt) salt = parsed.cacheSalt;
    if (parsed.model && parsed.model !== model) {
      const key = `${tenant}\u0000${parsed.model}`;
      if (![...sel.options].some((o) => o.value === key)) {
        return probeStatus(`The body names model "${parsed.model}", which no engine of tenant "${tenant}" serves.`, "bad");
      }
      sel.value = key;
      model = parsed.model;
    }
    const blockSize = Number(sel.selectedOptions[0].dataset.blockSize);
    const started = performance.now();
    const hashes = kv.blockHashes(tokens, blockSize, lora, salt);
    const took = performance.now() - started;
    if (hashes.length === 0) {
      return probeStatus(`${tokens.length} tokens: fewer than one block of ${blockSize}, nothing to look up.`, "bad");
    }
    const scope = { model_name: model, tenant_id: tenant, lora_name: lora ?? null, cache_salt: salt ?? null };
    // Hashes are u64: written as JSON integers by hand, since JSON.stringify cannot write a
    // BigInt and a Number would round them.
    const byHash = `{"block_hashes":[${Array.from(hashes, (h) => h.toString()).join(",")}],` +
      JSON.stringify(scope).slice(1);
    const byIds = JSON.stringify({ token_ids: Array.from(tokens), ...scope });
    const post = (path, body) => api(path, { method: "POST", body, headers: { "content-type": "application/json" } });
    const [hashed, direct, why] = await Promise.all([
      post("query_by_hash", byHash), post("query", byIds), post("v1/explain", byIds)]);
    drawBars(hashed, tenant, model);
    drawExplain(why);
    const disagree = [];
    const names = new Set([...Object.keys(hashed.instances), ...Object.keys(direct.instances)]);
    for (const n of names) {
      const a = hashed.instances[n] ? hashed.instances[n].longest_matched : 0;
      const b = direct.instances[n] ? direct.instances[n].longest_matched : 0;
      if (a !== b) disagree.push(`${n}: ${a} vs ${b} tokens`);
    }
    const summary = `${num(tokens.length)} tokens → ${hashed.query_blocks} blocks of ${hashed.block_size}, ` +
      `hashed in the browser in ${took < 0.1 ? "under 0.1" : took.toFixed(1)} ms` +
      (salt && !$("probe-salt").value.trim() ? " (cache_salt from the body)." : ".");
    if (disagree.length) {
      probeStatus(`${summary} The browser's hashes and the collector's /query disagree (${disagree.join("; ")}): ` +
        "check the LoRA name and cache_salt.", "bad");
    } else {
      probeStatus(`${summary} /query with the same ids agrees.`, "ok");
    }
  } catch (e) {
    if (e instanceof AuthError) {
      clearData();
      showError(e.message);
      return;
    }
    probeStatus(`Probe failed: ${e.message || e}`, "bad");
  }
}

/** The decision `/v1/explain` lays out: who would win, at what cost, and every instance's
 * terms, as the filter's router code computed them on the fleet load the collector holds. */
function drawExplain(why) {
  const cap = document.createElement("p");
  cap.id = "explain-verdict";
  const cost = (c) => (c === null || c === undefined ? "–" : c.toFixed(2));
  if (why.winner) {
    cap.dataset.winner = why.winner.instance_id;
    cap.textContent = `Routes to ${why.winner.instance_id} (cost ${cost(why.winner.cost)} blocks of work ahead)` +
      (why.runner_up ? `; runner-up ${why.runner_up.instance_id} (${cost(why.runner_up.cost)}).` : ".");
  } else {
    cap.textContent = why.verdict === "deferred"
      ? "Nobody holds a block and the policy defers: Envoy's own balancing picks."
      : "No instance serves this model.";
  }
  const table = document.createElement("table");
  table.className = "explain";
  const head = table.createTHead().insertRow();
  for (const h of ["instance", "matched (GPU / any)", "in flight (req / prefill)", "engine (wait / KV)", "competes", "cost"]) {
    const th = document.createElement("th");
    th.textContent = h;
    head.append(th);
  }
  const body = table.createTBody();
  for (const i of why.instances) {
    const tr = body.insertRow();
    tr.dataset.instance = i.instance_id;
    const e = i.engine;
    const cells = [
      i.instance_id,
      `${num(i.matched_tokens[0])} / ${num(i.matched_tokens[2])}`,
      `${num(i.requests)} / ${num(i.prefill_tokens)}`,
      e ? `${e.waiting} / ${Math.round(e.kv_usage * 100)}%${e.stale ? " (stale)" : ""}` : "–",
      i.competes ? "yes" : (i.saturated ? "no: saturated" : "no"),
      cost(i.cost),
    ];
    for (const c of cells) tr.insertCell().textContent = c;
  }
  $("probe-explain").replaceChildren(cap, table);
}

function drawBars(res, tenant, model) {
  const total = res.query_blocks * res.block_size;
  const names = new Set(Object.keys(res.instances));
  // Engines of the model that match nothing still get a (empty) bar: "not cached there" is
  // an answer too.
  for (const w of (last ? last.workers : [])) {
    if (w.tenant_id === tenant && w.model_name === model) names.add(w.instance_id);
  }
  const rows = [...names].map((n) => ({ name: n, m: res.instances[n] || { longest_matched: 0, gpu: 0, cpu: 0, disk: 0, dp: {} } }))
    .sort((a, b) => b.m.longest_matched - a.m.longest_matched || a.name.localeCompare(b.name));
  const best = rows.length && rows[0].m.longest_matched > 0 ? rows[0].m.longest_matched : -1;
  const out = rows.map(({ name, m }) => {
    const row = document.createElement("div");
    row.className = "probe-bar" + (m.longest_matched === best ? " best" : "");
    row.dataset.instance = name;
    row.dataset.matched = m.longest_matched;
    const label = document.createElement("span");
    label.className = "name";
    label.textContent = name;
    label.title = name;
    const track = document.createElement("div");
    track.className = "track";
    // Widest first so the better tiers paint over it.
    for (const k of ["disk", "cpu", "gpu"]) {
      const seg = document.createElement("div");
      seg.className = "seg " + k;
      seg.style.width = `${total ? (100 * Math.min(m[k], total)) / total : 0}%`;
      track.append(seg);
    }
    const text = document.createElement("span");
    text.className = "label";
    const pct = total ? Math.round((100 * m.longest_matched) / total) : 0;
    const dp = Object.keys(m.dp || {}).length > 1
      ? " · " + Object.entries(m.dp).map(([r, t]) => `dp${r} ${t}`).join(", ") : "";
    text.textContent = `${num(m.longest_matched)} / ${num(total)} tokens (${pct}%) · GPU ${num(m.gpu)}${dp}`;
    row.append(label, track, text);
    return row;
  });
  $("probe-bars").replaceChildren(...out);
}

function start() {
  $("token").value = "";
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const t = $("token").value.trim();
    if (t) sessionStorage.setItem(TOKEN_KEY, t);
    else sessionStorage.removeItem(TOKEN_KEY);
    $("token").value = "";
    clearData();
    refresh();
  });
  $("token-forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    clearData();
    refresh();
  });
  $("refresh").addEventListener("change", () => (last ? schedule() : refresh()));
  $("filter").addEventListener("input", () => last && renderEngines(last));
  $("probe-form").addEventListener("submit", runProbe);
  document.addEventListener("visibilitychange", () => (document.hidden ? clearTimeout(timer) : refresh()));
  refresh();
  // Ready before the first probe; an error shows there.
  loadCore().catch(() => {});
}

start();
