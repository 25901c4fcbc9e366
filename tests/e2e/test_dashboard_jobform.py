"""The dashboard's training job form in a real browser (Debian's headless Chromium, driven by Playwright): the
documented LLM request typed into labelled inputs is POSTed field for field as documented, the job page
follows it and cancels it after a confirmation, "Run again" brings the request back; three bad fields get three
errors beside them, from the server's own validation; a viewer is offered no action it may not take; a user-code
job brings its bundle, uploaded from the form."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from playwright.async_api import Browser, Dialog, Page

from apiary import bundle
from apiary.settings import Settings
from apiary.weights import dumps
from services.app.runtime import Embedded
from services.worker import Worker
from tests.e2e.jobform_helpers import API, Dashboard, dashboard, fill_by_label, posted_jobs, zip_folder
from tests.fixtures.llm import jsonl_dataset, llama_folder
from tests.toyjobs.toy import make_dataset
from tests.unit.test_jobspec_documented import DOCUMENTED

pytestmark = pytest.mark.slow

WORKERS = {"1": "own", "3": "own", "5": "platform"}
# The documented request as a person types it: each input by its accessible name, "Label (field)".
TYPED = {
    "Job name (name)": "distributed-llama-finetune",
    "Epochs (epochs)": "3", "Batch size (batch_size)": "4", "Learning rate (learning_rate)": "0.0002",
    "LoRA rank (lora_r)": "16", "LoRA alpha (lora_alpha)": "32",
    "Rounds (num_rounds)": "10", "Steps per round (steps_per_round)": "500",
    "Fewest workers (min_workers)": "2", "Most workers (max_workers)": "5",
}


async def registered(board: Dashboard, tmp_path: Path) -> tuple[int, int]:
    """The tiny llama and a JSONL dataset registered over the API: (model_id, dataset_id)."""
    model = await board.register("models", llama_folder(tmp_path / "tiny-llama"), "tiny-llama")
    dataset = await board.register("datasets", jsonl_dataset(tmp_path / "records.jsonl"), "records")
    return int(model["model_id"]), int(dataset["dataset_id"])


async def new_job_form(page: Page) -> None:
    """From the jobs list, open the form by its action and wait until it is drawn."""
    await page.get_by_role("link", name="New training job").click()
    await page.wait_for_selector("#f-name:focus")


def mixed_stack(tmp_path: Path) -> Embedded:
    """A stack whose workers are the documented request's: own 1 and 3, platform 5."""
    settings = Settings(home=tmp_path / ".apiary", http_port=0, heartbeat_interval=0.5, progress_interval=0.1)
    stack = Embedded(settings, workers=0)
    stack.workers = [Worker(stack.ports.bus, settings.model_copy(update={"worker_kind": kind}), worker_id=wid)
                     for wid, kind in WORKERS.items()]
    return stack


