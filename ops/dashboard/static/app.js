// The dashboard page: one snapshot on (re)connect, then live updates over server-sent events.
"use strict";

const LEVELS = ["debug", "info", "warning", "error", "critical"];
const MAX_EVENT_ROWS = 300;
const COLORS = ["#4a7bd0", "#d0654a", "#3a9d5d", "#9b59b6", "#c9a227", "#17a2b8", "#7f8c8d", "#e84393"];

const state = { train: [], eval: [], slots: [], events: [], status: {}, config: {}, counts: {}, health: {} };
const charts = {};
window.dashboard = { state, charts };  // for people at the console and for the browser tests

// --- charts ------------------------------------------------------------------------------------
// Each chart: an x field, and series (field, label) read from a list of rows.
const CHARTS = {
  "chart-reward": { rows: () => state.train, x: "version", series: [["reward_mean", "reward"], ["pass_rate", "pass rate"]],
                    extra: () => ({ rows: state.eval, field: "pass_at_1", label: "held-out pass@1" }) },
  "chart-loss": { rows: () => state.train, x: "version", series: [["loss", "loss"], ["pg_loss", "pg loss"], ["kl", "KL"]] },
  "chart-ratio": { rows: () => state.train, x: "version",
                   series: [["ratio_mean", "mean"], ["ratio_median", "median"], ["ratio_min", "min"], ["ratio_max", "max"]] },
  "chart-lr": { rows: () => state.train, x: "version", series: [["lr", "lr"], ["grad_norm", "grad norm"]], twoAxes: true },
  "chart-samples": { rows: () => state.train, x: "version",
                     series: [["samples_per_s", "samples/s"], ["trainer_utilisation", "trainer util"]] },
  "chart-tokens": { rows: () => state.train, x: "version", series: [["tokens_per_s", "tokens/s"]] },
  "chart-lag": { rows: () => state.train, x: "version", series: [["lag_min", "lag min"], ["lag_max", "lag max"]] },
  "chart-slots": { rows: () => state.slots, x: "time", time: true, series: null },
};

// axis ticks that stay readable for learning rates (3e-4) and counts (12,000) alike
function ticks(_, values) { return values.map(v => v === 0 ? "0" : Math.abs(v) < 1e-2 || Math.abs(v) >= 1e5 ? v.toExponential(1) : +v.toPrecision(4)); }

function num(v) { const n = typeof v === "number" ? v : parseFloat(v); return Number.isFinite(n) ? n : null; }

function seriesOf(spec) {
  if (spec.series) return spec.series;
  const keys = new Set();
  for (const row of spec.rows()) for (const k of Object.keys(row)) if (k !== "time") keys.add(k);
  return [...keys].sort().map(k => [k, k]);
}

// uPlot's tick loop never ends on a range that is flat up to float noise (a ratio of 1 ± 2e-7: leeoniya/uPlot#1084
// leaves such a range to the caller), and throws "Invalid array length" once memory runs out: widen it first.
function safeRange(u, min, max) {
  if (min === null || max === null || !Number.isFinite(min) || !Number.isFinite(max)) return [0, 1];
  const magnitude = Math.max(Math.abs(min), Math.abs(max));
  if (max - min <= magnitude * 1e-6) {
    const pad = magnitude > 0 ? magnitude * 0.1 : 1;
    return [min - pad, max + pad];
  }
  return uPlot.rangeNum(min, max, 0.1, true);
}

function chartData(spec) {
  const rows = spec.rows().filter(r => num(r[spec.x]) !== null), series = seriesOf(spec);
  let xs = rows.map(r => num(r[spec.x]));
  const columns = series.map(([f]) => rows.map(r => num(r[f])));
  if (spec.extra) {  // another row list on the same x (held-out evaluations at some versions)
    const extra = spec.extra(), at = new Map(extra.rows.map(r => [num(r[spec.x]), num(r[extra.field])]));
    const allX = [...new Set([...xs, ...at.keys()])].filter(x => x !== null).sort((a, b) => a - b);
    const byX = new Map(xs.map((x, i) => [x, i]));
    return { series: [...series, [extra.field, extra.label]],
             data: [allX, ...columns.map(c => allX.map(x => byX.has(x) ? c[byX.get(x)] : null)),
                    allX.map(x => at.has(x) ? at.get(x) : null)] };
  }
  return { series, data: [xs, ...columns] };
}

