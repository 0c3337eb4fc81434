// loraplex admin UI: the few live parts (no framework, no build step, nothing fetched from
// elsewhere). Every request carries the session's CSRF token in X-CSRF-Token.
"use strict";

const csrfToken = () => (document.querySelector('meta[name="csrf-token"]') || {}).content || "";
const $ = (sel, root = document) => root.querySelector(sel);
const fmt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US", { maximumFractionDigits: 1 }));
const svgNS = "http://www.w3.org/2000/svg";

function el(tag, attrs = {}, text = "") {
  const node = tag.startsWith("svg:") ? document.createElementNS(svgNS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== "") node.textContent = text;
  return node;
}

// Forms that need a confirmation (delete, revoke).
document.addEventListener("submit", (event) => {
  const form = event.target;
  if (form.dataset && form.dataset.confirm && !window.confirm(form.dataset.confirm)) event.preventDefault();
});

// Copy buttons (the new key).
document.addEventListener("click", async (event) => {
  const button = event.target.closest("[data-copy]");
  if (!button) return;
  const input = $(button.dataset.copy);
  input.select();
  try { await navigator.clipboard.writeText(input.value); } catch (_) { document.execCommand("copy"); }
  button.textContent = "Copied";
});

// ---- adapter upload: drag and drop or picker, progress bar, the validation answer ----------
function setupUpload() {
  const form = $("#upload-form");
  if (!form) return;
  const drop = $("#drop"), picker = $("#u-file"), list = $("#file-list"), bar = $("#u-progress");
  const result = $("#upload-result");
  let files = [];
  const show = (chosen) => {
    files = Array.from(chosen);
    list.textContent = files.map((f) => `${f.name} (${fmt(f.size)} bytes)`).join(", ");
  };
  picker.addEventListener("change", () => show(picker.files));
  drop.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); picker.click(); } });
  ["dragenter", "dragover"].forEach((t) => drop.addEventListener(t, (e) => { e.preventDefault(); drop.classList.add("over"); }));
  ["dragleave", "drop"].forEach((t) => drop.addEventListener(t, () => drop.classList.remove("over")));
  drop.addEventListener("drop", (e) => { e.preventDefault(); show(e.dataTransfer.files); });

  const fieldError = (param, message) => {
    const target = $(`#e-${param}`) || $("#e-file");
    target.textContent = message;
    target.hidden = false;
    target.setAttribute("role", "alert");
  };
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    form.querySelectorAll(".error").forEach((e) => { e.hidden = true; e.textContent = ""; });
    result.replaceChildren();
    const name = $("#u-name").value.trim();
    if (!name) return fieldError("name", "Name the adapter.");
    if (!files.length) return fieldError("file", "Choose or drop the adapter's files.");
    const body = new FormData();
    body.append("name", name);
    body.append("visibility", $("#u-visibility").value);
    if (files.length === 1) body.append("file", files[0]);
    else for (const f of files) body.append(f.name.endsWith(".json") ? "adapter_config" : "adapter_model", f);
    let url = form.dataset.url;
    const tenant = $("#u-tenant");
    if (tenant) {
      if (!tenant.value.trim()) return fieldError("tenant", "Choose the tenant the adapter is for.");
      url += "?tenant=" + encodeURIComponent(tenant.value.trim());
    }
    const xhr = new XMLHttpRequest();
    xhr.open("POST", url);
    xhr.setRequestHeader("X-CSRF-Token", csrfToken());
    xhr.setRequestHeader("Accept", "application/json");
    bar.hidden = false; bar.value = 0;
    xhr.upload.onprogress = (e) => { if (e.lengthComputable) bar.value = (100 * e.loaded) / e.total; };
    xhr.onerror = () => fieldError("file", "The upload failed (the connection broke).");
    xhr.onload = () => {
      bar.value = 100;
      let answer = {};
      try { answer = JSON.parse(xhr.responseText); } catch (_) { /* not JSON */ }
      if (xhr.status === 201) {
        const box = el("div", { class: "result", role: "status" });
        box.append(el("strong", {}, `Stored ${answer.owner}/${answer.name}`));
        const dl = el("dl");
        for (const [k, v] of [["rank", answer.rank], ["target modules", (answer.target_modules || []).join(", ")],
          ["size", `${fmt(answer.bytes)} bytes`], ["content hash", answer.version], ["visibility", answer.visibility]]) {
          dl.append(el("dt", {}, k), el("dd", {}, String(v)));
        }
        box.append(dl);
        result.append(box);
        refreshTable();
      } else {
        // The reason goes next to the field it concerns (the files, the name or the tenant).
        const err = answer.error || {};
        bar.hidden = true;
        const param = err.param === "name" || err.param === "tenant" ? err.param : "file";
        fieldError(param, `Refused: ${err.message || `HTTP ${xhr.status}`}`);
      }
    };
    xhr.send(body);
  });
}