async def test_the_form_posts_the_documented_request_field_by_field_and_the_job_page_cancels_it(
        browser: Browser, tmp_path: Path) -> None:
    # Prepare
    async with dashboard(tmp_path, stack=mixed_stack(tmp_path)) as board:
        model_id, dataset_id = await registered(board, tmp_path)
        expected = {**copy.deepcopy(DOCUMENTED), "model_id": model_id, "dataset_id": dataset_id}
        page = await board.open(browser, "submitter")
        await page.wait_for_selector("#workers-table tr[data-worker='5']")
        posted = posted_jobs(page)

        # Execute: the form, then Show request, then Submit
        await new_job_form(page)
        advanced_was_open = await page.locator("#advanced").evaluate("d => d.open")
        await page.get_by_label("Model (model_id)").select_option(str(model_id))
        await page.get_by_label("Dataset (dataset_id)").select_option(str(dataset_id))
        await page.get_by_label("Mixed precision (mixed_precision)").select_option("bf16")
        await page.locator("#advanced > summary").click()
        await fill_by_label(page, TYPED)
        await page.get_by_label("Which workers train (mode)").select_option("mixed")
        for group, worker in (("Own workers (worker_ids)", "1"), ("Own workers (worker_ids)", "3"),
                              ("Platform workers (parsyn_worker_ids)", "5")):
            await page.get_by_role("group", name=group).get_by_label(worker, exact=True).check()
        await page.get_by_role("button", name="Show request").click()
        shown = json.loads(await page.inner_text("#request-json"))
        await page.get_by_role("button", name="Copy as curl").click()
        curl = await page.inner_text("#request-json")
        await page.get_by_role("button", name="Submit job").click()
        await page.wait_for_url(lambda url: "#/jobs/" in url and not url.endswith("#/jobs/new"))
        job_id = page.url.rsplit("/", 1)[1]
        await page.wait_for_selector("#cancel")

        # Execute: cancel, first declined (confirm() blocks the click's handler: no request follows), then confirmed
        cancels: list[str] = []
        page.on("request", lambda r: cancels.append(r.url) if r.url.endswith(f"{job_id}/cancel") else None)
        await _answer_next_dialog(page, accept=False)
        await page.click("#cancel")
        cancels_after_decline = len(cancels)
        await _answer_next_dialog(page, accept=True)
        await page.click("#cancel")
        await page.wait_for_function("document.querySelector('.job-head .badge')?.textContent === 'cancelled'",
                                     timeout=120_000)

        # Execute: Run again brings the same request back
        await page.get_by_role("link", name="Run again").click()
        await page.wait_for_selector("#f-name:focus")
        await page.get_by_role("button", name="Show request").click()
        again = json.loads(await page.inner_text("#request-json"))
        await page.close()

    # Assert
    assert not advanced_was_open
    submitted = [p["body"] for p in posted if not p["dry_run"]]
    assert len(submitted) == 1
    body = submitted[0]
    assert set(body) == set(expected)
    for block in ("config", "distributed", "worker_selection"):
        assert set(body[block]) == set(expected[block]), block
        for key, value in expected[block].items():
            assert body[block][key] == value and type(body[block][key]) is type(value), f"{block}.{key}"
    for key in ("name", "model_id", "dataset_id"):
        assert body[key] == expected[key], key
    assert shown == body
    assert curl.startswith(f"curl -X POST '{board.url}{API}/training-jobs' -H \"Authorization: Bearer $APIARY_TOKEN\"")
    assert json.loads(curl.split(" -d '", 1)[1].removesuffix("'")) == body
    assert cancels_after_decline == 0 and len(cancels) == 1
    assert again == expected
    assert board.problems == []


async def _answer_next_dialog(page: Page, *, accept: bool) -> None:
    async def answer(dialog: Dialog) -> None:
        await (dialog.accept() if accept else dialog.dismiss())

    page.once("dialog", answer)


async def test_three_bad_fields_get_their_errors_beside_them_all_at_once_and_nothing_is_submitted(
        browser: Browser, tmp_path: Path) -> None:
    # Prepare
    async with dashboard(tmp_path) as board:
        model_id, dataset_id = await registered(board, tmp_path)
        page = await board.open(browser, "submitter")
        await new_job_form(page)
        await fill_by_label(page, {"Job name (name)": "three-mistakes", "LoRA rank (lora_r)": "0",
                                   "Other config keys, as a JSON object (other)": '{"lora_rr": 8}'})
        await page.get_by_label("Model (model_id)").select_option(str(model_id))
        await page.get_by_label("Dataset (dataset_id)").select_option(str(dataset_id))
        await page.locator("#advanced > summary").click()
        await fill_by_label(page, {"Rounds (num_rounds)": "0"})
        await page.locator("#advanced > summary").click()  # closed again: its error must open it

        # Execute
        await page.get_by_role("button", name="Submit job").click()
        await page.wait_for_selector("#form-errors li")
        beside = {field: await page.locator(f"[data-for='{field}'] .field-error").inner_text()
                  for field in ("config.lora_r", "config.other", "distributed.num_rounds")}
        invalid = await page.locator("[aria-invalid='true']").evaluate_all("els => els.map(e => e.id)")
        listed = await page.locator("#form-errors li").count()
        advanced_open = await page.locator("#advanced").evaluate("d => d.open")
        focused = await page.evaluate("document.activeElement.id")
        still_here = page.url.endswith("#/jobs/new")
        async with board.http("viewer") as http:
            jobs = (await http.get(f"{API}/training-jobs")).json()
        await page.close()

    # Assert
    assert beside["config.lora_r"].startswith("Input should be greater than or equal to 1")
    assert beside["config.other"] == "config.lora_rr: unknown field (did you mean lora_r?)"
    assert beside["distributed.num_rounds"].startswith("Input should be greater than or equal to 1")
    assert set(invalid) == {"f-config-lora_r", "f-config-other", "f-distributed-num_rounds"}
    assert listed == 3 and advanced_open and still_here
    assert focused == "f-config-lora_r"
    assert jobs == []
    assert board.problems == []


