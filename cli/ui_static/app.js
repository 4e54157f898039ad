// rlbus ui: four views of one run directory, read from the server's JSON (cli/ui.py). Charts: plotly.js.
"use strict";

const view = document.getElementById("view");
let poll = null; // the live view's timer

async function api(path, opts) {
  const r = await fetch(path, Object.assign({ credentials: "same-origin" }, opts || {}));
  if (!r.ok) throw new Error(path + ": " + r.status + " " + (await r.text()));
  return r.json();
}
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
const fmt = (v) => (v === null || v === undefined ? "-" : typeof v === "number" ? +v.toPrecision(5) : esc(v));
function el(html) { view.innerHTML = html; }

// -- the run at a glance --------------------------------------------------------------------------------------
const ROWS = [["reward/mean", "reward"], ["actor/entropy", "entropy"], ["mismatch/kl_k3", "mismatch KL (k3)"],
  ["staleness/mean", "staleness"], ["perf/tokens_per_s", "tokens/s"], ["time/step", "step time (s)"]];
let run = null;

function emptyRun() {
  const s = { step: [] };
  ROWS.forEach(([k]) => (s[k] = []));
  return { generation: -1, since: 0, series: s, eval: { step: [], accuracy: [] }, guard: [], weights: [],
    discarded: [], checkpoints: [] };
}

function merge(got) {
  if (!run || got.generation !== run.generation) { run = emptyRun(); run.generation = got.generation; }
  for (const k of Object.keys(run.series)) run.series[k].push(...(got.series[k] || []));
  run.eval.step.push(...got.eval.step); run.eval.accuracy.push(...got.eval.accuracy);
  run.guard.push(...got.guard); run.weights.push(...got.weights); run.discarded.push(...got.discarded);
  run.checkpoints = got.checkpoints; run.since = got.last_step; run.num_samples = got.num_samples;
}

function drawOverview() {
  if (!document.getElementById("chart")) return; // the user went to another view meanwhile
  const n = ROWS.length + 1, gap = 0.02, h = (1 - gap * (n - 1)) / n;
  const layout = { height: 150 * n, margin: { t: 20, l: 70, r: 20, b: 40 }, showlegend: true,
    legend: { orientation: "h", y: 1.04 }, xaxis: { title: { text: "step" }, anchor: "y" + n }, shapes: [] };
  const traces = [];
  ROWS.forEach(([key, title], i) => {
    const ax = i ? "y" + (i + 1) : "y";
    layout["yaxis" + (i ? i + 1 : "")] = { domain: [1 - (i + 1) * h - i * gap, 1 - i * gap - i * h], title: { text: title } };
    traces.push({ x: run.series.step, y: run.series[key], name: title, yaxis: ax, mode: "lines", line: { width: 1.5 } });
  });
  traces.push({ x: run.eval.step, y: run.eval.accuracy, name: "held-out accuracy", yaxis: "y", mode: "lines+markers" });
  layout["yaxis" + n] = { domain: [0, h], title: { text: "weight version" } };
  traces.push({ x: run.weights.map((w) => w.step), y: run.weights.map((w) => w.version), name: "weights published",
    yaxis: "y" + n, mode: "markers", marker: { size: 4 } });
  const vline = (x, color, dash) => ({ type: "line", xref: "x", yref: "paper", x0: x, x1: x, y0: 0, y1: 1,
    line: { color, width: 1, dash } });
  run.checkpoints.forEach((s) => layout.shapes.push(vline(s, "#9ca3af", "dot")));
  run.guard.forEach((g) => layout.shapes.push(vline(g.step, g.rollback_to >= 0 ? "#dc2626" : "#f59e0b", "solid")));
  traces.push({ x: run.guard.map((g) => g.step), y: run.guard.map(() => 0), yaxis: "y", mode: "markers",
    name: "guard action", text: run.guard.map((g) => g.message), marker: { symbol: "triangle-up", color: "#f59e0b", size: 9 } });
  Plotly.react("chart", traces, layout, { displaylogo: false, responsive: true });
  document.getElementById("last-step").textContent = run.since;
  const g = run.guard.map((a) => `<tr><td>${a.step}</td><td class="l">${esc(a.actions)}</td><td class="l">${esc(a.message)}</td></tr>`);
  document.getElementById("summary").innerHTML = `${run.series.step.length} steps, ${run.num_samples} samples trained;
    checkpoints on disk: ${run.checkpoints.join(", ") || "none"}; steps rolled back: ${run.discarded.join(", ") || "none"}
    ${g.length ? `<table><tr><th>step</th><th class="l">guard action</th><th class="l">why</th></tr>${g.join("")}</table>` : ""}`;
}