function draw(id) {
  const spec = CHARTS[id], el = document.getElementById(id);
  const { series, data } = chartData(spec);
  const key = series.map(s => s[0]).join(",");
  if (charts[id] && charts[id].key === key) { charts[id].plot.setData(data); return; }
  if (charts[id]) charts[id].plot.destroy();
  const opts = {
    width: 420, height: 200,
    scales: { x: spec.time ? { time: true } : { time: false, range: safeRange }, y: { range: safeRange },
              ...(spec.twoAxes ? { y2: { range: safeRange } } : {}) },
    series: [{ label: spec.x }, ...series.map(([, label], i) => ({
      label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
      points: { show: data[0].length < 60 }, scale: spec.twoAxes && i === 1 ? "y2" : "y" }))],
    axes: spec.twoAxes ? [{}, { scale: "y", values: ticks, size: 60 }, { scale: "y2", side: 1, values: ticks, size: 60 }]
                       : [{}, { values: ticks, size: 60 }],
  };
  charts[id] = { key, plot: new uPlot(opts, data, el) };
}

function drawCharts() { for (const id of Object.keys(CHARTS)) draw(id); }

// --- tables --------------------------------------------------------------------------------------
function cell(tr, text, cls) { const td = tr.insertCell(); td.textContent = text; if (cls) td.className = cls; return td; }

function renderStatus() {
  const st = state.status || {}, rec = st.reconciler, trainer = st.trainer;
  const lc = rec && rec.lifecycle;
  const head = [];
  if (trainer) head.push(`version ${trainer.version}`);
  if (rec) head.push(rec.finished ? "finished" : `eta ${rec.scheduling ? rec.scheduling.eta : "-"}`);
  if (lc) head.push(`${lc.samples_per_s.toFixed(2)} samples/s`);
  document.getElementById("headline").textContent = head.join(" · ");

  const body = document.querySelector("#actor-table tbody");
  body.replaceChildren();
  for (const a of st.actors || []) {
    const tr = body.insertRow(), shown = a.live === false ? "gone" : a.state;
    cell(tr, a.kind); cell(tr, a.id); cell(tr, shown, `state-${shown}`); cell(tr, `${a.host || ""}/${a.pid}`);
    cell(tr, a.num_handled); cell(tr, a.num_failed); cell(tr, a.num_inflight); cell(tr, a.code_hash);
    cell(tr, a.uptime_s !== undefined ? `${Math.round(a.uptime_s)} s` : "");
    const h = state.health[a.id] || { health: "ok", restarts: 0, last_failure: "", checks_failed: 0 };
    const td = cell(tr, h.health, `health-${h.health}`);
    td.title = h.last_failure ? `${h.checks_failed} failed checks; last: ${h.last_failure}` : "no failed check";
    cell(tr, h.restarts).title = h.replaces ? `replaces ${h.replaces}` : "the first process in its place";
  }
  document.getElementById("unanswered").textContent =
    (st.unanswered || []).map(u => `no status from ${u.id}: ${u.error}`).join("; ");

  const lat = document.querySelector("#latency tbody");
  lat.replaceChildren();
  if (lc) {
    for (const [stage, v] of Object.entries(lc.stage_latency)) {
      const tr = lat.insertRow();
      cell(tr, stage); cell(tr, (v.p50_s * 1e3).toFixed(1)); cell(tr, (v.p99_s * 1e3).toFixed(1)); cell(tr, v.count);
    }
    document.getElementById("counters").textContent =
      Object.entries(lc.counters).map(([k, v]) => `${k}=${v}`).join("  ");
    renderHistogram(lc.lag_histogram);
  }
}

