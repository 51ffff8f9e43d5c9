// rollwire ui: live reload of server-rendered pages, lazy whole prompts, and the windowed trace view.
// Plain browser JavaScript, served from the package: no framework, no build step, nothing from a CDN.
"use strict";

(function live() {
  const body = document.body;
  if (!body.dataset.live || !window.EventSource) return;
  let shown = Number(body.dataset.version), busy = false, pending = false;
  async function refresh() {
    if (busy) { pending = true; return; }
    busy = true;
    try {
      const response = await fetch(location.href, { headers: { accept: "text/html" } });
      if (response.ok) {
        const next = new DOMParser().parseFromString(await response.text(), "text/html");
        const open = new Set([...document.querySelectorAll("details[open]")].map((d) => d.id));
        const wholes = new Map([...document.querySelectorAll(".whole-prompt")].filter((w) => w.innerHTML)
          .map((w) => [w.closest("details").id, w.innerHTML]));
        document.getElementById("live").replaceWith(next.getElementById("live"));
        document.getElementById("view-state").replaceWith(next.getElementById("view-state"));
        for (const id of open) { const d = document.getElementById(id); if (d) d.open = true; }
        for (const [id, html] of wholes) { const d = document.getElementById(id); if (d) d.querySelector(".whole-prompt").innerHTML = html; }
        shown = Number(next.body.dataset.version);
        body.dataset.version = String(shown);
        body.dataset.refreshes = String(Number(body.dataset.refreshes || 0) + 1);
      }
    } finally {
      busy = false;
      if (pending) { pending = false; setTimeout(refresh, 1000); }
    }
  }
  const source = new EventSource("/api/updates");
  source.onmessage = (e) => { if (Number(e.data) > shown) refresh(); };
})();

document.addEventListener("click", async (e) => {
  const button = e.target.closest("button.whole");
  if (!button) return;
  const out = button.nextElementSibling;
  const response = await fetch(button.dataset.url);
  const call = await response.json();
  if (!response.ok) { out.textContent = call.error; return; }
  out.replaceChildren(...call.messages.map((m) => {
    const div = document.createElement("div");
    div.className = "msg role-" + m.role;
    const who = document.createElement("div"); who.className = "who"; who.textContent = m.role;
    const pre = document.createElement("pre");
    const text = typeof m.content === "string" ? m.content : (m.content || []).map((p) => p.text || "[" + p.type + "]").join("\n");
    pre.textContent = text + (m.tool_calls || []).map((t) => "\n" + t.name + "(" + t.arguments + ")").join("");
    div.append(who, pre);
    return div;
  }));
  button.remove();
});