async function showOverview() {
  el(`<div id="summary" class="muted"></div><div id="chart"></div>`);
  run = null;
  const tick = async () => {
    const got = await api("/api/overview?since=" + (run ? run.since : 0));
    const before = run ? run.generation : -2;
    if (run && got.generation !== before) { run = null; return tick(); }
    const grew = !run || got.series.step.length || got.guard.length || got.eval.step.length;
    merge(got);
    if (grew || !document.getElementById("chart").data) drawOverview();
  };
  await tick();
  poll = setInterval(() => tick().catch(console.warn), 2000);
}

// -- samples ---------------------------------------------------------------------------------------------------
let sampleQuery = { sort: "step", desc: "1", offset: "0", limit: "50" };

async function showSamples() {
  const f = (name, label, size) => `<label>${label}<input name="${name}" size="${size || 6}" value="${esc(sampleQuery[name] || "")}"></label>`;
  el(`<form class="filters" id="filters">${f("step", "step (N or A:B)")}${f("producer", "producer", 10)}${f("q", "prompt text", 16)}
      ${f("min_reward", "reward ≥")}${f("max_reward", "reward ≤")}${f("min_staleness", "staleness ≥")}${f("min_length", "length ≥")}
      <label>sort<select name="sort">${["step", "reward", "staleness", "length", "turns", "tool_calls"].map((s) =>
        `<option ${sampleQuery.sort === s ? "selected" : ""}>${s}</option>`).join("")}</select></label>
      <label>order<select name="desc"><option value="1">desc</option><option value="0" ${sampleQuery.desc === "0" ? "selected" : ""}>asc</option></select></label>
      <button>show</button></form><div class="pager" id="pager"></div><div id="rows"></div>`);
  document.getElementById("filters").onsubmit = (e) => {
    e.preventDefault();
    sampleQuery = Object.fromEntries(new FormData(e.target));
    sampleQuery.offset = "0"; sampleQuery.limit = "50";
    loadSamples();
  };
  await loadSamples();
}

async function loadSamples() {
  const q = new URLSearchParams(Object.entries(sampleQuery).filter(([, v]) => v !== ""));
  const page = await api("/api/samples?" + q);
  const off = page.offset, last = Math.min(off + page.limit, page.total);
  document.getElementById("pager").innerHTML = `<button id="prev" ${off ? "" : "disabled"}>‹ prev</button>
    <span id="page-range">${page.total ? off + 1 : 0}–${last} of ${page.total}</span>
    <button id="next" ${last < page.total ? "" : "disabled"}>next ›</button>`;
  const move = (d) => { sampleQuery.offset = String(Math.max(0, off + d * page.limit)); loadSamples(); };
  document.getElementById("prev").onclick = () => move(-1);
  document.getElementById("next").onclick = () => move(1);
  const cols = ["step", "group_id", "producer_id", "reward", "staleness", "response_len", "num_turns", "num_tool_calls", "finish_reason"];
  document.getElementById("rows").innerHTML = `<table><tr>${cols.map((c) => `<th>${c}</th>`).join("")}<th class="l">prompt</th></tr>
    ${page.rows.map((r) => `<tr class="click" data-id="${r.id}">${cols.map((c) => `<td>${fmt(r[c])}</td>`).join("")}
      <td class="l">${esc(r.prompt)}</td></tr>`).join("")}</table>`;
  document.querySelectorAll("tr.click").forEach((tr) => (tr.onclick = () => (location.hash = "#sample/" + tr.dataset.id)));
}

const COLOURS = { mask: null, version: "version", logprob: "logprob", advantage: "advantage", value: "value", mismatch: "mismatch" };
function tokenSpans(s, by) {
  s.tokens.forEach((t) => (t.mismatch = t.proximal === null || t.proximal === undefined ? null : t.logprob - t.proximal));
  const vals = s.tokens.map((t) => t[by]).filter((v) => v !== null && v !== undefined);
  const lo = Math.min(...vals), hi = Math.max(...vals);
  return s.tokens.map((t, i) => {
    let style = "";
    if (COLOURS[by] && t.mask && t[by] !== null) {
      const x = hi > lo ? (t[by] - lo) / (hi - lo) : 0.5;
      style = ` style="background: hsl(${Math.round(220 * (1 - x))}, 80%, 80%)"`;
    }
    return `<span class="tok m${t.mask}" data-i="${i}" data-id="${t.id}"${style}>${esc(t.text)}</span>`;
  }).join("");
}