function renderHistogram(hist) {
  const el = document.getElementById("lag-histogram");
  const entries = Object.entries(hist || {}).map(([k, v]) => [parseInt(k, 10), v]).sort((a, b) => a[0] - b[0]);
  const max = Math.max(1, ...entries.map(e => e[1]));
  el.replaceChildren();
  for (const [lag, count] of entries) {
    const bar = document.createElement("div");
    bar.style.height = `${(170 * count) / max}px`;
    bar.title = `lag ${lag}: ${count} samples`;
    const label = document.createElement("span"); label.textContent = lag; bar.appendChild(label);
    el.appendChild(bar);
  }
}

function renderConfig() {
  const body = document.querySelector("#config-table tbody");
  const typing = [...body.querySelectorAll("input")].some(i => i.value !== "");
  if (typing) return;  // never replace an input the operator is typing into; redrawn once it is sent
  body.replaceChildren();
  for (const key of Object.keys(state.config).sort()) {
    const tr = body.insertRow();
    tr.dataset.key = key;
    cell(tr, key); cell(tr, JSON.stringify(state.config[key]));
    const input = document.createElement("input"); input.name = key; input.size = 14;
    tr.insertCell().appendChild(input);
    const button = document.createElement("button"); button.textContent = "set";
    button.onclick = async () => { if (await setConfig(key, input.value)) { input.value = ""; renderConfig(); } };
    tr.insertCell().appendChild(button);
  }
}

async function setConfig(key, value) {
  const out = document.getElementById("config-result");
  try {
    const reply = await fetch("/api/config", { method: "POST", headers: { "Content-Type": "application/json" },
                                               body: JSON.stringify({ key, value }) });
    const body = await reply.json();
    out.textContent = body.ok ? `${key} = ${JSON.stringify(body.value)}: sent to the actors` : `refused: ${body.error}`;
    out.className = body.ok ? "small" : "warn";
    return body.ok;
  } catch (e) {
    out.textContent = `not sent: ${e}`; out.className = "warn";
    return false;
  }
}

function eventShown(e) {
  const level = document.getElementById("event-level").value, kind = document.getElementById("event-kind").value;
  const text = document.getElementById("event-text").value.trim();
  return LEVELS.indexOf(e.level || "info") >= LEVELS.indexOf(level) && (!kind || e.kind === kind)
    && (!text || String(e.event || "").includes(text));
}

function eventRow(body, e, atTop) {
  const tr = atTop ? body.insertRow(0) : body.insertRow();
  const fields = Object.fromEntries(Object.entries(e).filter(([k]) => !["time", "level", "event", "kind", "actor"].includes(k)));
  cell(tr, String(e.time || "").replace("T", " ").slice(0, 23)); cell(tr, e.level, `level-${e.level}`);
  cell(tr, e.actor || e.kind || ""); cell(tr, e.event); cell(tr, JSON.stringify(fields));
}

function renderEvents() {
  const body = document.querySelector("#event-table tbody");
  body.replaceChildren();
  const shown = state.events.filter(eventShown).slice(-MAX_EVENT_ROWS).reverse();
  for (const e of shown) eventRow(body, e, false);
  renderEventKinds();
}

function renderEventKinds() {
  const select = document.getElementById("event-kind");
  const known = new Set([...select.options].map(o => o.value));
  for (const e of state.events) if (e.kind && !known.has(e.kind)) { select.add(new Option(e.kind, e.kind)); known.add(e.kind); }
  document.getElementById("event-counts").textContent =
    LEVELS.filter(l => state.counts[l]).map(l => `${l}: ${state.counts[l]}`).join("  ");
}

// --- rollout viewer ---------------------------------------------------------------------------------
// A token's colour says which policy version sampled it; grey ones were not sampled by the policy
// (prompt, tool output: loss mask 0), so they carry no gradient.
function versionColor(version) { return `hsl(${(version * 47) % 360}, 70%, 82%)`; }
// A trained token whose trainer log-prob is this far (nats) from its behaviour log-prob is marked: the ratio
// exp(trainer - behaviour) is then outside [0.82, 1.22] (on-policy it is exactly 1).
const LARGE_DELTA = 0.2;
const PIECE_SEPARATOR = "\x1f";
// a log-prob near 0 (a confident token) keeps its digits
function logprobText(x) { return Math.abs(x) >= 1e-3 || x === 0 ? x.toFixed(4) : x.toExponential(2); }

