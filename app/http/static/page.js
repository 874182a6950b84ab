// The gateway's page: ask, stream the answer, show the sources and what the cache did; compare with
// a `full` run; add and list documents. Public API only (docs/api.md); no dependencies, no build.
"use strict";

(() => {
  const KEY = "hypic.apiKey";  // sessionStorage: this tab only, gone when it closes
  const $ = (id) => document.getElementById(id);
  const state = { params: null, main: null, full: null, busy: false, docsAfter: null };

  // --- talking to the API --------------------------------------------------------------------
  function headers(extra) {
    const h = Object.assign({ "X-Requested-With": "hypic-page" }, extra || {});
    const key = sessionStorage.getItem(KEY);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function failure(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (e) { /* not JSON: keep the status line */ }
    if (response.status === 401) message += " (type the server's API key at the top of the page)";
    return new Error(message);
  }

  async function api(path, options) {
    const opts = Object.assign({}, options || {});
    opts.headers = headers(opts.headers);
    const response = await fetch(path, opts);
    if (!response.ok) throw await failure(response);
    return response.json();
  }

  // Server-sent events from a fetch response (EventSource cannot send the Authorization header).
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        let name = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) name = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }  // comments (": keep-alive") and ids are skipped
        if (data.length) yield { name, data: JSON.parse(data.join("\n")) };
      }
    }
  }

  // --- small DOM helpers ---------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else node.setAttribute(k, v);
    }
    for (const child of children) if (child != null) node.append(child);
    return node;
  }

  const ms = (value) => (value == null ? "–" : value >= 1000 ? (value / 1000).toFixed(2) + " s" : Math.round(value) + " ms");

  function showError(error) {
    const box = $("error");
    box.textContent = error ? String(error.message || error) : "";
    box.hidden = !error;
  }

  // A stacked bar: parts [{cls, n, label}] as shares of their total.
  function bar(parts, className) {
    const total = parts.reduce((s, p) => s + p.n, 0) || 1;
    const node = el("div", { class: className || "bar" });
    for (const p of parts) {
      if (!p.n) continue;
      const piece = el("span", { class: p.cls, title: `${p.n} ${p.label}` });
      piece.style.width = (100 * p.n / total) + "%";
      node.append(piece);
    }
    return node;
  }

  // --- one run (a streamed /query) -----------------------------------------------------------
  function runCard(slot, title) {
    const card = $(slot);
    card.replaceChildren();
    const answer = el("p", { class: "answer streaming", "aria-live": "polite" });
    const cache = el("div", { class: "cache" }, el("p", { class: "hint", text: "Waiting for the first token…" }));
    card.append(el("header", {}, el("h3", { text: title }), el("span", { class: "badge", text: "streaming" })), answer, cache);
    card.dataset.state = "streaming";
    return { card, answer, cache, badge: card.querySelector(".badge") };
  }

  async function run(slot, mode) {
    const p = state.params;
    const body = { question: p.question, top_k: p.topK, max_tokens: p.maxTokens, stream: true };
    if (p.collections.length) body.collections = p.collections;
    if (mode) body.mode = mode;
    const view = runCard(slot, mode || "server's choice");
    const result = { mode: mode || "server's choice", answer: "", sources: [], usage: null, reuse: [], timings: null };
    try {
      const response = await fetch("/query", { method: "POST", headers: headers({ "Content-Type": "application/json" }),
                                               body: JSON.stringify(body) });
      if (!response.ok) throw await failure(response);
      for await (const event of events(response)) {
        if (event.name === "sources") {
          result.sources = event.data.sources;
          result.dropped = event.data.dropped_chunks;
          if (slot === "run-main") showSources(result);
        } else if (event.name === "delta") {
          result.answer += event.data.text;
          view.answer.textContent = result.answer;
        } else if (event.name === "done") {
          Object.assign(result, { usage: event.data.usage, reuse: event.data.reuse || [], timings: event.data.timings,
                                  finish: event.data.finish_reason });
        } else if (event.name === "failure") {
          throw new Error(event.data.error.message);
        }
      }
      if (!result.usage) throw new Error("the stream ended before its `done` event");
    } catch (error) {
      view.card.dataset.state = "failed";
      view.badge.textContent = "failed";
      view.answer.classList.remove("streaming");
      throw error;
    }
    view.answer.classList.remove("streaming");
    if (!result.answer.trim()) view.answer.textContent = "(empty answer)";
    view.badge.textContent = result.finish === "length" ? "done (max_tokens)" : "done";
    view.card.dataset.state = "done";
    showCache(view.cache, result);
    return result;
  }

  function tpot(result) {
    const n = result.usage.completion_tokens, t = result.timings;
    return n > 1 && t.ttft_ms != null ? (t.total_ms - t.ttft_ms) / (n - 1) : null;
  }

  function showCache(box, result) {
    const u = result.usage, t = result.timings;
    const computed = u.prompt_tokens - u.cached_tokens - u.composed_tokens - u.seam_tokens;
    const perToken = tpot(result);
    const metric = (label, value, hint, cls) => el("div", { class: "metric " + (cls || "") },
      el("dt", { text: label, title: hint }), el("dd", { text: value }));
    box.replaceChildren(
      el("dl", { class: "metrics" },
        metric("TTFT", ms(t.ttft_ms), "Time to first token, from the request's arrival", "ttft"),
        metric("TPOT", perToken == null ? "– (1 token)" : ms(perToken),
               "Time per output token after the first: (total − TTFT) / (tokens − 1)", "tpot"),
        metric("prefill", ms(t.prefill_ms), "Time spent computing the prompt"),
        metric("tokens out", String(u.completion_tokens), "Answer tokens")),
      el("p", { class: "prompt-label" }, `Prompt: ${u.prompt_tokens} tokens`),
      bar([{ cls: "exact", n: u.cached_tokens, label: "cached (exact prefix)" },
           { cls: "reused", n: u.composed_tokens, label: "reused chunk tokens (composed)" },
           { cls: "seam", n: u.seam_tokens, label: "seam tokens recomputed" },
           { cls: "computed", n: computed, label: "computed for this request" }], "bar prompt-bar"),
      el("p", { class: "legend" },
        el("span", { class: "key-exact", text: `${u.cached_tokens} cached_tokens` }), " (system prompt, exact) · ",
        el("span", { class: "key-reused", text: `${u.composed_tokens} composed_tokens` }), " · ",
        el("span", { class: "key-seam", text: `${u.seam_tokens} seam_tokens` }), " · ",
        el("span", { class: "key-computed", text: `${computed} computed` })),
      chunkTable(result));
  }

  function chunkTable(result) {
    const byId = new Map(result.reuse.map((r) => [r.chunk_id, r]));
    const table = el("table", { class: "chunks" },
      el("thead", {}, el("tr", {}, el("th", { text: "#" }), el("th", { text: "chunk" }), el("th", { text: "its tokens" }),
                                   el("th", { text: "reused" }), el("th", { text: "seam" }), el("th", { text: "computed" }))));
    const rows = el("tbody");
    result.sources.forEach((source, i) => {
      const r = byId.get(source.chunk_id);
      if (!r) return;
      const how = { composed: "reused", exact: "reused exactly", computed: "computed" }[r.how] || r.how;
      rows.append(el("tr", { class: "chunk", "data-how": r.how, "data-chunk": source.chunk_id },
        el("td", { text: `[${i + 1}]` }),
        el("td", { class: "chunk-title", title: source.document_id }, source.title || source.document_id,
           el("span", { class: "how how-" + r.how, text: how })),
        el("td", { class: "chunk-bar" }, bar([{ cls: r.how === "exact" ? "exact" : "reused", n: r.reused, label: "reused" },
                                              { cls: "seam", n: r.seam, label: "seam" },
                                              { cls: "computed", n: r.computed, label: "computed" }])),
        el("td", { class: "num reused-n", text: String(r.reused) }),
        el("td", { class: "num seam-n", text: String(r.seam) }),
        el("td", { class: "num computed-n", text: String(r.computed) })));
    });
    table.append(rows);
    return table;
  }

  function showSources(result) {
    const list = $("sources");
    list.replaceChildren();
    for (const s of result.sources) {
      list.append(el("li", { class: "source", "data-document": s.document_id },
        el("div", { class: "source-head" }, el("b", { text: s.title || s.document_id }),
           el("code", { text: s.document_id }),
           s.collection && s.collection !== "default" ? el("span", { class: "badge", text: s.collection }) : null,
           el("span", { class: "score", text: "score " + s.score.toFixed(3) })),
        el("p", { class: "source-text", text: s.text })));
    }
    if (result.dropped) list.append(el("li", { class: "hint", text: `${result.dropped} more did not fit the context` }));
    $("sources-panel").hidden = false;
  }

  function verdict() {
    const box = $("verdict"), a = state.main, b = state.full;
    if (!a || !b || !a.timings || !b.timings) { box.hidden = true; return; }
    const ratio = a.timings.ttft_ms && b.timings.ttft_ms ? b.timings.ttft_ms / a.timings.ttft_ms : null;
    const work = (r) => r.usage.prompt_tokens - r.usage.cached_tokens - r.usage.composed_tokens;
    const x = a.answer.trim(), y = b.answer.trim();
    let common = 0;
    while (common < x.length && common < y.length && x[common] === y[common]) common++;
    const atWordEnd = (s) => common >= s.length || /\s/.test(s[common]);
    let agreed = x.slice(0, common);
    if (!(atWordEnd(x) && atWordEnd(y))) agreed = agreed.replace(/\S*$/, "");  // whole words only
    agreed = agreed.trim();
    const short = agreed.length > 80 ? agreed.slice(0, 80) + "…" : agreed;
    const same = x === y;
    box.replaceChildren(
      `First token: ${a.mode} ${ms(a.timings.ttft_ms)}, full ${ms(b.timings.ttft_ms)}`,
      ratio ? el("b", { text: ` (${ratio.toFixed(1)}× ${ratio >= 1 ? "sooner" : "later"})` }) : "",
      `. Prompt tokens computed: ${work(a)} of ${a.usage.prompt_tokens} against ${work(b)} of ${b.usage.prompt_tokens}. `,
      same ? el("span", { class: "same", text: "Same answer." })
        : agreed ? el("span", { class: "differs", text: `The answers agree on “${short}”, then differ.` })
          : el("span", { class: "differs", text: "The answers differ from their first word." }));
    box.hidden = false;
  }

  function setBusy(busy) {
    state.busy = busy;
    $("ask").disabled = busy;
    $("compare").disabled = busy || !state.main;
  }

  async function ask(event) {
    event.preventDefault();
    if (state.busy) return;
    const question = $("question").value.trim();
    if (!question) return;
    state.params = {
      question,
      topK: Number($("top-k").value) || 4,
      maxTokens: Number($("max-tokens").value) || 64,
      mode: $("mode").value,
      collections: $("collections").value.split(",").map((c) => c.trim()).filter(Boolean),
    };
    state.main = state.full = null;
    showError(null);
    $("runs").hidden = false;
    $("verdict").hidden = true;
    const full = $("run-full");
    full.replaceChildren(el("p", { class: "hint", text: "The same question with mode full: no reuse, every prompt token computed." }),
                         el("button", { id: "compare", type: "button", text: "Compare with a full run" }));
    $("compare").addEventListener("click", compare);
    setBusy(true);
    try {
      state.main = await run("run-main", state.params.mode);
    } catch (error) {
      showError(error);
    } finally {
      setBusy(false);
    }
  }

  async function compare() {
    if (state.busy || !state.params) return;
    setBusy(true);
    showError(null);
    try {
      state.full = await run("run-full", "full");
      verdict();
    } catch (error) {
      showError(error);
    } finally {
      setBusy(false);
    }
  }

  // --- documents -----------------------------------------------------------------------------
  const docCollection = () => $("doc-collection").value.trim() || "default";

  function docItem(d, fresh) {
    return el("li", { class: fresh ? "doc new" : "doc", "data-document": d.document_id },
      el("b", { text: d.title || d.document_id }), el("code", { text: d.document_id }),
      el("span", { class: "hint", text: `${d.chunks} chunk${d.chunks === 1 ? "" : "s"} · ${d.tokens} tokens` }));
  }

  async function listDocuments(more) {
    const c = encodeURIComponent(docCollection());
    const after = more && state.docsAfter ? "&after=" + encodeURIComponent(state.docsAfter) : "";
    try {
      const page = await api(`/documents?limit=50&collection=${c}${after}`);
      if (!more) $("doc-list").replaceChildren();
      for (const d of page.data) $("doc-list").append(docItem(d, false));
      state.docsAfter = page.last_id;
      $("doc-more").hidden = !page.has_more;
      loadCollections();
    } catch (error) {
      $("doc-count").textContent = error.message;
    }
  }

  async function addDocument(event) {
    event.preventDefault();
    const file = $("doc-file").files[0];
    const id = $("doc-id").value.trim(), title = $("doc-title").value.trim(), text = $("doc-text").value;
    const path = "/documents?collection=" + encodeURIComponent(docCollection());
    let options;
    if (file) {
      const form = new FormData();
      form.append("file", file);
      if (id) form.append("id", id);
      if (title) form.append("title", title);
      options = { method: "POST", body: form };
    } else {
      if (!id || !text.trim()) { $("doc-state").textContent = "An id and some text (or a file) are needed."; return; }
      options = { method: "POST", headers: { "Content-Type": "application/json" },
                  body: JSON.stringify(title ? { id, title, text } : { id, text }) };
    }
    $("doc-add").disabled = true;
    $("doc-state").textContent = "Adding…";
    try {
      const added = await api(path, options);
      $("doc-state").textContent = `Added ${added.document_ids.join(", ")}: ${added.chunks} chunk${added.chunks === 1 ? "" : "s"}` +
        (added.replaced ? ` (${added.replaced} replaced)` : "") + ". Ask about it above.";
      for (const docId of added.document_ids.slice().reverse()) {
        const d = await api(`/documents/${encodeURIComponent(docId)}?collection=${encodeURIComponent(added.collection || docCollection())}`);
        $("doc-list").querySelectorAll(`li[data-document="${CSS.escape(docId)}"]`).forEach((n) => n.remove());
        $("doc-list").prepend(docItem(d, true));
      }
      $("doc-form").reset();
      loadCollections();
    } catch (error) {
      $("doc-state").textContent = error.message;
    } finally {
      $("doc-add").disabled = false;
    }
  }

  // --- the server, the key ---------------------------------------------------------------------
  async function loadCollections() {
    try {
      const list = await api("/collections");
      $("collection-names").replaceChildren(...list.data.map((c) => el("option", { value: c.name })));
      const here = list.data.find((c) => c.name === docCollection());
      $("doc-count").textContent = here ? `${here.documents} in “${here.name}”` : "";
    } catch (error) { /* shown by the calls that need it */ }
  }

  async function status() {
    const box = $("status");
    try {
      const ready = await fetch("/ready").then((r) => r.json());
      if (ready.status !== "ready") {
        box.dataset.state = ready.status;
        box.textContent = ready.status === "failed" ? "failed to load: " + ready.error : "loading the model…";
        if (ready.status !== "failed") setTimeout(status, 2000);
        return;
      }
      const health = await fetch("/health").then((r) => r.json());
      let text = `${ready.model} · ${ready.chunks} chunks`;
      try {
        const models = await api("/v1/models");
        const card = models.data.find((m) => m.id === ready.model) || models.data[0];
        if (card && card.max_model_len) text += ` · ${card.max_model_len}-token context`;
        $("key-state").textContent = sessionStorage.getItem(KEY) ? "key in use (this tab)" : "";
      } catch (error) {
        $("key-state").textContent = sessionStorage.getItem(KEY) ? "this key was refused" : "this server needs an API key";
      }
      const guard = health.guard;
      if (guard && guard.enabled && guard.mode) text += ` · guard serves ${guard.mode}`;
      box.dataset.state = "ready";
      box.textContent = text;
      listDocuments(false);
    } catch (error) {
      box.dataset.state = "down";
      box.textContent = "gateway unreachable";
      setTimeout(status, 3000);
    }
  }

  function useKey(event) {
    event.preventDefault();
    const key = $("key").value.trim();
    if (key) sessionStorage.setItem(KEY, key); else sessionStorage.removeItem(KEY);
    $("key").value = "";
    status();
  }

  function forgetKey() {
    sessionStorage.removeItem(KEY);
    $("key-state").textContent = "key forgotten";
    status();
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("ask-form").addEventListener("submit", ask);
    $("question").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask-form").requestSubmit(); }
    });
    $("compare").addEventListener("click", compare);
    $("key-form").addEventListener("submit", useKey);
    $("key-forget").addEventListener("click", forgetKey);
    $("doc-form").addEventListener("submit", addDocument);
    $("doc-more").addEventListener("click", () => listDocuments(true));
    $("doc-collection").addEventListener("change", () => listDocuments(false));
    if (sessionStorage.getItem(KEY)) $("key-state").textContent = "key in use (this tab)";
    status();
  });
})();