function sampleHtml(s, by) {
  const head = `step ${s.step} · group ${esc(s.group_id)} · sample ${s.spos} · producer ${esc(s.producer_id)} ·
    reward ${fmt(s.reward)} · ${s.num_turns} turn(s), ${s.num_tool_calls} tool call(s) · versions ${s.min_version}..${s.max_version} · staleness ${fmt(s.staleness)} · ${esc(s.finish_reason)}`;
  if (!s.tokens.length) return `<p>${head}</p><p class="muted">${esc(s.note)}</p>`;
  return `<p>${head}</p><div class="prompt">${esc(s.prompt_text)}</div>
    <div class="tokens" data-sample="${s.id}">${tokenSpans(s, by)}</div>`;
}

function hookTokens(samples) {
  document.querySelectorAll(".tokens").forEach((div) => {
    const s = samples.find((x) => String(x.id) === div.dataset.sample);
    div.onmouseover = (e) => {
      const t = s.tokens[e.target.dataset.i];
      if (!t) return;
      document.getElementById("tok-info").textContent = `token ${e.target.dataset.i} id ${t.id} ${JSON.stringify(t.text)} ` +
        `mask ${t.mask} · version ${t.version} · behaviour log-prob ${fmt(t.logprob)} · proximal ${fmt(t.proximal)} · ` +
        `mismatch ${fmt(t.mismatch)} · advantage ${fmt(t.advantage)}` + (t.value === null ? "" : ` · value ${fmt(t.value)}`);
    };
  });
}

