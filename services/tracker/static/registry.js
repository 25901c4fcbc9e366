/* The Models, Datasets and Workers pages: the registries (GET /api/v1/models, /datasets) with their details and
   an upload with a progress bar, and every worker with a filter by kind. Loaded before app.js; uses its helpers
   (h, api, API, me, workersTable) when a page is drawn. */
"use strict";

const REGISTRIES = {
  models: { title: "Models", id: "model_id", accept: ".zip,.gguf,.safetensors",
    kind: (m) => ({ gguf: "GGUF", hf: "Hugging Face folder", safetensors: "safetensors" }[m.format] || m.format || "?"),
    hint: "a .gguf or .safetensors file, or a Hugging Face model folder as a .zip" },
  datasets: { title: "Datasets", id: "dataset_id", accept: ".zip,.jsonl",
    kind: (d) => ((d.key || "").endsWith(".jsonl") ? "JSONL" : "zip of samples"),
    hint: "a JSONL file of text records, or a folder of samples with its manifest.json as a .zip" },
};

/* The facts of a model's config worth a glance (GGUF metadata or the folder's config.json). */
const CONFIG_FACTS = ["model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
  "vocab_size", "max_position_embeddings", "torch_dtype"];

function registryPage(kind) {
  const spec = REGISTRIES[kind];
  const what = kind.slice(0, -1);
  let items = null;
  const list = h("div", {});
  const upload = me && me.may_submit ? uploadForm(kind, spec, () => load()) : null;

  function details(item) {
    const facts = [["id", item[spec.id]], ["name", item.name], ["kind", spec.kind(item)], ["size", `${sizeText(item.size)} (${item.size} bytes)`],
      ["sha256", item.sha256], ["storage key", item.key], ["samples", item.num_samples],
      ["registered", item.created_at ? new Date(item.created_at * 1000).toLocaleString() : undefined]]
      .filter(([, v]) => v !== undefined && v !== null);
    const config = item.hf_config || null;
    if (config) for (const k of CONFIG_FACTS) if (config[k] !== undefined) facts.push([`config ${k}`, Array.isArray(config[k]) ? config[k].join(", ") : config[k]]);
    return h("dl", { class: "facts" }, facts.flatMap(([k, v]) => [h("dt", {}, k), h("dd", { class: k === "sha256" ? "mono" : "" }, String(v))]));
  }

  function render() {
    if (items === null) { list.replaceChildren(h("p", { class: "empty" }, "Loading…")); return; }
    if (!items.length) { list.replaceChildren(h("p", { class: "empty" }, `No ${what} is registered yet.`)); return; }
    list.replaceChildren(h("div", { class: "scroll" }, h("table", { class: "grid", id: `${kind}-table` },
      h("thead", {}, h("tr", {}, ["Id", "Name", "Kind", "Size", "sha256", ""].map((c) => h("th", {}, c)))),
      h("tbody", {}, items.flatMap((item) => {
        const id = item[spec.id];
        const more = h("tr", { class: "details", hidden: true, id: `${what}-${id}-details` },
          h("td", { colspan: 6 }, details(item)));
        const toggle = h("button", { type: "button", class: "toggle", "aria-expanded": "false", "aria-controls": more.id,
          onclick: (e) => {
            more.hidden = !more.hidden;
            e.currentTarget.setAttribute("aria-expanded", String(!more.hidden));
            e.currentTarget.textContent = more.hidden ? "Details" : "Hide";
          } }, "Details");
        return [h("tr", { dataset: { id } },
          h("td", { class: "num" }, `#${id}`), h("td", { class: "strong" }, item.name), h("td", {}, spec.kind(item)),
          h("td", { class: "num" }, sizeText(item.size)), h("td", { class: "mono small", title: item.sha256 }, (item.sha256 || "").slice(0, 12)),
          h("td", {}, toggle)), more];
      })))));
  }

  async function load() {
    const response = await api(`${API}/${kind}`);
    if (response.status === 401) return;
    items = response.ok ? await response.json() : [];
    render();
  }

  document.title = `${spec.title} · Apiary`;
  app.replaceChildren(h("section", { class: "card" },
    h("div", { class: "card-head" }, h("h1", {}, spec.title), h("span", { class: "muted small" }, `GET ${API}/${kind}`)), list),
    upload);
  setLive("live", "ready");
  render();
  load();
  return { stop: () => {} };
}

