// carma's dashboard: live GPU cards, queue, timeline and metric charts, from the daemon's API.
// No framework and no CDN (the machine may be offline): plain DOM and SVG.
"use strict";

const CHART_MINUTES = 30;
const TIMELINE_REFRESH_S = 10;
const GPU_COLORS = ["#3d6fb6", "#d98a1c", "#3a9a5b", "#c9423a", "#7a5bb5", "#2a9d9f", "#b5487f", "#7f7f3a"];
// beyond the eight, hues a golden angle apart: no two GPUs (MIG instances count) share a colour
const gpuColor = (i) => GPU_COLORS[i] || `hsl(${(i * 137.508) % 360}, 55%, 42%)`;
const CHARTS = [
  { key: "mem_pct", title: "Memory used (%)", max: 100 },
  { key: "smact", title: "SMACT", max: 1, threshold: "smact" },
  { key: "smocc", title: "SMOCC", max: 1, threshold: "smocc" },
  { key: "drama", title: "DRAMA", max: 1, threshold: "drama" },
  { key: "power_w", title: "Power (W)" },
];

const state = {
  token: localStorage.getItem("carma-token"),
  snapshot: null,
  names: {},            // task id -> name
  series: {},           // gpu -> {t: [], mem_pct: [], smact: [], ...}
  timeline: null,
  timelineAt: 0,
  selected: null,       // the task whose details show below the queue
  active: "",           // ids of the tasks not yet ended, to notice when the timeline changed
  listening: false,     // whether the live stream runs (or retries)
};

const $ = (sel) => document.querySelector(sel);
const esc = (text) => String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const gib = (mib) => (mib / 1024).toFixed(1);
// as the CLI's size_text: GiB from 1 GiB up, MiB below
const size = (bytes) => (bytes >= 2 ** 30 ? `${(bytes / 2 ** 30).toFixed(2)} GiB` : `${(bytes / 2 ** 20).toFixed(1)} MiB`);
const num = (v, digits = 2) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));

function duration(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

class Unauthorized extends Error {}

async function api(path) {
  const headers = state.token ? { Authorization: `Bearer ${state.token}` } : {};
  const response = await fetch(path, { headers });
  if (response.status === 401) throw new Unauthorized();
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

// ---------------------------------------------------------------- start-up and the live stream

// A `carma dashboard` link's token (#token=...): kept, and taken out of the address bar and history.
function takeLinkToken() {
  const match = location.hash.match(/token=([^&]+)/);
  if (!match) return false;
  try {
    state.token = decodeURIComponent(match[1]);
  } catch {
    state.token = match[1]; // a link written by hand, with a bare '%': the token as it stands
  }
  localStorage.setItem("carma-token", state.token);
  history.replaceState(null, "", location.pathname + location.search);
  return true;
}

function init() {
  takeLinkToken();
  // a link opened in a tab already showing the dashboard changes only the fragment: no reload, no init
  window.addEventListener("hashchange", () => {
    if (takeLinkToken()) start();
  });
  $("#login").addEventListener("submit", (event) => {
    event.preventDefault();
    state.token = $("#token").value.trim();
    localStorage.setItem("carma-token", state.token);
    start();
  });
  $("#hours").addEventListener("change", () => loadTimeline());
  document.addEventListener("click", (event) => {  // a queue row, a GPU card's chip or a timeline bar
    const item = event.target.closest("[data-task]");
    if (item) showTask(Number(item.dataset.task), !item.closest("#queue"));
  });
  $("#task").addEventListener("click", (event) => {
    if (event.target.closest(".close")) showTask(null);
  });
  window.addEventListener("resize", () => renderTimeline());
  start();
}

async function start() {
  try {
    await Promise.all([loadTimeline(), loadSeries()]);
  } catch (error) {
    if (error instanceof Unauthorized) return showLogin(state.token ? "that token was refused" : "");
    return setConnection("down", String(error));
  }
  $("#login").hidden = true;
  if (!state.listening) listen();
}

function showLogin(message) {
  $("#login").hidden = false;
  $("#login-error").textContent = message;
  setConnection("down", "not signed in");
}

function setConnection(kind, title) {
  const dot = $("#connection");
  dot.className = `conn ${kind}`;
  dot.title = title;
}

async function listen() {
  state.listening = true;  // until a refusal: one stream, however often start() runs (a link, a sign-in)
  const headers = state.token ? { Authorization: `Bearer ${state.token}` } : {};
  try {
    const response = await fetch("/v1/events", { headers });
    if (response.status === 401) {
      state.listening = false;
      return showLogin("that token was refused");
    }
    setConnection("live", "live");
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (data) onSnapshot(JSON.parse(data));
      }
    }
  } catch (error) {
    console.warn("live stream:", error);
  }
  setConnection("down", "disconnected; retrying");
  setTimeout(listen, 2000);
}

