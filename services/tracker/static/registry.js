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

  /* The jobs whose request names it (GET /{kind}/{id}: used_by), and for an admin a Delete that asks first. */
  async function usage(item, cell) {
    const id = item[spec.id];
    const response = await api(`${API}/${kind}/${id}`);
    if (!response.ok) return;
    const used = (await response.json()).used_by || [];
    const problem = h("div", { class: "error-text", role: "alert" });
    cell.append(h("div", { class: "used-by" }, h("strong", {}, "Used by: "),
      used.length ? used.map((j, i) => [i ? ", " : "", h("a", { href: `#/jobs/${encodeURIComponent(j.job_id)}` },
        j.name || j.job_id), ` (${j.status})`]) : "no job"),
      me && me.may_administer ? h("div", { class: "actions" }, h("button", { type: "button", class: "danger",
        id: `delete-${what}-${id}`, onclick: async () => {
          if (!confirm(`Delete ${what} #${id} (${item.name}) and its files? Jobs can no longer name it.`)) return;
          const answer = await api(`${API}/${kind}/${id}`, { method: "DELETE" });
          if (answer.status === 204) { load(); return; }
          problem.textContent = (await answer.json().catch(() => ({}))).detail || `delete failed (${answer.status})`;
        } }, `Delete ${what}`), problem) : null);
  }

  function render() {
    if (items === null) { list.replaceChildren(h("p", { class: "empty" }, "Loading…")); return; }
    if (!items.length) { list.replaceChildren(h("p", { class: "empty" }, `No ${what} is registered yet.`)); return; }
    list.replaceChildren(h("div", { class: "scroll" }, h("table", { class: "grid", id: `${kind}-table` },
      h("thead", {}, h("tr", {}, ["Id", "Name", "Kind", "Size", "sha256", ""].map((c) => h("th", {}, c)))),
      h("tbody", {}, items.flatMap((item) => {
        const id = item[spec.id];
        const cell = h("td", { colspan: 6 }, details(item));
        const more = h("tr", { class: "details", hidden: true, id: `${what}-${id}-details` }, cell);
        const toggle = h("button", { type: "button", class: "toggle", "aria-expanded": "false", "aria-controls": more.id,
          onclick: (e) => {
            if (more.hidden && !cell.querySelector(".used-by")) usage(item, cell);
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

/* Upload a file as a new model or dataset in resumable chunks (POST /uploads, PUT each chunk at the offset the
   tracker holds, POST .../complete), with a progress bar. A chunk that fails is retried from what the tracker
   holds; past a few tries the upload waits, kept for this tab, and pressing Upload with the same file resumes
   it. The server's 422 says why a file is refused; only a completed upload is registered. */
const UPLOAD_TRIES = 4;

function uploadForm(kind, spec, done) {
  const what = kind.slice(0, -1);
  const file = h("input", { type: "file", id: "upload-file", accept: spec.accept, "aria-describedby": "upload-hint" });
  const name = h("input", { type: "text", id: "upload-name", autocomplete: "off", pattern: "[\\w.\\-]{1,200}" });
  const progress = h("progress", { id: "upload-progress", max: 100, value: 0, hidden: true, "aria-label": "upload progress" });
  const status = h("div", { role: "status", id: "upload-status", class: "form-notice" });
  const button = h("button", { type: "submit", class: "primary", id: "upload-submit" }, `Upload ${what}`);
  file.addEventListener("change", () => {
    const chosen = file.files[0];
    if (chosen && !name.value) name.value = chosen.name.replace(/\.(zip|jsonl|gguf|safetensors)$/i, "").replace(/[^\w.\-]/g, "-");
  });
  const form = h("form", { id: "upload-form", class: "job-form", onsubmit: (e) => { e.preventDefault(); run(); } },
    h("div", { class: "grid-fields" },
      h("div", { class: "field" }, h("label", { for: "upload-file" }, `File (the ${what} to register)`), file,
        h("div", { class: "hint", id: "upload-hint" }, spec.hint)),
      h("div", { class: "field" }, h("label", { for: "upload-name" }, "Name (name)"), name)),
    h("div", { class: "form-actions" }, button, progress, status));

  /* One JSON call; a 401 brings the token prompt (the upload stays resumable). */
  async function call(url, options) {
    const response = await api(url, options);
    const answer = await response.json().catch(() => ({}));
    return { status: response.status, ok: response.ok, answer };
  }

  /* PUT one chunk at the offset the upload holds, reporting its bytes as they go. */
  function putChunk(state, chunk) {
    return new Promise((resolve, reject) => {
      const xhr = new XMLHttpRequest();
      xhr.open("PUT", `${API}/uploads/${state.upload_id}?offset=${state.received}`);
      xhr.setRequestHeader("Authorization", `Bearer ${token()}`);
      xhr.setRequestHeader("Content-Type", "application/octet-stream");
      xhr.upload.onprogress = (e) => { progress.value = (100 * (state.received + e.loaded)) / Math.max(state.size, 1); };
      xhr.onerror = () => reject(new Error("the connection was cut"));
      xhr.onload = () => {
        const answer = (() => { try { return JSON.parse(xhr.responseText); } catch (e) { return {}; } })();
        if (xhr.status === 200) resolve(answer);
        else reject(Object.assign(new Error(answer.detail || `the API answered ${xhr.status}`), { status: xhr.status }));
      };
      xhr.send(chunk);
    });
  }

  async function run() {
    const chosen = file.files[0];
    if (!chosen) { status.textContent = "choose a file first"; return; }
    const filename = chosen.name.replace(/[^\w.\-]/g, "-");
    const key = `apiary-upload:${kind}:${filename}:${chosen.size}:${chosen.lastModified}`;
    button.disabled = true;
    progress.hidden = false;
    try {
      let state = null;
      const saved = sessionStorage.getItem(key);
      if (saved) {
        const found = await call(`${API}/uploads/${saved}`);
        if (found.ok) state = found.answer;
      }
      if (!state) {
        const started = await call(`${API}/uploads`, { method: "POST", headers: { "Content-Type": "application/json" },
          body: JSON.stringify({ kind, filename, name: name.value.trim() || filename, size: chosen.size }) });
        if (started.status === 401) return;
        if (!started.ok) { status.textContent = `refused: ${started.answer.detail || started.status}`; return; }
        state = started.answer;
        sessionStorage.setItem(key, state.upload_id);
      }
      let tries = 0;
      while (state.received < state.size) {
        status.textContent = `uploading ${chosen.name}: ${sizeText(state.received)} of ${sizeText(state.size)}…`;
        try {
          state = await putChunk(state, chosen.slice(state.received, state.received + state.chunk_size));
          tries = 0;
        } catch (e) {
          if (e.status === 401) { askToken("the API refused the token: the upload resumes with the next one"); return; }
          tries += 1;
          if (tries >= UPLOAD_TRIES) {
            status.textContent = `cut off at ${sizeText(state.received)} of ${sizeText(state.size)} (${e.message}): `
              + "nothing is registered yet; press Upload again with the same file to resume";
            return;
          }
          await new Promise((wake) => setTimeout(wake, 250 * 2 ** tries));
          const found = await call(`${API}/uploads/${state.upload_id}`); // resume from what the tracker holds
          if (!found.ok) { sessionStorage.removeItem(key); status.textContent = `the upload is gone (${found.answer.detail || found.status}): upload it again`; return; }
          state = found.answer;
        }
      }
      status.textContent = `checking ${chosen.name}…`;
      const registered = await call(`${API}/uploads/${state.upload_id}/complete`, { method: "POST" });
      if (registered.status === 401) return;
      sessionStorage.removeItem(key);
      if (!registered.ok) { status.textContent = `refused: ${registered.answer.detail || registered.status}`; progress.hidden = true; return; }
      progress.value = 100;
      status.textContent = `registered ${what} #${registered.answer[spec.id]} (${registered.answer.name})`;
      done();
    } finally {
      button.disabled = false;
    }
  }

  return h("section", { class: "card" }, h("div", { class: "card-head" }, h("h2", {}, `Upload a ${what}`),
    h("span", { class: "muted small" }, `POST ${API}/uploads`)), form);
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
