"""The dashboard's other pages and its use without a mouse, in a real browser (Debian's headless Chromium): a
dataset uploaded through the Datasets page is in GET /api/v1/datasets and a file that is no dataset is refused
with why and leaves nothing registered; model details show its config; the workers page filters by kind; the
form is reached and used by keyboard with a visible focus; an expired token asks for another and the form comes
back as it was; no page (a job's included) scrolls sideways at 1280 px, nor at 390 px."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from playwright.async_api import Browser, Dialog, Route

from services.tracker import token_store
from services.tracker.upload_routes import CHUNK_BYTES
from tests.e2e.jobform_helpers import API, dashboard
from tests.fixtures.llm import jsonl_dataset, llama_folder
from tests.toyjobs.toy import make_dataset

pytestmark = pytest.mark.slow

READY = {"#/": "#workers-table", "#/jobs/new": "#f-name", "#/models": "#models-table", "#/datasets": "#datasets-table",
         "#/workers": "#workers-table"}


async def test_a_dataset_uploaded_through_the_page_is_registered_and_a_bad_file_is_refused_with_why(
        browser: Browser, tmp_path: Path) -> None:
    # Prepare
    records = jsonl_dataset(tmp_path / "records.jsonl")
    broken = tmp_path / "broken.jsonl"
    broken.write_text("this is not JSON\n")
    async with dashboard(tmp_path) as board:
        page = await board.open(browser, "submitter", "#/datasets")
        await page.wait_for_selector("#upload-form")

        # Execute
        await page.get_by_label("File (the dataset to register)").set_input_files(str(broken))
        await page.get_by_role("button", name="Upload dataset").click()
        await page.wait_for_function("document.querySelector('#upload-status').textContent.startsWith('refused')")
        refused = await page.inner_text("#upload-status")
        await page.get_by_label("File (the dataset to register)").set_input_files(str(records))
        await page.get_by_label("Name (name)").fill("my-records")
        await page.get_by_role("button", name="Upload dataset").click()
        await page.wait_for_selector("#datasets-table tbody tr[data-id]")
        progress = await page.get_attribute("#upload-progress", "value")
        row = await page.inner_text("#datasets-table tbody tr[data-id]")
        await page.get_by_role("button", name="Details").click()
        details = await page.inner_text("#datasets-table tr.details")
        async with board.http("viewer") as http:
            listed = (await http.get(f"{API}/datasets")).json()
        await page.close()

    # Assert
    assert refused.startswith("refused: ") and "broken.jsonl" in refused
    assert [d["name"] for d in listed] == ["my-records"]
    assert listed[0]["sha256"] in details and "JSONL" in row and "my-records" in row
    assert progress == "100"
    assert board.problems == []


async def test_a_large_upload_cut_off_mid_way_resumes_and_an_admin_deletes_it_after_a_confirmation(
        browser: Browser, tmp_path: Path) -> None:
    # Prepare: a file of two chunks, and a connection that drops the first try of the second
    big = tmp_path / "big.jsonl"
    line = json.dumps({"text": "x" * 1000}) + "\n"
    big.write_text(line * (CHUNK_BYTES // len(line) + 500))
    async with dashboard(tmp_path) as board:
        page = await board.open(browser, "admin", "#/datasets")
        await page.wait_for_selector("#upload-form")
        chunks: list[str] = []

        async def cut_once(route: Route) -> None:
            chunks.append(route.request.url)
            if "offset=0" not in route.request.url and len(chunks) == 2:
                await route.abort("connectionreset")
            else:
                await route.continue_()

        await page.route("**/api/v1/uploads/*?offset=*", cut_once)

        # Execute
        await page.get_by_label("File (the dataset to register)").set_input_files(str(big))
        await page.get_by_role("button", name="Upload dataset").click()
        await page.wait_for_selector("#datasets-table tbody tr[data-id]", timeout=60_000)
        async with board.http("viewer") as http:
            listed = (await http.get(f"{API}/datasets")).json()
        await page.get_by_role("button", name="Details").click()
        delete = page.get_by_role("button", name="Delete dataset")
        page.once("dialog", accept)
        await delete.click()
        await page.wait_for_selector("text=No dataset is registered yet.")
        async with board.http("viewer") as http:
            after = (await http.get(f"{API}/datasets")).json()
        await page.close()

    # Assert
    assert len(chunks) == 3 and chunks[1] == chunks[2]  # the cut chunk, sent again at the same offset
    assert [d["sha256"] for d in listed] == [hashlib.sha256(big.read_bytes()).hexdigest()]
    assert after == []
    assert board.problems == []


async def test_model_details_show_its_config_and_the_workers_page_filters_by_kind(
        browser: Browser, tmp_path: Path) -> None:
    # Prepare
    async with dashboard(tmp_path, workers=2) as board:
        await board.register("models", llama_folder(tmp_path / "tiny-llama"), "tiny-llama")
        page = await board.open(browser, "viewer", "#/models")

        # Execute
        await page.wait_for_selector("#models-table tbody tr[data-id]")
        upload_offered = await page.locator("#upload-form").count()
        await page.get_by_role("button", name="Details").click()
        details = await page.inner_text("#models-table tr.details")
        await page.goto(f"{board.url}/#/workers")
        await page.wait_for_selector("#workers-table tr[data-worker='worker-2']")
        every = await page.locator("#workers-table tbody tr").count()
        await page.get_by_label("Kind (kind)").select_option("platform")
        await page.wait_for_function("!document.querySelector('#workers-table')")
        platform = await page.locator("#workers-table tbody tr").count()
        await page.close()

    # Assert
    assert upload_offered == 0  # a viewer may not register
    assert "Hugging Face folder" in details and "config model_type" in details and "llama" in details
    assert every == 2 and platform == 0
    assert board.problems == []


async def test_the_form_is_reached_and_used_by_keyboard_with_a_visible_focus(browser: Browser, tmp_path: Path) -> None:
    # Prepare
    async with dashboard(tmp_path) as board:
        page = await board.open(browser, "submitter")
        await page.wait_for_selector("#new-job")

        # Execute: Tab to the action, Enter, type, Tab to the Advanced section, Enter opens it
        for _ in range(20):
            await page.keyboard.press("Tab")
            if await page.evaluate("document.activeElement.id") == "new-job":
                break
        outline = await page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
        await page.keyboard.press("Enter")
        await page.wait_for_selector("#f-name:focus")
        await page.keyboard.type("by-keyboard")
        for _ in range(60):
            await page.keyboard.press("Tab")
            if await page.evaluate("document.activeElement.parentElement?.id") == "advanced":
                break
        await page.keyboard.press("Enter")
        opened = await page.locator("#advanced").evaluate("d => d.open")
        await page.keyboard.press("Tab")
        inside = await page.evaluate("document.activeElement.closest('#advanced') !== null")
        unlabelled = await page.evaluate(
            "[...document.querySelectorAll('#job-form input, #job-form select, #job-form textarea')]"
            ".filter(e => !e.labels || !e.labels.length).map(e => e.id || e.name)")
        name = await page.input_value("#f-name")
        await page.close()

    # Assert
    assert outline == "solid"
    assert name == "by-keyboard"
    assert opened and inside
    assert unlabelled == []
    assert board.problems == []


async def test_an_expired_token_asks_for_another_and_the_form_comes_back_as_it_was(
        browser: Browser, tmp_path: Path) -> None:
    # Prepare
    async with dashboard(tmp_path) as board:
        page = await board.open(browser, "submitter", "#/jobs/new")
        await page.wait_for_selector("#f-name:focus")
        await page.get_by_label("Job name (name)").fill("kept-across-tokens")
        await page.get_by_label("Epochs (epochs)").fill("7")
        await token_store.revoke(board.stack.ports.db, "submitter-1")

        # Execute
        await page.get_by_role("button", name="Check").click()
        await page.wait_for_selector("#token-form")
        await page.fill("#token-input", board.tokens["admin"])
        await page.click("#token-form button")
        await page.wait_for_selector("#f-name")
        name, epochs = await page.input_value("#f-name"), await page.input_value("#f-config-epochs")
        await page.close()

    # Assert
    assert (name, epochs) == ("kept-across-tokens", "7")
    assert board.problems == []


async def accept(dialog: Dialog) -> None:
    """Answer a confirmation with OK."""
    await dialog.accept()


@pytest.mark.parametrize("width", [1280, 390])
async def test_no_page_scrolls_sideways(browser: Browser, tmp_path: Path, width: int) -> None:
    # Prepare
    async with dashboard(tmp_path, workers=1) as board:
        await board.register("datasets", jsonl_dataset(tmp_path / "records.jsonl"), "records")
        await board.register("models", llama_folder(tmp_path / "tiny-llama"), "tiny-llama")
        request = {"name": "toy", "entrypoint": "tests.toyjobs.toy:fl_train_model", "config": {"mode": "ok"},
                   "dataset": str(make_dataset(tmp_path / "toy-data", 6)), "distributed": {"num_rounds": 2}}
        async with board.http() as http:
            job_id = (await http.post(f"{API}/training-jobs", json=request)).json()["job_id"]
        await board.stack.wait(job_id, timeout=120)
        page = await board.open(browser, "admin", "#/", width=width)
        overflow = {}
        ready = {**READY, f"#/jobs/{job_id}": "#data-table"}

        # Execute
        for hash_ in ready:
            await page.goto(f"{board.url}/{hash_}")
            await page.wait_for_selector(ready[hash_])
            if hash_ == "#/jobs/new":
                await page.locator("#advanced > summary").click()
            overflow[hash_] = await page.evaluate(
                "document.documentElement.scrollWidth - document.documentElement.clientWidth")
        await page.close()

    # Assert
    assert overflow == dict.fromkeys(ready, 0)
    assert board.problems == []