function onSnapshot(s) {
  state.snapshot = s;
  for (const t of s.tasks) state.names[t.id] = t.name;
  renderSummary(s);
  renderMig(s);
  renderGpus(s);
  renderQueue(s);
  appendSamples(s);
  renderCharts();
  const active = s.tasks.map((t) => `${t.id}:${t.state}:${t.attempts}`).join(",");
  if (active !== state.active || Date.now() - state.timelineAt > TIMELINE_REFRESH_S * 1000) {
    state.active = active;
    loadTimeline().catch((e) => console.warn("timeline:", e));
    if (state.selected !== null) showTask(state.selected);
  } else {
    renderTimeline();
  }
}

// ---------------------------------------------------------------- summary, GPU cards, queue

// Every task by what the page shows of it, from the server's counts (the live event lists only some tasks).
function taskCounts(status) {
  const count = (name) => status.tasks[name] || 0;
  return {
    running: count("running") + count("dispatched"),
    waiting: count("queued") + count("recovering") + count("oom_crashed"),
    completed: count("completed"), failed: count("failed"), cancelled: count("cancelled"),
  };
}

function renderSummary(s) {
  const st = s.status;
  const count = taskCounts(st);
  const parts = [
    `policy ${st.policy}`, `${st.gpus} GPU${st.gpus === 1 ? "" : "s"}`,
    `${count.running} running`, `${count.waiting} waiting`,
    `${count.completed} completed`, `${count.failed} failed`,
  ];
  if (count.cancelled) parts.push(`${count.cancelled} cancelled`);
  if (st.mps) parts.push("MPS");
  if (st.draining) parts.push("draining");
  if (st.time_scale !== 1) parts.push(`fake GPUs, time x${st.time_scale}`);
  $("#summary").textContent = parts.join(" · ");
}

function bar(label, value, max, threshold, text, title) {
  const pct = value === null || value === undefined ? 0 : Math.min(100, (100 * value) / max);
  const high = threshold !== undefined && value !== null && value >= threshold;
  const mark = threshold === undefined ? "" : `<span class="threshold" style="left:${(100 * threshold) / max}%" title="risk threshold ${threshold}"></span>`;
  return `<div class="row" title="${esc(title || "")}"><span>${label}</span>
    <div class="bar"><span class="fill${high ? " high" : ""}" style="width:${pct}%"></span>${mark}</div>
    <span class="value">${text}</span></div>`;
}

