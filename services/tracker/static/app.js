/* Apiary dashboard: a jobs list and a live job page, fed by the tracker's API and its event streams. */
"use strict";

const API = "/api/v1";
const TERMINAL = ["completed", "failed", "cancelled", "rejected"];
const app = document.getElementById("app");
let page = null; // the page shown now: {stop()}
let me = null; // the token's name and role (GET /api/v1/token): the pages offer only what it may do

/* ---------- small DOM helpers (text always goes through textContent: names come from users) ---------- */

function h(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

const badge = (state) => h("span", { class: `badge s-${state}` }, state);
const num = (v, digits) => (typeof v === "number" ? Charts.fmt(+v.toFixed(digits ?? 4)) : "—");

/* Labels as text in natural order: numbers by value ("10" after "9"), then the others alphabetically. */
function labelOrder(a, b) {
  const x = Number(a), y = Number(b);
  const xn = a.trim() !== "" && !Number.isNaN(x), yn = b.trim() !== "" && !Number.isNaN(y);
  if (xn && yn) return x - y;
  if (xn !== yn) return xn ? -1 : 1;
  return a < b ? -1 : a > b ? 1 : 0;
}

function ago(seconds) {
  if (seconds < 1) return "just now";
  if (seconds < 60) return `${Math.round(seconds)} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
  return `${Math.round(seconds / 86400)} d ago`;
}

function duration(seconds) {
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 1 : 0)} s`;
  const m = Math.floor(seconds / 60), s = Math.round(seconds % 60);
  return m < 60 ? `${m} min ${s} s` : `${Math.floor(m / 60)} h ${m % 60} min`;
}

function bytes(n) {
  const gib = n / 2 ** 30;
  return gib >= 1 ? `${gib.toFixed(1)} GiB` : `${(n / 2 ** 20).toFixed(0)} MiB`;
}

function bar(fraction, cls) {
  const pct = Math.max(0, Math.min(1, fraction || 0)) * 100;
  return h("span", { class: `bar ${cls || ""}` }, h("i", { style: `width:${pct.toFixed(1)}%` }));
}

function roundText(job) {
  return `${job.round || 0} / ${job.num_rounds ?? "?"}`;
}

function roundFraction(job) {
  if (!job.num_rounds) return 0;
  if (job.status === "completed") return 1;
  const p = job.progress;
  const within = p && p.total ? p.reported / p.total : 0;
  return Math.max(0, (job.round - 1 + within) / job.num_rounds);
}

/* ---------- live connection ---------- */

function setLive(state, text) {
  const live = document.getElementById("live");
  live.dataset.state = state;
  live.querySelector("span").textContent = text;
}

/* ---------- the API token: asked for once, kept for the session (sessionStorage) ---------- */

const TOKEN_KEY = "apiary-token";
const token = () => sessionStorage.getItem(TOKEN_KEY) || "";

/* `apiary run` prints the dashboard's address with its token (?token=): keep it, and take it out of the bar. */
function takeTokenFromAddress() {
  const params = new URLSearchParams(location.search);
  if (!params.get("token")) return;
  sessionStorage.setItem(TOKEN_KEY, params.get("token"));
  params.delete("token");
  const rest = params.toString();
  history.replaceState(null, "", location.pathname + (rest ? `?${rest}` : "") + location.hash);
}

/* fetch with the token; a 401 asks for another. */
async function api(url, options) {
  const headers = { ...((options || {}).headers || {}), Authorization: `Bearer ${token()}` };
  const response = await fetch(url, { ...(options || {}), headers });
  if (response.status === 401) {
    const body = await response.clone().json().catch(() => ({}));
    askToken(body.detail || "the API refused the token");
  }
  return response;
}

/* EventSource cannot send headers: the live streams take the token in the query. */
const withToken = (url) => `${url}${url.includes("?") ? "&" : "?"}token=${encodeURIComponent(token())}`;

function askToken(reason) {
  if (page) page.stop();
  page = { stop: () => {} };
  sessionStorage.removeItem(TOKEN_KEY);
  setLive("down", "no token");
  const input = h("input", { id: "token-input", type: "password", autocomplete: "off", size: 48,
    placeholder: "apiary_…" });
  const form = h("form", { id: "token-form", onsubmit: (e) => {
    e.preventDefault();
    if (input.value.trim()) { sessionStorage.setItem(TOKEN_KEY, input.value.trim()); route(); }
  } }, h("label", { for: "token-input" }, "API token "), input, " ", h("button", { type: "submit" }, "Open"));
  app.replaceChildren(h("section", { class: "card" }, h("h2", {}, "This dashboard needs an API token"),
    reason ? h("p", { class: "empty" }, reason) : null,
    h("p", { class: "empty" }, "Make one with `apiary token create --name NAME --role viewer`; it is kept for "
      + "this browser tab only."), form));
  input.focus();
}

/* An EventSource with named-event handlers; the browser reconnects on its own after errors. */
function subscribe(url, handlers) {
  const source = new EventSource(withToken(url));
  source.onopen = () => setLive("live", "live");
  source.onerror = () => {
    if (source.readyState !== EventSource.CLOSED) setLive("down", "reconnecting");
  };
  for (const [name, fn] of Object.entries(handlers)) {
    source.addEventListener(name, (e) => fn(JSON.parse(e.data)));
  }
  return source;
}

/* Re-render at most once per frame however many events arrive. */
function scheduler(render) {
  let queued = false;
  return () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => { queued = false; render(); });
  };
}