// per-token arrays travel as base64 of little-endian float32 (actors.sample_views)
function float32s(b64) {
  const bin = atob(b64 || ""), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return new Float32Array(bytes.buffer);
}

// the sample's summary of behaviour vs trainer log-probs over its trained tokens ([{b, t}], t NaN: not scored)
function trainerSummary(s, tokens) {
  let count = 0, sumAbs = 0, maxAbs = 0, minRatio = Infinity, maxRatio = -Infinity, large = 0;
  for (const { b, t } of tokens) {
    if (!Number.isFinite(t)) continue;
    const delta = t - b, ratio = Math.exp(delta);
    count++; sumAbs += Math.abs(delta); maxAbs = Math.max(maxAbs, Math.abs(delta));
    minRatio = Math.min(minRatio, ratio); maxRatio = Math.max(maxRatio, ratio);
    if (Math.abs(delta) > LARGE_DELTA) large++;
  }
  if (!count) return `trainer log-probs (policy version ${s.trainer_version}): no trained token`;
  return `trainer log-probs (policy version ${s.trainer_version}, the forward of its step to ${s.trainer_version + 1}): `
    + `${count} trained tokens · mean |Δ| ${(sumAbs / count).toExponential(2)} · max |Δ| ${maxAbs.toExponential(2)} · `
    + `ratio exp(trainer − behaviour) min ${minRatio.toFixed(4)} max ${maxRatio.toFixed(4)} · `
    + `${large} marked (|Δ| > ${LARGE_DELTA})`;
}

async function loadSamples() {
  const q = new URLSearchParams({ sort: document.getElementById("sample-sort").value,
                                  prompt: document.getElementById("sample-prompt").value,
                                  failed: document.getElementById("sample-failed").checked ? "1" : "" });
  const body = await (await fetch(`/api/samples?${q}`)).json();
  const rows = document.querySelector("#sample-table tbody");
  rows.replaceChildren();
  for (const s of body.samples || []) {
    const tr = rows.insertRow();
    tr.dataset.sample = s.sample_id;
    cell(tr, s.sample_id); cell(tr, s.prompt_id); cell(tr, s.version); cell(tr, (+s.reward).toFixed(3));
    cell(tr, s.advantage === undefined ? "" : (+s.advantage).toFixed(3)); cell(tr, s.passed ? "yes" : "no");
    tr.onclick = () => showSample(s.sample_id, tr);
  }
  document.getElementById("sample-note").textContent =
    body.note || `${(body.samples || []).length} samples of ${body.num_groups} kept groups`;
}