function renderGpus(s) {
  const risk = s.status.risk;
  const missing = s.status.missing_metrics || {};
  const byId = Object.fromEntries(s.tasks.map((t) => [t.id, t]));
  $("#gpus").innerHTML = s.gpus.map((g) => {
    const badges = [];
    if (g.excluded) badges.push(`<span class="badge warn">risk filter: excluded</span>`);
    if (g.awaiting_first_kernel) badges.push(`<span class="badge info">awaiting first kernel</span>`);
    else if (!g.valid) badges.push(`<span class="badge info">TTFK window</span>`);
    if (g.exclusive) badges.push(`<span class="badge">MIG instance: exclusive</span>`);
    if (missing[g.index]) badges.push(`<span class="badge warn">no ${esc(missing[g.index].join("/").toUpperCase())}</span>`);
    if (g.other_processes) badges.push(`<span class="badge">${g.other_processes} other process(es)</span>`);
    if (g.held_mib > (g.used_mib ?? 0)) {
      badges.push(`<span class="badge info" title="the known memory needs of its tasks, allocated or not: no other task is placed into them">${gib(g.held_mib)} GiB held</span>`);
    }
    const metric = (key) => {
      const score = g.risk ? g.risk[key] : null;
      return bar(key.toUpperCase(), g[key], 1, risk.enabled ? risk[key] : undefined, num(g[key]), `risk score ${num(score)}`);
    };
    const used = g.used_mib ?? 0;
    const tasks = g.tasks.map((id) => {
      const t = byId[id];
      const cls = t && t.state === "dispatched" ? "task dispatched" : "task";
      return `<span class="${cls}" data-task="${id}" title="${esc(t ? t.state : "")}">#${id} ${esc(state.names[id] || "")}</span>`;
    }).join("");
    const facts = [
      g.power_w !== null ? `${num(g.power_w, 0)} W` : null,
      g.temperature_c !== null && g.temperature_c !== undefined ? `${num(g.temperature_c, 0)} °C` : null,
      g.energy_j !== null && g.energy_j !== undefined ? `${num(g.energy_j / 1000, 1)} kJ` : null,
    ].filter(Boolean).join(" · ");
    return `<div class="gpu" data-gpu="${g.index}">
      <h3><span>GPU ${g.index}</span><span class="name" title="${esc(g.uuid)}">${esc(g.name)}</span></h3>
      ${bar("memory", used, g.total_mib, undefined, `${gib(used)}/${gib(g.total_mib)} GiB`)}
      ${metric("smact")}${metric("smocc")}${metric("drama")}
      <div class="badges">${badges.join("")}</div>
      <div class="facts">${facts}</div>
      <div class="tasks">${tasks || '<span class="muted">no tasks</span>'}</div>
    </div>`;
  }).join("");
}

// Each MIG GPU's layout (dynamic MIG): its memory slices in a row, each instance a block from its first slice
// over the slices it holds (profile, position, its task or idle), the slices no instance holds marked free.
function renderMig(s) {
  const mig = s.status.mig;
  const area = $("#mig");
  area.hidden = mig === null;
  if (mig === null) return;
  const chip = (id) => `<span class="task" data-task="${id}">#${id} ${esc(state.names[id] || "")}</span>`;
  const counts = `${mig.reconfigurations} reconfiguration${mig.reconfigurations === 1 ? "" : "s"}, ${mig.refused} refused since the start`;
  area.innerHTML = mig.gpus.map((g) => {
    const cell = (start, span) => `grid-column: ${start + 1} / span ${span}`;
    const blocks = g.instances.map((i) => {
      const busy = i.tasks.length > 0;
      const slices = Array.from({ length: i.slices }, (_, k) => i.start + k).join(", ");
      const title = `${i.slot}: GPU ${i.gpu}, memory slices ${slices}, ${busy ? "busy" : "idle"}`;
      return `<div class="instance ${busy ? "busy" : "idle"}" data-slot="${esc(i.slot)}" style="${cell(i.start, i.slices)}" title="${esc(title)}">
        <b>${esc(i.slot.split("@")[0])}</b> <span class="muted">GPU ${i.gpu}</span>
        <div>${busy ? i.tasks.map(chip).join("") : '<span class="muted">idle</span>'}</div></div>`;
    });
    // the free slices, a block per run of neighbours
    const runs = [];
    for (const slice of g.free_slices) {
      const last = runs[runs.length - 1];
      if (last && last[0] + last.length === slice) last.push(slice);
      else runs.push([slice]);
    }
    for (const run of runs) {
      blocks.push(`<div class="instance free" data-free="${run.join(",")}" style="${cell(run[0], run.length)}" title="memory slice${run.length > 1 ? "s" : ""} ${run.join(", ")}: no instance">free</div>`);
    }
    const ruler = Array.from({ length: g.memory_slices }, (_, k) => `<span>${k}</span>`).join("");
    return `<div class="mig" data-mig="${esc(g.gpu)}">
      <h3><span>MIG <span class="name" title="${esc(g.gpu)}">${esc(g.gpu)}</span></span><span class="name">${esc(g.model)}</span></h3>
      <div class="slices" style="grid-template-columns: repeat(${g.memory_slices}, 1fr)">${blocks.join("")}</div>
      <div class="slices ruler" style="grid-template-columns: repeat(${g.memory_slices}, 1fr)" title="memory slices">${ruler}</div>
    </div>`;
  }).join("") + `<div class="facts">${counts}</div>`;
}