/* The sample-weighted validation loss of each aggregated round (x = round), where the workers reported one. */
function valLossPoints(job) {
  if (!job) return [];
  return job.rounds.filter((r) => r.status === "aggregated" && typeof r.metrics.val_loss === "number")
    .map((r) => ({ x: r.round, y: r.metrics.val_loss }));
}

/* Each metric of the rounds' evaluations of the global model on a worker (fl_evaluate_model), by name:
   points x = round. */
function evaluationSeries(job) {
  const series = new Map();
  for (const r of (job ? job.rounds : [])) {
    for (const [name, value] of Object.entries(r.evaluation || {})) {
      if (typeof value !== "number") continue;
      if (!series.has(name)) series.set(name, []);
      series.get(name).push({ x: r.round, y: value });
    }
  }
  return series;
}

/* The evaluation metrics drawn beside the aggregated training loss: losses, on the loss chart's scale. */
function evaluationLosses(job) {
  return [...evaluationSeries(job)].filter(([name]) => name.endsWith("loss"));
}

/* The other evaluation metrics drawn on their own chart: scores between 0 and 1 (accuracy, F1, ...). */
function evaluationScores(job) {
  return [...evaluationSeries(job)].filter(([name, points]) =>
    !name.endsWith("loss") && points.every((p) => p.y >= 0 && p.y <= 1));
}

const EVALUATION_COLORS = ["#1a9e5b", "#b5367a", "#7a5af8", "#d9480f"];

function evaluationText(r) {
  if (r.evaluation_error) return r.evaluation_error;
  const text = Object.entries(r.evaluation || {}).map(([k, v]) => `${k} ${num(v)}`).join(" · ") || "—";
  /* A personal-layers job: the mean of each shard's personalised model, then the shards by the first score. */
  const shards = Object.entries(r.evaluation_shards || {});
  const first = Object.keys(r.evaluation || {}).find((k) => k !== "num_samples");
  if (!shards.length || !first) return text;
  const each = shards.filter(([, m]) => first in m).map(([s, m]) => `${s}: ${num(m[first])}`).join(", ");
  return `${text} (mean of ${shards.length} shards; ${first} by shard ${each})`;
}

/* ---------- workers table (both pages) ---------- */

const KIND_TITLE = { own: "the user's own machine", platform: "a platform worker" };

function workersTable(workers, receivedAt) {
  if (!workers.length) return h("p", { class: "empty" }, "No worker has announced itself yet.");
  const age = (w) => w.seconds_since_heartbeat + (Date.now() - receivedAt) / 1000;
  return h("div", { class: "scroll" }, h("table", { class: "grid", id: "workers-table" },
    h("thead", {}, h("tr", {},
      ["Worker", "Kind", "Status", "Assignment", "GPU utilisation", "GPU memory", "Throughput", "Last heartbeat"]
        .map((c) => h("th", {}, c)))),
    h("tbody", {}, workers.map((w) => {
      const state = w.status === "offline" ? "offline" : w.state || "idle";
      const a = w.assignment;
      const gpu = w.gpu;
      return h("tr", { dataset: { worker: w.worker_id } },
        h("td", {}, h("div", { class: "strong" }, w.worker_id), h("div", { class: "muted small" }, w.hostname || "")),
        h("td", { class: "kind" }, w.kind ? h("span", { class: `kind-${w.kind}`, title: KIND_TITLE[w.kind] || "" }, w.kind)
          : h("span", { class: "muted", title: "the worker declared no kind" }, "—")),
        h("td", {}, badge(state)),
        h("td", {}, a ? h("a", { href: `#/jobs/${encodeURIComponent(a.job_id)}` },
          `${a.job_id} · round ${a.round ?? "?"} · shard ${a.shard ?? "?"}`) : h("span", { class: "muted" }, "—")),
        h("td", {}, gpu && typeof gpu.utilization === "number"
          ? h("div", { class: "gpu" }, bar(gpu.utilization / 100, "b-gpu"),
            h("span", { class: "num" }, `${gpu.utilization.toFixed(0)} %`))
          : h("span", { class: "muted", title: "no GPU on this worker" }, "no GPU")),
        h("td", { class: "num" }, gpu && gpu.memory_total
          ? [bar(gpu.memory_used / gpu.memory_total, "b-mem"), ` ${bytes(gpu.memory_used)} / ${bytes(gpu.memory_total)}`,
            typeof gpu.process_memory_used === "number"
              ? h("div", { class: "muted small", title: "held by this worker's training process" },
                `this worker: ${bytes(gpu.process_memory_used)}`) : null]
          : h("span", { class: "muted" }, "—")),
        h("td", { class: "num" }, typeof w.samples_per_s === "number"
          ? `${w.samples_per_s.toFixed(w.samples_per_s < 100 ? 1 : 0)} samples/s` : h("span", { class: "muted" }, "—")),
        h("td", { class: "muted", dataset: { age: age(w) } }, ago(age(w))));
    }))));
}

/* ---------- jobs list ---------- */

