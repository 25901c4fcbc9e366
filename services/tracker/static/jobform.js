/* The training job form: it builds the documented request body (POST /api/v1/training-jobs) from labelled
   inputs whose accessible names carry the request's field names, and shows the server's own validation beside
   each field. Loaded before app.js; uses its helpers (h, api, API, me) when a page is drawn. */
"use strict";

const DRAFT_KEY = "apiary-job-draft";
// What the form always sends for the built-in trainer: the documented request's config keys.
const BUILT_IN_MAIN = ["epochs", "batch_size", "learning_rate", "mixed_precision", "use_peft", "lora_r", "lora_alpha"];
const CODE_MAIN = ["epochs", "batch_size", "learning_rate"];
// The built-in trainer's other keys: sent only where they differ from their default.
const BUILT_IN_MORE = ["lora_dropout", "max_seq_length", "gradient_accumulation_steps", "warmup_steps",
  "validation_split", "seed", "merge_adapter", "lora_target_modules", "eval_dataset_id"];
const LABELS = {
  epochs: "Epochs", batch_size: "Batch size", learning_rate: "Learning rate", mixed_precision: "Mixed precision",
  use_peft: "LoRA adapters only", lora_r: "LoRA rank", lora_alpha: "LoRA alpha", lora_dropout: "LoRA dropout",
  max_seq_length: "Max sequence length", gradient_accumulation_steps: "Gradient accumulation steps",
  warmup_steps: "Warm-up steps", validation_split: "Validation split", seed: "Seed", merge_adapter: "Merge adapter at the end",
  lora_target_modules: "LoRA target modules, comma-separated", eval_dataset_id: "Held-out dataset",
  enabled: "Federated over several workers", strategy: "Strategy", strategy_params: "Strategy parameters, JSON",
  num_rounds: "Rounds", steps_per_round: "Steps per round", min_workers: "Fewest workers", max_workers: "Most workers",
  aggregation_timeout: "Aggregation timeout, seconds", fault_tolerance: "Failed rounds tolerated",
  evaluate_every: "Evaluate every N rounds", metric: "Metric", mode: "Mode", patience: "Patience",
  min_delta: "Minimum improvement", keep_best: "Keep the best round's model",
};
const DISTRIBUTED_MAIN = ["enabled", "strategy", "num_rounds", "steps_per_round", "min_workers", "max_workers",
  "aggregation_timeout", "fault_tolerance"];
const STRATEGIES = ["federated_averaging", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedmedian",
  "fedtrimmedavg", "krum", "multikrum"];

/* ---------- reading inputs as request values ---------- */

/* A number input's value: "" leaves the field out, a number is sent as one, anything else as typed (the server
   says what is wrong with it). */
function numberValue(text) {
  const t = text.trim();
  if (t === "") return undefined;
  const n = Number(t);
  return Number.isFinite(n) ? n : t;
}

/* A JSON textarea's value: "" leaves it out; text that is no JSON is reported beside it before anything is sent. */
function jsonValue(text, field, problems) {
  if (!text.trim()) return undefined;
  try { return JSON.parse(text); } catch (e) {
    problems.push({ field, message: `not valid JSON (${e.message})` });
    return undefined;
  }
}

/* A worker id as the documented request writes it: digits as an integer, anything else as text. */
const workerId = (id) => (/^\d+$/.test(id) && String(Number(id)) === id ? Number(id) : id);

const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);

function sizeText(n) {
  if (typeof n !== "number") return "";
  if (n < 1000) return `${n} B`;
  if (n < 1e6) return `${(n / 1000).toFixed(1)} kB`;
  if (n < 1e9) return `${(n / 1e6).toFixed(1)} MB`;
  return `${(n / 1e9).toFixed(2)} GB`;
}

const MODEL_KINDS = { gguf: "GGUF", hf: "Hugging Face folder", safetensors: "safetensors" };
const modelKind = (m) => MODEL_KINDS[m.format] || m.format || "?";
const datasetKind = (d) => ((d.key || "").endsWith(".jsonl") ? "JSONL" : "zip of samples");

/* ---------- the form ---------- */