// The memory a task is (or will be) placed with, as `carma queue` shows it; its source in the tooltip.
function needText(t) {
  if (t.need === null) return t.estimate && t.state === "queued" ? `${esc(t.estimate)} pending` : "-";
  if (t.need === "known") return size(t.need_mib * 2 ** 20) + (t.gpus_requested > 1 ? "/GPU" : "");
  return kindText(t.need);
}

// A need not known in MiB: a whole GPU, or unknown (recovery only).
function kindText(need) {
  return need === "whole_gpu" ? "whole GPU" : "unknown";
}

// Where a need came from, as `carma show` says it: nothing known ("none") is recovery only.
function sourceText(source) {
  return source === "none" ? "recovery only" : `from ${esc(source)}`;
}

function renderQueue(s) {
  const order = { running: 0, dispatched: 1, oom_crashed: 2, recovering: 3, queued: 4 };
  const tasks = [...s.tasks].sort((a, b) => (order[a.state] ?? 9) - (order[b.state] ?? 9) || a.id - b.id);
  const count = taskCounts(s.status);  // every task, also those the event leaves out
  $("#queue-count").textContent = `${count.running} running, ${count.waiting} waiting`;
  const rows = tasks.map((t) => {
    const running = t.state === "running" || t.state === "dispatched";
    const since = running ? t.start_s : t.submit_s;
    const gpus = running ? t.gpus.join(",") : `(${t.gpus_requested})`;
    const why = running ? t.activity || "" : t.waiting_reason || t.reason || "";
    return `<tr data-task="${t.id}"><td>${t.id}</td><td>${esc(t.name)}</td><td>${esc(t.user)}</td>
      <td>${t.state}</td><td>${gpus}</td><td title="${esc(t.need_source ?? "")}">${needText(t)}</td>
      <td>${since !== null ? duration(s.now_s - since) : ""}</td><td class="why">${esc(why)}</td></tr>`;
  });
  if (s.tasks_not_shown) {
    rows.push(`<tr class="empty"><td colspan="8">and ${s.tasks_not_shown} more waiting: <code>carma queue</code> lists them all</td></tr>`);
  }
  $("#queue tbody").innerHTML = rows.join("") || `<tr class="empty"><td colspan="8">no tasks waiting or running</td></tr>`;
}

// ---------------------------------------------------------------- one task's details, as `carma show`