(function trace() {
  const bootEl = document.getElementById("trace-boot");
  if (!bootEl) return;
  const boot = JSON.parse(bootEl.textContent);
  const layout = boot.layout, rows = layout.rows, CHUNK = layout.chunk, ROW = 18, OVERSCAN = 30;
  const box = document.getElementById("trace"), spacer = document.getElementById("trace-spacer");
  const out = document.getElementById("trace-rows"), tip = document.getElementById("tip");
  const chunks = new Map(), loading = new Map();
  const callStarts = new Map(layout.calls.map((c, i) => [c[0], i]));
  chunks.set(0, boot.first);
  spacer.style.height = rows.length * ROW + "px";
  const state = window.rollwireTrace = { rendered: 0, firstPaintMs: null, chunksLoaded: 1 };

  function load(index) {
    if (chunks.has(index) || loading.has(index)) return;
    const p = fetch(boot.tokens_url + "?start=" + index * CHUNK + "&count=" + CHUNK)
      .then((r) => r.json()).then((chunk) => { chunks.set(index, chunk); state.chunksLoaded++; loading.delete(index); schedule(); });
    loading.set(index, p);
  }
  function token(i) {
    const chunk = chunks.get(Math.floor(i / CHUNK));
    return chunk ? [chunk, i - chunk.start] : null;
  }
  function shown(text) { return text.replace(/\n/g, "↵").replace(/\t/g, "→").replace(/\r/g, "␍"); }
  function heat(lp) {
    if (lp === null) return "hsl(120,70%,80%)";
    const p = Math.exp(lp);
    return "hsl(" + Math.round(120 * p) + ",70%,80%)";
  }
  function rowHtml(r) {
    const start = rows[r], end = r + 1 < rows.length ? rows[r + 1] : layout.length;
    const callIndex = callStarts.get(start);
    let html = '<div class="row' + (callIndex !== undefined ? " call-start" : "") + '" data-row="' + r + '"><span class="off">'
      + (callIndex !== undefined ? '<span class="call-label">#' + layout.calls[callIndex][2] + "</span> " : "") + start + "</span><span>";
    for (let i = start; i < end; i++) {
      const found = token(i);
      if (!found) { html += '<span class="t">…</span>'; break; }
      const [chunk, k] = found, trained = chunk.mask[k] === "1";
      const text = shown(chunk.text[k]).replace(/&/g, "&amp;").replace(/</g, "&lt;");
      html += trained
        ? '<span class="t m1" data-i="' + i + '" style="background:' + heat(chunk.logprobs[k]) + '">' + text + "</span>"
        : '<span class="t" data-i="' + i + '">' + text + "</span>";
    }
    return html + "</span></div>";
  }
  let queued = false;
  function schedule() { if (!queued) { queued = true; requestAnimationFrame(render); } }
  function render() {
    queued = false;
    const first = Math.max(0, Math.floor(box.scrollTop / ROW) - OVERSCAN);
    const last = Math.min(rows.length - 1, Math.ceil((box.scrollTop + box.clientHeight) / ROW) + OVERSCAN);
    if (rows.length) {
      const from = rows[first], to = last + 1 < rows.length ? rows[last + 1] : layout.length;
      for (let c = Math.floor(from / CHUNK); c <= Math.floor(Math.max(from, to - 1) / CHUNK); c++) load(c);
    }
    let html = "";
    for (let r = first; r <= last; r++) html += rowHtml(r);
    out.style.top = first * ROW + "px";
    out.innerHTML = html;
    state.rendered = out.querySelectorAll(".t[data-i]").length;
    state.firstRow = first; state.lastRow = last;
    const marked = state.target === undefined ? null : out.querySelector('.t[data-i="' + state.target + '"]');
    if (marked) marked.classList.add("target");
    if (state.firstPaintMs === null && state.rendered > 0) {
      requestAnimationFrame(() => setTimeout(() => { state.firstPaintMs = performance.now(); }, 0));
    }
  }
  box.addEventListener("scroll", schedule, { passive: true });
  window.addEventListener("resize", schedule);
  box.addEventListener("mouseover", (e) => {
    const span = e.target.closest(".t[data-i]");
    if (!span) { tip.hidden = true; return; }
    const i = Number(span.dataset.i), [chunk, k] = token(i), call = layout.calls[chunk.call[k]];
    const lp = chunk.logprobs[k];
    tip.textContent = "token " + i + "  id " + chunk.ids[k] + "\n" + (chunk.mask[k] === "1" ? "trained" : "context (mask 0)")
      + (lp === null ? "" : "\nlogprob " + lp.toFixed(4) + "  p " + Math.exp(lp).toFixed(3))
      + (call ? "\ncall #" + call[2] + "  " + call[3].slice(0, 12) : "") + "\n" + JSON.stringify(chunk.text[k]);
    const rect = span.getBoundingClientRect();
    tip.style.left = rect.left + "px"; tip.style.top = rect.bottom + 4 + "px"; tip.hidden = false;
  });
  box.addEventListener("mouseleave", () => { tip.hidden = true; });
  // #token-<i>: scroll the row holding token i into view (binary search over the row starts).
  function goToHash() {
    const match = /^#token-(\d+)$/.exec(location.hash);
    if (!match) return;
    const target = Number(match[1]);
    let lo = 0, hi = rows.length - 1;
    while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (rows[mid] <= target) lo = mid; else hi = mid - 1; }
    box.scrollTop = Math.max(0, lo * ROW - box.clientHeight / 3);
    state.target = target;
    schedule();
  }
  window.addEventListener("hashchange", goToHash);
  goToHash();
  render();
})();