async function showSample(id, tr) {
  for (const row of document.querySelectorAll("#sample-table tr.picked")) row.classList.remove("picked");
  if (tr) tr.classList.add("picked");
  const reply = await fetch(`/api/samples/${encodeURIComponent(id)}`);
  const detail = document.getElementById("sample-detail");
  if (!reply.ok) { detail.textContent = (await reply.json()).error; return; }
  const s = await reply.json();
  detail.replaceChildren();
  const head = document.createElement("p");
  head.textContent = `${s.sample_id} · prompt ${s.prompt_id} · group ${s.group_id} · reward ${(+s.reward).toFixed(3)}`
    + (s.advantage !== undefined ? ` · advantage ${(+s.advantage).toFixed(3)}` : "") + (s.end ? ` · ended: ${s.end}` : "");
  detail.appendChild(head);
  for (const [title, obj] of [["reward components", s.components], ["tests", s.tests], ["group", s.group], ["tool calls", s.tool_uses]]) {
    if (!obj) continue;
    const p = document.createElement("p"); p.textContent = `${title}: ${JSON.stringify(obj)}`; detail.appendChild(p);
  }
  const versions = [...new Set((s.tokens || []).map(t => t[1]).filter(v => v >= 0))].sort((a, b) => a - b);
  const legend = document.createElement("p"); legend.className = "legend"; legend.textContent = "policy version: ";
  for (const v of versions) { const span = document.createElement("span"); span.textContent = v; span.style.background = versionColor(v); legend.appendChild(span); }
  const untrained = document.createElement("span"); untrained.textContent = "not sampled (loss mask 0)"; untrained.className = "untrained"; legend.appendChild(untrained);
  const marked = document.createElement("span"); marked.textContent = `|trainer − behaviour| > ${LARGE_DELTA} (hover a token for both)`; marked.className = "token large-delta"; legend.appendChild(marked);
  detail.appendChild(legend);
  // behaviour and trainer log-probs per segment, each token's at its position in its segment
  const behaviour = (s.behaviour_logprobs || []).map(float32s);
  const trainer = s.trainer_logprobs ? s.trainer_logprobs.map(float32s) : null;
  const perToken = [];
  const text = document.createElement("div"); text.className = "tokens";
  let segment = 0, position = 0;
  for (const [piece, version, trained, logprob, n, pieces] of s.tokens || []) {
    if (n === 0) { segment++; position = 0; }  // a chain's next segment starts after this separator
    const span = document.createElement("span");
    span.dataset.version = version;
    if (trained) {
      span.style.background = versionColor(version);
      span.title = `version ${version}, mean behaviour log-prob ${(+logprob).toFixed(3)}`;
    } else span.className = "untrained";
    // each token's text: given for a run that is not all ASCII, else its characters, one a token
    const texts = trained && behaviour[segment] ? (pieces ? pieces.split(PIECE_SEPARATOR) : Array.from(piece)) : null;
    if (texts && texts.length === n) {  // each token its own span: its behaviour and trainer log-probs
      span.className = "run";
      texts.forEach((tokenText, i) => {
        const tok = document.createElement("span"), p = position + i;
        const b = behaviour[segment][p], t = trainer && trainer[segment] ? trainer[segment][p] : NaN;
        tok.textContent = tokenText; tok.className = "token";
        tok.dataset.version = version; tok.style.background = versionColor(version);
        tok.dataset.behaviour = b;
        let title = `version ${version} · behaviour ${logprobText(b)}`;
        if (Number.isFinite(t)) {
          const delta = t - b;
          tok.dataset.trainer = t; tok.dataset.delta = delta;
          title += ` · trainer ${logprobText(t)} · Δ ${delta.toExponential(2)} · ratio ${Math.exp(delta).toFixed(4)}`;
          if (Math.abs(delta) > LARGE_DELTA) tok.classList.add("large-delta");
        } else title += trainer ? " · trainer: not scored" : " · trainer: not trained yet";
        tok.title = title;
        perToken.push({ b, t, text: tokenText, segment, position: p });
        span.appendChild(tok);
      });
    } else span.textContent = piece;
    position += n;
    text.appendChild(span);
  }
  const summary = document.createElement("p"); summary.id = "trainer-summary";
  if (trainer) summary.textContent = trainerSummary(s, perToken);
  else {
    summary.className = "untrained-note";
    summary.textContent = "trainer log-probs: not trained yet (they come with the step that trains it)"
      + (s.advantage === 0 ? "; with advantage 0 and no KL term the trainer leaves it out of its forward, so none come" : "");
  }
  detail.appendChild(summary);
  detail.appendChild(text);
  if (trainer) detail.appendChild(largestDeltas(perToken));
}