async function showTask(id, reveal = false) {
  state.selected = id;
  const panel = $("#task");
  if (id === null) {
    panel.hidden = true;
    return;
  }
  let t;
  try {
    t = await api(`/v1/tasks/${id}`);
  } catch (error) {
    t = null;
    console.warn("task:", error);
  }
  if (state.selected !== id) return;  // another task was picked meanwhile
  if (t === null) {
    panel.innerHTML = `<h3>task ${id} <button class="close" aria-label="close">&times;</button></h3><p class="muted">not found</p>`;
    panel.hidden = false;
    return;
  }
  const e = t.memory_estimate;
  const estimate = e
    ? `<p>estimate: <b>${size(e.peak_bytes)}</b> by ${esc(e.method)} for ${esc(e.device)} in ${e.seconds.toFixed(1)} s</p>
       <table class="parts">${Object.entries(e.breakdown).map(([part, n]) => `<tr><td>${esc(part.replaceAll("_", " "))}</td><td>${size(n)}</td></tr>`).join("")}</table>
       ${(e.notes || []).map((n) => `<p class="note">note: ${esc(n)}</p>`).join("")}`
    : "";
  const attempts = t.attempt_list.map((a) => {
    const need = a.need_mib ? `${a.need_mib} MiB` : kindText(a.need);
    const how = (a.recovery ? "recovery, " : "") + (a.shared ? "collocated" : "alone");
    return `<li>attempt ${a.number} on GPU ${a.gpus.join(",")} (${how}; ${a.outcome || (a.ended_s === null ? t.state : "ended")}; need ${esc(need)} ${sourceText(a.need_source)}) ${esc(a.message || "")}</li>`;
  }).join("");
  panel.innerHTML = `<h3>task ${t.id}: ${esc(t.name)} <span class="muted">${esc(t.user)} · ${t.state}</span>
      <button class="close" aria-label="close">&times;</button></h3>
    <p><code>${esc(t.command.join(" "))}</code> <span class="muted">in ${esc(t.workdir)}</span></p>
    <p>memory: <b>${needText(t)}</b> <span class="muted">${t.need_source ? sourceText(t.need_source) : ""}</span></p>
    ${t.waiting_reason ? `<p>waiting: ${esc(t.waiting_reason)}</p>` : ""}
    ${t.activity ? `<p>now: ${esc(t.activity)}</p>` : ""}
    ${t.reason ? `<p class="reason">reason: ${esc(t.reason)}</p>` : ""}
    ${estimate}${attempts ? `<ul>${attempts}</ul>` : ""}`;
  panel.hidden = false;
  if (reveal) panel.scrollIntoView({ block: "nearest" });  // picked in the GPUs or the timeline, away from it
}

// ---------------------------------------------------------------- timeline (Gantt per GPU)

async function loadTimeline() {
  state.timeline = await api(`/v1/timeline?hours=${$("#hours").value}`);
  state.timelineAt = Date.now();
  for (const a of state.timeline.attempts) state.names[a.task_id] = a.name;
  renderTimeline();
}

const OUTCOME_WORDS = { running: "running", success: "completed", oom: "out of memory", error: "failed", killed: "cancelled" };
const RECONFIGURATION_WORDS = { done: "done", refused: "refused", interrupted: "interrupted by the daemon stopping" };

// A reconfiguration as the daemon logs it: `destroyed 1g.5gb@0; created 2g.10gb@0`.
function reconfigurationText(r) {
  const parts = [];
  if (r.destroyed.length) parts.push(`destroyed ${r.destroyed.join(", ")}`);
  if (r.created.length) parts.push(`created ${r.created.join(", ")}`);
  return parts.join("; ");
}

// Each GPU's attempts in lanes: attempts that overlap in time (collocated) get lanes of their own, so none
// hides another (one row per GPU drew the last over the others).
function timelineLanes(attempts, gpus, since, now) {
  const lanes = Object.fromEntries(gpus.map((g) => [g, []]));  // per GPU, per lane: the end of its last bar
  const bars = [];
  const visible = attempts.filter((a) => (a.end_s ?? now) >= since).sort((a, b) => a.start_s - b.start_s);
  for (const a of visible) {
    for (const gpu of a.gpus) {
      if (!(gpu in lanes)) continue;
      const ends = lanes[gpu];
      let lane = ends.findIndex((end) => end <= a.start_s);
      if (lane < 0) lane = ends.push(0) - 1;
      ends[lane] = a.end_s ?? now;
      bars.push({ a, gpu, lane });
    }
  }
  return { lanes, bars };
}