function jobFormPage(fromJob) {
  const state = { defaults: null, models: [], datasets: [], workers: [], code: null, stopped: false };
  const inputs = new Map(); // request field path -> input element
  const errorSlots = new Map(); // request field path -> the element its error is shown in
  const form = h("form", { id: "job-form", class: "job-form", novalidate: true, onsubmit: (e) => { e.preventDefault(); submit(); } });
  const summary = h("div", { id: "form-errors", role: "alert", class: "form-errors", tabindex: "-1" });
  const requestView = h("pre", { id: "request-json", class: "request-json", hidden: true });
  const notice = h("div", { role: "status", class: "form-notice", id: "form-notice" });

  function slot(field) {
    const el = h("div", { class: "field-error", id: `error-${field.replace(/[^\w-]/g, "-")}` });
    errorSlots.set(field, el);
    return el;
  }

  /* One labelled control; its accessible name is "Label (api_name)", and its errors appear right under it. */
  function control(field, label, input, hint) {
    const leaf = field.split(".").pop();
    const id = `f-${field.replace(/[^\w-]/g, "-")}`;
    input.id = id;
    input.dataset.field = field;
    inputs.set(field, input);
    const error = slot(field);
    const hintEl = hint ? h("div", { class: "hint", id: `${id}-hint` }, hint) : null;
    input.setAttribute("aria-describedby", [error.id, hintEl && hintEl.id].filter(Boolean).join(" "));
    if (input.type === "checkbox") {
      return h("div", { class: "field check", dataset: { for: field } },
        h("label", { for: id }, input, ` ${label} (${leaf})`), hintEl, error);
    }
    return h("div", { class: "field", dataset: { for: field } },
      h("label", { for: id }, `${label} (${leaf})`), input, hintEl, error);
  }

  const text = (attrs) => h("input", { type: "text", autocomplete: "off", ...(attrs || {}) });
  const number = (attrs) => h("input", { type: "text", inputmode: "decimal", autocomplete: "off", class: "short", ...(attrs || {}) });
  const checkbox = () => h("input", { type: "checkbox" });
  const select = (options) => h("select", {}, options.map(([value, label]) => h("option", { value }, label)));
  const defaultHint = (value) => (value === null || value === undefined ? "default: none" : `default: ${Array.isArray(value) ? value.join(", ") : value}`);

  /* ---- the parts of the form ---- */

  function build() {
    const d = state.defaults;
    const cfg = d.built_in_config, dist = d.distributed, stop = d.early_stopping, split = d.split;
    const modelOptions = [["", "— none —"], ...state.models.map((m) =>
      [String(m.model_id), `${m.name} · #${m.model_id} · ${modelKind(m)} · ${sizeText(m.size)}`])];
    const datasetOptions = [["", "— choose a dataset —"], ...state.datasets.map((x) =>
      [String(x.dataset_id), `${x.name} · #${x.dataset_id} · ${datasetKind(x)} · ${x.num_samples ?? "?"} samples · ${sizeText(x.size)}`])];
    const trainer = select([["built_in", "Built-in LLM fine-tuning (no entrypoint)"], ["code", "My own code (entrypoint)"]]);
    trainer.id = "f-trainer";
    trainer.addEventListener("change", showTrainer);
    const codeFile = h("input", { type: "file", accept: ".zip,application/zip", id: "f-code-file" });
    codeFile.addEventListener("change", () => uploadCode(codeFile));
    const codeInfo = h("div", { class: "hint", id: "code-info" });

    const configControl = (key, kind) => {
      const value = cfg[key];
      let input;
      if (kind === "bool") input = checkbox();
      else if (key === "mixed_precision") input = select([["no", "no"], ["bf16", "bf16"], ["fp16", "fp16"]]);
      else if (key === "eval_dataset_id") input = select(datasetOptions.map(([v, l]) => [v, v ? l : "— none —"]));
      else if (key === "lora_target_modules") input = text();
      else input = number();
      setValue(input, value);
      return control(`config.${key}`, LABELS[key], input, defaultHint(value));
    };
    const kindOf = (key) => (typeof cfg[key] === "boolean" ? "bool" : "value");
    const distControl = (key) => {
      let input;
      if (key === "enabled") input = checkbox();
      else if (key === "strategy") input = text({ list: "strategies" });
      else input = number();
      setValue(input, dist[key]);
      return control(`distributed.${key}`, LABELS[key], input, defaultHint(dist[key]));
    };
    const stopControl = (key) => {
      const input = key === "keep_best" ? checkbox() : key === "mode" ? select([["min", "min"], ["max", "max"]])
        : key === "metric" ? text() : number();
      setValue(input, stop[key]);
      return control(`distributed.early_stopping.${key}`, LABELS[key], input, defaultHint(stop[key]));
    };
    const stopping = checkbox();
    const stoppingFields = h("div", { class: "grid-fields", id: "early-stopping-fields" },
      ["metric", "mode", "patience", "min_delta", "keep_best"].map(stopControl));
    stopping.addEventListener("change", () => { stoppingFields.hidden = !stopping.checked; });
    stoppingFields.hidden = true;
    const mode = select([["pool", "pool: any worker"], ["pinned", "pinned: shard i on worker i"],
      ["mixed", "mixed: own and platform workers"]]);
    mode.addEventListener("change", showMode);

    const advanced = h("details", { class: "advanced", id: "advanced" },
      h("summary", {}, "Advanced: distributed settings and worker selection (distributed, worker_selection)"),
      h("fieldset", {}, h("legend", {}, "Rounds and workers (distributed)"), slot("distributed"),
        h("div", { class: "grid-fields" }, DISTRIBUTED_MAIN.map(distControl),
          control("distributed.strategy_params", LABELS.strategy_params, h("textarea", { rows: 2, placeholder: '{"eta": 0.01}' }),
            "the strategy's parameters, e.g. {\"proximal_mu\": 0.1}"),
          distControl("evaluate_every"),
          control("distributed.personal_layers", "Personal layers, comma-separated globs", text({ placeholder: "fc.*" }),
            "tensors that stay with each shard, never aggregated (FedPer); default: none")),
        h("datalist", { id: "strategies" }, STRATEGIES.map((s) => h("option", { value: s })))),
      h("fieldset", {}, h("legend", {}, "Early stopping (distributed.early_stopping)"), slot("distributed.early_stopping"),
        control("distributed.early_stopping", "Stop when the metric stops improving", stopping, "off by default"),
        stoppingFields),
      h("fieldset", { id: "worker-selection" }, h("legend", {}, "Worker selection (worker_selection)"), slot("worker_selection"),
        control("worker_selection.mode", "Which workers train", mode, "default: pool"),
        h("div", { id: "pinned-fields" }, control("worker_selection.workers", "Pinned workers, comma-separated", text(),
          "one worker id per shard, in order")),
        h("div", { id: "mixed-fields", class: "grid-fields" },
          workerPicker("worker_selection.worker_ids", "Own workers", "own"),
          workerPicker("worker_selection.parsyn_worker_ids", "Platform workers", "platform"))),
      h("fieldset", {}, h("legend", {}, "How the dataset is split (split)"), slot("split"),
        h("div", { class: "grid-fields" },
          control("split.strategy", "Split", select(["random", "label_skew", "quantity_skew", "group"].map((s) => [s, s])), "default: random"),
          control("split.seed", "Seed", number({ value: String(split.seed) }), defaultHint(split.seed)),
          control("split.alpha", "Dirichlet alpha", number({ value: String(split.alpha) }), "for label_skew and quantity_skew"),
          control("split.key", "Group key", text({ value: split.key }), "for group"))));

    const moreBuiltIn = h("details", { class: "more", id: "more-config" },
      h("summary", {}, "More trainer settings (config)"),
      h("div", { class: "grid-fields" }, BUILT_IN_MORE.map((k) => configControl(k, kindOf(k)))));

    form.replaceChildren(
      summary,
      h("fieldset", {}, h("legend", {}, "Job"),
        control("name", "Job name", text({ required: true, maxlength: 200 })),
        h("div", { class: "field" }, h("label", { for: "f-trainer" }, "What trains (entrypoint, or none for the built-in trainer)"), trainer),
        h("div", { id: "code-fields" },
          control("entrypoint", "Entrypoint", text({ placeholder: "package.module:fl_train_model" }), "module:function of your code"),
          h("div", { class: "field" }, h("label", { for: "f-code-file" }, "Code bundle, a zip of your folder (code)"), codeFile,
            codeInfo, slot("code")),
          control("requirements", "Requirements, comma-separated", text({ placeholder: "torch>=2.3, scikit-learn>=1.4" }),
            "checked on the workers, never installed; default: the bundle's requirements.txt"),
          control("model", "Or a checkpoint path or URI", text(), "a safetensors file the operator's data roots allow")),
        control("model_id", "Model", select(modelOptions), "registered models: id, kind and size"),
        control("dataset_id", "Dataset", select(datasetOptions), "registered datasets: id, kind, samples and size"),
        control("dataset", "Or a dataset path or URI", text(), "a folder, zip or JSONL file the operator's data roots allow")),
      h("fieldset", {}, h("legend", {}, "Training (config)"), slot("config"),
        h("div", { class: "grid-fields" },
          CODE_MAIN.map((k) => configControl(k, "value")),
          h("div", { id: "built-in-main", class: "contents" },
            ["mixed_precision", "use_peft", "lora_r", "lora_alpha"].map((k) => configControl(k, kindOf(k))))),
        h("div", { id: "built-in-more" }, moreBuiltIn),
        control("config.other", "Other config keys, as a JSON object", h("textarea", { rows: 2, placeholder: '{"heldout": "data/heldout"}' }),
          "merged into config; your code reads them as env[KEY]")),
      advanced,
      h("div", { class: "form-actions" },
        h("button", { type: "submit", class: "primary", id: "submit-job" }, "Submit job"),
        h("button", { type: "button", id: "check-job", onclick: () => check() }, "Check"),
        h("button", { type: "button", id: "show-request", "aria-expanded": "false", "aria-controls": "request-json",
          onclick: (e) => toggleRequest(e.currentTarget) }, "Show request"),
        h("button", { type: "button", id: "copy-curl", onclick: () => copyCurl() }, "Copy as curl"),
        notice),
      requestView);
    inputs.set("trainer", trainer);
    inputs.set("early_stopping.on", stopping);
    state.codeInfo = codeInfo;
    form.addEventListener("input", changed);
    form.addEventListener("change", changed);
  }

  /* A fieldset of checkboxes, one per online worker of a kind. */
  function workerPicker(field, label, kind) {
    const leaf = field.split(".").pop();
    const online = state.workers.filter((w) => w.kind === kind && w.status === "online");
    const box = h("fieldset", { class: "picker", id: `f-${leaf}`, dataset: { field, kind } },
      h("legend", {}, `${label} (${leaf})`),
      online.length ? online.map((w) => h("span", { class: "pick" }, h("label", {},
        h("input", { type: "checkbox", value: w.worker_id, dataset: { worker: w.worker_id } }), ` ${w.worker_id}`),
        w.hostname ? h("span", { class: "muted small" }, w.hostname) : null))
        : h("p", { class: "muted small" }, `no ${kind} worker is online`),
      slot(field));
    inputs.set(field, box);
    return box;
  }

  function setValue(input, value) {
    if (input.type === "checkbox") input.checked = Boolean(value);
    else if (Array.isArray(value)) input.value = value.join(", ");
    else input.value = value === null || value === undefined ? "" : String(value);
  }

  const builtIn = () => inputs.get("trainer").value === "built_in";

  function showTrainer() {
    const code = !builtIn();
    document.getElementById("code-fields").hidden = !code;
    document.getElementById("built-in-main").hidden = code;
    document.getElementById("built-in-more").hidden = code;
  }

  function showMode() {
    const mode = inputs.get("worker_selection.mode").value;
    document.getElementById("pinned-fields").hidden = mode !== "pinned";
    document.getElementById("mixed-fields").hidden = mode !== "mixed";
  }

  /* ---- the request body ---- */

  function read(field) {
    const input = inputs.get(field);
    if (input.type === "checkbox") return input.checked;
    if (input.tagName === "SELECT") return input.value;
    return input.value;
  }

  /* The body the form will POST, and the problems found before sending (JSON that does not parse). */
  function requestBody() {
    const problems = [];
    const d = state.defaults;
    const body = { name: read("name") };
    const config = {};
    if (builtIn()) {
      for (const key of BUILT_IN_MAIN) config[key] = configValue(key);
      for (const key of BUILT_IN_MORE) {
        const value = configValue(key);
        if (value !== undefined && !same(value, d.built_in_config[key])) config[key] = value;
      }
    } else {
      if (read("entrypoint").trim()) body.entrypoint = read("entrypoint").trim();
      if (state.code) body.code = state.code;
      const requirements = read("requirements").split(",").map((r) => r.trim()).filter(Boolean);
      if (requirements.length) body.requirements = requirements;
      if (read("model").trim()) body.model = read("model").trim();
      for (const key of CODE_MAIN) config[key] = configValue(key);
    }
    const datasetId = read("dataset_id"), modelId = read("model_id");
    if (datasetId) body.dataset_id = Number(datasetId);
    if (read("dataset").trim()) body.dataset = read("dataset").trim();
    if (modelId) body.model_id = Number(modelId);
    Object.assign(config, jsonValue(read("config.other"), "config.other", problems) || {});
    for (const [k, v] of Object.entries(config)) if (v === undefined) delete config[k];
    body.config = config;

    const distributed = {};
    for (const key of DISTRIBUTED_MAIN) {
      const value = key === "enabled" ? read("distributed.enabled") : key === "strategy"
        ? read("distributed.strategy").trim() : numberValue(read(`distributed.${key}`));
      if (value !== undefined && value !== "") distributed[key] = value;
    }
    const params = jsonValue(read("distributed.strategy_params"), "distributed.strategy_params", problems);
    if (params !== undefined) distributed.strategy_params = params;
    const personal = read("distributed.personal_layers").split(",").map((s) => s.trim()).filter(Boolean);
    if (personal.length) distributed.personal_layers = personal;
    const every = numberValue(read("distributed.evaluate_every"));
    if (every !== undefined && every !== d.distributed.evaluate_every) distributed.evaluate_every = every;
    if (inputs.get("early_stopping.on").checked) {
      const stop = {};
      for (const key of ["metric", "mode", "patience", "min_delta", "keep_best"]) {
        const field = `distributed.early_stopping.${key}`;
        const input = inputs.get(field);
        stop[key] = input.type === "checkbox" ? input.checked : ["metric", "mode"].includes(key)
          ? input.value : numberValue(input.value);
      }
      distributed.early_stopping = stop;
    }
    body.distributed = distributed;
    const mode = read("worker_selection.mode");
    const selection = { mode };
    if (mode === "pinned") {
      selection.workers = read("worker_selection.workers").split(",").map((s) => s.trim()).filter(Boolean);
    } else if (mode === "mixed") {
      selection.worker_ids = picked("worker_selection.worker_ids");
      selection.parsyn_worker_ids = picked("worker_selection.parsyn_worker_ids");
    }
    body.worker_selection = selection;
    const split = { strategy: read("split.strategy"), seed: numberValue(read("split.seed")),
      alpha: numberValue(read("split.alpha")), key: read("split.key") };
    const changedSplit = Object.fromEntries(Object.entries(split).filter(([k, v]) => v !== undefined && !same(v, d.split[k])));
    if (Object.keys(changedSplit).length) body.split = { strategy: split.strategy, ...changedSplit };
    return { body, problems };
  }

  function configValue(key) {
    const input = inputs.get(`config.${key}`);
    if (input.type === "checkbox") return input.checked;
    if (key === "mixed_precision") return input.value;
    if (key === "eval_dataset_id") return input.value ? Number(input.value) : null;
    if (key === "lora_target_modules") {
      const names = input.value.split(",").map((s) => s.trim()).filter(Boolean);
      return names.length ? names : null;
    }
    return numberValue(input.value);
  }

  const picked = (field) => [...inputs.get(field).querySelectorAll("input:checked")].map((i) => workerId(i.value));

  /* ---- filling the form from a request (Run again, or the draft kept across a token prompt) ---- */

  function fill(body) {
    const config = { ...(body.config || {}) };
    inputs.get("trainer").value = body.entrypoint ? "code" : "built_in";
    setValue(inputs.get("name"), body.name);
    setValue(inputs.get("entrypoint"), body.entrypoint);
    state.code = body.code || null;
    if (state.code) state.codeInfo.textContent = `code ${state.code.sha256.slice(0, 12)} (${sizeText(state.code.size)})`;
    setValue(inputs.get("model_id"), body.model_id);
    setValue(inputs.get("dataset_id"), body.dataset_id);
    setValue(inputs.get("dataset"), body.dataset);
    setValue(inputs.get("model"), body.model);
    setValue(inputs.get("requirements"), body.requirements || []);
    const known = body.entrypoint ? CODE_MAIN : [...BUILT_IN_MAIN, ...BUILT_IN_MORE];
    for (const key of known) {
      if (key in config) { setValue(inputs.get(`config.${key}`), config[key]); delete config[key]; }
    }
    setValue(inputs.get("config.other"), Object.keys(config).length ? JSON.stringify(config) : "");
    const dist = body.distributed || {};
    for (const key of [...DISTRIBUTED_MAIN, "evaluate_every"]) {
      setValue(inputs.get(`distributed.${key}`), key in dist ? dist[key] : key === "steps_per_round" ? null : state.defaults.distributed[key]);
    }
    setValue(inputs.get("distributed.strategy_params"),
      dist.strategy_params && Object.keys(dist.strategy_params).length ? JSON.stringify(dist.strategy_params) : "");
    setValue(inputs.get("distributed.personal_layers"), dist.personal_layers || []);
    const stop = dist.early_stopping;
    inputs.get("early_stopping.on").checked = Boolean(stop);
    document.getElementById("early-stopping-fields").hidden = !stop;
    for (const [k, v] of Object.entries(stop || {})) {
      if (inputs.has(`distributed.early_stopping.${k}`)) setValue(inputs.get(`distributed.early_stopping.${k}`), v);
    }
    const selection = body.worker_selection || { mode: "pool" };
    inputs.get("worker_selection.mode").value = selection.mode || "pool";
    setValue(inputs.get("worker_selection.workers"), selection.workers || []);
    for (const field of ["worker_ids", "parsyn_worker_ids"]) {
      const wanted = (selection[field] || []).map(String);
      for (const box of inputs.get(`worker_selection.${field}`).querySelectorAll("input")) box.checked = wanted.includes(box.value);
    }
    const split = { ...state.defaults.split, ...(body.split || {}) };
    for (const k of ["strategy", "seed", "alpha", "key"]) setValue(inputs.get(`split.${k}`), split[k]);
    showTrainer();
    showMode();
    const advanced = Object.keys(body.distributed || {}).some((k) => !same(dist[k], state.defaults.distributed[k]))
      || selection.mode !== "pool" || body.split;
    if (advanced && fromJob) document.getElementById("advanced").open = true;
  }

  /* ---- errors beside their fields ---- */

  function clearErrors() {
    for (const el of errorSlots.values()) el.replaceChildren();
    for (const input of form.querySelectorAll("[aria-invalid]")) input.removeAttribute("aria-invalid");
    summary.replaceChildren();
  }

  /* The slot an error's field is shown in: the field's own, else its nearest block's (an unknown config key:
     the other keys' JSON), else the form's summary alone. */
  function slotFor(field) {
    // A built-in job has no entrypoint input: "entrypoint: Field required" there means it names no model.
    if (field === "entrypoint" && builtIn()) return "model_id";
    const parts = field.split(".");
    for (let n = parts.length; n > 0; n--) {
      const path = parts.slice(0, n).join(".");
      if (errorSlots.has(path)) return path;
      // A config key the form has no input for came from the other keys' JSON.
      if (n === 2 && parts[0] === "config") return "config.other";
    }
    return null;
  }

  function showErrors(errors) {
    clearErrors();
    let first = null;
    for (const error of errors) {
      const path = slotFor(error.field);
      if (path === null) continue;
      errorSlots.get(path).append(h("p", { dataset: { field: error.field } },
        path === error.field ? error.message : `${error.field}: ${error.message}`));
      const input = inputs.get(path);
      if (input) {
        input.setAttribute("aria-invalid", "true");
        first = first || input;
      }
      const details = errorSlots.get(path).closest("details");
      if (details) details.open = true;
    }
    summary.append(h("p", { class: "strong" }, `${errors.length} field${errors.length === 1 ? "" : "s"} to fix before the job is submitted:`),
      h("ul", {}, errors.map((e) => h("li", {}, h("code", {}, e.field), ` ${e.message}`))));
    (first || summary).focus();
  }

  /* ---- actions ---- */

  function changed() {
    if (state.stopped) return;
    const { body } = requestBody();
    sessionStorage.setItem(DRAFT_KEY, JSON.stringify({ from: fromJob || null, body }));
    if (!requestView.hidden) requestView.textContent = JSON.stringify(body, null, 2);
  }

  function toggleRequest(button) {
    requestView.hidden = !requestView.hidden;
    button.setAttribute("aria-expanded", String(!requestView.hidden));
    button.textContent = requestView.hidden ? "Show request" : "Hide request";
    if (!requestView.hidden) requestView.textContent = JSON.stringify(requestBody().body, null, 2);
  }

  function curl(body) {
    const json = JSON.stringify(body).replace(/'/g, "'\\''");
    return `curl -X POST '${location.origin}${API}/training-jobs' -H "Authorization: Bearer $APIARY_TOKEN" `
      + `-H 'Content-Type: application/json' -d '${json}'`;
  }

  async function copyCurl() {
    const command = curl(requestBody().body);
    requestView.hidden = false;
    requestView.textContent = command;
    try {
      await navigator.clipboard.writeText(command);
      notice.textContent = "curl command copied (it reads the token from $APIARY_TOKEN)";
    } catch (e) {
      notice.textContent = "the browser refused the clipboard: copy the command shown below";
    }
  }

  async function post(dryRun) {
    const { body, problems } = requestBody();
    if (problems.length) { showErrors(problems); return null; }
    const response = await api(`${API}/training-jobs${dryRun ? "?dry_run=true" : ""}`, { method: "POST",
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    if (response.status === 401) return null; // the token prompt is up; the draft keeps the form
    const answer = await response.json().catch(() => ({}));
    if (response.status === 422) { showErrors(answer.errors && answer.errors.length ? answer.errors : [{ field: "(request)", message: answer.detail }]); return null; }
    if (!response.ok) { clearErrors(); summary.append(h("p", {}, answer.detail || `the API answered ${response.status}`)); summary.focus(); return null; }
    return answer;
  }

  async function check() {
    notice.textContent = "checking…";
    const answer = await post(true);
    notice.textContent = answer ? "the request is valid: nothing was submitted yet" : "";
    if (answer) clearErrors();
  }

  async function submit() {
    const button = document.getElementById("submit-job");
    button.disabled = true;
    notice.textContent = "submitting…";
    try {
      const answer = await post(false);
      if (answer && answer.job_id) {
        sessionStorage.removeItem(DRAFT_KEY);
        state.stopped = true;
        location.hash = `#/jobs/${encodeURIComponent(answer.job_id)}`;
        return;
      }
      notice.textContent = "";
    } finally {
      button.disabled = false;
    }
  }

  async function uploadCode(file) {
    const chosen = file.files[0];
    if (!chosen) return;
    state.codeInfo.textContent = `uploading ${chosen.name}…`;
    errorSlots.get("code").replaceChildren();
    const response = await api(`${API}/code`, { method: "POST", headers: { "Content-Type": "application/zip" }, body: chosen });
    const answer = await response.json().catch(() => ({}));
    if (!response.ok) {
      state.code = null;
      state.codeInfo.textContent = "";
      errorSlots.get("code").append(h("p", {}, answer.detail || `upload failed (${response.status})`));
      return;
    }
    state.code = answer;
    state.codeInfo.textContent = `code ${answer.sha256.slice(0, 12)} (${sizeText(answer.size)}) stored as ${answer.key}`;
    changed();
  }

  /* ---- loading what the form offers ---- */

  async function load() {
    const [defaults, models, datasets, workers] = await Promise.all(
      ["job-defaults", "models", "datasets", "workers"].map((p) => api(`${API}/${p}`)));
    if ([defaults, models, datasets, workers].some((r) => r.status === 401)) return;
    state.defaults = await defaults.json();
    state.models = models.ok ? await models.json() : [];
    state.datasets = datasets.ok ? await datasets.json() : [];
    state.workers = workers.ok ? await workers.json() : [];
    // What the form held before a token prompt comes back first; else the job's request to run again.
    const draft = JSON.parse(sessionStorage.getItem(DRAFT_KEY) || "null");
    let prefill = draft && draft.from === (fromJob || null) ? draft.body : null;
    if (!prefill && fromJob) {
      const response = await api(`${API}/training-jobs/${encodeURIComponent(fromJob)}/request`);
      if (response.status === 401) return;
      if (response.ok) prefill = await response.json();
      else notice.textContent = `job ${fromJob}'s request could not be read (${response.status})`;
    }
    if (state.stopped) return;
    build();
    showTrainer();
    showMode();
    if (prefill) fill(prefill);
    document.getElementById("f-name").focus();
  }

  document.title = "New training job · Apiary";
  app.replaceChildren(h("a", { class: "back", href: "#/" }, "← All jobs"),
    h("section", { class: "card" }, h("div", { class: "card-head" },
      h("h1", {}, fromJob ? "Run again" : "New training job"),
      h("span", { class: "muted small" }, fromJob ? `prefilled with job ${fromJob}'s request` : "POST /api/v1/training-jobs")),
    form));
  form.append(h("p", { class: "empty" }, "Loading…"));
  setLive("live", "ready");
  load();
  return { stop: () => { state.stopped = true; } };
}