async function refreshTable() {
  const response = await fetch(location.href, { headers: { Accept: "text/html" } });
  const page = new DOMParser().parseFromString(await response.text(), "text/html");
  const fresh = $("#adapter-list", page), current = $("#adapter-list");
  if (fresh && current) current.replaceWith(fresh);
}

// ---- dashboard: poll the stats, derive rates, draw the tables and the two small charts --------
function meter(used, total) {
  const wrap = el("div");
  const m = el("div", { class: "meter", role: "img", "aria-label": `${used} of ${total}` });
  const pct = total ? Math.min(100, (100 * used) / total) : 0;
  const fill = el("span");
  fill.style.width = `${pct}%`; // CSSOM, not a style attribute: the CSP allows only this origin's CSS
  m.append(fill);
  wrap.append(m, el("span", { class: "amount" }, total ? `${fmt(used)} / ${fmt(total)}` : "off"));
  return wrap;
}

// Charts are drawn in the SVG's own pixel size, so text stays at its CSS size at any width.
function fitView(svg, height) {
  if (height) svg.style.height = `${height}px`;
  const w = Math.max(120, Math.round(svg.clientWidth || 300)), h = height || Math.max(60, Math.round(svg.clientHeight || 110));
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  return [w, h];
}

function drawSpark(svg, points) {
  svg.replaceChildren();
  const [w, h] = fitView(svg), max = Math.max(1, ...points);
  const xy = points.map((p, i) => [(w * i) / Math.max(1, points.length - 1), h - 14 - ((h - 24) * p) / max]);
  if (xy.length > 1) {
    const d = xy.map(([x, y], i) => `${i ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`).join("");
    svg.append(el("svg:path", { class: "area", d: `${d}L${w},${h - 14}L0,${h - 14}Z` }), el("svg:path", { class: "line", d }));
  }
  if (xy.length < 2) svg.append(el("svg:text", { x: 0, y: 16 }, "collecting…"));
  svg.append(el("svg:text", { x: 0, y: h - 2 }, `last ${points.length * 2} s`));
  svg.append(el("svg:text", { x: w, y: 12, "text-anchor": "end" }, `max ${fmt(max)}/s`));
}

function drawBars(svg, byTenant) {
  svg.replaceChildren();
  const rows = Object.entries(byTenant).sort((a, b) => b[1] - a[1]).slice(0, 5);
  const [w] = fitView(svg, Math.max(1, rows.length) * 22 + 6); // as tall as its bars
  if (!rows.length) { svg.append(el("svg:text", { x: 0, y: 16 }, "No requests in the last hour.")); return; }
  const max = Math.max(...rows.map((r) => r[1]));
  const left = Math.min(140, w * 0.3), right = 70, span = Math.max(10, w - left - right);
  rows.forEach(([name, tokens], i) => {
    const y = i * 22;
    svg.append(el("svg:text", { x: 0, y: y + 15 }, name.length > 18 ? name.slice(0, 17) + "…" : name));
    svg.append(el("svg:rect", { class: "bar", x: left, y: y + 4, height: 14, width: Math.max(2, (span * tokens) / max), rx: 2 }));
    svg.append(el("svg:text", { x: w, y: y + 15, "text-anchor": "end" }, `${fmt(tokens)} tok`));
  });
}