function renderTimeline() {
  const data = state.timeline;
  if (!data) return;
  const gpus = state.snapshot ? state.snapshot.gpus.map((g) => g.index) : [...new Set(data.attempts.flatMap((a) => a.gpus))].sort((a, b) => a - b);
  const now = state.snapshot ? state.snapshot.now_s : data.now_s;
  // the chosen window, shortened to what there is to show (at least ten minutes)
  const first = Math.min(now - 600, ...data.attempts.map((a) => a.start_s), ...data.reconfigurations.map((r) => r.t_s));
  const since = Math.max(now - Number($("#hours").value) * 3600, first - 0.02 * (now - first));
  const width = $("#timeline").clientWidth || 1000, left = 52, right = 10, laneH = 20, minRowH = 26, top = 6, axis = 20;
  const { lanes, bars } = timelineLanes(data.attempts, gpus, since, now);
  const x = (t) => left + ((Math.max(t, since) - since) / (now - since)) * (width - left - right);
  const parts = [];
  const rowTop = {}, rowEnd = {};
  let y = top;
  for (const gpu of gpus) {
    rowTop[gpu] = y;
    y += Math.max(minRowH, lanes[gpu].length * laneH + 6);
    rowEnd[gpu] = y;
    parts.push(`<text x="4" y="${rowTop[gpu] + 17}">GPU ${gpu}</text><line class="grid" x1="${left}" x2="${width - right}" y1="${y}" y2="${y}"/>`);
  }
  const height = Math.max(y, top + minRowH) + axis;
  for (const { a, gpu, lane } of bars) {
    const end = a.end_s ?? now;
    const kind = a.outcome === null ? "running" : a.outcome;
    const label = `#${a.task_id} ${a.name} (attempt ${a.attempt}${a.recovery ? ", recovery" : ""}): ${OUTCOME_WORDS[kind] || kind}, ${duration(end - a.start_s)}`;
    const h = lanes[gpu].length > 1 ? laneH - 3 : minRowH - 6;
    const w = Math.max(2, x(end) - x(a.start_s));
    parts.push(`<rect class="attempt ${kind}${a.recovery ? " recovery" : ""}" data-task="${a.task_id}" x="${x(a.start_s)}" y="${rowTop[gpu] + 3 + lane * laneH}" width="${w}" height="${h}" rx="2"><title>${esc(label)}</title></rect>`);
  }
  parts.push(...reconfigurationMarks(data.reconfigurations, since, now, x, rowTop, rowEnd, top, y));
  $("#legend-mig").hidden = data.reconfigurations.length === 0;
  const ticks = Math.max(2, Math.min(6, Math.floor((width - left - right) / 110)));  // labels ~80 px wide
  for (let i = 0; i <= ticks; i++) {
    const t = since + ((now - since) * i) / ticks;
    parts.push(`<text x="${x(t)}" y="${height - 5}" text-anchor="${i === 0 ? "start" : i === ticks ? "end" : "middle"}">${i === ticks ? "now" : "-" + duration(now - t)}</text>`);
  }
  $("#timeline").innerHTML = `<svg width="${width}" height="${height}">${parts.join("")}</svg>`;
}

// A MIG reconfiguration: a mark at its time across the rows of its GPU's instances (as the GPU cards list them
// now), or across every row when none of its instances is left; what it did and why in the tooltip.
function reconfigurationMarks(reconfigurations, since, now, x, rowTop, rowEnd, top, bottom) {
  const parents = state.snapshot ? state.snapshot.gpus : [];
  return reconfigurations.filter((r) => r.t_s >= since).map((r, i) => {
    const rows = parents.filter((g) => g.parent === r.gpu && g.index in rowTop);
    const y1 = rows.length ? Math.min(...rows.map((g) => rowTop[g.index])) : top;
    const y2 = rows.length ? Math.max(...rows.map((g) => rowEnd[g.index])) : bottom;
    const at = x(r.t_s);
    const label = `GPU ${r.gpu}: MIG ${reconfigurationText(r)}: ${RECONFIGURATION_WORDS[r.outcome] || r.outcome}, -${duration(now - r.t_s)}${r.reason ? `. ${r.reason}` : ""}`;
    return `<g class="reconfiguration ${esc(r.outcome)}" data-reconfiguration="${i}"><title>${esc(label)}</title>
      <line x1="${at}" x2="${at}" y1="${y1}" y2="${y2}"/><rect class="hit" x="${at - 4}" y="${y1}" width="8" height="${y2 - y1}"/>
      <path d="M${at - 5},${y1} L${at + 5},${y1} L${at},${y1 + 7} Z"/></g>`;
  });
}

