// The rollout viewer's script (viewer.py inlines it into every page; no network).
// A step page renders each rollout's tokens when it is opened; the URL hash sets the view:
//   step_000001.html#open=all&channel=logprob&min=0.5&q=7?3   (open: all or rollout numbers, comma-separated)
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const hash = new URLSearchParams(location.hash.slice(1));
const $ = id => document.getElementById(id);
const esc = s => String(s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"})[c]);
const fmt = x => (x > 0 ? "+" : "") + (Math.abs(x) >= 1e-3 || x === 0 ? x.toFixed(3) : x.toExponential(1));

// Colour channels: a sampled token's value and its colour on this page's scale ("scale" is set per page).
const rgba = (rgb, a) => `rgba(${rgb},${Math.min(1, a).toFixed(3)})`;
const diverging = (x, s) => x > 0 ? rgba("0,150,0", x / s) : rgba("210,0,0", -x / s);
const CHANNELS = {
  advantage: {value: (t, j) => t.advantages && t.advantages[j], colour: diverging,
              legend: s => [fmt(-s), "linear-gradient(90deg,rgb(210,0,0),#fff,rgb(0,150,0))", fmt(s)]},
  logprob: {value: (t, j) => t.logprobs[j], colour: x => rgba("230,120,0", 1 - Math.exp(x)),
            legend: () => ["p=1", "linear-gradient(90deg,#fff,rgb(230,120,0))", "p=0"]},
  mismatch: {value: (t, j) => t.trainer_logprobs && t.trainer_logprobs[j] - t.logprobs[j], colour: diverging,
             legend: s => ["trainer " + fmt(-s) + " below sampler", "linear-gradient(90deg,rgb(210,0,0),#fff,rgb(0,150,0))", fmt(s) + " above"]},
  version: {value: (t, j) => t.versions[j], colour: (v, s) => rgba("60,90,220", (s.max - v) / Math.max(1, s.max - s.min)),
            legend: s => ["newest (v" + s.max + ")", "linear-gradient(90deg,#fff,rgb(60,90,220))", "oldest (v" + s.min + ")"]},
};
let channel = CHANNELS[hash.get("channel")] ? hash.get("channel") : "advantage";

const scales = {};
function scale(name) {  // the page's scale for a channel: max |x| (signed ones), the version range
  return scales[name] ??= pageScale(name);
}
function pageScale(name) {
  const xs = [];
  for (const t of DATA.rollouts) (t.mask || []).forEach((m, j) => { const x = m && CHANNELS[name].value(t, j); if (m && x != null) xs.push(x); });
  if (name === "version") return xs.reduce((s, v) => ({min: Math.min(s.min, v), max: Math.max(s.max, v)}),
                                           {min: xs[0] ?? 0, max: xs[0] ?? 0});
  const s = xs.reduce((m, x) => Math.max(m, Math.abs(x)), 0);
  return name === "mismatch" ? Math.max(s, 0.05) : s || 1;  // mismatch: below 0.05 nats stays pale
}

function token(t, j, texts, sc) {
  const id = t.tokens[j], text = texts[id] ?? "";
  let tip = `#${j} id ${id} ${JSON.stringify(text)}`;
  if (!t.mask[j]) return `<span class="p" data-j="${j}" data-id="${id}" title="${esc(tip)}">${esc(text)}</span>`;
  const adv = t.advantages ? t.advantages[j] : null, tlp = t.trainer_logprobs ? t.trainer_logprobs[j] : null;
  tip += `\nadvantage ${adv == null ? "not dumped" : fmt(adv)}\nlogprob ${fmt(t.logprobs[j])} (p ${Math.exp(t.logprobs[j]).toFixed(3)})`
    + `\ntrainer logprob ${tlp == null ? "not dumped" : fmt(tlp) + "\nmismatch " + fmt(tlp - t.logprobs[j])}\nversion ${t.versions[j]}`
    + (t.turns ? `\nturn ${t.turns[j]}` : "");
  const x = CHANNELS[channel].value(t, j);
  const bg = x == null ? "" : ` style="background:${CHANNELS[channel].colour(x, sc)}"`;
  return `<span class="s" data-j="${j}" data-id="${id}" data-value="${x ?? ""}"${bg} title="${esc(tip)}">${esc(text) || "∅"}</span>`;
}

// A rollout's branches: `parent` is the rollout id (in its group) it continues, `branch_turn` the turn it
// branched at (its first own token is that turn's first sampled one); without it, the shared token prefix.
const parentOf = t => t.parent ?? null;
function branchPoint(t, p) {
  const own = t.branch_turn != null && t.turns ? t.turns.findIndex((k, j) => k === t.branch_turn && t.mask[j]) : -1;
  if (own >= 0) return own;
  let n = 0;
  while (n < t.tokens.length && n < p.tokens.length && t.tokens[n] === p.tokens[n]) n++;
  return n;
}

function body(i) {  // a rollout's conversation: prompt, each sampled turn and observation, tokens coloured
  const t = DATA.rollouts[i], sc = scale(channel);
  let out = (t.images || []).map(src => `<img class="thumb" src="${esc(src)}">`).join("");
  if (t.dropped) out += `<p>dropped (<b>${esc(t.dropped)}</b>)</p>` + (t.detail ? `<pre>${esc(t.detail)}</pre>` : "")
    + (t.tokens ? "" : `<pre>${esc(typeof t.prompt === "string" ? t.prompt : JSON.stringify(t.prompt))}</pre>`);
  if (!t.tokens) return out;
  const p = byId(t, parentOf(t));
  let start = 0;
  if (p != null) {
    start = branchPoint(t, DATA.rollouts[p]);
    out += `<p class="branch-note">branch of <a href="#open=${p}">#${p}</a>: its first ${start} tokens are #${p}'s</p>`;
  }
  let turn = 0;
  for (let j = start; j < t.tokens.length;) {
    let k = j;
    while (k < t.tokens.length && t.mask[k] === t.mask[j] && (!t.turns || !t.mask[j] || t.turns[k] === t.turns[j])) k++;
    let label = j === 0 ? "prompt" : "observation";
    if (t.mask[j]) {
      const n = t.turns ? t.turns[j] : turn++;
      label = `turn ${n + 1}` + (t.turn_rewards && t.turn_rewards[n] != null ? ` · reward ${fmt(t.turn_rewards[n])}` : "")
        + (t.finish_reasons && t.finish_reasons[n] ? ` · ${esc(t.finish_reasons[n])}` : "");
    }
    const spans = [];
    for (let m = j; m < k; m++) spans.push(token(t, m, DATA.texts, sc));
    out += `<div class="blk ${t.mask[j] ? "sampled" : j === 0 ? "prompt" : "obs"}" data-turn="${label}"><div class="lbl">${label}</div><div class="toks">${spans.join("")}</div></div>`;
    j = k;
  }
  const kids = DATA.rollouts.map((c, c_i) => byId(c, parentOf(c)) === i ? c_i : -1).filter(c => c >= 0);
  if (kids.length) out += "<p>branches: " + kids.map(c => `<a href="#open=${c}">#${c}</a> at token ${branchPoint(DATA.rollouts[c], t)}`).join(", ") + "</p>";
  const info = Object.entries(t.info || {}).map(([k, v]) => `${esc(k)}=${esc(v)}`).join(" ");
  return out + (info ? `<p class="info">info: ${info}</p>` : "");
}

function byId(t, rid) {  // the index of rollout `rid` of t's group (its first segment), or null
  if (rid == null) return null;
  const i = DATA.rollouts.findIndex(r => !r.dropped && r.group === t.group && r.rollout_id === rid && r !== t);
  return i < 0 ? null : i;
}

const promptOf = t => { const n = t.mask ? (t.mask.indexOf(1) < 0 ? t.mask.length : t.mask.indexOf(1)) : 0;
  return t.tokens ? t.tokens.slice(0, n).map(id => DATA.texts[id]).join("") : JSON.stringify(t.prompt); };

// A rollout's segments (rows sharing its group and id: each rewrite of its context starts one) hang under its first.
const segments = t => t.dropped ? [] : DATA.rollouts.flatMap((r, j) => !r.dropped && r.group === t.group && r.rollout_id === t.rollout_id ? [j] : []);

function summary(i) {
  const t = DATA.rollouts[i], sampled = (t.mask || []).reduce((a, b) => a + b, 0), p = byId(t, parentOf(t)), segs = segments(t);
  return `#${i} · group ${t.group} · rollout ${t.rollout_id ?? ""} · ` + (t.dropped ? `<b>dropped: ${esc(t.dropped)}</b>` : `reward <b>${fmt(t.reward)}</b>`)
    + (segs.length > 1 ? ` · segment ${segs.indexOf(i) + 1} of ${segs.length}` : "")
    + ` · ${sampled} sampled tokens` + (t.turn_rewards ? ` · turn rewards ${t.turn_rewards.map(fmt).join(" ")}` : "")
    + (p != null ? ` · ↳ branch of #${p}` : "");
}

function order() {  // rollouts in dump order, each branch or later segment right after its parent (a tree), dropped ones last
  const kids = {}, roots = [];
  DATA.rollouts.forEach((t, i) => { const s = segments(t)[0], p = byId(t, parentOf(t)) ?? (s < i ? s : null);
    if (p == null || t.dropped) roots.push(i); else (kids[p] = kids[p] || []).push(i); });
  const out = [], visit = (i, depth) => { out.push([i, depth]); (kids[i] || []).forEach(c => visit(c, depth + 1)); };
  roots.filter(i => !DATA.rollouts[i].dropped).forEach(i => visit(i, 0));
  roots.filter(i => DATA.rollouts[i].dropped).forEach(i => out.push([i, 0]));
  return out;
}

function fill(d) { d.querySelector(".body").innerHTML = body(+d.dataset.i); d.dataset.filled = channel; }

function legend() {
  const [lo, grad, hi] = CHANNELS[channel].legend(scale(channel));
  $("legend").dataset.channel = channel;
  $("legend").innerHTML = `<span>${esc(lo)}</span><span class="bar" style="background:${grad}"></span><span>${esc(hi)}</span>`;
}

function filter() {  // reward range and prompt text; dropped rollouts show unless a reward bound is set
  const lo = parseFloat($("min").value), hi = parseFloat($("max").value), q = $("q").value.toLowerCase();
  let shown = 0;
  for (const d of document.querySelectorAll("details.rollout")) {
    const t = DATA.rollouts[+d.dataset.i];
    const ok = (isNaN(lo) || (!t.dropped && t.reward >= lo)) && (isNaN(hi) || (!t.dropped && t.reward <= hi))
      && (!q || promptOf(t).toLowerCase().includes(q));
    d.hidden = !ok;
    shown += ok;
  }
  $("shown").textContent = `${shown} of ${DATA.rollouts.length} shown`;
}

function stepPage() {
  const opts = Object.keys(CHANNELS).map(c => `<option${c === channel ? " selected" : ""}>${c}</option>`).join("");
  const nav = (DATA.prev ? `<a href="${DATA.prev}">← prev</a> · ` : "") + `<b>step ${DATA.step}</b>` + (DATA.next ? ` · <a href="${DATA.next}">next →</a>` : "");
  $("step").innerHTML = `<header><a href="index.html">index</a> · ${nav} · <label>colour by <select id="channel">${opts}</select></label>
    <span id="legend"></span><br><label>reward ≥ <input id="min" type="number" step="any" value="${esc(hash.get("min") ?? "")}"></label>
    <label>≤ <input id="max" type="number" step="any" value="${esc(hash.get("max") ?? "")}"></label>
    <label>prompt contains <input id="q" value="${esc(hash.get("q") ?? "")}"></label><span id="shown"></span></header>`
    + (DATA.missing.length ? `<p class="missing">this dump has no ${DATA.missing.join(", ")}: those colours are blank (trainer_logprobs are not measured under --old_logprobs engine, the old policy's logprobs being the engine's; or an older version dumped it)</p>` : "")
    + order().map(([i, depth]) => `<details class="rollout${depth ? " branch" : ""}${DATA.rollouts[i].dropped ? " dropped" : ""}" id="r${i}" data-i="${i}"`
      + ` style="margin-left:${2 * depth}em"><summary>${summary(i)}</summary><div class="body"></div></details>`).join("");
  const open = (hash.get("open") || "").split(",");
  for (const d of document.querySelectorAll("details.rollout")) {
    d.addEventListener("toggle", () => { if (d.open && d.dataset.filled !== channel) fill(d); });
    if (open.includes("all") || open.includes(d.dataset.i)) { d.open = true; fill(d); }
  }
  $("channel").onchange = e => { channel = e.target.value; legend(); document.querySelectorAll("details.rollout[open]").forEach(fill); };
  for (const id of ["min", "max", "q"]) $(id).oninput = filter;
  legend();
  filter();
  window.onhashchange = () => location.reload();
}

function indexPage() {  // the prompt filter of the first/last comparison
  const box = $("prompt-filter");
  if (!box) return;
  box.value = hash.get("q") ?? "";
  const apply = () => document.querySelectorAll("tr.cmp").forEach(r => { r.hidden = !r.dataset.prompt.toLowerCase().includes(box.value.toLowerCase()); });
  box.oninput = apply;
  apply();
}

DATA ? stepPage() : indexPage();
