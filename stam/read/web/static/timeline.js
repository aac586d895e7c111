/* The STAM timeline page (stam/read/page.py). Record text only ever reaches the DOM through textContent, DOM
 * elements handed to vis-timeline, or tooltip strings (vis-timeline sets those with innerText): never innerHTML. */
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const patient = document.body.dataset.patient;
  const inline = $("stam-data");
  const TOKEN_KEY = "stam.query-token";
  const SERVED = /(^| )served( |$)/;
  const base = "/patients/" + encodeURIComponent(patient) + "/timeline";
  const items = new vis.DataSet();
  const groups = new vis.DataSet();
  // More threads than this in view (a patient with years of record): one row per category, each opened on a
  // click into its threads. Hundreds of rows, not the items, set the time of a first draw (docs/timeline.md).
  const FOLD_ABOVE = 100;
  const state = { data: null, asOf: null, compare: null, loaded: null, served: new Set(), timeline: null,
                  timing: null, request: 0, open: new Set(), fold: FOLD_ABOVE, drawn: false, afterDraw: null,
                  fitted: false };
  window.stam = { items: items, groups: groups, state: state };

  function status(text, error) {
    $("status").textContent = text;
    $("status").className = error ? "error" : "";
  }

  function token() { return sessionStorage.getItem(TOKEN_KEY); }

  function askToken(why) {
    $("token-form").hidden = false;
    document.body.dataset.state = "token";
    status(why || "a query token is needed to read this patient's memory", !!why);
  }

  function readUrl() {
    const q = new URLSearchParams(location.search);
    state.asOf = q.get("as_of") || null;
    state.compare = q.get("compare") || null;
    const fold = parseInt(q.get("fold"), 10);  // ?fold=N: fold above N threads (0: always; a large N: never)
    if (!isNaN(fold) && fold >= 0) state.fold = fold;
  }

  function writeUrl() {
    if (inline) return;
    const q = new URLSearchParams(location.search);
    for (const [k, v] of [["as_of", state.asOf], ["compare", state.compare]]) {
      if (v) q.set(k, v); else q.delete(k);
    }
    const s = q.toString();
    history.replaceState(null, "", location.pathname + (s ? "?" + s : ""));
  }

  function text(s, cls) {
    const el = document.createElement("span");
    el.textContent = s;
    if (cls) el.className = cls;
    return el;
  }

  function groupLabel(t) {
    const el = document.createElement("span");
    el.appendChild(text(t.category, "cat"));
    el.appendChild(text(t.label));
    return el;
  }

  function categoryLabel(cat, threads, open) {
    const el = document.createElement("span");
    el.appendChild(text(open ? "▾" : "▸", "fold"));
    el.appendChild(text(cat, "cat"));
    el.appendChild(text(threads + " thread" + (threads === 1 ? "" : "s")));
    return el;
  }

  // The rows: one per thread, or folded (more than state.fold threads, every category shown) one per category
  // with its threads under it once opened. Returns the groups and the row of each thread.
  function layout(rows, folded) {
    const groupsOut = [], rowOf = new Map();
    const threadRow = (t) => ({ id: t.id, content: groupLabel(t), title: t.label + " (" + t.n + ")" });
    if (!folded) {
      for (const t of rows) { groupsOut.push(threadRow(t)); rowOf.set(t.id, t.id); }
      return { groups: groupsOut, rowOf: rowOf };
    }
    const byCat = new Map();
    for (const t of rows) {
      if (!byCat.has(t.category)) byCat.set(t.category, []);
      byCat.get(t.category).push(t);
    }
    for (const [cat, mine] of byCat) {
      const open = state.open.has(cat), id = "c:" + cat;
      groupsOut.push({ id: id, content: categoryLabel(cat, mine.length, open),
                       className: "category cat-" + cat.replace(/[^a-z-]/g, "") + (open ? " open" : ""),
                       title: (open ? "close " : "open ") + cat + ": " + mine.length + " threads" });
      for (const t of mine) {
        if (open) { groupsOut.push(threadRow(t)); rowOf.set(t.id, t.id); } else rowOf.set(t.id, id);
      }
    }
    return { groups: groupsOut, rowOf: rowOf };
  }

  function memoryTitle(m) {
    const lines = [m.text, m.category + " · " + (m.current ? "current" : "history" + (m.reason ? " (" + m.reason + ")" : ""))];
    lines.push(m.to ? m.from + " to " + m.to : (m.from || "no time"));
    if (!m.current && m.ended) lines.push("ended " + m.ended);
    lines.push("entry " + m.entry + (m.encounter ? " · " + m.encounter : ""));
    if (m.changed) lines.push("changed since " + state.compare);
    return lines.join("\n");
  }

  function transitionTitle(t) {
    return ["transition: " + (t.reason || "archived"),
            "evidence entry: " + (t.evidence_entry || "unknown"),
            "clinical time: " + (t.clinical || "unknown"),
            "recorded: " + (t.recorded || (t.recorded_known ? "not recorded" : "zoom in to read it")),
            "successor: " + (t.successor || "none")].join("\n");
  }

  function draw() {
    const d = state.data;
    const cat = $("category").value;
    const rows = d.threads.filter((t) => !cat || t.category === cat);
    const folded = !cat && rows.length > state.fold;
    const { groups: rowGroups, rowOf } = layout(rows, folded);
    const out = [];
    for (const m of d.memories) {
      if (!rowOf.has(m.thread)) continue;
      const cls = [m.current ? "current" : "history", "cat-" + m.category.replace(/[^a-z-]/g, "")];
      if (state.served.has(m.id)) cls.push("served");
      if (m.changed) cls.push("changed");
      const row = rowOf.get(m.thread), inFold = typeof row === "string";
      if (inFold) cls.push("folded");  // a category's strip: marks without text (the tooltip has it), read when opened
      const it = { id: "m" + m.i, memory: m.id, group: row, start: m.start, content: text(inFold ? "" : m.text),
                   title: memoryTitle(m), className: cls.join(" "), type: m.end === null ? "point" : "range" };
      if (m.end !== null) it.end = m.end;
      out.push(it);
    }
    for (const t of d.transitions) {
      if (!rowOf.has(t.thread)) continue;
      out.push({ id: "t" + t.i, memory: t.id, group: rowOf.get(t.thread), start: t.at, type: "point",
                 content: text("⇢"), title: transitionTitle(t), className: "transition" });  // details in the tooltip
    }
    for (const e of d.encounters) {
      out.push({ id: "e" + e.id, start: e.start, end: e.end, type: "background", content: text(e.label),
                 title: e.label, className: "encounter" + (e.open ? " open" : "") });
    }
    groups.clear();
    groups.add(rowGroups);
    items.clear();
    items.add(out);
    const c = d.counts;
    const cats = new Set(rows.map((t) => t.category)).size;
    $("counts").textContent = c.shown + " of " + c.present + " memories in view (" + c.current + " current), " +
      rows.length + " threads" + (folded ? " in " + cats + " categories (click one to open it)" : "") + ", " +
      c.transitions + " transitions" + (d.truncated ? "; the latest only: zoom in" : "") +
      (c.untimed ? "; " + c.untimed + " without a time" : "") + (c.changed !== undefined ? "; " + c.changed + " changed since" : "");
  }

  function showGaps(d) {
    const box = $("gaps");
    box.replaceChildren();
    box.hidden = !d.gaps.length;
    if (!d.gaps.length) return;
    box.appendChild(text(d.gap_line + " — the record is incomplete"));
    const ul = document.createElement("ul");
    for (const g of d.gaps) {
      const li = document.createElement("li");
      li.textContent = "entry " + (g.entry_id || "(unknown id)") + ": " + g.stage + ", " + g.error_type +
        "; dead letter " + g.dead_letter + (g.replayed_at ? " (replayed, not applied yet)" : "");
      ul.appendChild(li);
    }
    box.appendChild(ul);
  }

  function setCategories(d) {
    const sel = $("category");
    const keep = sel.value;
    sel.replaceChildren(new Option("all", ""));
    for (const c of d.categories) sel.appendChild(new Option(c, c));
    sel.value = d.categories.includes(keep) ? keep : "";
  }

  function ensureTimeline(d) {
    if (state.timeline) return;
    const opts = {
      stack: false, showTooltips: true, groupHeightMode: "fixed", orientation: "top", zoomKey: "ctrlKey",
      verticalScroll: true, maxHeight: "70vh", margin: { item: 2 }, selectable: true,
      tooltip: { followMouse: true, overflowMethod: "cap", delay: 150 },
      // Busy stretches of a row become clusters; a memory the question served never hides in one.
      cluster: { maxItems: 4, titleTemplate: "{count} memories: zoom in", showStipes: false, fitOnDoubleClick: true,
                 clusterCriteria: (a, b) => !SERVED.test(a.className || "") && !SERVED.test(b.className || "") },
      moment: (date) => vis.moment(date).utc(),
      xss: { disabled: false },
      // vis-timeline fits its first draw to every item (a bar that lasts into the window starts before it): the
      // window the data was read for is set again once that draw is done. (Given as the start and end options
      // instead, it kept the timeline hidden until an unrelated redraw, about a second later.)
      onInitialDrawComplete: () => {
        const w = state.data.window;
        if (w.from !== null && state.fitted) state.timeline.setWindow(w.from, w.to, { animation: false });
        state.drawn = true;
        const then = state.afterDraw;
        state.afterDraw = null;
        if (then) then();
      },
    };
    state.timeline = new vis.Timeline($("timeline"), items, groups, opts);
    window.stam.timeline = state.timeline;
    const tl = state.timeline;
    tl.on("click", (p) => {  // a folded category's row label opens it into its threads, and closes it again
      if (p.what !== "group-label" || typeof p.group !== "string" || !p.group.startsWith("c:")) return;
      const cat = p.group.slice(2);
      if (state.open.has(cat)) state.open.delete(cat); else state.open.add(cat);
      draw();
    });
    tl.addCustomTime(new Date(state.asOf || d.clock || Date.now()), "as-of");
    tl.setCustomTimeMarker("as of", "as-of", false);
    tl.on("timechanged", (p) => {
      if (inline) return;
      const iso = new Date(p.time).toISOString();
      if (p.id === "as-of") { state.asOf = iso; $("as-of").value = iso; }
      if (p.id === "compare") { state.compare = iso; $("compare").value = iso; }
      writeUrl();
      reload();
    });
    let pending = null;
    tl.on("rangechanged", (p) => {
      if (!p.byUser || inline) return;
      clearTimeout(pending);
      pending = setTimeout(() => {
        const a = p.start.valueOf(), b = p.end.valueOf(), l = state.loaded;
        const inside = l && l.from !== null && a >= l.from && b <= l.to;
        if (!inside || (state.data.truncated && (b - a) < (l.to - l.from) / 2)) {
          const pad = (b - a) / 2;
          load(a - pad, b + pad, false);
        }
      }, 300);
    });
  }

  function setCompareLine() {
    const tl = state.timeline;
    if (!tl) return;
    try { tl.removeCustomTime("compare"); } catch (e) { /* none yet */ }
    if (state.compare) {
      tl.addCustomTime(new Date(state.compare), "compare");
      tl.setCustomTimeMarker("since", "compare", false);
    }
  }

  function query(from, to) {
    const q = new URLSearchParams();
    if (from !== null) q.set("from", new Date(from).toISOString());
    if (to !== null) q.set("to", new Date(to).toISOString());
    if (state.asOf) q.set("as_of", state.asOf);
    if (state.compare) q.set("compare", state.compare);
    return q;
  }

  async function load(from, to, fit) {
    const n = ++state.request;
    const t0 = performance.now();
    document.body.dataset.state = "loading";
    let r;
    try {
      r = await fetch(base + "/data?" + query(from, to), { headers: { Authorization: "Bearer " + token() },
                                                            cache: "no-store" });
    } catch (e) {
      status("the query worker did not answer: " + e, true);
      document.body.dataset.state = "error";
      return;
    }
    if (n !== state.request) return;
    if (r.status === 401) { sessionStorage.removeItem(TOKEN_KEY); askToken("token refused (401): enter a valid one"); return; }
    if (r.status === 404) { status("no memory for this patient that this token may read (404)", true);
                            document.body.dataset.state = "not-found"; return; }
    if (!r.ok) {
      let why = "";
      try { why = (await r.json()).error || ""; } catch (e) { /* not JSON */ }
      status("data request failed: " + r.status + (why ? ": " + why : ""), true);
      document.body.dataset.state = "error";
      return;
    }
    const d = await r.json();
    const t1 = performance.now();
    show(d, fit);
    whenDrawn(() => {
      const t2 = performance.now();
      state.timing = { fetch_ms: t1 - t0, render_ms: t2 - t1, total_ms: t2 - t0, shown: d.counts.shown };
      document.body.dataset.state = "ready";
    });
  }

  // Once what show() changed is on the screen: vis-timeline's first draw (its own callback, which can come
  // after a frame or two on a busy machine), then the next frame of any later one.
  function whenDrawn(then) {
    const framed = () => requestAnimationFrame(() => requestAnimationFrame(then));
    if (state.drawn) framed(); else state.afterDraw = framed;
  }

  function show(d, fit) {
    state.data = d;
    state.loaded = { from: d.window.from, to: d.window.to };
    $("token-form").hidden = true;
    setCategories(d);
    showGaps(d);
    ensureTimeline(d);
    draw();
    state.fitted = fit;
    if (fit && d.window.from !== null) state.timeline.setWindow(d.window.from, d.window.to, { animation: false });
    state.timeline.setCustomTime(new Date(state.asOf || d.clock || Date.now()), "as-of");
    setCompareLine();
    $("as-of").value = state.asOf || "";
    $("compare").value = state.compare || "";
    $("compare-on").checked = !!state.compare;
    status((d.as_of ? "state as of " + d.as_of : "state now (latest in the record)") + " · version " + d.version);
  }

  function reload() {
    const w = state.timeline ? state.timeline.getWindow() : null;
    if (w) load(w.start.valueOf(), w.end.valueOf(), false); else load(null, null, true);
  }

  async function ask(ev) {
    ev.preventDefault();
    const question = $("question-text").value.trim();
    if (!question) return;
    $("gate").textContent = "asking...";
    document.body.dataset.asked = "pending";
    const body = { patient_id: patient, question: question, answer: false };
    if (state.asOf) body.as_of = state.asOf;
    let r;
    try {
      r = await fetch("/v1/query", { method: "POST", cache: "no-store", body: JSON.stringify(body),
                                     headers: { Authorization: "Bearer " + token(), "Content-Type": "application/json" } });
    } catch (e) {
      $("gate").textContent = "the query worker did not answer: " + e;
      document.body.dataset.asked = "error";
      return;
    }
    const a = await r.json().catch(() => ({}));
    if (!r.ok || !a.ok) {
      $("gate").textContent = "query failed (" + r.status + "): " + (a.error || "");
      document.body.dataset.asked = "error";
      return;
    }
    const p = a.packet;
    state.served = new Set(p.items.map((i) => i.memory_id));
    const g = p.gate;
    $("gate").textContent = "gate (" + g.mode + "): " + (g.serve_history ? "HISTORY served" : "ACTIVE only") +
      " — " + g.reason + " · intent: " + p.intent + " · " + p.items.length + " memories served";
    const list = $("served");
    list.replaceChildren();
    const loaded = new Set(state.data.memories.map((m) => m.id));
    for (const it of p.items) {
      const li = document.createElement("li");
      li.appendChild(text(it.text));
      li.appendChild(text(it.store + (loaded.has(it.memory_id) ? "" : " · outside the loaded window"), "store"));
      li.dataset.memory = it.memory_id;
      list.appendChild(li);
    }
    draw();
    const ids = items.get({ filter: (i) => state.served.has(i.memory) && !String(i.id).startsWith("t") }).map((i) => i.id);
    if (ids.length) {  // brought into view: the window fits them, the rows scroll to the first
      state.timeline.setSelection(ids);
      const w = state.timeline.getWindow();
      const times = items.get(ids).flatMap((i) => [i.start, i.end === undefined ? i.start : i.end]);
      const span = Math.max(...times) - Math.min(...times);
      // Zoomed to fit them when they lie wider apart than the window shows; else only centred (a value and its
      // siblings at one instant would zoom to milliseconds).
      state.timeline.focus(ids, { animation: false, zoom: span > w.end - w.start });
    }
    // vis-timeline redraws on the next frame: done once the marks are drawn.
    requestAnimationFrame(() => requestAnimationFrame(() => { document.body.dataset.asked = "done"; }));
  }

  function useTime(input, key) {
    const v = input.value.trim();
    if (v && isNaN(Date.parse(v))) { status(key + ": not a time: " + v, true); return; }
    state[key] = v ? new Date(v).toISOString() : null;
    writeUrl();
    reload();
  }

  $("category").addEventListener("change", () => { if (state.data) draw(); });
  $("as-of").addEventListener("change", (e) => useTime(e.target, "asOf"));
  $("as-of-now").addEventListener("click", () => { $("as-of").value = ""; useTime($("as-of"), "asOf"); });
  $("compare").addEventListener("change", (e) => useTime(e.target, "compare"));
  $("compare-on").addEventListener("change", (e) => {
    if (!e.target.checked) { $("compare").value = ""; useTime($("compare"), "compare"); return; }
    const w = state.timeline.getWindow();
    $("compare").value = new Date((w.start.valueOf() + w.end.valueOf()) / 2).toISOString();
    useTime($("compare"), "compare");
  });
  $("ask").addEventListener("submit", ask);
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const t = $("token").value.trim();
    if (!t) return;
    sessionStorage.setItem(TOKEN_KEY, t);
    $("token").value = "";
    load(null, null, true);
  });

  if (inline) {
    // A static export (stam state --html): one window's data, no worker to ask or to move the state in time.
    const d = JSON.parse(inline.textContent);
    state.asOf = d.as_of;
    for (const id of ["as-of", "as-of-now", "compare", "compare-on", "question-text"]) $(id).disabled = true;
    $("ask").querySelector("button").disabled = true;
    const t0 = performance.now();
    show(d, true);
    status("static export of version " + d.version + (d.as_of ? " as of " + d.as_of : "") +
           ": no worker behind it, so the as-of line and the question box are off");
    whenDrawn(() => {
      state.timing = { render_ms: performance.now() - t0, shown: d.counts.shown };
      document.body.dataset.state = "ready";
    });
  } else {
    readUrl();
    if (token()) load(null, null, true); else askToken();
  }
})();