async function showSample(id, group) {
  const s = await api("/api/sample/" + id);
  const samples = group ? await api(`/api/group?step=${s.step}&gpos=${s.gpos}`) : [s];
  const render = (by) => {
    const body = group ? `<div class="side">${samples.map((x) => `<div>${sampleHtml(x, by)}</div>`).join("")}</div>`
      : sampleHtml(s, by) + `<h4>Turns</h4><table>${s.turns.map((t) => `<tr><td class="l">${t.role}</td><td>${t.tokens}</td>
        <td class="l"><pre>${esc(t.text)}</pre></td></tr>`).join("")}</table>`;
    el(`<p><a href="#samples">‹ samples</a> · ${group ? `<a href="#sample/${id}">one sample</a>` : `<a href="#group/${id}">its group side by side</a>`}
      · colour by <select id="by">${Object.keys(COLOURS).map((k) => `<option ${k === by ? "selected" : ""}>${k}</option>`).join("")}</select>
      <span class="muted">green: sampled, trained (response_mask 1); grey: inserted, masked out (tool results, template)</span></p>
      <div id="tok-info"></div>${body}
      <p class="muted">advantage: ${esc(s.advantage_note || "-")}. proximal log-probs: ${esc(s.proximal || "-")}.
      ${s.tokens.length && s.tokens[0].proximal === null ? `<button id="prox">recompute step ${s.step}'s proximal log-probs</button>` : ""}
      ${s.tokenizer === false ? "The run's tokenizer (model.path) is not on this machine: token ids shown." : ""}</p>`);
    document.getElementById("by").onchange = (e) => render(e.target.value);
    const prox = document.getElementById("prox");
    if (prox) prox.onclick = async () => {
      prox.disabled = true;
      try {
        const job = await api("/api/proximal", { method: "POST", body: JSON.stringify({ step: s.step }), headers: { "Content-Type": "application/json" } });
        await waitJob(job.id, (j) => (prox.textContent = `replaying up to step ${s.step - 1} … (${j.state})`));
        route();
      } catch (err) { prox.textContent = err.message; }
    };
    hookTokens(samples);
  };
  render("mask");
}

const versionsText = (vs) => vs.length <= 12 ? vs.map((v) => v.version).join(" ")
  : `${vs.slice(0, 3).map((v) => v.version).join(" ")} … ${vs.slice(-3).map((v) => v.version).join(" ")} (${vs.length} loads)`;

// -- producers -------------------------------------------------------------------------------------------------
// The heartbeat's in-flight sizing and failure counts, as the producers table shows them (null: "-").
const pct = (v) => (v === null || v === undefined ? "-" : (100 * v).toFixed(0) + "%");
const SIZING = [["inflight_limit", fmt], ["engine_idle", pct], ["infra_failures", fmt], ["env_failures", fmt],
  ["tool_retries", fmt]];

async function showProducers() {
  const d = await api("/api/producers");
  const t0 = d.t0 || 0, traces = [], limits = d.producers.some((p) => p.inflight_limits.length);
  d.producers.forEach((p) => {
    const x = [], y = [];
    p.spans.forEach((s) => { x.push(s.start - t0, s.end - t0, null); y.push(p.producer_id, p.producer_id, null); });
    traces.push({ x, y, mode: "lines", line: { width: 10 }, name: p.producer_id });
  });
  const stops = d.lifecycle.filter((e) => e.role === "producer");
  traces.push({ x: stops.map((e) => e.t - t0), y: stops.map((e) => e.role_id), mode: "markers", name: "start / stop",
    text: stops.map((e) => `${e.kind} ${e.detail || ""}`), marker: { size: 10, symbol: stops.map((e) =>
      e.kind === "RoleStarted" ? "triangle-right" : e.clean ? "square" : "x"), color: "#111" } });
  el(`<div id="timeline"></div><table id="producer-table"><tr><th class="l">producer</th><th>processes</th>
    <th>restarts</th><th>killed</th><th>groups</th><th>tokens generated</th><th>tokens discarded</th>
    <th>samples restarted</th><th>in-flight limit</th><th>engine idle</th><th>infra failures</th><th>env failures</th>
    <th>tool retries</th><th class="l">versions loaded</th></tr>
    ${d.producers.map((p) => `<tr data-producer="${esc(p.producer_id)}"><td class="l">${esc(p.producer_id)}</td>
      <td>${p.processes.length}</td><td>${p.restarts}</td><td>${p.killed}</td><td>${p.groups_done}</td>
      <td>${p.tokens_generated}</td><td>${p.tokens_discarded}</td><td>${p.samples_restarted}</td>
      ${SIZING.map(([k, show]) => `<td data-k="${k}">${show(p[k])}</td>`).join("")}
      <td class="l">${versionsText(p.versions)}</td></tr>`).join("")}</table>
    <p class="muted">in-flight limit: the tasks the producer allows itself now (rollout.max_inflight_tasks, or sized
      from its engine's idle time); engine idle: the share of recent time its engine had nothing to generate (latest
      heartbeat); infra failures: tasks given back because a tool, sandbox or judge failed (not trained); env
      failures: tasks whose environment raised or gave bad output; tool retries: tool calls tried again after their
      service failed (counts over all its processes); "-": its heartbeats predate these fields.</p>
    <div id="versions"></div>${limits ? `<div id="inflight"></div>` : ""}
    <h4>Lifecycle</h4><table>${d.lifecycle.map((e) => `<tr><td>${(e.t - t0).toFixed(1)} s</td><td class="l">${e.kind}</td>
      <td class="l">${esc(e.role_id)}</td><td class="l">${esc(e.detail)}</td></tr>`).join("")}</table>
    <h4>Errors (newest first)</h4><table id="errors">${d.errors.length ? `<tr><th>t</th><th class="l">role</th>
      <th class="l">error</th><th class="l">failure class</th><th class="l">message</th></tr>` : ""}
      ${d.errors.map((e) => `<tr><td>${(e.t - t0).toFixed(1)} s</td><td class="l">${esc(e.role_id)}</td>
      <td class="l">${esc(e.error)}</td><td class="l">${fmt(e.failure)}</td>
      <td class="l">${esc(e.message)}</td></tr>`).join("") || "<tr><td>none</td></tr>"}</table>`);
  // One step line per producer of a value over time: p[list] holds {t, [key]: value} where the value changed.
  const overTime = (div, list, key, title) => Plotly.react(div, d.producers.map((p) => ({
    x: p[list].map((v) => v.t - t0), y: p[list].map((v) => v[key]), name: p.producer_id, mode: "lines",
    line: { shape: "hv" } })), { height: 260, margin: { t: 20, l: 120 }, yaxis: { title: { text: title } },
    xaxis: { title: { text: "seconds since the first heartbeat" } } }, { displaylogo: false, responsive: true });
  overTime("versions", "versions", "version", "weight version loaded");
  if (limits) overTime("inflight", "inflight_limits", "limit", "in-flight limit");
  Plotly.react("timeline", traces, { height: 120 + 40 * d.producers.length, margin: { t: 20, l: 120 },
    xaxis: { title: { text: "seconds since the first heartbeat" } } }, { displaylogo: false, responsive: true });
}

// -- two steps compared, and replay -----------------------------------------------------------------------------
async function showCompare(a, b) {
  const info = await api("/api/info");
  a = a || Math.max(1, info.last_step - 1); b = b || info.last_step;
  const d = await api(`/api/compare?a=${a}&b=${b}`);
  const num = (v) => (typeof v === "number" ? v : null);
  el(`<form class="filters" id="cmp"><label>step A<input name="a" value="${a}" size="6"></label>
      <label>step B<input name="b" value="${b}" size="6"></label><button>compare</button></form>
    <h4>Replay step A with a what-if</h4>
    <form class="filters" id="rp"><label>steps<input name="steps" value="1" size="3"></label>
      <label>overrides (key=value, one a line)<textarea name="overrides" rows="2" cols="40" placeholder="trainer.lr=1e-5"></textarea></label>
      <button id="replay-go">replay step ${a}</button></form><div id="replay"></div>
    <h4>Samples</h4><table><tr><th class="l"></th>${Object.keys(d.samples.a).map((k) => `<th>${k}</th>`).join("")}</tr>
      ${["a", "b"].map((s) => `<tr><td class="l">step ${d[s]}</td>${Object.values(d.samples[s]).map((v) => `<td>${fmt(v)}</td>`).join("")}</tr>`).join("")}</table>
    <h4>Metrics</h4><table id="cmp-metrics"><tr><th class="l">metric</th><th>step ${a}</th><th>step ${b}</th><th>B − A</th></tr>
      ${d.metrics.map((m) => `<tr><td class="l">${esc(m.metric)}</td><td>${fmt(m.a)}</td><td>${fmt(m.b)}</td>
        <td>${num(m.a) !== null && num(m.b) !== null ? fmt(m.b - m.a) : ""}</td></tr>`).join("")}</table>`);
  document.getElementById("cmp").onsubmit = (e) => {
    e.preventDefault();
    const f = new FormData(e.target);
    location.hash = `#compare/${f.get("a")}/${f.get("b")}`;
  };
  document.getElementById("rp").onsubmit = async (e) => {
    e.preventDefault();
    const f = new FormData(e.target);
    const body = { from_step: +a, steps: +f.get("steps"), overrides: f.get("overrides").split("\n").filter((x) => x.trim()) };
    try {
      const job = await api("/api/replay", { method: "POST", body: JSON.stringify(body), headers: { "Content-Type": "application/json" } });
      followReplay(job.id);
    } catch (err) { document.getElementById("replay").textContent = err.message; }
  };
}

async function waitJob(id, progress) {
  for (;;) {
    const job = await api("/api/replay/" + id);
    if (job.state === "failed") throw new Error(job.log_tail);
    if (job.state === "done") return job;
    progress(job);
    await new Promise((r) => setTimeout(r, 1500));
  }
}

async function followReplay(id) {
  const box = document.getElementById("replay");
  const job = await api("/api/replay/" + id);
  if (!box) return;
  if (job.state === "running") {
    box.innerHTML = `<p class="muted">running: <code>${esc(job.command.join(" "))}</code> …</p>`;
    setTimeout(() => followReplay(id), 1500);
    return;
  }
  if (job.state === "failed") { box.innerHTML = `<pre>${esc(job.log_tail)}</pre>`; return; }
  const r = job.result;
  box.innerHTML = `<p id="replay-verdict">replayed steps ${r.steps.join(", ")} from ${r.from_checkpoint ? "checkpoint step " + r.from_checkpoint : "the base model"}
    (${esc(job.overrides.join(" ") || "no overrides")}): ${r.identical ? "bit for bit identical to the recorded run" : "differs from the recorded run"}</p>
    <table id="replay-table"><tr><th>step</th><th class="l">metric</th><th>recorded</th><th>replayed</th><th></th></tr>
    ${r.diffs.map((d) => `<tr><td>${d.step}</td><td class="l">${esc(d.metric)}</td><td>${fmt(d.recorded)}</td>
      <td data-metric="${esc(d.metric)}" data-step="${d.step}" data-value="${d.replayed}">${fmt(d.replayed)}</td>
      <td class="${d.equal ? "" : "diff"}">${d.equal ? "=" : "differs"}</td></tr>`).join("")}</table>`;
}

// -- routing ---------------------------------------------------------------------------------------------------
async function route() {
  clearInterval(poll); poll = null;
  const [name, a, b] = (location.hash.slice(1) || "overview").split("/");
  document.querySelectorAll("nav a").forEach((x) => x.classList.toggle("on", x.id === "nav-" + name));
  try {
    if (name === "samples") await showSamples();
    else if (name === "sample") await showSample(a, false);
    else if (name === "group") await showSample(a, true);
    else if (name === "producers") await showProducers();
    else if (name === "compare") await showCompare(+a, +b);
    else await showOverview();
  } catch (err) { el(`<p class="diff">${esc(err.message)}</p>`); console.error(err); }
}

(async () => {
  const info = await api("/api/info");
  document.getElementById("run-name").textContent = info.run_dir;
  document.getElementById("live").textContent = info.live ? "● live" : "finished";
  document.getElementById("last-step").textContent = info.last_step;
  window.addEventListener("hashchange", route);
  route();
})();
