// The trajectory viewer (docs/viewer.md): draws a view document (trajectory_view/document.py) or the session list.
// No framework and no build step. Long segments stay responsive: the token flow is cut into blocks of at most
// BLOCK tokens that are drawn only when they come near the viewport (IntersectionObserver); everything else
// (the heat strip, the turn banners) is drawn at once.
(function () {
  "use strict";
  var BLOCK = 512;
  var started = performance.now();
  var body = document.body;
  var mode = body.dataset.mode;
  var content = document.getElementById("content");
  var panel = document.getElementById("panel");
  var statusBar = document.getElementById("status");
  var params = new URLSearchParams(location.search);
  var token = params.get("token");  // the admin token, when the server has one: sent as a header, never logged
  var doc = null, pieces = {}, special = new Set(), escaped = {}, selected = null, observer = null;
  var segState = [];

  function esc(s) {
    return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
  }
  function el(tag, cls, html) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (html !== undefined) e.innerHTML = html;
    return e;
  }
  function withToken(url) { return token ? url + "?token=" + encodeURIComponent(token) : url; }
  function fetchJson(url) {
    var headers = token ? {"Authorization": "Bearer " + token} : {};
    return fetch(url, {headers: headers}).then(function (r) {
      if (!r.ok) return r.text().then(function (t) { throw new Error(r.status + " " + t); });
      return r.json();
    });
  }
  function fmt(x, digits) {
    if (x === null || x === undefined) return "–";
    return typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toFixed(digits === undefined ? 4 : digits))
      : String(x);
  }
  function ago(seconds) {
    if (seconds < 60) return seconds.toFixed(1) + " s ago";
    if (seconds < 3600) return (seconds / 60).toFixed(1) + " min ago";
    return (seconds / 3600).toFixed(1) + " h ago";
  }
  function done() {
    // Measured by the browser tests (logged, never asserted): time from script start to the first drawn tokens.
    window.__viewRenderedMs = performance.now() - started;
    body.dataset.ready = "1";
  }
  function fail(err) {
    content.innerHTML = "";
    content.appendChild(el("p", "error", esc(err.message || err)));
    body.dataset.ready = "error";
  }

  // ---- the session list (/view/) ---------------------------------------------------------------------------
  function renderList(data) {
    content.innerHTML = "";
    var card = el("div", "card");
    card.appendChild(el("div", "facts", "<div><span>replica</span><b>" + esc(data.replica || "–") +
      "</b></div><div><span>live sessions</span><b>" + data.total + "</b></div><div><span>shown</span><b>" +
      data.sessions.length + "</b></div><div><span>paused</span><b>" + (data.paused ? "yes" : "no") + "</b></div>"));
    content.appendChild(card);
    var table = el("table", "list");
    table.id = "sessions";
    var rows = ["<tr><th>session</th><th>status</th><th>segments</th><th>turns</th><th>tokens</th>" +
      "<th>busy</th><th>last activity</th><th>age</th><th>weight versions</th><th>metadata</th></tr>"];
    data.sessions.forEach(function (s) {
      rows.push("<tr data-session=\"" + esc(s.id) + "\"><td><a href=\"" + esc(withToken("sessions/" +
        encodeURIComponent(s.id))) + "\">" + esc(s.id) + "</a></td><td>" + esc(s.status) + "</td><td>" +
        s.segments + "</td><td>" + s.turns + "</td><td>" + s.tokens + "</td><td" +
        (s.busy ? " class=\"busy\">busy" : ">–") + "</td><td>" + ago(s.idle_s) + "</td><td>" + ago(s.age_s) +
        "</td><td>" + esc(s.weight_versions.join(", ") || "–") + "</td><td>" + esc(JSON.stringify(s.metadata)) +
        "</td></tr>");
    });
    if (!data.sessions.length) rows.push("<tr><td colspan=\"10\" class=\"note\">no live sessions</td></tr>");
    table.innerHTML = rows.join("");
    var box = el("div", "card");
    box.appendChild(table);
    content.appendChild(box);
    panel.innerHTML = "<p class=\"note\">Sessions on this replica, most recently active first. Open one to see its " +
      "trajectory token by token. The page reads a snapshot: it never waits for a turn.</p>";
    var reload = el("button", "", "reload");
    reload.onclick = function () { location.reload(); };
    document.getElementById("tools").appendChild(reload);
    done();
  }

  // ---- a trajectory ----------------------------------------------------------------------------------------
  function versionOf(seg, i) {
    var spans = seg.weight_spans;
    for (var k = 0; k < spans.length; k++) if (spans[k][1] <= i && i < spans[k][2]) return spans[k][0];
    return null;
  }
  function turnOf(seg, i) {
    var turns = seg.turns, found = null;
    for (var k = 0; k < turns.length; k++) if (turns[k].start <= i) found = turns[k];
    return found;
  }
  function imageAt(seg, i) {
    for (var k = 0; k < seg.images.length; k++) {
      var sp = seg.images[k].span;
      if (sp[0] <= i && i < sp[1]) return k;
    }
    return -1;
  }
  function expertsAt(seg, i) {
    if (!seg.experts) return null;
    for (var k = 0; k < seg.experts.length; k++) if (seg.experts[k][0] <= i && i < seg.experts[k][1]) return true;
    return false;
  }
  function pieceHtml(id) {
    var h = escaped[id];
    if (h === undefined) {
      var p = pieces[id];
      h = escaped[id] = p === undefined ? "⟨" + id + "⟩" : (p === "" ? "∅" : esc(p));
    }
    return h;
  }

  function facts(obj) {
    return Object.keys(obj).map(function (k) {
      var v = obj[k];
      if (v !== null && typeof v === "object") v = JSON.stringify(v);
      return "<div><span>" + esc(k) + "</span><b>" + esc(v === null || v === undefined ? "–" : v) + "</b></div>";
    }).join("");
  }
  function legend() {
    return "<div class=\"legend\"><span><span class=\"t s h7\">sampled</span> trained on (loss mask 1), " +
      "underline = probability</span><span><span class=\"t p\">prompt</span> prompt and template glue " +
      "(loss mask 0)</span><span><span class=\"t sp\">&lt;|ctl|&gt;</span> control token</span>" +
      "<span><span class=\"chip tool\">tool</span> tool calls and results</span>" +
      "<span><span class=\"t img\" style=\"padding:0 4px\">image</span> at its pad run</span>" +
      (anyCheck() ? "<span><span class=\"t bad\">mismatch</span> trainer disagrees beyond tolerance</span>" : "") +
      "</div>";
  }
  function anyCheck() { return doc.segments.some(function (s) { return !!s.check; }); }

  function renderDoc(d) {
    doc = d;
    pieces = d.pieces || {};
    special = new Set(d.special || []);
    document.title = d.title + " · trajectory viewer";
    document.getElementById("title").textContent = d.title;
    content.innerHTML = "";
    var head = el("div", "card");
    head.id = "header";
    head.innerHTML = "<div class=\"facts\">" + facts(d.header) + "</div>" + legend();
    content.appendChild(head);
    observer = new IntersectionObserver(function (entries) {
      entries.forEach(function (e) { if (e.isIntersecting) drawBlock(e.target); });
    }, {rootMargin: "1200px 0px"});
    if (!d.segments.length) content.appendChild(el("p", "note", "no generated turn yet"));
    d.segments.forEach(renderSegment);
    var tools = document.getElementById("tools");
    var jump = el("input");
    jump.placeholder = "token #";
    jump.title = "jump to a token position (segment:position or position)";
    jump.onkeydown = function (e) {
      if (e.key !== "Enter") return;
      var parts = jump.value.split(":"), si = parts.length > 1 ? +parts[0] : 0, pos = +parts[parts.length - 1];
      if (doc.segments[si] && pos >= 0 && pos < doc.segments[si].tokens.length) select(si, pos, true);
    };
    tools.appendChild(jump);
    if (mode === "session") {
      var reload = el("button", "", "reload");
      reload.onclick = function () { location.reload(); };
      tools.appendChild(reload);
    }
    window.addEventListener("hashchange", fromHash);
    requestAnimationFrame(function () { fromHash(); done(); });
  }

  function regions(seg) {
    // [start, end, kind, turn index] in order: each turn's appended prompt, then its completion; then any tail.
    var out = [], n = seg.tokens.length, at = 0;
    seg.turns.forEach(function (t, k) {
      if (t.prompt_len > at) out.push([at, t.prompt_len, "prompt", k]);
      var end = Math.min(n, t.prompt_len + t.completion_len);
      if (end > t.prompt_len) out.push([t.prompt_len, end, "sampled", k]);
      at = Math.max(at, end);
    });
    if (at < n) out.push([at, n, seg.mask[at] === "1" ? "sampled" : "prompt", -1]);
    return out;
  }

  function banner(seg, t) {
    var h = "<b>turn " + t.turn + "</b>";
    function kv(k, v) { return v === null || v === undefined ? "" : "<span class=\"kv\"><span>" + k + "</span>" +
      esc(v) + "</span>"; }
    h += kv("rid", t.rid) + kv("weights", t.weight_version);
    h += kv("prompt", t.prompt_tokens !== undefined && t.prompt_tokens !== null ? t.prompt_tokens : t.prompt_len);
    h += kv("cached", t.cached_tokens) + kv("sampled", t.completion_len);
    if (t.finish_reason) h += kv("finish", t.finish_reason.type + (t.finish_reason.matched !== undefined ?
      " (" + JSON.stringify(t.finish_reason.matched) + ")" : ""));
    if (t.e2e_latency) h += kv("latency", t.e2e_latency.toFixed(3) + " s");
    if (t.rolled_back) h += "<span class=\"chip warn\">rolled back " + t.rolled_back + " (" +
      esc(t.rollback_reason) + ")</span>";
    var versions = seg.weight_spans.filter(function (s) {
      return s[1] >= t.prompt_len && s[2] <= t.prompt_len + t.completion_len; });
    if (versions.length > 1) h += "<span class=\"chip warn\">weights changed mid-turn: " + versions.map(
      function (s) { return esc(s[0]) + " [" + s[1] + "," + s[2] + ")"; }).join(" ") + "</span>";
    if (expertsAt(seg, t.prompt_len)) h += "<span class=\"chip experts\">routed experts</span>";
    if (t.messages && t.messages.length) {
      h += "<div style=\"margin-top:4px\">" + t.messages.map(function (m) {
        var role = m.role === "tool" ? "tool" : (m.role === "user" ? "user" : "system");
        return "<span class=\"chip " + role + "\" title=\"" + esc(m.text || "") + "\">" + esc(m.role) +
          (m.role === "tool" ? " result" : "") + (m.name ? " · " + esc(m.name) : "") + "</span>";
      }).join("") + "</div>";
    }
    var b = el("div", "turn", h);
    b.dataset.turn = t.turn;
    return b;
  }

  function toolCalls(t) {
    if (!t.tool_calls || !t.tool_calls.length) return null;
    return el("div", "toolcall", t.tool_calls.map(function (c) {
      return "<b>tool call</b> " + esc(c.name) + "(" + esc(c.arguments) + ")";
    }).join("\n"));
  }

  function renderSegment(seg, si) {
    var n = seg.tokens.length, sampled = 0, i;
    for (i = 0; i < n; i++) if (seg.mask.charCodeAt(i) === 49) sampled++;
    var st = {seg: seg, blocks: [], check: seg.check, bad: null};
    segState.push(st);
    if (seg.check) {
      st.bad = new Uint8Array(n);
      var tol = seg.check.tolerance;
      for (i = 0; i < n; i++) {
        var tr = seg.check.trainer[i];
        if (tr !== null && tr !== undefined && Math.abs(tr - seg.logprobs[i]) > tol) st.bad[i] = 1;
      }
    }
    var card = el("section", "card segment");
    card.id = "seg" + si;
    var versions = Array.from(new Set(seg.weight_spans.map(function (s) { return s[0]; })));
    var info = seg.info ? " · " + Object.keys(seg.info).filter(function (k) { return seg.info[k] !== null; })
      .map(function (k) { return k + " " + seg.info[k]; }).join(", ") : "";
    card.appendChild(el("h2", "", esc(seg.label) + "<small>" + n + " tokens · " + sampled + " sampled · " +
      seg.turns.length + " turns · " + seg.images.length + " images · weights " + esc(versions.join(", ") || "–") +
      (seg.experts ? " · routed experts recorded" : "") + " · " + esc(seg.status) +
      (seg.truncated_from ? " (truncated from " + seg.truncated_from + ")" : "") + esc(info) + "</small>"));
    var strip = el("canvas", "strip");
    strip.title = "the whole segment: sampled tokens coloured by probability (red: unlikely), prompt grey; click to jump";
    card.appendChild(strip);
    card.appendChild(el("div", "strip-legend", "heat strip: top, each sampled token's probability (green likely, " +
      "red unlikely; prompt grey); bottom, turns alternating, images violet" + (seg.check ? ", mismatches red" : "") +
      ". Click to jump."));
    if (seg.check) card.appendChild(checkCard(seg, si));
    var flow = el("div", "flow");
    card.appendChild(flow);
    content.appendChild(card);
    requestAnimationFrame(function () { drawStrip(strip, st); });
    strip.onclick = function (e) {
      var r = strip.getBoundingClientRect();
      select(si, Math.min(n - 1, Math.floor((e.clientX - r.left) / r.width * n)), true);
    };
    var turnStarted = {};
    regions(seg).forEach(function (r) {
      var k = r[3];
      if (k >= 0 && !turnStarted[k]) { turnStarted[k] = true; flow.appendChild(banner(seg, seg.turns[k])); }
      var a = r[0];
      while (a < r[1]) {
        var b = Math.min(r[1], a + BLOCK);
        var img = imageAt(seg, b - 1);
        if (img >= 0) b = Math.min(r[1], Math.max(b, seg.images[img].span[1]));  // an image is never split
        var block = el("div", "block r-" + r[2]);
        block.dataset.seg = si; block.dataset.a = a; block.dataset.b = b;
        block.style.minHeight = estimate(seg, a, b, flow) + "px";
        st.blocks.push(block);
        flow.appendChild(block);
        observer.observe(block);
        a = b;
      }
      if (r[2] === "sampled" && k >= 0) {
        var calls = toolCalls(seg.turns[k]);
        if (calls) flow.appendChild(calls);
      }
    });
  }

  function estimate(seg, a, b, flow) {
    var chars = 0, lines = 1, width = Math.max(200, (flow.clientWidth || 800) - 20), perLine = width / 7.8;
    for (var i = a; i < b; i++) {
      var p = pieces[seg.tokens[i]];
      if (p === undefined) { chars += 6; continue; }
      var nl = p.indexOf("\n");
      if (nl >= 0) { lines += Math.ceil(chars / perLine) + p.split("\n").length - 2; chars = 0; } else chars += p.length;
    }
    return Math.round((lines + Math.ceil(chars / perLine)) * 21);
  }

  function drawBlock(block) {
    if (block.dataset.drawn) return;
    block.dataset.drawn = "1";
    observer.unobserve(block);
    var si = +block.dataset.seg, a = +block.dataset.a, b = +block.dataset.b;
    var st = segState[si], seg = st.seg, tokens = seg.tokens, mask = seg.mask, lps = seg.logprobs;
    var out = [], i = a;
    while (i < b) {
      var img = seg.images.length ? imageAt(seg, i) : -1;
      if (img >= 0) {
        var im = seg.images[img], end = Math.min(b, im.span[1]);
        out.push("<span class=\"t img\" data-i=\"" + i + "\" data-img=\"" + img + "\">" + (im.src ?
          "<img alt=\"image " + img + "\" src=\"" + im.src + "\">" : "<span class=\"ph\"></span>") +
          "<span class=\"cap\">image " + img + " · " + (im.span[1] - im.span[0]) + " pads · grid " +
          esc((im.grid || []).join("×")) + "</span></span>");
        i = end;
        continue;
      }
      var id = tokens[i], cls = mask.charCodeAt(i) === 49 ? "t s h" + Math.min(7, Math.floor(Math.exp(lps[i]) * 8))
        : "t p";
      if (special.has(id)) cls += " sp";
      if (st.bad && st.bad[i]) cls += " bad";
      out.push("<span class=\"" + cls + "\" data-i=\"" + i + "\">" + pieceHtml(id) + "</span>");
      i++;
    }
    block.innerHTML = out.join("");
    block.style.minHeight = "";
    if (selected && selected[0] === si && selected[1] >= a && selected[1] < b) mark(true);
  }

  function drawStrip(canvas, st) {
    var seg = st.seg, n = seg.tokens.length, dpr = window.devicePixelRatio || 1;
    var w = Math.max(1, Math.floor(canvas.clientWidth * dpr)), h = Math.floor(22 * dpr);
    canvas.width = w; canvas.height = h;
    var ctx = canvas.getContext("2d"), top = Math.floor(h * 0.62);
    ctx.fillStyle = "#dde1e7"; ctx.fillRect(0, 0, w, h);
    if (!n) return;
    for (var x = 0; x < w; x++) {
      var a = Math.floor(x * n / w), b = Math.max(a + 1, Math.floor((x + 1) * n / w)), minP = 2, bad = false;
      for (var i = a; i < b && i < n; i++) {
        if (seg.mask.charCodeAt(i) === 49) minP = Math.min(minP, Math.exp(seg.logprobs[i]));
        if (st.bad && st.bad[i]) bad = true;
      }
      if (minP <= 1) { ctx.fillStyle = "hsl(" + Math.round(minP * 125) + ",70%,45%)"; ctx.fillRect(x, 0, 1, top); }
      if (bad) { ctx.fillStyle = "#d93025"; ctx.fillRect(x, top, 1, h - top); }
    }
    seg.turns.forEach(function (t, k) {
      var a = t.start / n * w, b = Math.min(n, t.prompt_len + t.completion_len) / n * w;
      ctx.fillStyle = k % 2 ? "#9aa5b4" : "#5f6b7a";
      ctx.fillRect(a, top + 2, Math.max(1, b - a), h - top - 2);
    });
    seg.images.forEach(function (im) {
      ctx.fillStyle = "#7b4fd6";
      ctx.fillRect(im.span[0] / n * w, top + 2, Math.max(2, (im.span[1] - im.span[0]) / n * w), h - top - 2);
    });
  }

  function checkCard(seg, si) {
    var c = seg.check, box = el("div", "check");
    var m = c.metrics || {}, max = m["rollout_check/logprob_abs_diff_max"];
    var ok = max !== undefined && max <= c.tolerance;
    var h = "<div class=\"facts\" style=\"margin:6px 0\"><div><span>trainer check</span><b class=\"" +
      (ok ? "ok\">within " : "fail\">beyond ") + c.tolerance + "</b></div>";
    ["rollout_check/tokens", "rollout_check/logprob_abs_diff_max", "rollout_check/logprob_abs_diff_mean",
      "rollout_corr/k3_kl"].forEach(function (k) {
      if (m[k] !== undefined) h += "<div><span>" + esc(k.split("/")[1]) + "</span><b>" + fmt(m[k], 6) + "</b></div>";
    });
    h += "</div>";
    if (c.worst && c.worst.length) {
      h += "<table id=\"worst" + si + "\"><tr><th>worst tokens</th><th>piece</th><th>turn</th><th>weights</th>" +
        "<th>engine</th><th>trainer</th><th>|diff|</th></tr>" + c.worst.map(function (w) {
          return "<tr><td><a class=\"worst\" href=\"#s" + si + "t" + w.position + "\">token " + w.position +
            "</a></td><td>" + pieceHtml(w.token_id) + "</td><td>" + fmt(w.turn) + "</td><td>" +
            esc(fmt(w.weight_version)) + "</td><td>" + fmt(w.engine, 6) + "</td><td>" + fmt(w.trainer, 6) +
            "</td><td class=\"" + (w.diff > c.tolerance ? "fail" : "ok") + "\">" + w.diff.toExponential(2) +
            "</td></tr>";
        }).join("") + "</table>";
    }
    box.innerHTML = h;
    return box;
  }

  function fromHash() {
    var m = /^#s(\d+)t(\d+)$/.exec(location.hash);
    if (m && doc.segments[+m[1]] && +m[2] < doc.segments[+m[1]].tokens.length) select(+m[1], +m[2], true);
  }

  function blockOf(si, pos) {
    var blocks = segState[si].blocks;
    for (var k = 0; k < blocks.length; k++) if (+blocks[k].dataset.a <= pos && pos < +blocks[k].dataset.b) {
      return blocks[k];
    }
    return null;
  }
  function spanOf(si, pos) {
    var block = blockOf(si, pos);
    if (!block) return null;
    drawBlock(block);
    var seg = segState[si].seg, img = imageAt(seg, pos);
    var at = img >= 0 ? seg.images[img].span[0] : pos;
    return block.querySelector("[data-i=\"" + at + "\"]");
  }
  function mark(on) {
    if (!selected) return;
    var span = spanOf(selected[0], selected[1]);
    if (span) span.classList.toggle("sel", on);
  }

  function select(si, pos, scroll) {
    mark(false);
    selected = [si, pos];
    mark(true);
    var span = spanOf(si, pos);
    if (scroll && span) span.scrollIntoView({block: "center"});
    showDetails(si, pos);
  }

  function details(si, pos) {
    var st = segState[si], seg = st.seg, id = seg.tokens[pos], sampled = seg.mask.charCodeAt(pos) === 49;
    var lp = seg.logprobs[pos], turn = turnOf(seg, pos), img = imageAt(seg, pos), rows = [];
    rows.push(["position", pos]);
    rows.push(["token_id", id]);
    rows.push(["piece", pieces[id] === undefined ? "(not decoded)" : JSON.stringify(pieces[id])]);
    rows.push(["loss_mask", sampled ? "1 · sampled, trained on" : "0 · prompt / glue, not trained"]);
    rows.push(["logprob", sampled ? fmt(lp, 6) : "–"]);
    rows.push(["probability", sampled ? fmt(Math.exp(lp), 4) : "–"]);
    rows.push(["weight_version", fmt(versionOf(seg, pos))]);
    rows.push(["turn", turn ? turn.turn + (pos >= turn.prompt_len ? " (completion)" : " (prompt)") : "–"]);
    rows.push(["segment", seg.label]);
    var ex = expertsAt(seg, pos);
    rows.push(["routed_experts", ex === null ? "not recorded for this session" : (ex ? "recorded" : "none here")]);
    if (special.has(id)) rows.push(["control", "a special token of the template"]);
    if (img >= 0) {
      var im = seg.images[img];
      rows.push(["image", img + " · span [" + im.span[0] + ", " + im.span[1] + ") · grid " +
        (im.grid || []).join("×")]);
      rows.push(["digest", im.digest]);
    }
    if (st.check) {
      var tr = st.check.trainer[pos];
      rows.push(["trainer_logprob", tr === null || tr === undefined ? "–" : fmt(tr, 6)]);
      if (tr !== null && tr !== undefined) rows.push(["abs_diff", Math.abs(tr - lp).toExponential(2) +
        (st.bad[pos] ? " · beyond " : " · within ") + st.check.tolerance]);
    }
    return rows;
  }

  function showDetails(si, pos) {
    var rows = details(si, pos), seg = segState[si].seg, img = imageAt(seg, pos);
    panel.innerHTML = "<h3>token " + pos + " <small class=\"note\">· <a href=\"#s" + si + "t" + pos +
      "\">link</a></small></h3><table>" + rows.map(function (r) {
        return "<tr data-k=\"" + r[0] + "\"><th>" + r[0] + "</th><td>" + esc(r[1]) + "</td></tr>";
      }).join("") + "</table>" + (img >= 0 && seg.images[img].src ? "<img alt=\"image\" src=\"" +
      seg.images[img].src + "\">" : "");
  }

  content.addEventListener("click", function (e) {
    var t = e.target.closest ? e.target.closest("[data-i]") : null;
    if (!t) return;
    var block = t.closest(".block");
    select(+block.dataset.seg, +t.dataset.i, false);
  });
  content.addEventListener("mouseover", function (e) {
    var t = e.target.closest ? e.target.closest("[data-i]") : null;
    if (!t) return;
    var si = +t.closest(".block").dataset.seg, pos = +t.dataset.i, seg = segState[si].seg, id = seg.tokens[pos];
    var sampled = seg.mask.charCodeAt(pos) === 49;
    statusBar.textContent = seg.label + " · token " + pos + " · id " + id + " · " +
      JSON.stringify(pieces[id] === undefined ? "" : pieces[id]) + " · " + (sampled ? "sampled · logprob " +
      fmt(seg.logprobs[pos], 4) : "prompt") + " · weights " + fmt(versionOf(seg, pos));
  });

  // Exposed for the browser tests and the console: select a token, read the document.
  window.trajectoryView = {select: select, document: function () { return doc; }};

  if (mode === "list") {
    fetchJson(body.dataset.source).then(renderList).catch(fail);
  } else if (mode === "session") {
    fetchJson(body.dataset.source).then(renderDoc).catch(fail);
  } else {
    try { renderDoc(JSON.parse(document.getElementById("view-doc").textContent)); } catch (err) { fail(err); }
  }
})();