// ---------------------------------------------------------------- metric charts

async function loadSeries() {
  const data = await api(`/v1/series?minutes=${CHART_MINUTES}`);
  state.series = {};
  for (const [gpu, cols] of Object.entries(data.gpus)) {
    state.series[gpu] = {
      t: cols.t, smact: cols.smact, smocc: cols.smocc, drama: cols.drama, power_w: cols.power_w,
      mem_pct: cols.used_mib.map((u, i) => (100 * u) / cols.total_mib[i]),
    };
  }
}

function appendSamples(s) {
  for (const g of s.gpus) {
    if (g.used_mib === null) continue;
    const series = (state.series[g.index] ||= { t: [], mem_pct: [], smact: [], smocc: [], drama: [], power_w: [] });
    series.t.push(s.now_s);
    series.mem_pct.push((100 * g.used_mib) / g.total_mib);
    for (const key of ["smact", "smocc", "drama", "power_w"]) series[key].push(g[key]);
    const keep = series.t.findIndex((t) => t >= s.now_s - CHART_MINUTES * 60);
    if (keep > 0) for (const key of Object.keys(series)) series[key].splice(0, keep);
  }
}

function renderCharts() {
  const risk = state.snapshot ? state.snapshot.status.risk : null;
  const now = state.snapshot ? state.snapshot.now_s : 0;
  const since = now - CHART_MINUTES * 60;
  const width = 600, height = 150, left = 36, right = 8, top = 8, bottom = 18;
  // by the series' order, the GPUs by position first: a MIG instance since destroyed is named by its id, not a number
  const color = Object.fromEntries(Object.keys(state.series).map((gpu, i) => [gpu, gpuColor(i)]));
  $("#charts").innerHTML = CHARTS.map((chart) => {
    let max = chart.max;
    if (max === undefined) {
      const values = Object.values(state.series).flatMap((s) => s[chart.key]).filter((v) => v !== null);
      max = Math.max(1, ...values) * 1.1;
    }
    const x = (t) => left + ((t - since) / (now - since)) * (width - left - right);
    const y = (v) => top + (1 - Math.min(v, max) / max) * (height - top - bottom);
    const parts = [0, 0.5, 1].map((f) => `<line class="grid" x1="${left}" x2="${width - right}" y1="${y(max * f)}" y2="${y(max * f)}"/><text x="${left - 4}" y="${y(max * f) + 4}" text-anchor="end">${+(max * f).toFixed(max < 2 ? 1 : 0)}</text>`);
    if (chart.threshold && risk && risk.enabled) {
      const v = risk[chart.threshold];
      parts.push(`<line class="threshold" x1="${left}" x2="${width - right}" y1="${y(v)}" y2="${y(v)}"/>`);
    }
    for (const [gpu, s] of Object.entries(state.series)) {
      let run = [];
      const flush = () => {
        if (run.length > 1) parts.push(`<polyline stroke="${color[gpu]}" points="${run.join(" ")}"><title>GPU ${gpu}</title></polyline>`);
        run = [];
      };
      s.t.forEach((t, i) => {
        const v = s[chart.key][i];
        if (v === null || v === undefined || t < since) return flush();
        run.push(`${x(t).toFixed(1)},${y(v).toFixed(1)}`);
      });
      flush();
    }
    parts.push(`<text x="${left}" y="${height - 4}">-${CHART_MINUTES}m</text><text x="${width - right}" y="${height - 4}" text-anchor="end">now</text>`);
    // the key below the chart, wrapping: one line inside it ran past its edges beyond eight GPUs
    const keys = Object.keys(state.series).map((gpu) => `<span style="color:${color[gpu]}">■ GPU ${esc(gpu)}</span>`).join("");
    return `<div class="chart" data-chart="${chart.key}"><h4>${chart.title}</h4><svg viewBox="0 0 ${width} ${height}">${parts.join("")}</svg><div class="keys">${keys}</div></div>`;
  }).join("");
}

init();