// the tokens whose trainer log-prob is furthest from their behaviour one, each with both, Δ and the ratio
function largestDeltas(tokens, count = 20) {
  const scored = tokens.filter(x => Number.isFinite(x.t)).sort((x, y) => Math.abs(y.t - y.b) - Math.abs(x.t - x.b));
  const table = document.createElement("table"); table.id = "largest-deltas";
  table.createCaption().textContent = `the ${Math.min(count, scored.length)} tokens of largest |Δ| (of ${scored.length})`;
  const head = table.createTHead().insertRow();
  for (const title of ["token", "segment:position", "behaviour", "trainer", "Δ", "ratio"]) {
    const th = document.createElement("th"); th.textContent = title; head.appendChild(th);
  }
  const body = table.createTBody();
  for (const x of scored.slice(0, count)) {
    const tr = body.insertRow(), delta = x.t - x.b;
    if (Math.abs(delta) > LARGE_DELTA) tr.className = "large-delta";
    cell(tr, JSON.stringify(x.text)); cell(tr, `${x.segment}:${x.position}`); cell(tr, logprobText(x.b));
    cell(tr, logprobText(x.t)); cell(tr, delta.toExponential(2)); cell(tr, Math.exp(delta).toFixed(4));
  }
  return table;
}

for (const id of ["sample-sort", "sample-failed"]) document.getElementById(id).addEventListener("change", loadSamples);
document.getElementById("sample-prompt").addEventListener("input", loadSamples);
document.getElementById("sample-refresh").addEventListener("click", loadSamples);

// --- live updates ------------------------------------------------------------------------------------
let pending = false;
function redrawSoon() {  // many updates in one burst (a replayed log) redraw once
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => { pending = false; drawCharts(); });
}

function parseEvent(line) { try { return JSON.parse(line); } catch (e) { return null; } }

function applyEvent(data) {
  state.events.push(data);
  if (state.events.length > 2000) state.events.shift();
  state.counts[data.level] = (state.counts[data.level] || 0) + 1;
  if (eventShown(data)) {
    const body = document.querySelector("#event-table tbody");
    eventRow(body, data, true);
    while (body.rows.length > MAX_EVENT_ROWS) body.deleteRow(-1);
  }
  if (data.kind && !document.querySelector(`#event-kind option[value="${CSS.escape(data.kind)}"]`)) renderEventKinds();
}

function apply(update) {
  const { kind, data } = update;
  if (kind === "event") {
    const parsed = parseEvent(data);
    if (!parsed) return;
    applyEvent(parsed);
  } else if (kind === "train") { state.train.push(data); redrawSoon(); }

  else if (kind === "eval") { state.eval.push(data); redrawSoon(); }
  else if (kind === "slots") { state.slots.push(data); if (state.slots.length > 3600) state.slots.shift(); redrawSoon(); }
  else if (kind === "status") { state.status = data; renderStatus(); }
  else if (kind === "config") { state.config = data; renderConfig(); }
  else if (kind === "actor_health") { state.health[data.id] = data; renderStatus(); }
}

function load(snapshot) {
  Object.assign(state, { train: snapshot.train, eval: snapshot.eval, slots: snapshot.slots,
                         events: snapshot.events.map(parseEvent).filter(e => e),
                         status: snapshot.status, config: snapshot.config, counts: snapshot.event_counts,
                         health: snapshot.actor_health || {} });
  document.getElementById("run-name").textContent = `run ${snapshot.run}`;
  document.title = `${snapshot.run} · dashboard`;
  renderStatus(); renderConfig(); renderEvents(); drawCharts(); loadSamples();
}

function connect() {
  const badge = document.getElementById("connection");
  const source = new EventSource("/api/stream");
  source.addEventListener("snapshot", m => {
    const snapshot = JSON.parse(m.data);
    load(snapshot);
    // a run served from its files: how it ended (its supervisor's outcome), or "not live" if it never said
    badge.textContent = snapshot.live ? "live" : (snapshot.ended || "not live");
    badge.className = snapshot.live ? "badge live" : "badge offline";
  });
  source.addEventListener("updates", m => { for (const u of JSON.parse(m.data)) apply(u); });
  source.addEventListener("closing", () => { badge.textContent = "dashboard stopped"; badge.className = "badge offline"; });
  source.onerror = () => { badge.textContent = "reconnecting"; badge.className = "badge lost"; };  // EventSource retries
}

for (const id of ["event-level", "event-kind"]) document.getElementById(id).addEventListener("change", renderEvents);
document.getElementById("event-text").addEventListener("input", renderEvents);
connect();
