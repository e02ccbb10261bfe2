// Hyrax live dashboard: polls /dashboard/summary (public aggregates) every second and, with
// the admin token, /admin/requests and (every 5 s, where a controller runs the deployment)
// /admin/events; draws its own small line charts (no external assets).
"use strict";
const HISTORY = 120;
const COLORS = ["#2b6cb0", "#d69e2e", "#cc1f1a", "#1f9d55", "#805ad5", "#dd6b20", "#319795", "#718096"];
const series = {};  // chart id -> {name -> [values]}
let last = null;

function push(chart, name, value) {
  const s = (series[chart] = series[chart] || {});
  const arr = (s[name] = s[name] || []);
  arr.push(Number.isFinite(value) ? value : 0);
  if (arr.length > HISTORY) arr.shift();
}

function draw(chart) {
  const cv = document.getElementById(chart);
  if (!cv) return;
  const ctx = cv.getContext("2d");
  const s = series[chart] || {};
  const names = Object.keys(s);
  ctx.clearRect(0, 0, cv.width, cv.height);
  let max = 0;
  names.forEach(n => s[n].forEach(v => { if (v > max) max = v; }));
  max = max > 0 ? max * 1.1 : 1;
  const h = cv.height - 22, w = cv.width - 40;
  ctx.strokeStyle = "#dde1e6"; ctx.fillStyle = "#555"; ctx.font = "11px sans-serif";
  ctx.beginPath(); ctx.moveTo(38, 2); ctx.lineTo(38, h + 2); ctx.lineTo(cv.width, h + 2); ctx.stroke();
  ctx.fillText(max.toPrecision(3), 0, 10); ctx.fillText("0", 26, h + 2);
  names.forEach((n, i) => {
    const arr = s[n];
    ctx.strokeStyle = COLORS[i % COLORS.length]; ctx.lineWidth = 1.5; ctx.beginPath();
    arr.forEach((v, k) => {
      const x = 40 + (k / (HISTORY - 1)) * w, y = 2 + h - (v / max) * h;
      if (k === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
    ctx.fillStyle = COLORS[i % COLORS.length];
    ctx.fillText(n, 44 + (i % 4) * 105, cv.height - 4 - Math.floor(i / 4) * 0);
  });
  cv.dataset.points = String(names.reduce((a, n) => a + s[n].length, 0));
}

function sum(list, f) { return list.reduce((a, x) => a + (f(x) || 0), 0); }

function update(d) {
  const now = performance.now() / 1000;
  document.getElementById("model").textContent = d.model;
  const hp = document.getElementById("health");
  hp.textContent = d.ready ? "ready" : "not ready"; hp.className = "pill " + (d.ready ? "ok" : "bad");
  const tot = {
    gen: sum(d.replicas, r => r.generation_tokens), prompt: sum(d.replicas, r => r.prompt_tokens),
    retr: sum(d.replicas, r => r.retractions), rest: sum(d.replicas, r => r.restores),
    fb: sum(d.replicas, r => r.restore_fallbacks), xfer: sum(d.replicas, r => r.bytes_transferred),
    query: sum(d.replicas, r => r.prefix_query_tokens), hit: sum(d.replicas, r => r.prefix_hit_tokens),
  };
  if (last) {
    const dt = Math.max(now - last.t, 1e-3);
    push("c-throughput", "generated", (tot.gen - last.gen) / dt);
    push("c-throughput", "prompt", (tot.prompt - last.prompt) / dt);
    push("c-retract", "retractions", (tot.retr - last.retr) / dt);
    push("c-retract", "verified restores", (tot.rest - last.rest) / dt);
    push("c-retract", "fallbacks", (tot.fb - last.fb) / dt);
    push("c-transfer", "bytes/s", (tot.xfer - last.xfer) / dt);
    const asked = tot.query - last.query;
    push("c-prefix", "hit rate", asked > 0 ? (tot.hit - last.hit) / asked : 0);
  }
  last = Object.assign({ t: now }, tot);
  push("c-queue", "running", sum(d.replicas, r => r.running));
  push("c-queue", "waiting", sum(d.replicas, r => r.waiting));
  push("c-queue", "retracted", sum(d.replicas, r => r.retracted));
  Object.entries(d.pool_usage).forEach(([c, v]) => push("c-pools", c, v));
  push("c-ttft", "p50", d.ttft_p50 || 0);
  ["c-throughput", "c-queue", "c-pools", "c-retract", "c-transfer", "c-ttft", "c-prefix"].forEach(draw);
}

function token() { return document.getElementById("token").value.trim(); }

async function admin(path, body) {
  const opts = { headers: { "Authorization": "Bearer " + token() } };
  if (body !== undefined) { opts.method = "POST"; opts.headers["Content-Type"] = "application/json"; opts.body = JSON.stringify(body); }
  const r = await fetch(path, opts);
  const j = await r.json();
  if (!r.ok) throw new Error((j.error && j.error.message) || r.status);
  return j;
}

function status(msg) { document.getElementById("status").textContent = msg; }

function checksumCell(r) {
  if (!r.backup) return ["—", ""];
  const comps = Object.entries(r.backup.components || {});
  const ranks = r.backup.num_ranks || 1;
  const complete = comps.length > 0 && comps.every(([, c]) => Object.keys(c.checksums).length === ranks);
  return [comps.map(([n, c]) => n + ":" + Object.values(c.checksums).join("/")).join(" "), complete ? "ok" : "bad"];
}

async function refreshTable() {
  if (!token()) return;
  let reqs;
  try { reqs = (await admin("/admin/requests")).requests; } catch (e) { status("requests: " + e.message); return; }
  document.getElementById("table-hint").style.display = "none";
  const tb = document.querySelector("#requests tbody");
  tb.innerHTML = "";
  reqs.forEach(r => {
    const tr = document.createElement("tr");
    const [ck, cls] = checksumCell(r);
    const cells = [r.id, r.state, r.role + "/" + r.replica, r.prompt_tokens, r.output_tokens, r.retractions, ck];
    cells.forEach((v, i) => { const td = document.createElement("td"); td.textContent = v; if (i === 6 && cls) td.className = cls; tr.appendChild(td); });
    const td = document.createElement("td");
    const mk = (label, fn) => { const b = document.createElement("button"); b.textContent = label; b.dataset.action = label; b.dataset.id = r.id; b.onclick = fn; td.appendChild(b); };
    if (r.state === "running") {
      mk("retract", () => act("/admin/retract", { request_ids: [r.id], hold: true }));
      mk("migrate", () => act("/admin/migrate", { request_id: r.id }));
    }
    if (r.state === "retracted") mk("resume", () => act("/admin/resume", { request_ids: [r.id] }));
    tr.appendChild(td);
    tb.appendChild(tr);
  });
}

const EVENTS_SHOWN = 20, EVENTS_EVERY = 5;  // the newest 20, asked every 5th tick
const STOPPED = new Set(["dead", "hung", "down", "replace_failed"]);
let ticks = 0;

async function refreshEvents(controller) {
  // only where a controller keeps a log (hyrax serve): an in-process gateway answers 404
  document.getElementById("events-section").hidden = !controller;
  if (!controller || !token() || ticks++ % EVENTS_EVERY) return;
  let page;
  try { page = await admin("/admin/events"); } catch (e) { status("events: " + e.message); return; }
  document.getElementById("events-hint").style.display = "none";
  const tb = document.querySelector("#events tbody");
  tb.innerHTML = "";
  page.events.slice(-EVENTS_SHOWN).reverse().forEach(e => {
    const tr = document.createElement("tr");
    [new Date(e.time * 1000).toLocaleString(), e.kind, e.event].forEach((v, i) => {
      const td = document.createElement("td"); td.textContent = v;
      if (i === 1 && STOPPED.has(e.kind)) td.className = "bad";
      tr.appendChild(td);
    });
    tb.appendChild(tr);
  });
}

async function act(path, body) {
  try { const j = await admin(path, body); status(path + ": " + JSON.stringify(j.results || j.result || j)); }
  catch (e) { status(path + " failed: " + e.message); }
  refreshTable();
}

document.getElementById("set-forced").onclick = () =>
  act("/admin/forced-retraction", { interval: Number(document.getElementById("forced").value) || 0 });
document.getElementById("token").value = sessionStorage.getItem("hyrax-admin-token") || "";
document.getElementById("token").onchange = e => { sessionStorage.setItem("hyrax-admin-token", e.target.value); refreshTable(); };

async function tick() {
  let d = null;
  try { const r = await fetch("/dashboard/summary"); if (r.ok) { d = await r.json(); update(d); } } catch (e) { /* server restarting */ }
  refreshTable();
  if (d) refreshEvents(d.controller);
}
tick();
setInterval(tick, 1000);