function jobsPage() {
  let jobs = null, workers = [], workersAt = Date.now();
  // The heads stay (a focused "New training job" keeps its focus); render() refreshes the counts and tables.
  const count = h("span", { class: "muted push" }), list = h("div", {});
  const online = h("span", { class: "muted" }), workersPart = h("div", {});
  document.title = "Apiary";
  app.replaceChildren(
    h("section", { class: "card" },
      h("div", { class: "card-head" }, h("h1", {}, "Training jobs"), count,
        me && me.may_submit ? h("a", { class: "button primary", id: "new-job", href: "#/jobs/new" }, "New training job") : null),
      list),
    h("section", { class: "card" }, h("div", { class: "card-head" }, h("h2", {}, "Workers"), online), workersPart));
  const render = scheduler(() => {
    count.textContent = jobs ? `${jobs.length} job${jobs.length === 1 ? "" : "s"}` : "";
    list.replaceChildren(
        jobs === null ? h("p", { class: "empty" }, "Loading…")
          : !jobs.length ? h("p", { class: "empty" },
            "No jobs yet. Run one with ", h("code", {}, "apiary run job.yaml"), " or submit it with ",
            h("code", {}, "POST /api/v1/training-jobs"), ".")
            : h("div", { class: "scroll" }, h("table", { class: "grid", id: "jobs-table" },
              h("thead", {}, h("tr", {}, ["Job", "Status", "Round", "Aggregated loss", "Started", "Updated"]
                .map((c) => h("th", {}, c)))),
              h("tbody", {}, jobs.map((j) => {
                const loss = j.last_round_metrics.loss;
                const now = Date.now() / 1000;
                return h("tr", { class: "link", dataset: { job: j.job_id },
                  onclick: () => { location.hash = `#/jobs/${encodeURIComponent(j.job_id)}`; } },
                h("td", {}, h("a", { class: "strong", href: `#/jobs/${encodeURIComponent(j.job_id)}` },
                  j.name || j.job_id), h("div", { class: "muted small mono" }, j.job_id)),
                h("td", {}, badge(j.status)),
                h("td", {}, h("div", { class: "round-cell" }, bar(roundFraction(j), `b-${j.status}`),
                  h("span", { class: "num" }, roundText(j)))),
                h("td", { class: "num" }, num(loss)),
                h("td", { class: "muted" }, ago(now - j.created_at)),
                h("td", { class: "muted" }, ago(now - j.updated_at)));
              })))));
    online.textContent = `${workers.filter((w) => w.status === "online").length} online`;
    workersPart.replaceChildren(workersTable(workers, workersAt));
  });
  const source = subscribe(`${API}/stream`, {
    jobs: (data) => { jobs = data; render(); },
    workers: (data) => { workers = data; workersAt = Date.now(); render(); },
  });
  const clock = setInterval(render, 5000);
  render();
  return { stop: () => { source.close(); clearInterval(clock); } };
}

/* ---------- one job ---------- */