/* Upload a file as a new model or dataset: the file is the request's body (streamed to disk by the tracker),
   with a progress bar; the server's 422 says why a file is refused. */
function uploadForm(kind, spec, done) {
  const what = kind.slice(0, -1);
  const file = h("input", { type: "file", id: "upload-file", accept: spec.accept, "aria-describedby": "upload-hint" });
  const name = h("input", { type: "text", id: "upload-name", autocomplete: "off", pattern: "[\\w.\\-]{1,200}" });
  const progress = h("progress", { id: "upload-progress", max: 100, value: 0, hidden: true, "aria-label": "upload progress" });
  const status = h("div", { role: "status", id: "upload-status", class: "form-notice" });
  file.addEventListener("change", () => {
    const chosen = file.files[0];
    if (chosen && !name.value) name.value = chosen.name.replace(/\.(zip|jsonl|gguf|safetensors)$/i, "").replace(/[^\w.\-]/g, "-");
  });
  const form = h("form", { id: "upload-form", class: "job-form", onsubmit: (e) => { e.preventDefault(); send(); } },
    h("div", { class: "grid-fields" },
      h("div", { class: "field" }, h("label", { for: "upload-file" }, `File (the ${what} to register)`), file,
        h("div", { class: "hint", id: "upload-hint" }, spec.hint)),
      h("div", { class: "field" }, h("label", { for: "upload-name" }, "Name (name)"), name)),
    h("div", { class: "form-actions" }, h("button", { type: "submit", class: "primary", id: "upload-submit" }, `Upload ${what}`),
      progress, status));

  function send() {
    const chosen = file.files[0];
    if (!chosen) { status.textContent = "choose a file first"; return; }
    const filename = chosen.name.replace(/[^\w.\-]/g, "-");
    const query = new URLSearchParams({ filename, name: name.value.trim() || filename });
    const xhr = new XMLHttpRequest();
    xhr.open("POST", `${API}/${kind}?${query}`);
    xhr.setRequestHeader("Authorization", `Bearer ${token()}`);
    xhr.setRequestHeader("Content-Type", "application/octet-stream");
    progress.hidden = false;
    progress.value = 0;
    status.textContent = `uploading ${chosen.name} (${sizeText(chosen.size)})…`;
    xhr.upload.onprogress = (e) => { if (e.lengthComputable) progress.value = (100 * e.loaded) / e.total; };
    xhr.onerror = () => { status.textContent = "the upload was cut off: nothing was registered; upload it again"; };
    xhr.onload = () => {
      const answer = (() => { try { return JSON.parse(xhr.responseText); } catch (e) { return {}; } })();
      if (xhr.status === 401) { askToken(answer.detail || "the API refused the token"); return; }
      if (xhr.status !== 201) { status.textContent = `refused: ${answer.detail || xhr.status}`; progress.hidden = true; return; }
      progress.value = 100;
      status.textContent = `registered ${what} #${answer[spec.id]} (${answer.name})`;
      done();
    };
    xhr.send(chosen);
  }

  return h("section", { class: "card" }, h("div", { class: "card-head" }, h("h2", {}, `Upload a ${what}`),
    h("span", { class: "muted small" }, `POST ${API}/${kind}`)), form);
}

function workersPage() {
  let workers = [], at = Date.now(), kind = "all";
  const filter = h("select", { id: "kind-filter" }, [["all", "all kinds"], ["own", "own"], ["platform", "platform"], ["none", "no kind declared"]]
    .map(([v, l]) => h("option", { value: v }, l)));
  filter.addEventListener("change", () => { kind = filter.value; render(); });
  const table = h("div", {});
  const count = h("span", { class: "muted" });
  const render = () => {
    const shown = workers.filter((w) => kind === "all" || (kind === "none" ? !w.kind : w.kind === kind));
    count.textContent = `${shown.filter((w) => w.status === "online").length} online of ${shown.length}`;
    table.replaceChildren(workersTable(shown, at));
  };
  document.title = "Workers · Apiary";
  app.replaceChildren(h("section", { class: "card" },
    h("div", { class: "card-head" }, h("h1", {}, "Workers"), count),
    h("div", { class: "field inline" }, h("label", { for: "kind-filter" }, "Kind (kind) "), filter), table));
  const source = subscribe(`${API}/stream`, { workers: (data) => { workers = data; at = Date.now(); render(); } });
  const clock = setInterval(render, 5000);
  render();
  return { stop: () => { source.close(); clearInterval(clock); } };
}
