/* Line charts drawn as inline SVG: no library, no build step. */
"use strict";

const Charts = (() => {
  const SVG = "http://www.w3.org/2000/svg";
  const PALETTE = ["#2f6fde", "#e5731a", "#16a36b", "#c23b8a", "#7b4fd6", "#0e9bb5",
                   "#b8860b", "#d64545", "#5c7a29", "#6b7280"];
  const H = 270, M = { top: 16, right: 18, bottom: 40, left: 58 };

  function el(name, attrs, text) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  /* About `count` round tick values covering [lo, hi]. */
  function ticks(lo, hi, count) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toFixed(10));
    return out;
  }

  /* Ticks for a log10 axis given in log units: 1, 2, 5 times each power of ten, thinned to fit. */
  function logTicks(lo, hi) {
    const out = [];
    for (let e = Math.floor(lo); e <= Math.ceil(hi); e++) {
      for (const m of [1, 2, 5]) {
        const v = Math.log10(m) + e;
        if (v >= lo && v <= hi) out.push(v);
      }
    }
    return out.length > 8 ? out.filter((v) => Number.isInteger(+v.toFixed(9))) : out;
  }

  function fmt(v) {
    const a = Math.abs(v);
    if (a !== 0 && (a < 0.001 || a >= 1e5)) return v.toExponential(1);
    return String(+v.toPrecision(a < 1 ? 2 : 3));
  }

  function extent(values, pad) {
    let lo = Math.min(...values), hi = Math.max(...values);
    if (!isFinite(lo)) return [0, 1];
    if (lo === hi) { lo -= Math.abs(lo) * 0.1 || 0.5; hi += Math.abs(hi) * 0.1 || 0.5; }
    const p = (hi - lo) * pad;
    return [lo - p, hi + p];
  }

  /* Whether a log y axis reads better: every value positive and spanning more than 20x. */
  function wantsLog(values) {
    if (!values.length) return false;
    const lo = Math.min(...values), hi = Math.max(...values);
    return lo > 0 && hi / lo > 20;
  }

  /*
   * Draw `series` ([{name, color, points: [{x, y, group, label}], line, dots}]) into `svg`.
   * A point whose `group` differs from the previous one starts a new segment (a new round).
   * opts: {xLabel, yLabel, logY, xTicks: "rounds" | "auto", marks: [{x, label}], empty}
   */
  function line(svg, series, opts) {
    opts = opts || {};
    const W = Math.max(320, Math.round(svg.getBoundingClientRect().width) || 640);
    svg.replaceChildren();
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const all = series.flatMap((s) => s.points);
    svg.dataset.points = String(series.filter((s) => s.counted !== false).reduce((n, s) => n + s.points.length, 0));
    const pw = W - M.left - M.right, ph = H - M.top - M.bottom;
    if (!all.length) {
      svg.appendChild(el("text", { x: W / 2, y: H / 2, class: "chart-empty", "text-anchor": "middle" },
        opts.empty || "no data yet"));
      return;
    }
    const ty = opts.logY ? (y) => Math.log10(y) : (y) => y;
    const usable = opts.logY ? all.filter((p) => p.y > 0) : all;
    let [x0, x1] = extent(all.map((p) => p.x), 0.02);
    if (opts.xTicks === "rounds" && opts.roundsPad) {
      // Points sit on whole rounds: half a round of room either side.
      x0 = Math.min(...all.map((p) => p.x)) - 0.5;
      x1 = Math.max(...all.map((p) => p.x)) + 0.5;
    } else if (opts.xTicks === "rounds") {
      // Round r spans (r - 1, r]: show whole rounds.
      x0 = Math.max(0, Math.ceil(Math.min(...all.map((p) => p.x))) - 1);
      x1 = Math.max(x0 + 1, Math.ceil(Math.max(...all.map((p) => p.x))));
    }
    const [y0, y1] = extent(usable.map((p) => ty(p.y)), 0.08);
    const sx = (x) => M.left + ((x - x0) / (x1 - x0)) * pw;
    const sy = (y) => M.top + ph - ((ty(y) - y0) / (y1 - y0)) * ph;

    const grid = el("g", { class: "chart-grid" });
    for (const t of opts.logY ? logTicks(y0, y1) : ticks(y0, y1, 5)) {
      const y = M.top + ph - ((t - y0) / (y1 - y0)) * ph;
      grid.appendChild(el("line", { x1: M.left, x2: M.left + pw, y1: y, y2: y }));
      grid.appendChild(el("text", { x: M.left - 8, y: y + 4, "text-anchor": "end" }, fmt(opts.logY ? 10 ** t : t)));
    }
    let xt;
    if (opts.xTicks === "rounds") {
      const every = Math.max(1, Math.ceil((x1 - x0) / Math.max(2, Math.floor(pw / 32))));
      xt = [];
      for (let r = Math.ceil(x0); r <= x1; r++) if (r % every === 0 || every === 1) xt.push(r);
      for (const r of xt) grid.appendChild(el("line", { class: "chart-vgrid", x1: sx(r), x2: sx(r), y1: M.top, y2: M.top + ph }));
    } else {
      xt = ticks(x0, x1, Math.max(3, Math.floor(pw / 90)));
    }
    for (const t of xt) {
      grid.appendChild(el("text", { x: sx(t), y: M.top + ph + 18, "text-anchor": "middle" }, fmt(t)));
    }
    grid.appendChild(el("line", { class: "chart-axis", x1: M.left, x2: M.left + pw, y1: M.top + ph, y2: M.top + ph }));
    svg.appendChild(grid);

    const marks = el("g", { class: "chart-marks" });
    let lastLabel = -Infinity;
    for (const m of opts.marks || []) {
      if (m.x < x0 || m.x > x1) continue;
      marks.appendChild(el("line", { x1: sx(m.x), x2: sx(m.x), y1: M.top, y2: M.top + ph }));
      if (sx(m.x) - lastLabel >= 28) {
        marks.appendChild(el("text", { x: sx(m.x) + 3, y: M.top + 10 }, m.label));
        lastLabel = sx(m.x);
      }
    }
    svg.appendChild(marks);

    if (opts.xLabel) {
      svg.appendChild(el("text", { class: "chart-label", x: M.left + pw / 2, y: H - 4, "text-anchor": "middle" },
        opts.xLabel));
    }
    if (opts.yLabel) {
      svg.appendChild(el("text", { class: "chart-label", x: 14, y: M.top + ph / 2, "text-anchor": "middle",
        transform: `rotate(-90 14 ${M.top + ph / 2})` }, opts.yLabel + (opts.logY ? " (log)" : "")));
    }

    series.forEach((s, i) => {
      const color = s.color || PALETTE[i % PALETTE.length];
      const g = el("g", { class: "chart-series", "data-name": s.name });
      const points = opts.logY ? s.points.filter((p) => p.y > 0) : s.points;
      if (s.line !== false) {
        let d = "", prev;
        for (const p of points) {
          d += `${prev === undefined || p.group !== prev ? "M" : "L"}${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`;
          prev = p.group;
        }
        g.appendChild(el("path", { d, stroke: color, fill: "none", "stroke-width": s.width || 1.75,
          "stroke-linejoin": "round", "stroke-linecap": "round", "stroke-dasharray": s.dash || "none" }));
      }
      if (s.dots || points.length === 1) {
        for (const p of points) {
          const dot = el("circle", { cx: sx(p.x), cy: sy(p.y), r: s.radius || 3.5, fill: color,
            stroke: "#fff", "stroke-width": 1.5 });
          dot.appendChild(el("title", {}, `${p.label || s.name}: ${fmt(p.y)}`));
          g.appendChild(dot);
        }
      }
      svg.appendChild(g);
    });
  }

  /* A legend of colour swatches: [{name, color, dot}]. */
  function legend(container, items) {
    container.replaceChildren();
    items.forEach((item, i) => {
      const entry = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = item.color || PALETTE[i % PALETTE.length];
      if (item.dot) swatch.className = "dot";
      entry.append(swatch, document.createTextNode(item.name));
      container.appendChild(entry);
    });
  }

  return { line, legend, fmt, wantsLog, PALETTE };
})();