function jobPage(jobId) {
  const state = { job: null, workers: [], workersAt: Date.now(), curves: new Map(), rounds: [], marks: [],
                  missing: false, ended: false, axis: "rounds", logY: null };
  const url = `${API}/training-jobs/${encodeURIComponent(jobId)}`;

  // The page skeleton stays; render() only refreshes its parts, so charts do not flicker.
  const parts = {
    title: h("h1", {}), id: h("div", { class: "muted mono small" }, jobId), status: h("span", {}),
    strategy: h("div", { class: "muted small", id: "strategy" }),
    privacy: h("div", { class: "muted small", id: "privacy" }),
    shardState: h("div", { class: "muted small", id: "shard-state" }),
    code: h("div", { class: "muted small mono", id: "code" }),
    actions: h("div", { class: "actions" }), banner: h("div", {}),
    round: h("div", { class: "stat-value", id: "round-counter" }, "–"), roundBar: h("div", {}),
    roundSub: h("div", { class: "stat-sub" }), reported: h("div", { class: "stat-value" }, "–"),
    reportedSub: h("div", { class: "stat-sub" }), loss: h("div", { class: "stat-value" }, "–"),
    lossSub: h("div", { class: "stat-sub" }), elapsed: h("div", { class: "stat-value" }, "–"),
    elapsedSub: h("div", { class: "stat-sub" }),
    workerChart: document.createElementNS("http://www.w3.org/2000/svg", "svg"),
    workerLegend: h("div", { class: "legend" }), roundLegend: h("div", { class: "legend" }),
    controls: h("div", { class: "controls" }),
    roundChart: document.createElementNS("http://www.w3.org/2000/svg", "svg"),
    evaluationChart: document.createElementNS("http://www.w3.org/2000/svg", "svg"),
    evaluationLegend: h("div", { class: "legend" }),
    progress: h("div", {}), progressHead: h("span", { class: "muted" }), workers: h("div", {}),
    rounds: h("div", {}), final: h("div", {}),
    data: h("div", {}), dataHead: h("span", { class: "muted small", id: "split" }),
    roundLabel: h("div", { class: "stat-label" }, "Round"),
    // Mode async (FedBuff): versions, staleness per update and each worker's update rate; hidden otherwise.
    asyncCard: h("section", { class: "card", id: "async-versions", hidden: true }),
  };
  parts.workerChart.id = "worker-loss-chart";
  parts.roundChart.id = "round-loss-chart";
  parts.workerChart.classList.add("chart");
  parts.roundChart.classList.add("chart");
  parts.evaluationChart.id = "evaluation-chart";
  parts.evaluationChart.classList.add("chart");

  const stat = (label, value, sub, extra) => h("div", { class: "stat" }, h("div", { class: "stat-label" }, label),
    value, extra, sub);
  app.replaceChildren(
    h("a", { class: "back", href: "#/" }, "← All jobs"),
    h("section", { class: "job-head" },
      h("div", {}, h("div", { class: "title-row" }, parts.title, parts.status), parts.id, parts.strategy, parts.privacy, parts.shardState, parts.code),
      parts.actions),
    parts.banner,
    h("section", { class: "stats" },
      h("div", { class: "stat" }, parts.roundLabel, parts.round, parts.roundBar, parts.roundSub),
      stat("Reported this round", parts.reported, parts.reportedSub),
      stat("Aggregated loss", parts.loss, parts.lossSub),
      stat("Elapsed", parts.elapsed, parts.elapsedSub)),
    parts.asyncCard,
    h("section", { class: "charts" },
      h("div", { class: "card" }, h("div", { class: "card-head" }, h("h2", {}, "Loss per worker"), parts.controls),
        parts.workerChart, parts.workerLegend),
      h("div", { class: "card" }, h("div", { class: "card-head" }, h("h2", {}, "Aggregated loss per round"),
        h("span", { class: "muted small" }, "sample-weighted over workers")), parts.roundChart,
        parts.roundLegend)),
    h("section", { class: "card" }, h("div", { class: "card-head" }, h("h2", {}, "Workers in this round"),
      parts.progressHead), parts.progress),
    h("section", { class: "card" }, h("div", { class: "card-head" }, h("h2", {}, "Workers")), parts.workers),
    h("section", { class: "card" }, h("div", { class: "card-head" }, h("h2", {}, "Evaluation per round"),
      h("span", { class: "muted small" }, "the global model, on a worker")), parts.evaluationChart,
      parts.evaluationLegend),
    h("section", { class: "card" }, h("div", { class: "card-head" }, h("h2", {}, "Rounds")), parts.rounds),
    h("section", { class: "card" }, h("div", { class: "card-head" }, h("h2", {}, "Data per shard"),
      parts.dataHead), parts.data),
    parts.final);

  async function cancel(button) {
    if (!confirm(`Cancel job ${state.job ? state.job.name || jobId : jobId}? No further round starts; the job ends cancelled.`)) return;
    button.disabled = true;
    button.textContent = "Cancelling…";
    const response = await api(`${url}/cancel`, { method: "POST" });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      button.textContent = "Cancel";
      button.disabled = false;
      alert(body.detail || `cancel failed (${response.status})`);
    }
  }

  /* The job's code bundle, as `apiary status` prints it: code 3f2a9c0d1e4b (12.3 kB), entrypoint pkg.train:fit. */
  function codeText(code) {
    const n = code.size;
    const size = typeof n !== "number" ? "" : n < 1000 ? ` (${n} B)`
      : n < 1e6 ? ` (${(n / 1000).toFixed(1)} kB)` : ` (${(n / 1e6).toFixed(1)} MB)`;
    return `code ${(code.sha256 || "?").slice(0, 12)}${size}, entrypoint ${code.entrypoint || "?"}`;
  }

  /* What the job keeps with its shards, as `apiary status` prints it: shard state: 3 shards, 80.0 kB each
     (240.0 kB in all); server state 59.3 kB a round to each worker. Empty for a job that keeps none. */
  function shardStateText(kept) {
    if (!kept) return "";
    const size = (n) => n < 1000 ? `${n} B` : n < 1e6 ? `${(n / 1000).toFixed(1)} kB` : `${(n / 1e6).toFixed(1)} MB`;
    const sizes = Object.values(kept.bytes_per_shard || {});
    const out = [];
    if (sizes.length) {
      const lo = Math.min(...sizes), hi = Math.max(...sizes);
      out.push(`${sizes.length} shards, ${lo === hi ? size(lo) : `${size(lo)} to ${size(hi)}`} each (${size(kept.total_bytes || 0)} in all)`);
    }
    if (kept.server_state_bytes != null) out.push(`server state ${size(kept.server_state_bytes)} a round to each worker`);
    return `shard state: ${out.join("; ")}`;
  }

  /* The job's strategy and its parameters, as `apiary status` prints them: fedadam (eta=0.1, tau=0.001). */
  function strategyText(job) {
    const params = Object.entries(job.strategy_params || {}).map(([k, v]) => `${k}=${v}`).join(", ");
    return params ? `${job.strategy} (${params})` : job.strategy;
  }

  /* What differential privacy has spent, as `apiary status` prints it, from the last aggregated round's metrics
     (its numbers as Python's `:.4g` and `:g` write them). */
  function privacyText(job) {
    const last = job.rounds.slice().reverse().find((r) => r.status === "aggregated" && "dp_clipping_norm" in r.metrics);
    if (!last) return "";
    const m = last.metrics;
    const g4 = (x) => String(Number(x.toPrecision(4)));
    const g = (x) => (x < 1e-4 ? x.toExponential().replace(/e-(\d)$/, "e-0$1") : String(x));
    const spent = typeof m.dp_epsilon === "number" ? `ε ${g4(m.dp_epsilon)} at δ ${g(m.dp_delta)}` : "ε unbounded (no noise)";
    return `differential privacy: ${spent} after round ${last.round}, clipping norm ${g4(m.dp_clipping_norm)}`;
  }

  function renderHead(job) {
    document.title = `${job.name || job.job_id} · Apiary`;
    parts.title.textContent = job.name || job.job_id;
    parts.status.replaceChildren(badge(job.status));
    parts.strategy.textContent = job.strategy ? `strategy ${strategyText(job)}` : "";
    parts.privacy.textContent = privacyText(job);
    parts.shardState.textContent = shardStateText(job.shard_state);
    parts.code.textContent = job.code ? codeText(job.code) : "";
    // Redrawn only when they change, so a focused button keeps its focus.
    const mayChange = Boolean(me && me.may_submit), ended = TERMINAL.includes(job.status);
    if (parts.actions.dataset.ended !== String(ended)) {
      parts.actions.dataset.ended = String(ended);
      parts.actions.replaceChildren(
        mayChange ? h("a", { class: "button", id: "run-again", href: `#/jobs/new?from=${encodeURIComponent(jobId)}` }, "Run again") : "",
        ended || !mayChange ? "" :
          h("button", { class: "danger", id: "cancel", onclick: (e) => cancel(e.currentTarget) }, "Cancel job"));
    }
    const banner = [];
    if (job.reason) {
      banner.push(h("div", { class: `banner ${job.status === "completed" ? "warn" : job.status === "cancelled" ? "info" : "error"}` },
        h("strong", {}, job.status === "completed" ? "Note: " : job.status === "cancelled" ? "Cancelled: " : "Failed: "),
        job.reason,
        job.errors.length ? h("ul", {}, job.errors.map((e) => h("li", {}, h("code", {}, e.field), " ", e.message))) : ""));
    }
    if (job.forged && job.forged.length) {
      // Reports that did not come from the shard's assigned worker: refused, never counted.
      banner.push(h("div", { class: "banner warn", id: "forged" },
        h("strong", {}, `${job.forged.length} forged report${job.forged.length > 1 ? "s" : ""} refused: `),
        h("ul", {}, job.forged.slice(0, 10).map((f) => h("li", {},
          h("code", {}, f.routing_key), ` round ${f.round ?? "?"} shard ${f.shard ?? "?"} as ${f.worker_id}: ${f.reason}`)))));
    }
    parts.banner.replaceChildren(...banner);
  }

  function renderStats(job) {
    parts.round.textContent = roundText(job);
    parts.round.dataset.round = String(job.round || 0);
    parts.roundBar.replaceChildren(bar(roundFraction(job), `b-${job.status} wide`));
    parts.roundSub.textContent = job.attempt > 1 ? `attempt ${job.attempt}` : job.status === "running"
      ? "in progress" : job.status;
    const p = job.progress;
    parts.reported.textContent = p.total ? `${p.reported} / ${p.total}` : "–";
    parts.reportedSub.textContent = p.total
      ? [p.training && `${p.training} training`, p.assigned && `${p.assigned} waiting`, p.failed && `${p.failed} failed`,
         p.offline && `${p.offline} offline`, p.stopped && `${p.stopped} stopped`].filter(Boolean).join(" · ")
        || "all reported" : "no round started yet";
    const aggregated = state.rounds;
    const last = aggregated[aggregated.length - 1];
    const before = aggregated[aggregated.length - 2];
    parts.loss.textContent = num(last?.y);
    if (last && before) {
      const delta = last.y - before.y;
      parts.lossSub.textContent = `after round ${last.x} · ${delta <= 0 ? "▼" : "▲"} ${num(Math.abs(delta))} from round ${before.x}`;
      parts.lossSub.className = `stat-sub ${delta <= 0 ? "good" : "bad"}`;
    } else {
      parts.lossSub.textContent = last ? `after round ${last.x}`
        : TERMINAL.includes(job.status) ? "no round aggregated" : "after the first round";
      parts.lossSub.className = "stat-sub";
    }
    const end = TERMINAL.includes(job.status) ? job.updated_at : Date.now() / 1000;
    parts.elapsed.textContent = duration(Math.max(0, end - job.created_at));
    parts.elapsedSub.textContent = `started ${new Date(job.created_at * 1000).toLocaleTimeString()}`;
  }

  /* An async job: its versions are its rounds; how stale the folded updates were (a histogram) and how often
     each worker contributes (fast workers never wait for slow ones, so their rates differ). */
  function renderAsync(job) {
    const a = job.asynchronous;
    parts.roundLabel.textContent = a ? "Version" : "Round";
    parts.asyncCard.hidden = !a;
    if (!a) return;
    const most = Math.max(1, ...a.staleness_histogram.map((s) => s.count));
    const fastest = Math.max(1e-9, ...a.workers.map((w) => w.per_minute));
    parts.asyncCard.replaceChildren(
      h("div", { class: "card-head" }, h("h2", {}, "Asynchronous versions"),
        h("span", { class: "muted small" }, `K=${a.buffer_size} updates a version · ${a.concurrency} training at once`
          + ` · staleness weight ${a.staleness_weight}${a.max_staleness != null ? ` · max ${a.max_staleness}` : ""}`)),
      h("p", { class: "muted small" }, `${a.versions} versions from ${a.updates} updates`),
      h("div", { class: "charts" },
        h("div", {}, h("h3", {}, "Staleness per update"),
          a.staleness_histogram.length ? h("table", { class: "grid", id: "staleness-histogram" },
            h("thead", {}, h("tr", {}, ["Staleness", "Updates", ""].map((c) => h("th", {}, c)))),
            h("tbody", {}, a.staleness_histogram.map((s) => h("tr", { dataset: { staleness: s.staleness } },
              h("td", { class: "num" }, s.staleness), h("td", { class: "num" }, s.count),
              h("td", {}, bar(s.count / most, "b-completed wide"))))))
            : h("p", { class: "empty" }, "No update folded yet.")),
        h("div", {}, h("h3", {}, "Updates per worker"),
          a.workers.length ? h("table", { class: "grid", id: "update-rates" },
            h("thead", {}, h("tr", {}, ["Worker", "Updates", "Per minute", "Mean staleness", ""].map((c) => h("th", {}, c)))),
            h("tbody", {}, a.workers.map((w) => h("tr", { dataset: { worker: w.worker_id } },
              h("td", { class: "mono" }, w.worker_id), h("td", { class: "num" }, w.updates),
              h("td", { class: "num" }, num(w.per_minute)), h("td", { class: "num" }, num(w.mean_staleness)),
              h("td", {}, bar(w.per_minute / fastest, "b-running wide"))))))
            : h("p", { class: "empty" }, "No update folded yet."))));
  }

  function renderProgress(job) {
    parts.progressHead.textContent = job.round ? `round ${job.round}${job.attempt > 1 ? ` (attempt ${job.attempt})` : ""}` : "";
    if (!job.shards.length) {
      parts.progress.replaceChildren(h("p", { class: "empty" },
        TERMINAL.includes(job.status) ? "No round ran." : "Waiting for the first round to start…"));
      return;
    }
    parts.progress.replaceChildren(h("table", { class: "grid", id: "progress-table" },
      h("thead", {}, h("tr", {}, ["Shard", "Worker", "State", "Step", "Loss", "Other metrics", "Updated"]
        .map((c) => h("th", {}, c)))),
      h("tbody", {}, job.shards.map((s) => {
        const others = Object.entries(s.metrics).filter(([k]) => k !== "loss")
          .map(([k, v]) => `${k} ${num(v)}`).join(" · ");
        return h("tr", { dataset: { shard: s.shard, state: s.state } },
          h("td", { class: "num" }, `#${s.shard}`),
          h("td", {}, s.worker_id || h("span", { class: "muted" }, "not picked up")),
          h("td", {}, badge(s.state)),
          h("td", { class: "num" }, s.step ?? "—"),
          h("td", { class: "num" }, num(s.metrics.loss)),
          h("td", { class: s.error ? "error-text" : "muted" }, s.error || others || "—"),
          h("td", { class: "muted" }, ago(Date.now() / 1000 - s.updated_at)));
      }))));
  }

  /* What secure aggregation did in a round, as `apiary status` prints it (its "secure aggregation" column). */
  function secureText(s) {
    if (!s) return "—";
    const listed = (shards) => (shards && shards.length ? shards.join(",") : "none");
    const parts = [s.stage, `threshold ${s.threshold} of ${s.num_shares}`, `participants ${listed(s.participants)}`];
    if (s.survivors && s.survivors.length) parts.push(`masked ${listed(s.survivors)}`);
    if (s.dropped && s.dropped.length) {
      parts.push(`dropped ${listed(s.dropped)}${s.stage === "unmasked" ? " (recovered from shares)" : ""}`);
    }
    if (s.signers && s.signers.length) parts.push(`signed ${listed(s.signers)}`);
    if (s.revealed && s.revealed.length) parts.push(`shares from ${listed(s.revealed)}`);
    return parts.join("; ");
  }

  function renderRounds(job) {
    if (!job.rounds.length) { parts.rounds.replaceChildren(h("p", { class: "empty" }, "No round yet.")); return; }
    const secure = job.rounds.some((r) => r.secure_aggregation);
    const columns = ["Round", "Status", "Loss", "Val loss", "Other metrics", "Evaluation", "Duration"];
    parts.rounds.replaceChildren(h("table", { class: "grid" },
      h("thead", {}, h("tr", {}, columns.concat(secure ? ["Secure aggregation"] : [])
        .map((c) => h("th", {}, c)))),
      h("tbody", {}, job.rounds.slice().reverse().map((r) => h("tr", {},
        h("td", { class: "num" }, `${r.round}${r.attempt > 1 ? ` (attempt ${r.attempt})` : ""}`),
        h("td", {}, badge(r.status)),
        h("td", { class: "num" }, num(r.metrics.loss)),
        h("td", { class: "num val-loss" }, num(r.metrics.val_loss)),
        h("td", { class: r.reason ? "error-text" : "muted" }, r.reason || Object.entries(r.metrics)
          .filter(([k]) => k !== "loss" && k !== "val_loss").map(([k, v]) => `${k} ${num(v)}`).join(" · ") || "—"),
        h("td", { class: r.evaluation_error ? "error-text evaluation" : "muted evaluation" }, evaluationText(r)),
        h("td", { class: "num muted" }, r.started_at && r.ended_at ? duration(r.ended_at - r.started_at) : "…"),
        ...(secure ? [h("td", { class: "muted secure-aggregation" }, secureText(r.secure_aggregation))] : []))))));
  }

  /* What each worker receives: one stacked bar per shard, a segment per label sized by its samples; a bar's
     length is the shard's size against the largest shard's, so quantity skew shows as well as label skew. */
  function renderData(job) {
    const split = job.split || {};
    const shown = { label_skew: ["alpha"], quantity_skew: ["alpha"], group: ["key"] }[split.strategy] || [];
    parts.dataHead.textContent = split.strategy ? `split ${split.strategy}${[...shown, "seed"]
      .filter((k) => split[k] !== undefined).map((k) => ` ${k}=${split[k]}`).join("")}` : "";
    const shards = job.data_shards || [];
    if (!shards.length) {
      parts.data.replaceChildren(h("p", { class: "empty" },
        TERMINAL.includes(job.status) ? "The dataset was not split." : "Waiting for the dataset to be split…"));
      return;
    }
    const labels = [...new Set(shards.flatMap((s) => Object.keys(s.labels || {})))].sort(labelOrder);
    const color = (label) => Charts.PALETTE[labels.indexOf(label) % Charts.PALETTE.length];
    const largest = Math.max(...shards.map((s) => s.num_samples), 1);
    parts.data.replaceChildren(h("table", { class: "grid", id: "data-table" },
      h("thead", {}, h("tr", {}, ["Shard", "Samples", "Samples per label"].map((c) => h("th", {}, c)))),
      h("tbody", {}, shards.map((s) => h("tr", { dataset: { shard: s.shard } },
        h("td", { class: "num" }, `#${s.shard}`),
        h("td", { class: "num" }, s.num_samples),
        h("td", {}, stackedBar(s, labels, color, largest)))))),
      labels.length ? h("div", { class: "legend" }, labels.map((label) =>
        h("span", {}, h("i", { class: "dot", style: `background:${color(label)}` }), `label ${label}`))) : "");
  }

  function stackedBar(shard, labels, color, largest) {
    const counts = shard.labels || {};
    const stack = h("div", { class: "stack", title: `${shard.num_samples} samples` });
    stack.style.width = `${Math.max(2, (100 * shard.num_samples) / largest)}%`;
    if (!shard.labels) { stack.append(h("span", { class: "unlabelled" })); return stack; }
    for (const label of labels.filter((l) => counts[l])) {
      const segment = h("span", { title: `label ${label}: ${counts[label]}`, dataset: { label, count: counts[label] } });
      segment.style.flexGrow = String(counts[label]);
      segment.style.background = color(label);
      stack.append(segment);
    }
    return stack;
  }

  function renderFinal(job) {
    if (job.status !== "completed") { parts.final.replaceChildren(); return; }
    parts.final.replaceChildren(h("section", { class: "card" },
      h("div", { class: "card-head" }, h("h2", {}, "Final model"),
        h("span", { class: "muted small" }, "metrics of the last round, and of the held-out evaluation where the job has one")),
      h("div", { class: "final" },
        h("code", { class: "path", id: "final-model" }, job.final_model || "—"),
        h("div", { class: "metrics" }, Object.entries(job.metrics).map(([k, v]) =>
          h("span", { class: "metric" }, h("span", { class: "muted" }, k), h("strong", {}, num(v))))))));
  }

  /* Where a point sits on a round axis: round r spans (r - 1, r], a point at step s of S at r - 1 + s / S.
     S is the most steps any worker logged in that round; the running round borrows the previous
     round's S until it reaches it, so its points do not slide as they arrive. */
  function roundPosition() {
    const most = new Map();
    for (const points of state.curves.values()) {
      for (const p of points) most.set(p.round, Math.max(most.get(p.round) || 0, p.step ?? 0));
    }
    const current = state.job && !TERMINAL.includes(state.job.status) ? state.job.round : null;
    return (p) => {
      const steps = Math.max(most.get(p.round) || 0, p.round === current ? most.get(p.round - 1) || 0 : 0);
      return p.round - 1 + (steps > 0 ? (p.step ?? 0) / steps : 1);
    };
  }

  function renderControls() {
    const values = [...state.curves.values()].flat().map((p) => p.y).concat(state.rounds.map((r) => r.y))
      .concat(valLossPoints(state.job).map((p) => p.y))
      .concat(evaluationLosses(state.job).flatMap(([, points]) => points.map((p) => p.y)));
    const logY = state.logY ?? Charts.wantsLog(values);
    const toggle = (label, active, onclick, title) =>
      h("button", { class: `toggle${active ? " on" : ""}`, onclick, title }, label);
    parts.controls.replaceChildren(
      h("div", { class: "segmented" },
        toggle("by round", state.axis === "rounds", () => { state.axis = "rounds"; render(); }, "x axis: rounds"),
        toggle("by time", state.axis === "time", () => { state.axis = "time"; render(); },
          "x axis: seconds since the job was requested")),
      toggle("log", logY, () => { state.logY = !logY; render(); }, "logarithmic y axis"));
    return logY;
  }

  function renderCharts() {
    const logY = renderControls();
    const names = [...state.curves.keys()].sort();
    const byRound = state.axis === "rounds";
    const place = byRound ? roundPosition() : (p) => p.x;
    const series = names.map((name) => ({
      name,
      points: state.curves.get(name).slice().sort((a, b) => a.seq - b.seq)
        .map((p) => ({ x: place(p), y: p.y, group: `${p.round}.${p.attempt}`,
                       label: `${name}, round ${p.round}, step ${p.step ?? "?"}` })),
    }));
    const legend = names.map((name, i) => ({ name, color: Charts.PALETTE[i % Charts.PALETTE.length] }));
    if (byRound && state.rounds.length) {
      series.push({ name: "aggregated", color: "#1b2330", width: 1.5, dash: "4 4", dots: true, radius: 3.5,
        counted: false, points: state.rounds.map((r) => ({ x: r.x, y: r.y, group: 0, label: `aggregated after round ${r.x}` })) });
      legend.push({ name: "aggregated after each round", color: "#1b2330", dot: true });
    }
    Charts.line(parts.workerChart, series, {
      xLabel: byRound ? "round" : "seconds since the job was requested", yLabel: "loss", logY,
      xTicks: byRound ? "rounds" : "auto",
      marks: byRound ? [] : state.marks.map((m) => ({ x: m.x, label: `R${m.round}${m.attempt > 1 ? `.${m.attempt}` : ""}` })),
      empty: "waiting for the workers' first loss reports…",
    });
    Charts.legend(parts.workerLegend, legend);
    const roundSeries = [{ name: "aggregated loss", color: "#e5a00d", width: 2.5, dots: true,
      points: state.rounds.map((r) => ({ x: r.x, y: r.y, group: 0, label: `round ${r.x}` })) }];
    const validation = valLossPoints(state.job);
    // Validation loss is drawn only for jobs whose workers report it (the built-in trainer does).
    if (validation.length) {
      roundSeries.push({ name: "validation loss", color: "#2f6fde", width: 2, dash: "6 3", dots: true,
        points: validation.map((p) => ({ ...p, group: 0, label: `validation, round ${p.x}` })) });
    }
    // The global model's evaluation on a worker after each evaluated round (fl_evaluate_model), beside it.
    evaluationLosses(state.job).forEach(([name, points], i) => {
      roundSeries.push({ name: `evaluation ${name}`, color: EVALUATION_COLORS[i % EVALUATION_COLORS.length],
        width: 2, dash: "2 3", dots: true, points: points.map((p) => ({ ...p, group: 0, label: `evaluation ${name}, round ${p.x}` })) });
    });
    Charts.line(parts.roundChart, roundSeries,
      { xLabel: "round", yLabel: "loss", logY, xTicks: "rounds", roundsPad: true, empty: "no round aggregated yet" });
    Charts.legend(parts.roundLegend, roundSeries.length > 1
      ? roundSeries.map((s) => ({ name: s.name, color: s.color, dot: true })) : []);
    const scores = evaluationScores(state.job).map(([name, points], i) => ({
      name: `evaluation ${name}`, color: EVALUATION_COLORS[i % EVALUATION_COLORS.length], width: 2, dots: true,
      points: points.map((p) => ({ ...p, group: 0, label: `evaluation ${name}, round ${p.x}` })) }));
    Charts.line(parts.evaluationChart, scores, { xLabel: "round", yLabel: "score", xTicks: "rounds", roundsPad: true,
      empty: "no evaluation yet (the job's fl_evaluate_model runs on a worker after each round)" });
    Charts.legend(parts.evaluationLegend, scores.map((s) => ({ name: s.name, color: s.color, dot: true })));
  }

  const render = scheduler(() => {
    if (state.missing) {
      app.replaceChildren(h("a", { class: "back", href: "#/" }, "← All jobs"),
        h("section", { class: "card" }, h("p", { class: "empty" }, `There is no job ${jobId}.`)));
      return;
    }
    const job = state.job;
    if (job) {
      renderHead(job); renderStats(job); renderAsync(job); renderProgress(job); renderRounds(job); renderData(job); renderFinal(job);
    }
    parts.workers.replaceChildren(workersTable(state.workers, state.workersAt));
    renderCharts();
  });

  let source = null;
  api(url).then((response) => {
    if (response.status === 401) return;
    if (response.status === 404) { state.missing = true; setLive("ended", "no such job"); render(); return; }
    source = subscribe(`${url}/events`, {
      job: (data) => { state.job = data; render(); },
      metrics: (data) => {
        for (const series of data.workers) {
          const points = state.curves.get(series.worker_id) || [];
          points.push(...series.points);
          state.curves.set(series.worker_id, points);
        }
        state.rounds = data.rounds;
        state.marks = data.round_marks;
        render();
      },
      workers: (data) => { state.workers = data; state.workersAt = Date.now(); render(); },
      end: () => { source.close(); state.ended = true; setLive("ended", "job ended"); },
    });
  });
  const clock = setInterval(() => { if (!state.ended) render(); }, 1000);
  render();
  return { stop: () => { if (source) source.close(); clearInterval(clock); } };
}

/* ---------- routing ---------- */

async function route() {
  if (page) page.stop();
  page = null;
  if (!token()) { askToken(""); return; }
  setLive("connecting", "connecting");
  // A token that the API refuses is asked for again before any stream opens (a stream cannot tell why).
  const who = await api(`${API}/token`);
  if (who.status === 401) return;
  me = who.ok ? await who.json() : null;
  for (const link of document.querySelectorAll(".topbar nav a")) {
    link.toggleAttribute("aria-current", link.getAttribute("href") === (location.hash || "#/").split("?")[0]);
  }
  const hash = location.hash;
  const again = hash.match(/^#\/jobs\/new\?from=(.+)$/);
  const match = hash.match(/^#\/jobs\/(.+)$/);
  if (hash === "#/jobs/new" || again) page = me && me.may_submit ? jobFormPage(again ? decodeURIComponent(again[1]) : null) : jobsPage();
  else if (hash === "#/models" || hash === "#/datasets") page = registryPage(hash.slice(2));
  else if (hash === "#/workers") page = workersPage();
  else page = match ? jobPage(decodeURIComponent(match[1])) : jobsPage();
  window.scrollTo(0, 0);
}

takeTokenFromAddress();
window.addEventListener("hashchange", route);
route();
