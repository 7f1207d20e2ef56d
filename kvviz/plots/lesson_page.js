// kvviz lesson page: sliders over a precomputed grid, the Explorer's two charts drawn as SVG.
// Written for kvviz.plots.lesson, which inlines it. Data come from two inert script blocks (JSON and
// gzip + base64 typed arrays); every text from them is set with textContent, never parsed as HTML.
// The charts are drawn here rather than with plotly.js: plotly.min.js alone is 4.8 MB, which would leave
// almost nothing of the 5 MB budget for the grid (see docs/lesson.md for the measurements).
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";
  var COLORS = {sink: "#0072B2", recent: "#009E73", "heavy hitter": "#E69F00", "kept (no eviction)": "#56B4E9",
                evicted: "#D55E00", original: "#999999", quantization: "#CC79A7", black: "#000000"};
  var EVICTED = 0;
  var api = window.kvvizLesson = {ready: false};

  function $(id) { return document.getElementById(id); }
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function svg(tag, attrs, parent) {
    var e = document.createElementNS(SVG, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function fail(message) {
    var box = $("failure");
    box.textContent = message;
    box.style.display = "block";
  }

  // --- data ---------------------------------------------------------------------------------------
  var meta = JSON.parse($("lesson-meta").textContent);

  function unpack() {
    var text = $("lesson-data").textContent.trim();
    var raw = atob(text);
    var bytes = new Uint8Array(raw.length);
    for (var i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    if (typeof DecompressionStream === "undefined") {
      return Promise.reject(new Error("this browser cannot unpack the lesson (it needs DecompressionStream: " +
                                      "Chrome 80+, Edge 80+, Firefox 113+ or Safari 16.4+)"));
    }
    var stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return new Response(stream).arrayBuffer();
  }

  function views(buffer) {
    var types = {float64: Float64Array, uint32: Uint32Array, int32: Int32Array, uint8: Uint8Array};
    var out = {};
    Object.keys(meta.blob).forEach(function (name) {
      var a = meta.blob[name];
      var count = a.shape.reduce(function (x, y) { return x * y; }, 1);
      if (a.dtype === "json") {
        out[name] = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, a.offset, count)));
      } else {
        out[name] = new types[a.dtype](buffer, a.offset, count);
      }
    });
    return out;
  }

  // --- state --------------------------------------------------------------------------------------
  var data = null, at = {}, locked = null, C = meta.n, K = meta.columns.length;

  function pointIndex() {
    var i = 0;
    meta.sliders.forEach(function (s) { i = i * s.values.length + at[s.name]; });
    return i;
  }
  function column(row, name) {
    var k = meta.columns.indexOf(name);
    return data.rows.subarray((row * K + k) * C, (row * K + k + 1) * C);
  }
  function current() {
    var i = pointIndex();
    if (!data) return opening(i);
    var row = data.row_of[i], out = {index: i};
    meta.columns.forEach(function (name) { out[name] = column(row, name); });
    var m = data.mark_of[i];
    out[meta.binned ? "kept_tokens" : "reason"] = data.marks.subarray(m * C, (m + 1) * C);
    out.text = {};
    meta.fields.forEach(function (f, j) { out.text[f] = data.strings[data.text_of[i * meta.fields.length + j]]; });
    return out;
  }

  function opening(i) {
    // The point the page opens at travels in the JSON too (null = NaN), so the first chart is drawn
    // before the grid is unpacked.
    var first = meta.first, out = {index: i, text: first.text};
    Object.keys(first.columns).forEach(function (name) {
      out[name] = Float64Array.from(first.columns[name], function (v) { return v === null ? NaN : v; });
    });
    out[meta.binned ? "kept_tokens" : "reason"] = first.marks;
    return out;
  }

  // --- sliders --------------------------------------------------------------------------------------
  function buildSliders() {
    var box = $("sliders");
    meta.sliders.forEach(function (s) {
      at[s.name] = s.start;
      var wrap = el("div", {"class": "slider"});
      var id = "s-" + s.name;
      var label = el("label", {"for": id});
      label.appendChild(el("span", {}, s.label));
      var out = el("output", {id: id + "-value", "for": id}, s.display[s.start]);
      label.appendChild(out);
      var input = el("input", {type: "range", id: id, min: "0", max: String(s.values.length - 1), step: "1",
                               value: String(s.start), "aria-valuetext": s.display[s.start]});
      input.disabled = s.values.length < 2;
      input.addEventListener("input", function () {
        at[s.name] = +input.value;
        out.textContent = s.display[at[s.name]];
        input.setAttribute("aria-valuetext", s.display[at[s.name]]);
        draw();
      });
      wrap.appendChild(label);
      wrap.appendChild(input);
      wrap.appendChild(el("div", {"class": "values"}, "grid: " + s.display.join(", ")));
      box.appendChild(wrap);
    });
  }

  // --- numbers --------------------------------------------------------------------------------------
  function card(dl, label, value, small, key) {
    var d = el("div", {"data-card": key});
    d.appendChild(el("dt", {}, label));
    var dd = el("dd", {}, value);
    if (small) dd.appendChild(el("small", {}, small));
    d.appendChild(dd);
    dl.appendChild(d);
  }
  function ranges(flags) {
    var out = [], i = 0;
    while (i < flags.length) {
      if (!flags[i]) { i++; continue; }
      var j = i;
      while (j + 1 < flags.length && flags[j + 1]) j++;
      out.push(i === j ? String(i) : i + "-" + j);
      i = j + 1;
    }
    return out.length ? out.join(", ") : "none";
  }
  function readout(p) {
    var t = p.text, metrics = $("metrics"), memory = $("memory");
    metrics.textContent = "";
    memory.textContent = "";
    card(metrics, "Attention mass retained", t.mass, "", "mass");
    card(metrics, "TV distance", t.tv, "", "tv");
    card(metrics, "TV from quantization", t.tvq, "", "tvq");
    card(metrics, "KL divergence", t.kl, "", "kl");
    card(metrics, "Output error", t.out, t.cos, "out");
    card(memory, "KV memory", t.kv, "", "kv");
    card(memory, "Memory vs 16-bit", t.ratio, t.smaller, "ratio");
    card(memory, "Tokens kept", t.kept, "", "kept");
    $("setting").textContent = meta.source + " · " + meta.row + " · " + t.label;
    var w = $("warnings");
    w.textContent = "";
    t.warnings.split("\n").filter(Boolean).forEach(function (line) { w.appendChild(el("div", {"class": "warn"}, line)); });
    var kept = $("kept");
    if (meta.binned) {
      kept.textContent = meta.n_tokens + " tokens: the charts show " + C + " bins of up to " + meta.bin_width +
                         " tokens each.";
    } else {
      var flags = [], evicts = false;
      for (var i = 0; i < C; i++) { flags.push(p.reason[i] !== EVICTED); evicts = evicts || p.reason[i] !== 4; }
      kept.textContent = "";
      if (evicts) {
        kept.appendChild(el("b", {}, "Kept tokens: "));
        kept.appendChild(document.createTextNode(ranges(flags)));
      }
    }
    var query = new URLSearchParams(meta.link.query);
    meta.sliders.forEach(function (s) {
      var v = s.values[at[s.name]];
      if (v !== meta.link.defaults[s.name]) query.set(s.name, String(v));
    });
    var q = query.toString();
    $("applink").setAttribute("href", meta.link.base + (q ? "?" + q : ""));
  }

  // --- charts ---------------------------------------------------------------------------------------
  function niceStep(span, count) {
    var raw = span / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var steps = [1, 2, 5, 10];
    for (var i = 0; i < steps.length; i++) if (steps[i] * mag >= raw * (1 - 1e-12)) return steps[i] * mag;
    return 10 * mag;
  }
  var widths = {};   // chart widths, measured once and on resize (reading them after each change forces a layout)
  function frame(host, yLo, yHi, yTitle) {
    if (!widths[host.id]) widths[host.id] = Math.max(320, host.clientWidth || 960);
    host.textContent = "";
    var W = widths[host.id], H = meta.text_tokens && !meta.binned ? 380 : 330;
    var m = {l: 64, r: 14, t: 8, b: meta.text_tokens && !meta.binned ? 86 : 44};
    var root = svg("svg", {viewBox: "0 0 " + W + " " + H, width: W, height: H, role: "img",
                           "font-family": "Source Sans Pro, Segoe UI, Helvetica, Arial, sans-serif", "font-size": "12"},
                   host);
    var defs = svg("defs", {}, root);
    var id = host.id;
    var clip = svg("clipPath", {id: id + "-clip"}, defs);
    svg("rect", {x: m.l, y: m.t, width: W - m.l - m.r, height: H - m.t - m.b}, clip);
    [["hatch", "rgba(213,94,0,0.35)", "#D55E00"]].forEach(function (h) {
      var pat = svg("pattern", {id: id + "-" + h[0], patternUnits: "userSpaceOnUse", width: 5, height: 5,
                                patternTransform: "rotate(45)"}, defs);
      svg("rect", {width: 5, height: 5, fill: h[1]}, pat);
      svg("line", {x1: 0, y1: 0, x2: 0, y2: 5, stroke: h[2], "stroke-width": 1.6}, pat);
    });
    var f = {root: root, W: W, H: H, m: m, hatch: "url(#" + id + "-hatch)"};
    var x0 = -0.5, x1 = meta.n_tokens - 0.5;
    f.x = function (v) { return m.l + (v - x0) / (x1 - x0) * (W - m.l - m.r); };
    f.unit = (W - m.l - m.r) / (x1 - x0);
    f.y = function (v) { return m.t + (yHi - v) / (yHi - yLo) * (H - m.t - m.b); };
    // y axis: grid lines and ticks
    var step = niceStep(yHi - yLo, 6), digits = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    var axis = svg("g", {"class": "yaxis"}, root);
    for (var v = Math.ceil(yLo / step) * step; v <= yHi + step * 1e-9; v += step) {
      var yy = f.y(v);
      svg("line", {x1: m.l, x2: W - m.r, y1: yy, y2: yy, stroke: "#e6e6e6"}, axis);
      svg("text", {x: m.l - 6, y: yy + 4, "text-anchor": "end", fill: "#333"}, axis).textContent =
        (Math.abs(v) < step / 2 ? 0 : v).toFixed(digits);
    }
    var yt = svg("text", {transform: "translate(14," + (m.t + (H - m.t - m.b) / 2) + ") rotate(-90)",
                          "text-anchor": "middle", fill: "#333"}, root);
    yt.textContent = yTitle;
    f.plot = svg("g", {"clip-path": "url(#" + id + "-clip)"}, root);
    xAxis(f);
    return f;
  }
  function xAxis(f) {
    var g = svg("g", {"class": "xaxis"}, f.root), base = f.H - f.m.b;
    svg("line", {x1: f.m.l, x2: f.W - f.m.r, y1: base, y2: base, stroke: "#999"}, g);
    var title;
    if (meta.text_tokens && !meta.binned) {
      var every = Math.max(1, Math.ceil(C / 48));
      for (var i = 0; i < C; i += every) {
        var label = meta.labels[i].replace(/\n/g, "↵").trim() || "␣";
        var t = svg("text", {transform: "translate(" + (f.x(meta.x[i]) + 3) + "," + (base + 8) + ") rotate(-60)",
                             "text-anchor": "end", fill: "#333", "font-size": "11"}, g);
        t.textContent = label.slice(0, 10);
      }
      title = "token";
    } else {
      var step = niceStep(meta.n_tokens, 12);
      for (var v = 0; v < meta.n_tokens; v += step) {
        svg("line", {x1: f.x(v), x2: f.x(v), y1: base, y2: base + 4, stroke: "#999"}, g);
        svg("text", {x: f.x(v), y: base + 16, "text-anchor": "middle", fill: "#333"}, g).textContent = String(v);
      }
      title = meta.binned ? "token position (bins of " + meta.bin_width + " tokens)" : "token position (index)";
    }
    svg("text", {x: f.m.l + (f.W - f.m.l - f.m.r) / 2, y: f.H - 4, "text-anchor": "middle", fill: "#333"}, g)
      .textContent = title;
  }
  function bar(f, cls, i, xa, xb, ya, yb, fill, value) {
    var top = Math.min(f.y(ya), f.y(yb)), h = Math.abs(f.y(ya) - f.y(yb));
    var r = svg("rect", {"class": cls, x: xa, width: Math.max(0.5, xb - xa), y: top, height: h, fill: fill,
                         "data-i": i, "data-v": String(value)}, f.plot);
    return r;
  }
  function center(i) { return meta.binned ? (meta.x[i] + meta.x_end[i]) / 2 : meta.x[i]; }
  function width(i) { return meta.binned ? meta.x_end[i] - meta.x[i] + 1 : 1; }
  // Hover: one tooltip box per chart, filled from the column under the pointer (not an element per column,
  // which would double what every slider move redraws).
  function hover(f, describe) {
    var host = f.root.parentNode, box = el("div", {"class": "tip", role: "tooltip"});
    host.appendChild(box);
    function column(evt) {
      var r = f.root.getBoundingClientRect(), x = (evt.clientX - r.left) * f.W / r.width;
      for (var i = 0; i < C; i++) {
        var half = width(i) * f.unit / 2, cx = f.x(center(i));
        if (x >= cx - half && x <= cx + half) return i;
      }
      return -1;
    }
    f.root.addEventListener("mousemove", function (evt) {
      var i = column(evt);
      if (i < 0) { box.style.display = "none"; return; }
      box.textContent = describe(i);
      box.style.display = "block";
      var r = host.getBoundingClientRect();
      box.style.left = Math.min(evt.clientX - r.left + 12, r.width - 220) + "px";
      box.style.top = (evt.clientY - r.top + 12) + "px";
    });
    f.root.addEventListener("mouseleave", function () { box.style.display = "none"; });
  }
  function where(i) {
    return meta.binned ? "tokens " + meta.x[i] + "-" + meta.x_end[i] + " (" + meta.labels[i] + ")"
                       : meta.labels[i] + " (position " + meta.x[i] + ")";
  }
  function legend(id, items) {
    var box = $(id);
    box.textContent = "";
    items.forEach(function (it) {
      var s = el("span", {});
      var sw = el("i", {});
      sw.style.background = it[1];
      if (it[2]) sw.style.backgroundImage = "repeating-linear-gradient(45deg, #D55E00 0 1.5px, transparent 1.5px 4px)";
      s.appendChild(sw);
      s.appendChild(document.createTextNode(it[0]));
      box.appendChild(s);
    });
  }
  function extent(values, lo, hi) {
    for (var i = 0; i < values.length; i++) {
      var v = values[i];
      if (isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    }
    return [lo, hi];
  }

  function attentionChart(p) {
    var orig = meta.original, comp = p.compressed, hi = extent(comp, 0, 0)[1];
    hi = extent(orig, 0, hi)[1] * 1.06 || 1;
    var range = locked ? locked.attention : [0, hi];
    var f = frame($("attention"), range[0], range[1],
                  meta.binned ? "attention mass per bin (probability)" : "attention weight (probability)");
    var seen = {};
    for (var i = 0; i < C; i++) {
      var cx = f.x(center(i)), half = width(i) * f.unit * 0.45;
      if (meta.binned) {
        var ev = p.evicted_mass[i], keptMass = orig[i] - ev;
        bar(f, "original kept", i, cx - half, cx, 0, keptMass, COLORS.original, keptMass);
        if (ev > 0) bar(f, "original evicted", i, cx - half, cx, keptMass, keptMass + ev, f.hatch, ev);
        bar(f, "compressed", i, cx, cx + half, 0, comp[i], COLORS["kept (no eviction)"], comp[i]);

      } else {
        var why = meta.reasons[p.reason[i]];
        seen[why] = true;
        var evicted = p.reason[i] === EVICTED;
        bar(f, evicted ? "original evicted" : "original", i, cx - half, cx, 0, orig[i],
            evicted ? f.hatch : COLORS.original, orig[i]);
        if (!evicted) bar(f, "compressed", i, cx, cx + half, 0, comp[i], COLORS[why], comp[i]);

      }
    }
    var items = [["original", COLORS.original]];
    if (meta.binned) {
      items = [["original: kept tokens", COLORS.original], ["original: evicted tokens", COLORS.evicted, true],
               ["compressed", COLORS["kept (no eviction)"]]];
    } else {
      if (seen.evicted) items.push(["original, evicted (compressed = 0)", "rgba(213,94,0,0.35)", true]);
      ["sink", "recent", "heavy hitter", "kept (no eviction)"].forEach(function (r) {
        if (seen[r]) items.push(["compressed: " + r, COLORS[r]]);
      });
    }
    legend("attention-legend", items);
    hover(f, function (i) {
      return where(i) + "\noriginal " + orig[i].toFixed(4) + "\ncompressed " + comp[i].toFixed(4) + "\n" +
        (meta.binned ? "kept " + p.kept_tokens[i] + " of " + width(i) + "; evicted mass " + p.evicted_mass[i].toFixed(4)
                     : meta.reasons[p.reason[i]]);
    });
    return [0, hi];
  }

  function errorChart(p) {
    var parts = [["eviction", p.error_eviction_mean], ["quantization", p.error_quantization_mean]];
    var shown = parts.filter(function (part) {
      for (var i = 0; i < C; i++) if (Math.abs(part[1][i]) > 0) return true;
      return false;
    });
    var lo = 0, hi = 0, i;
    for (i = 0; i < C; i++) {
      var pos = 0, neg = 0;
      shown.forEach(function (part) { var v = part[1][i]; if (v >= 0) pos += v; else neg += v; });
      lo = Math.min(lo, neg, p.error_mean[i]);
      hi = Math.max(hi, pos, p.error_mean[i]);
      if (meta.members > 1) {
        if (isFinite(p.band_lo[i])) lo = Math.min(lo, p.band_lo[i]);
        if (isFinite(p.band_hi[i])) hi = Math.max(hi, p.band_hi[i]);
      }
    }
    var pad = (hi - lo) * 0.06 || 0.01, range = locked ? locked.error : [lo - pad, hi + pad];
    var f = frame($("error"), range[0], range[1], meta.binned ? "error in attention mass per bin (probability)"
                                                             : "attention error (compressed − original)");
    for (i = 0; i < C; i++) {
      var cx = f.x(center(i)), half = Math.max(0.5, width(i) * f.unit * 0.425), up = 0, down = 0;
      shown.forEach(function (part) {
        var v = part[1][i];
        if (v === 0) return;
        var fill = part[0] === "eviction" ? f.hatch : COLORS.quantization;
        if (v >= 0) { bar(f, part[0], i, cx - half, cx + half, up, up + v, fill, v); up += v; }
        else { bar(f, part[0], i, cx - half, cx + half, down + v, down, fill, v); down += v; }
      });
      var mean = p.error_mean[i], y = f.y(mean), tick = Math.min(6, half + 1);
      svg("line", {"class": "total", x1: cx - tick, x2: cx + tick, y1: y, y2: y, stroke: "#000", "stroke-width": 2,
                   "data-i": i, "data-v": String(mean)}, f.plot);
      if (meta.members > 1) {
        var bhi = p.band_hi[i] - mean, blo = mean - p.band_lo[i];
        bhi = bhi > 0 ? bhi : 0;   // as the Explorer: (hi - mean).clip(0).fillna(0)
        blo = blo > 0 ? blo : 0;
        var yt = f.y(mean + bhi), yb = f.y(mean - blo);
        svg("path", {"class": "band", d: "M" + (cx - 2) + " " + yt + "H" + (cx + 2) + "M" + cx + " " + yt + "V" + yb +
                                          "M" + (cx - 2) + " " + yb + "H" + (cx + 2),
                     fill: "none", stroke: "#000", "stroke-width": 1.2,
                     "data-i": i, "data-lo": String(p.band_lo[i]), "data-hi": String(p.band_hi[i])}, f.plot);
      }
    }
    svg("line", {x1: f.m.l, x2: f.W - f.m.r, y1: f.y(0), y2: f.y(0), stroke: "#000", "stroke-width": 1}, f.plot);
    var items = shown.map(function (part) {
      return part[0] === "eviction" ? ["eviction part", "rgba(213,94,0,0.35)", true] : ["quantization part",
                                                                                          COLORS.quantization];
    });
    items.push([meta.members > 1 ? "total (" + meta.bars_text + ")" : "total", "#000"]);
    legend("error-legend", items);
    hover(f, function (i) {
      return where(i) + "\ntotal error " + p.error_mean[i].toFixed(5) +
        (meta.members > 1 ? "\nband " + p.band_lo[i].toFixed(5) + " to " + p.band_hi[i].toFixed(5) : "") +
        shown.map(function (part) { return "\n" + part[0] + " part " + part[1][i].toFixed(5); }).join("");
    });
    return [lo - pad, hi + pad];
  }

  function draw() {
    var t0 = performance.now(), p = current();
    readout(p);
    var a = attentionChart(p), e = errorChart(p);
    if ($("lock").checked && !locked) locked = {attention: a, error: e};
    api.point = p.index;
    api.lastDrawMs = performance.now() - t0;
  }

  // --- start ----------------------------------------------------------------------------------------
  function start() {
    document.title = meta.title;
    $("source").textContent = meta.source + " · made with kvviz " + meta.version;
    $("lecturer").textContent = meta.lecturer;
    $("gridnote").textContent = meta.grid_note;
    $("fixed").textContent = meta.fixed;
    $("quant").textContent = meta.quant;
    $("appnote").textContent = meta.link.note;
    var notes = $("notes");
    meta.notes.forEach(function (n) { notes.appendChild(el("div", {"class": "info"}, n)); });
    $("attention-title").textContent = meta.binned ? "Attention mass per bin of tokens: original vs compressed"
                                                   : "Attention per token: original vs compressed";
    $("attention-title").appendChild(el("span", {}, "one row: " + meta.row));
    $("error-title").textContent = "Per-token error: compressed − original attention";
    $("error-title").appendChild(el("span", {}, meta.members > 1
      ? "ensemble mean of N = " + meta.members + " rows (" + meta.ensemble + "), bars: " + meta.bars_text
      : "one row (" + meta.ensemble + "), no ensemble: no error bars"));
    buildSliders();
    $("lock").addEventListener("change", function () { locked = null; draw(); });
    draw();
    var inputs = document.querySelectorAll("#sliders input");
    inputs.forEach(function (input) { input.disabled = true; });     // until the grid is unpacked
    afterPaint(function () {
      performance.mark("kvviz-first-chart");
      api.firstChartMs = performance.now();        // since the page began to load (time origin)
      unpack().then(function (buffer) {
        data = views(buffer);
        meta.sliders.forEach(function (s, k) { inputs[k].disabled = s.values.length < 2; });
        api.ready = true;
      }).catch(function (e) {
        fail("This lesson cannot be shown: " + (e && e.message ? e.message : String(e)) + ".");
      });
      var resized = null;
      window.addEventListener("resize", function () {
        clearTimeout(resized);
        resized = setTimeout(function () { widths = {}; draw(); }, 100);
      });
    });
  }
  function afterPaint(fn) {   // a callback of the frame after next runs once this frame has been painted
    requestAnimationFrame(function () { requestAnimationFrame(fn); });
  }
  api.current = function () { return data ? current() : null; };
  api.meta = meta;
  start();
})();