async def test_a_viewer_is_offered_no_new_job_nor_job_actions(browser: Browser, tmp_path: Path) -> None:
    # Prepare
    async with dashboard(tmp_path) as board:
        async with board.http("submitter") as http:
            response = await http.post(f"{API}/training-jobs", json=_toy_request(tmp_path))
            job_id = response.json()["job_id"]

        # Execute
        viewer = await board.open(browser, "viewer")
        await viewer.wait_for_selector(f"#jobs-table tr[data-job='{job_id}']")
        viewer_actions = await viewer.get_by_role("link", name="New training job").count()
        await viewer.goto(f"{board.url}/#/jobs/new")
        await viewer.wait_for_selector("#jobs-table")
        viewer_form = await viewer.locator("#job-form").count()
        await viewer.goto(f"{board.url}/#/jobs/{job_id}")
        await viewer.wait_for_selector(".job-head .badge")
        viewer_job_actions = await viewer.locator("#cancel, #run-again").count()
        submitter = await board.open(browser, "submitter")
        await submitter.wait_for_selector(f"#jobs-table tr[data-job='{job_id}']")
        submitter_actions = await submitter.get_by_role("link", name="New training job").count()
        await viewer.close()
        await submitter.close()

    # Assert
    assert (viewer_actions, viewer_form, viewer_job_actions) == (0, 0, 0)
    assert submitter_actions == 1
    assert board.problems == []


def _toy_request(tmp_path: Path) -> dict[str, Any]:
    return {"name": "toy", "entrypoint": "tests.toyjobs.toy:fl_train_model",
            "dataset": str(make_dataset(tmp_path / "toy-data", 6)), "config": {"mode": "ok"},
            "distributed": {"num_rounds": 1, "min_workers": 1, "max_workers": 1}}


TRAIN_PY = '''
def fl_train_model(payload, out_dir, logger=None):
    return {"weights": dict(payload["initial_weights"]), "samples": 1}
'''


async def test_a_user_code_job_brings_its_bundle_uploaded_from_the_form(browser: Browser, tmp_path: Path) -> None:
    # Prepare: a folder packed as apiary does, a registered checkpoint and dataset
    (tmp_path / "src" / "formtoy").mkdir(parents=True)
    (tmp_path / "src" / "formtoy" / "train.py").write_text(TRAIN_PY)
    packed = tmp_path / "formtoy.zip"
    packed.write_bytes(bundle.pack(tmp_path / "src").data)
    (tmp_path / "init.safetensors").write_bytes(dumps({"w": torch.zeros(2)}))
    async with dashboard(tmp_path, workers=1) as board:
        model = await board.register("models", tmp_path / "init.safetensors", "init")
        data = zip_folder(make_dataset(tmp_path / "data", 4), tmp_path / "data.zip")
        dataset = await board.register("datasets", data, "toy")
        page = await board.open(browser, "submitter", "#/jobs/new")
        await page.wait_for_selector("#f-name:focus")
        posted = posted_jobs(page)

        # Execute
        await page.get_by_label("What trains (entrypoint, or none for the built-in trainer)").select_option("code")
        await fill_by_label(page, {"Job name (name)": "bundled",
                                   "Entrypoint (entrypoint)": "formtoy.train:fl_train_model"})
        await page.get_by_label("Code bundle, a zip of your folder (code)").set_input_files(str(packed))
        await page.wait_for_function("document.querySelector('#code-info').textContent.startsWith('code ')")
        await page.get_by_label("Model (model_id)").select_option(str(model["model_id"]))
        await page.get_by_label("Dataset (dataset_id)").select_option(str(dataset["dataset_id"]))
        await page.get_by_role("button", name="Submit job").click()
        await page.wait_for_function("document.querySelector('.job-head .badge')?.textContent === 'completed'",
                                     timeout=120_000)
        shown = await page.text_content("#code")
        await page.close()

    # Assert
    body = next(p["body"] for p in posted if not p["dry_run"])
    assert body["code"]["key"].startswith("code/") and body["code"]["sha256"] in body["code"]["key"]
    assert body["entrypoint"] == "formtoy.train:fl_train_model" and body["model_id"] == model["model_id"]
    assert shown is not None and shown.startswith(f"code {body['code']['sha256'][:12]}")
    assert board.problems == []