function setupDashboard() {
  const root = $("#dashboard");
  if (!root) return;
  const state = $("#live-state");
  const history = [];
  let previous = null;
  const set = (k, v) => { const node = $(`[data-k="${k}"]`, root); if (node) node.textContent = fmt(v); };
  async function poll() {
    try {
      const response = await fetch(root.dataset.statsUrl, { headers: { Accept: "application/json" } });
      if (response.status === 401) { location.href = "/admin"; return; }
      const s = await response.json();
      const tenants = Object.values(s.tenants);
      const requests = tenants.reduce((a, t) => a + t.requests, 0);
      const tokens = tenants.reduce((a, t) => a + t.generated_tokens, 0);
      if (previous) {
        const dt = Math.max(0.001, s.timestamp - previous.timestamp) || 2;
        const rps = Math.max(0, (requests - previous.requests) / Math.max(dt, 1));
        set("rps", rps); set("tps", Math.max(0, (tokens - previous.tokens) / Math.max(dt, 1)));
        history.push(rps); if (history.length > 60) history.shift();
      }
      previous = { timestamp: s.timestamp, requests, tokens };
      set("requests", requests);
      if (s.engine) {
        set("running", s.engine.running); set("waiting", s.engine.waiting);
        const ttft = $('[data-k="ttft"]', root);
        if (ttft) ttft.textContent = s.ttft_ms ? `${fmt(s.ttft_ms.p50)} / ${fmt(s.ttft_ms.p99)} ms` : "–";
        const kv = $("#kv-tiers tbody"); kv.replaceChildren();
        for (const t of s.engine.kv_tiers) {
          const row = el("tr"); row.append(el("th", { scope: "row" }, t.tier));
          const cell = el("td"); cell.append(meter(t.used_blocks, t.total_blocks)); row.append(cell);
          row.append(el("td", { class: "num" }, t.hit_rate === null ? "–" : `${(100 * t.hit_rate).toFixed(1)} %`));
          kv.append(row);
        }
        const ad = $("#adapter-tiers tbody"); ad.replaceChildren();
        for (const t of s.engine.adapters || []) {
          const row = el("tr"); row.append(el("th", { scope: "row" }, t.tier));
          const cell = el("td");
          if (t.capacity === null) cell.textContent = `${fmt(t.adapters)} registered`; else cell.append(meter(t.adapters, t.capacity));
          row.append(cell); ad.append(row);
        }
      }
      const body = $("#tenant-table tbody"); body.replaceChildren();
      for (const [name, t] of Object.entries(s.tenants)) {
        const row = el("tr"); row.append(el("td", {}, name));
        for (const v of [t.requests, t.prompt_tokens, t.generated_tokens, t.failed]) row.append(el("td", { class: "num" }, fmt(v)));
        body.append(row);
      }
      drawSpark($("#rps-chart"), history);
      drawBars($("#tenant-chart"), s.tokens_last_hour);
      state.textContent = `live · updated ${new Date().toLocaleTimeString()}`;
      state.className = "muted live ok";
    } catch (err) {
      state.textContent = "not updating (the server did not answer)";
      state.className = "muted live bad";
    }
  }
  poll();
  setInterval(poll, 2000);
}

// ---- playground: stream one or two completions of the same prompt ------------------------
async function streamInto(url, model, prompt, maxTokens, out, err) {
  out.textContent = ""; err.hidden = true;
  const response = await fetch(url, {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-CSRF-Token": csrfToken() },
    body: JSON.stringify({ model, prompt, max_tokens: maxTokens, temperature: 0, stream: true }),
  });
  if (!response.ok) {
    let message = `HTTP ${response.status}`;
    try { message = (await response.json()).error.message; } catch (_) { /* keep the status */ }
    err.textContent = message; err.hidden = false; return;
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
      const data = event.replace(/^data: /, "");
      if (data === "[DONE]") return;
      try { const chunk = JSON.parse(data); if (chunk.choices && chunk.choices.length) out.textContent += chunk.choices[0].text; } catch (_) { /* keep-alive */ }
    }
  }
}

function setupPlayground() {
  const form = $("#playground");
  if (!form) return;
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const prompt = $("#p-prompt").value, max = Number($("#p-max").value) || 32;
    const a = $("#p-model-a").value.trim(), b = $("#p-model-b").value.trim();
    $("#out-a-title").textContent = a; $("#out-b-title").textContent = b || "Model B";
    const runs = [streamInto(form.dataset.url, a, prompt, max, $("#out-a"), $("#err-a"))];
    if (b) runs.push(streamInto(form.dataset.url, b, prompt, max, $("#out-b"), $("#err-b")));
    Promise.all(runs);
  });
}

document.addEventListener("DOMContentLoaded", () => { setupUpload(); setupDashboard(); setupPlayground(); });
