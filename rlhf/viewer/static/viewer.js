// rlhf view: the page's code (rlhf/viewer/, docs/runs.md). Our own, no library: SVG curves, a
// sortable table, the token view. Every text from a run goes into the page as text (textContent,
// Text nodes), never as markup.
"use strict";
(() => {
  const boot = JSON.parse(document.getElementById("boot").textContent);
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#2563eb", "#e8590c", "#0ca678", "#ae3ec9", "#e03131", "#1098ad", "#f08c00", "#5c940d"];
  const CATEGORIES = ["#4c6ef5", "#f59f00", "#12b886", "#e64980", "#7950f2", "#15aabf", "#fa5252", "#82c91e", "#868e96"];
  const SMOOTHING = 0.6;

  // --- elements, safely ---------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = String(value);
      else if (key === "style") for (const [name, v] of Object.entries(value)) node.style.setProperty(name, v);  // CSSOM: allowed by the CSP
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : String(child));  // a string becomes a Text node
    }
    return node;
  }
  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    return node;
  }
  const fmt = (v, digits = 3) => (v === null || v === undefined || Number.isNaN(v)) ? "–"
    : (typeof v === "number" ? (Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(2) : +v.toFixed(digits)) : String(v));
  const short = (text, n = 80) => { const s = String(text ?? "").replace(/\s+/g, " "); return s.length > n ? s.slice(0, n - 1) + "…" : s; };
  const expand = (runs) => (runs || []).flatMap(([value, count]) => Array(count).fill(value));

  // --- where the data comes from: the server, or the export's inline data ----------------------
  function liveSource(token) {
    async function get(path, params) {
      const query = new URLSearchParams({ ...params, token });
      const answer = await fetch(`/api/${path}?${query}`, { credentials: "same-origin", cache: "no-store" });
      if (!answer.ok) throw new Error(`${path}: ${answer.status} ${await answer.text()}`);
      return answer.json();
    }
    return {
      live: true,
      runs: () => get("runs", {}),
      metrics: (run, keys, from) => get("metrics", { run, keys: keys.join(","), from }),
      steps: (run) => get("steps", { run }),
      step: (run, step) => get("step", { run, step }),
      prompt: (prompt) => get("prompt", { prompt }),
    };
  }
  function exportSource(data) {
    return {
      live: false,
      runs: async () => ({ runs: data.runs, charts: data.charts }),
      metrics: async (run, keys) => {
        const m = data.runs[run].metrics;
        return { rows: m.rows, keys: Object.keys(m.series), step: m.step,
                 series: Object.fromEntries(keys.filter((k) => k in m.series).map((k) => [k, m.series[k]])) };
      },
      steps: async () => ({ steps: data.exported_steps }),
      step: async (run, step) => data.runs[run].step_data[String(step)] || { step, samples: [], tokens: {} },
      prompt: async (prompt) => ({
        runs: data.runs.map((r) => Object.values(r.step_data).flatMap((d) =>
          d.samples.filter((s) => s.prompt === prompt).map((s) => ({ ...s, step: d.step })))),
      }),
    };
  }
  const source = boot.mode === "live" ? liveSource(boot.token) : exportSource(boot);

  // --- state --------------------------------------------------------------------------------
  const S = {
    runs: [], charts: [], metrics: [], chartKeys: [], steps: [], step: null, run: 0, data: null,
    order: [], selected: null, sort: { key: null, dir: -1 }, tab: "sample", quantity: "logprobs",
    across: null, pinned: null,
  };

  function setStatus(text, error) {
    const status = $("status");
    status.textContent = text;
    status.classList.toggle("error", !!error);
  }

  // --- runs and curves ----------------------------------------------------------------------
  function renderRuns() {
    const box = $("runs");
    box.replaceChildren(...S.runs.map((run, i) => el("button", {
      type: "button", class: "run-chip" + (i === S.run ? " active" : ""), title: run.path,
      onclick: () => { S.run = i; renderRuns(); loadStep(S.step); },
    }, el("span", { class: "swatch", style: { background: COLORS[i % COLORS.length] } }), run.name)));
  }

  async function loadMetrics(keys, fresh) {
    await Promise.all(S.runs.map(async (_, i) => {
      const have = S.metrics[i];
      const from = fresh || !have ? 0 : have.rows;
      const got = await source.metrics(i, keys, from);
      if (!have || fresh || got.rows < from) { S.metrics[i] = { rows: got.rows, keys: got.keys, step: got.step, series: got.series }; return; }
      if (got.rows === have.rows) { have.keys = got.keys; return; }
      have.step.push(...got.step);
      for (const key of Object.keys(have.series)) have.series[key].push(...(got.series[key] || got.step.map(() => null)));
      have.rows = got.rows; have.keys = got.keys;
    }));
  }

  async function addMetric(key) {
    if (!key || S.chartKeys.includes(key)) return;
    await Promise.all(S.runs.map(async (_, i) => {
      const got = await source.metrics(i, [key], 0);
      const have = S.metrics[i];
      have.series[key] = got.step.length === have.step.length ? got.series[key] || [] : have.step.map(() => null);
    }));
    S.chartKeys.push(key);
    renderCharts();
  }

  function smooth(values) {
    let last = null;
    return values.map((v) => (v === null ? null : (last = last === null ? v : SMOOTHING * last + (1 - SMOOTHING) * v)));
  }

  function points(i, key) {
    const m = S.metrics[i];
    const values = (m && m.series[key]) || [];
    const out = [];
    values.forEach((v, j) => { if (v !== null && v !== undefined) out.push([m.step[j], v]); });
    return out;
  }

  function renderCharts() {
    const box = $("charts");
    box.replaceChildren();
    const W = 320, H = 120, L = 34, R = 6, T = 6, B = 16;
    for (const key of S.chartKeys) {
      const series = S.runs.map((_, i) => points(i, key));
      const all = series.flat();
      const card = el("div", { class: "chart", "data-metric": key });
      const latest = series[S.run] && series[S.run].length ? series[S.run][series[S.run].length - 1][1] : null;
      const atStep = (series[S.run] || []).find(([s]) => s === S.step);
      card.append(el("h3", {}, el("span", { text: key }), el("span", { class: "value", text: fmt(atStep ? atStep[1] : latest) })),
                  el("button", { class: "close", type: "button", title: "remove this curve", text: "×",
                                  onclick: () => { S.chartKeys = S.chartKeys.filter((k) => k !== key); renderCharts(); } }));
      const plot = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img", "aria-label": key });
      if (all.length) {
        let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
        let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
        if (x1 === x0) { x0 -= 1; x1 += 1; }
        if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
        const X = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
        const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
        for (const y of [y0, (y0 + y1) / 2, y1]) {
          plot.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: Y(y), y2: Y(y) }));
          const label = svg("text", { class: "axis", x: L - 3, y: Y(y) + 3, "text-anchor": "end" });
          label.textContent = fmt(y, 2);
          plot.append(label);
        }
        for (const [x, anchor] of [[x0, "start"], [x1, "end"]]) {
          const label = svg("text", { class: "axis", x: X(x), y: H - 3, "text-anchor": anchor });
          label.textContent = String(x);
          plot.append(label);
        }
        series.forEach((pts, i) => {
          if (!pts.length) return;
          const color = COLORS[i % COLORS.length];
          const path = (ps) => ps.map(([x, y], j) => `${j ? "L" : "M"}${X(x).toFixed(1)} ${Y(y).toFixed(1)}`).join("");
          const smoothed = smooth(pts.map((p) => p[1]));
          plot.append(svg("path", { d: path(pts), fill: "none", stroke: color, "stroke-width": 1, opacity: 0.3, "vector-effect": "non-scaling-stroke" }));
          plot.append(svg("path", { class: "line", d: path(pts.map((p, j) => [p[0], smoothed[j]])), fill: "none", stroke: color,
                                    "stroke-width": 1.8, "vector-effect": "non-scaling-stroke" }));
          if (pts.length === 1) plot.append(svg("circle", { cx: X(pts[0][0]), cy: Y(pts[0][1]), r: 2.5, fill: color }));
        });
        if (S.step !== null) plot.append(svg("line", { class: "cursor", x1: X(S.step), x2: X(S.step), y1: T, y2: H - B, "vector-effect": "non-scaling-stroke" }));
        plot.addEventListener("click", (event) => {
          const box = plot.getBoundingClientRect();
          const x = x0 + ((event.clientX - box.left) / box.width * W - L) / (W - L - R) * (x1 - x0);
          const nearest = S.steps.reduce((best, s) => (Math.abs(s - x) < Math.abs(best - x) ? s : best), S.steps[0]);
          if (nearest !== undefined) loadStep(nearest);
        });
      } else {
        const label = svg("text", { class: "axis", x: W / 2, y: H / 2, "text-anchor": "middle" });
        label.textContent = "not logged";
        plot.append(label);
      }
      card.append(plot);
      box.append(card);
    }
    const picker = $("add-metric");
    const keys = [...new Set(S.metrics.flatMap((m) => (m ? m.keys : [])))].filter((k) => !S.chartKeys.includes(k)).sort();
    picker.replaceChildren(el("option", { value: "", text: "metrics.jsonl key" }), ...keys.map((k) => el("option", { value: k, text: k })));
  }

  // --- steps --------------------------------------------------------------------------------
  async function loadSteps() {
    const got = await source.steps(S.run);
    S.steps = got.steps.length ? got.steps : [...new Set((S.metrics[S.run] || { step: [] }).step.filter((s) => s >= 1))];
    $("step-max").textContent = S.steps.length ? `of ${S.steps[S.steps.length - 1]}` : "no steps yet";
  }

  function stepAt(offset) {
    if (!S.steps.length) return null;
    const at = S.steps.indexOf(S.step);
    if (at < 0) return S.steps[S.steps.length - 1];
    return S.steps[Math.max(0, Math.min(S.steps.length - 1, at + offset))];
  }

  async function loadStep(step, keepSelection) {
    if (step === null || step === undefined) { renderTable(); renderDetail(); return; }
    const previous = keepSelection ? S.selected : null;
    S.step = step;
    $("step-input").value = step;
    try {
      S.data = await source.step(S.run, step);
    } catch (error) { setStatus(String(error), true); return; }
    S.selected = previous !== null && previous < S.data.samples.length ? previous : (S.data.samples.length ? 0 : null);
    S.across = null;
    fillOutcomes();
    renderCharts();
    renderTable();
    renderDetail();
    const n = S.data.samples.length;
    setStatus(`${source.live ? "live" : "exported page"} · step ${step}: ${n} sample${n === 1 ? "" : "s"}, ${Object.keys(S.data.tokens).length} with tokens`);
  }

  // --- the samples table --------------------------------------------------------------------
  function advantage(index) {
    const record = S.data && S.data.tokens[String(index)];
    if (!record || !record.advantages) return null;
    const at = record.mask.findIndex((m, j) => m && record.advantages[j] !== null);
    return at >= 0 ? record.advantages[at] : null;
  }

  function columns() {
    const sources = [...new Set((S.data ? S.data.samples : []).flatMap((s) => Object.keys(s.rewards || {})))].sort();
    return [
      { key: "index", label: "#", value: (s, i) => i, num: true },
      { key: "group", label: "group", value: (s) => s.group, num: true },
      { key: "reward", label: "reward", value: (s) => s.reward, num: true },
      ...(sources.length > 1 ? sources.map((name) => ({ key: "r:" + name, label: name, value: (s) => (s.rewards || {})[name], num: true })) : []),
      { key: "adv", label: "adv", value: (s, i) => advantage(i), num: true },
      { key: "len", label: "len", value: (s) => s.completion_tokens, num: true },
      { key: "turns", label: "turns", value: (s) => s.turns, num: true },
      { key: "finish", label: "finish", value: (s) => s.finish_reason },
      { key: "outcome", label: "outcome", value: (s) => s.outcome },
      { key: "completion", label: "completion", value: (s) => s.completion, text: true },
      { key: "prompt", label: "prompt", value: (s) => s.prompt, text: true },
    ];
  }

  function fillOutcomes() {
    const select = $("f-outcome");
    const current = select.value;
    const outcomes = [...new Set(S.data.samples.map((s) => s.outcome).filter(Boolean))].sort();
    select.replaceChildren(el("option", { value: "", text: "any" }), ...outcomes.map((o) => el("option", { value: o, text: o })));
    select.value = outcomes.includes(current) ? current : "";
  }

  function matcher() {
    const text = $("f-text").value;
    const box = $("f-text");
    box.classList.remove("error");
    if (!text) return () => true;
    if ($("f-regex").checked) {
      try {
        const pattern = new RegExp(text, "i");
        return (s) => pattern.test(String(s.prompt ?? "")) || pattern.test(String(s.completion ?? ""));
      } catch (error) {
        box.classList.add("error");
        box.title = String(error);
        return () => true;
      }
    }
    const needle = text.toLowerCase();
    return (s) => String(s.prompt ?? "").toLowerCase().includes(needle) || String(s.completion ?? "").toLowerCase().includes(needle);
  }

  function visible() {
    if (!S.data) return [];
    const low = parseFloat($("f-min").value), high = parseFloat($("f-max").value);
    const outcome = $("f-outcome").value, match = matcher();
    const cols = columns();
    let order = S.data.samples.map((s, i) => i).filter((i) => {
      const s = S.data.samples[i];
      if (!Number.isNaN(low) && !(s.reward >= low)) return false;
      if (!Number.isNaN(high) && !(s.reward <= high)) return false;
      if (outcome && s.outcome !== outcome) return false;
      return match(s);
    });
    const col = cols.find((c) => c.key === S.sort.key);
    if (col) {
      const key = (i) => col.value(S.data.samples[i], i);
      order.sort((a, b) => {
        const [x, y] = [key(a), key(b)];
        if (x === y) return a - b;
        if (x === null || x === undefined) return 1;
        if (y === null || y === undefined) return -1;
        return (x < y ? -1 : 1) * S.sort.dir;
      });
    }
    return order;
  }

  function renderTable() {
    const table = $("samples");
    const cols = columns();
    table.tHead.replaceChildren(el("tr", {}, cols.map((c) => el("th", {
      class: S.sort.key === c.key ? "sorted" : "", title: "sort",
      onclick: () => { S.sort = { key: c.key, dir: S.sort.key === c.key ? -S.sort.dir : (c.num ? -1 : 1) }; renderTable(); },
    }, c.label + (S.sort.key === c.key ? (S.sort.dir > 0 ? " ▲" : " ▼") : "")))));
    S.order = visible();
    const body = table.tBodies[0];
    const rows = S.order.slice(0, 1000).map((i) => {
      const s = S.data.samples[i];
      const bad = s.outcome && s.outcome !== "ok" && s.outcome !== "truncated";
      return el("tr", { "data-index": i, class: i === S.selected ? "selected" : "", onclick: () => select(i) },
        cols.map((c) => {
          const v = c.value(s, i);
          return el("td", { class: (c.num ? "num" : "") + (c.text ? " text" : "") + (c.key === "outcome" && bad ? " outcome-bad" : ""),
                            title: c.text ? short(v, 400) : null }, c.text ? short(v) : fmt(v));
        }));
    });
    if (!S.data || !S.data.samples.length) {
      rows.push(el("tr", {}, el("td", { colspan: cols.length, class: "note",
        text: S.step === null ? "no step yet" : `no samples logged for step ${S.step} (samples.jsonl)` })));
    }
    body.replaceChildren(...rows);
    $("f-count").textContent = S.data ? `${S.order.length} of ${S.data.samples.length}` : "";
  }

  function select(index, scroll) {
    S.selected = index;
    S.pinned = null;
    for (const row of $("samples").tBodies[0].rows) row.classList.toggle("selected", Number(row.dataset.index) === index);
    if (scroll) {
      const row = $("samples").querySelector(`tr[data-index="${index}"]`);
      const wrap = $("samples").parentElement, head = $("samples").tHead.offsetHeight;
      if (row && row.offsetTop - head < wrap.scrollTop) wrap.scrollTop = row.offsetTop - head;  // vertically only
      else if (row && row.offsetTop + row.offsetHeight > wrap.scrollTop + wrap.clientHeight) wrap.scrollTop = row.offsetTop + row.offsetHeight - wrap.clientHeight;
    }
    renderDetail();
  }

  function move(offset) {
    if (!S.order.length) return;
    const at = S.order.indexOf(S.selected);
    const next = at < 0 ? 0 : Math.max(0, Math.min(S.order.length - 1, at + offset));
    select(S.order[next], true);
  }

  // --- the detail: sample and tokens, group, across steps, config ---------------------------
  const QUANTITIES = [
    { key: "logprobs", label: "log-prob (policy)", kind: "logprob" },
    { key: "rollout_logprobs", label: "log-prob (rollout)", kind: "logprob" },
    { key: "diff", label: "policy − rollout", kind: "signed" },
    { key: "advantages", label: "advantage", kind: "signed" },
    { key: "kl", label: "KL", kind: "signed" },
    { key: "mask", label: "loss mask", kind: "category" },
    { key: "origins", label: "origin", kind: "category" },
    { key: "versions", label: "policy version", kind: "category" },
  ];

  function tokenTable(record) {
    const n = record.ids.length;
    const col = (name) => (record[name] ? record[name] : null);
    const origins = record.origins ? expand(record.origins) : record.mask.map((m) => (m ? "model" : "env"));
    const versions = record.versions ? expand(record.versions) : null;
    const diff = record.logprobs && record.rollout_logprobs
      ? record.logprobs.map((v, j) => (v === null || record.rollout_logprobs[j] === null || !record.mask[j] ? null : v - record.rollout_logprobs[j])) : null;
    return { n, values: { logprobs: col("logprobs"), rollout_logprobs: col("rollout_logprobs"), diff, advantages: col("advantages"),
                          kl: col("kl"), mask: record.mask, origins, versions } };
  }

  function colorFor(quantity, values) {
    const q = QUANTITIES.find((x) => x.key === quantity);
    if (q.kind === "category") {
      const kinds = [...new Set(values.filter((v) => v !== null && v !== undefined).map(String))];
      const color = (v) => (v === null || v === undefined ? null : CATEGORIES[kinds.indexOf(String(v)) % CATEGORIES.length] + "55");
      const legend = el("span", { class: "legend" }, kinds.map((k) => el("span", { class: "cat" },
        el("i", { style: { background: CATEGORIES[kinds.indexOf(k) % CATEGORIES.length] } }), k)));
      return { color, legend };
    }
    const finite = values.filter((v) => typeof v === "number");
    const scale = Math.max(1e-9, ...finite.map((v) => Math.abs(v)));
    const style = getComputedStyle(document.documentElement);
    const pos = style.getPropertyValue("--pos").trim(), neg = style.getPropertyValue("--neg").trim();
    const color = (v) => {
      if (typeof v !== "number") return null;
      const a = Math.min(1, Math.abs(v) / scale) * 0.75;
      return `rgba(${q.kind === "logprob" ? neg : (v >= 0 ? pos : neg)}, ${a.toFixed(3)})`;
    };
    const bar = q.kind === "logprob"
      ? `linear-gradient(to right, rgba(${neg},0.75), rgba(${neg},0))`
      : `linear-gradient(to right, rgba(${neg},0.75), rgba(${neg},0), rgba(${pos},0.75))`;
    const legend = el("span", { class: "legend" }, q.kind === "logprob" ? fmt(-scale, 2) : fmt(-scale, 2),
      el("span", { class: "bar", style: { background: bar } }), q.kind === "logprob" ? "0" : fmt(scale, 2));
    return { color, legend };
  }

  function describeToken(record, table, j) {
    const v = table.values;
    const parts = [`#${j}`, `id ${record.ids[j]}`, JSON.stringify(record.pieces ? record.pieces[j] : "")];
    for (const q of QUANTITIES) {
      const column = v[q.key];
      if (column) parts.push(`${q.label} ${fmt(column[j], 4)}`);
    }
    return parts.join(" · ");
  }

  function tokenView(record) {
    const table = tokenTable(record);
    const available = QUANTITIES.filter((q) => table.values[q.key]);
    if (!available.some((q) => q.key === S.quantity)) S.quantity = available[0].key;
    const values = table.values[S.quantity];
    const { color, legend } = colorFor(S.quantity, values);
    const info = el("div", { class: "hover-info", id: "token-info", text: "hover a token for its values" });
    const picker = el("select", { id: "quantity", "aria-label": "colour tokens by",
      onchange: (event) => { S.quantity = event.target.value; renderDetail(); } },
      QUANTITIES.map((q) => el("option", { value: q.key, disabled: !table.values[q.key], text: q.label + (table.values[q.key] ? "" : " (not recorded)") })));
    picker.value = S.quantity;
    const view = el("div", { class: "tokens", id: "tokens" });
    let block = null, blockKind = null;
    const kindOf = (j) => {
      const origin = String(table.values.origins[j]);
      return origin === "model" ? "policy" : origin;
    };
    for (let j = 0; j < table.n; j++) {
      const kind = kindOf(j);
      if (kind !== blockKind) {
        block = el("div", { class: `turn ${kind}`, "data-kind": kind }, el("span", { class: "turn-label", text: kind === "env" ? "environment" : kind }));
        view.append(block);
        blockKind = kind;
      }
      const piece = record.pieces ? String(record.pieces[j]) : `[${record.ids[j]}]`;
      const background = color(values[j]);
      const span = el("span", { class: "tok" + (values[j] === null || values[j] === undefined ? " missing" : ""), "data-j": j,
        style: background ? { background } : null, title: describeToken(record, table, j) });
      const lines = piece.split("\n");
      lines.forEach((line, k) => {
        if (k) span.append(el("span", { class: "nl", text: "↵" }), "\n");
        span.append(line);
      });
      if (!piece.length) span.append(el("span", { class: "nl", text: "∅" }));
      span.addEventListener("mouseenter", () => { info.textContent = describeToken(record, table, j); });
      block.append(span);
    }
    return [el("div", { class: "token-tools" }, el("label", {}, "colour by ", picker), legend), view, info];
  }

  function facts(sample, index) {
    const items = [["reward", fmt(sample.reward, 4)]];
    for (const [name, value] of Object.entries(sample.rewards || {})) items.push([`↳ ${name}`, fmt(value, 4)]);
    items.push(["advantage", fmt(advantage(index), 4)], ["length", fmt(sample.completion_tokens)], ["turns", fmt(sample.turns)],
               ["finish", fmt(sample.finish_reason)], ["outcome", fmt(sample.outcome)]);
    if (sample.label !== undefined && sample.label !== null) items.push(["label", typeof sample.label === "string" ? sample.label : JSON.stringify(sample.label)]);
    if (sample.error) items.push(["error", sample.error]);
    return el("dl", { class: "facts" }, items.map(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })]));
  }

  function sampleDetail() {
    const i = S.selected, sample = S.data.samples[i];
    const record = S.data.tokens[String(i)];
    const out = [el("div", { class: "note", text: `${S.runs[S.run].name} · step ${S.step} · sample ${i} · group ${sample.group}` }), facts(sample, i),
                 el("details", { open: true }, el("summary", { text: "prompt" }), el("pre", { id: "prompt-text", text: sample.prompt ?? "" }))];
    if (record) {
      out.push(el("details", { open: true }, el("summary", { text: "tokens" }), ...tokenView(record)));
    } else {
      out.push(el("details", { open: true }, el("summary", { text: "completion" }), el("pre", { id: "completion-text", text: sample.completion ?? "" })),
               el("p", { class: "note", text: S.runs[S.run].has_tokens
                 ? "No token record for this sample: tokens.jsonl holds the first --log-tokens N samples of each step."
                 : "This run has no tokens.jsonl (an older rlhf, or --log-tokens 0): the token view is missing." }));
    }
    if (sample.segments && sample.segments.length) {
      out.push(el("details", {}, el("summary", { text: `${sample.segments.length} earlier segment(s) of this agent trajectory` }),
        sample.segments.map((seg) => el("pre", { text: seg.completion ?? "" }))));
    }
    return out;
  }

  function groupDetail() {
    const sample = S.data.samples[S.selected];
    const members = S.data.samples.map((s, i) => [s, i]).filter(([s]) => s.group === sample.group);
    const rewards = members.map(([s]) => s.reward).filter((r) => typeof r === "number");
    const mean = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null;
    return [el("div", { class: "note", text: `group ${sample.group} at step ${S.step}: ${members.length} samples, mean reward ${fmt(mean, 4)}` }),
            el("details", {}, el("summary", { text: "prompt" }), el("pre", { text: sample.prompt ?? "" })),
            el("div", { class: "group" }, members.map(([s, i]) => el("div", { class: "card" + (i === S.selected ? " selected" : ""), onclick: () => select(i, true) },
              el("div", {}, el("b", { text: `#${i}` }), `  reward ${fmt(s.reward, 3)}  adv ${fmt(advantage(i), 3)}  ${s.outcome || ""}`),
              el("pre", { text: s.completion ?? "" }))))];
  }

  // The same prompt side by side: a row per step, a column per run given, in each cell the step's
  // samples of that prompt (reward, outcome, the completion's start); a click opens one in the sample view.
  async function openSample(run, step, prompt, ordinal, completion) {
    S.tab = "sample";
    if (run !== S.run) { S.run = run; renderRuns(); await loadSteps(); }
    await loadStep(step);
    if (!S.data) return;
    const same = S.data.samples.map((s, i) => [s, i]).filter(([s]) => (s.prompt ?? "") === prompt);
    const hit = same[ordinal] && same[ordinal][0].completion === completion ? same[ordinal] : same.find(([s]) => s.completion === completion);
    if (hit) select(hit[1], true);
  }

  function acrossDetail() {
    const sample = S.data.samples[S.selected];
    const prompt = sample.prompt ?? "";
    const box = el("div", {}, el("div", { class: "note", text: "searching…" }));
    const key = `${prompt}`;
    const show = (found) => {
      const cells = new Map();  // "run:step" -> the samples of the prompt there, in the log's order
      const steps = new Set();
      found.runs.forEach((rows, r) => rows.forEach((row) => {
        const at = `${r}:${row.step}`;
        if (!cells.has(at)) cells.set(at, []);
        cells.get(at).push(row);
        steps.add(row.step);
      }));
      const ordered = [...steps].sort((a, b) => a - b);
      const runs = S.runs.map((run, r) => [run, r]);
      const head = el("tr", {}, el("th", { text: "step" }), runs.map(([run, r]) => el("th", { "data-run": r, scope: "col" },
        el("span", { class: "swatch", style: { background: COLORS[r % COLORS.length] } }), " ", run.name)));
      const body = ordered.map((step) => el("tr", { "data-step": step },
        el("th", { class: "num", scope: "row", text: step }),
        runs.map(([, r]) => {
          const here = cells.get(`${r}:${step}`) || [];
          const rewards = here.map((row) => row.reward).filter((v) => typeof v === "number");
          const mean = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null;
          return el("td", { class: "cell" + (step === S.step && r === S.run ? " current" : ""), "data-run": r },
            here.length ? [
              here.length > 1 ? el("div", { class: "cell-mean", text: `${here.length} samples · mean reward ${fmt(mean, 3)}` }) : null,
              here.map((row, ordinal) => {
                const bad = row.outcome && row.outcome !== "ok" && row.outcome !== "truncated";
                return el("button", { type: "button", class: "across-sample", title: short(row.completion, 400),
                  onclick: () => openSample(r, step, prompt, ordinal, row.completion) },
                  el("span", { class: "reward", text: fmt(row.reward, 3) }),
                  row.outcome ? el("span", { class: "outcome" + (bad ? " outcome-bad" : ""), text: row.outcome }) : null,
                  el("span", { class: "completion", text: short(row.completion, 120) }));
              }),
            ] : el("span", { class: "muted", text: "–" }));
        })));
      const table = el("table", { id: "across" }, el("thead", {}, head), el("tbody", {}, body));
      const total = [...cells.values()].reduce((n, rows) => n + rows.length, 0);
      box.replaceChildren(el("div", { class: "note", text: `this prompt: ${total} samples at ${steps.size} steps in ${found.runs.filter((r) => r.length).length} of ${S.runs.length} run(s)${source.live ? "" : " (of the exported steps)"}; a click opens a sample` }),
                          el("details", {}, el("summary", { text: "prompt" }), el("pre", { text: prompt })),
                          el("div", { class: "across-wrap" }, table));
    };
    if (S.across && S.across.key === key) show(S.across.found);
    else source.prompt(prompt).then((found) => { S.across = { key, found }; if (S.tab === "across") show(found); })
      .catch((error) => box.replaceChildren(el("div", { class: "error", text: String(error) })));
    return [box];
  }

  function renderDetail() {
    for (const button of document.querySelectorAll(".tabs button")) button.classList.toggle("active", button.dataset.tab === S.tab);
    const box = $("detail");
    if (S.tab === "config") {
      box.replaceChildren(el("pre", { id: "config-text", text: S.runs[S.run].config || "(no config.yaml)" }));
      return;
    }
    if (!S.data || S.selected === null || !S.data.samples[S.selected]) {
      box.replaceChildren(el("p", { class: "note", text: "Choose a sample (j / k, or click a row)." }));
      return;
    }
    box.replaceChildren(...(S.tab === "group" ? groupDetail() : S.tab === "across" ? acrossDetail() : sampleDetail()));
  }

  // --- following a live run -----------------------------------------------------------------
  async function poll() {
    try {
      const before = S.steps[S.steps.length - 1];
      await loadMetrics(S.chartKeys, false);
      await loadSteps();
      const last = S.steps[S.steps.length - 1];
      if (last !== before) {
        renderCharts();
        if ($("follow").checked) await loadStep(last);
      } else if (S.step === last) {
        const count = S.data ? S.data.samples.length : 0;
        const fresh = await source.step(S.run, S.step);
        if (fresh.samples.length !== count || Object.keys(fresh.tokens).length !== Object.keys(S.data.tokens).length) {
          S.data = fresh; renderTable(); renderDetail();
        }
      }
    } catch (error) { setStatus(`cannot reach the server: ${error}`, true); }
  }

  // --- keys and controls --------------------------------------------------------------------
  function onKey(event) {
    const field = event.target.closest && event.target.closest("input, select, textarea");
    if (event.key === "Escape") { $("help").hidden = true; if (field) field.blur(); return; }
    if (field || event.ctrlKey || event.metaKey || event.altKey) return;
    const actions = {
      j: () => move(1), ArrowDown: () => move(1), k: () => move(-1), ArrowUp: () => move(-1),
      "]": () => loadStep(stepAt(1), true), "[": () => loadStep(stepAt(-1), true),
      "/": () => $("f-text").focus(),
      t: () => { S.tab = "sample"; renderDetail(); }, g: () => { S.tab = "group"; renderDetail(); },
      a: () => { S.tab = "across"; renderDetail(); },
      q: () => {
        const options = [...document.querySelectorAll("#quantity option:not([disabled])")].map((o) => o.value);
        if (options.length) { S.quantity = options[(options.indexOf(S.quantity) + 1) % options.length]; renderDetail(); }
      },
      "?": () => { $("help").hidden = !$("help").hidden; },
    };
    const action = actions[event.key];
    if (action) { event.preventDefault(); action(); }
  }

  function wire() {
    document.addEventListener("keydown", onKey);
    $("prev-step").addEventListener("click", () => loadStep(stepAt(-1), true));
    $("next-step").addEventListener("click", () => loadStep(stepAt(1), true));
    $("step-input").addEventListener("change", (event) => {
      const wanted = Number(event.target.value);
      const nearest = S.steps.reduce((best, s) => (Math.abs(s - wanted) < Math.abs(best - wanted) ? s : best), S.steps[0]);
      loadStep(nearest ?? null);
    });
    for (const id of ["f-min", "f-max", "f-outcome", "f-text", "f-regex"]) $(id).addEventListener("input", () => renderTable());
    $("add-metric").addEventListener("change", (event) => addMetric(event.target.value));
    $("help-button").addEventListener("click", () => { $("help").hidden = !$("help").hidden; });
    for (const button of document.querySelectorAll(".tabs button")) {
      button.addEventListener("click", () => { S.tab = button.dataset.tab; renderDetail(); });
    }
    if (!source.live) { $("follow-label").hidden = true; }
  }

  async function start() {
    wire();
    try {
      const info = await source.runs();
      S.runs = info.runs;
      S.charts = info.charts;
      renderRuns();
      await loadMetrics(S.charts, true);
      const logged = new Set(S.metrics.flatMap((m) => m.keys));
      S.chartKeys = S.charts.filter((k) => logged.has(k));
      if (!S.chartKeys.length) {
        S.chartKeys = [...logged].sort().slice(0, 4);
        await loadMetrics(S.chartKeys, true);
      }
      await loadSteps();
      renderCharts();
      await loadStep(S.steps.length ? S.steps[S.steps.length - 1] : null);
      document.body.dataset.ready = "1";  // for tests: the first step is on the page
      if (source.live) setInterval(poll, 2000);
    } catch (error) {
      setStatus(String(error), true);
      document.body.dataset.ready = "error";
    }
  }
  start();
})();
