"""The docs' reference pages are what scripts/gen_docs_reference.py writes from the code, and nothing they show
lacks a description: a field, setting, command, route or routing key added without one fails here."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

import pytest
import typer
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs_reference", ROOT / "scripts" / "gen_docs_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _generator()


@pytest.fixture(scope="module")
def generated() -> dict[Path, str]:
    return gen.pages()


def test_every_reference_page_is_what_the_code_generates(generated: dict[Path, str]) -> None:
    stale = [str(path) for path, text in generated.items()
             if not (ROOT / path).exists() or (ROOT / path).read_text() != text]

    assert stale == [], f"run `python scripts/gen_docs_reference.py` and commit: {stale}"


def test_everything_the_reference_shows_has_its_description() -> None:
    assert gen.undocumented() == []


def test_the_reference_lists_every_setting_routing_key_and_command(generated: dict[Path, str]) -> None:
    settings, bus, cli = (generated[gen.REFERENCE / name] for name in ("settings.md", "bus.md", "cli.md"))

    assert "`APIARY_QUEUE_TYPE`" in settings and "`APIARY_API_URL`" in settings
    assert "| `job.requested` |" in bus and "| `assign.worker.<id>` |" in bus and "| `presence.pace` |" in bus
    assert "`apiary broker setup`" in cli and "`apiary run`" in cli


def test_a_request_field_without_a_description_is_named() -> None:
    class Inner(BaseModel):
        documented: int = Field(default=1, description="says what")
        bare: int = 2

    class Request(BaseModel):
        inner: Inner = Field(default_factory=Inner, description="nested")

    assert gen.undocumented_fields(Request.model_json_schema(), "job request") == [
        "job request: field inner.bare has no description"]


def test_a_setting_without_a_description_is_named() -> None:
    class Settings(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="APIARY_")
        documented: int = Field(default=1, description="says what")
        new_knob: int = 2

    assert gen.undocumented_settings(Settings) == ["setting APIARY_NEW_KNOB has no description"]


def test_a_command_or_option_without_help_is_named() -> None:
    app = typer.Typer(help="A tool.")

    @app.command()
    def documented(count: int = typer.Option(1, help="how many")) -> None:
        """Says what."""

    @app.command()
    def bare(count: int = typer.Option(1)) -> None:
        pass

    assert gen.undocumented_commands(app) == ["command `apiary bare` has no help",
                                              "command `apiary bare`: COUNT has no help"]


def test_a_route_or_parameter_without_a_description_is_named() -> None:
    document = {"paths": {"/a": {"get": {"description": "Says what.", "parameters": [{"name": "limit"}]}},
                          "/b": {"post": {}}}}

    assert gen.undocumented_routes(document) == ["route GET /a: parameter limit has no description",
                                                 "route POST /b has no description (its function's docstring)"]


def test_a_routing_key_without_a_description_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    class Undocumented(BaseModel):
        job_id: str

    monkeypatch.setattr(gen, "routing_keys", lambda: {"job.new_thing": Undocumented})

    assert gen.undocumented_routing_keys() == [
        "routing key job.new_thing (Undocumented) has no description (its class docstring)"]


def test_a_message_field_without_a_description_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    class Part(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)
        documented: int = 1
        """Says what."""
        bare: int = 2

    class Message(BaseModel):
        """`job.new_thing`: something happened."""

        model_config = ConfigDict(use_attribute_docstrings=True)
        job_id: str
        """The job it is about."""
        part: Part
        """Its part."""
        parts: list[Part] = Field(default_factory=list, description="more of them")
        count: int = Field(default=0, description="how many")
        size: int = 0

    monkeypatch.setattr(gen, "routing_keys", lambda: {"job.new_thing": Message, "assign.a": Part, "assign.b": Part})

    assert gen.undocumented_message_fields() == [
        "routing key job.new_thing (Message): field part.bare has no description",
        "routing key job.new_thing (Message): field parts[].bare has no description",
        "routing key job.new_thing (Message): field size has no description",
        "routing keys assign.a, assign.b (Part): field bare has no description"]


def test_the_asyncapi_document_has_a_channel_per_routing_key_with_its_publisher_and_consumers() -> None:
    document = gen.asyncapi()

    def roles(action: str, channel: str) -> set[str]:
        return {op["x-apiary-role"] for op in document["operations"].values()
                if op["action"] == action and op["channel"]["$ref"] == f"#/channels/{channel}"}

    assert set(document["channels"]) >= {"job_requested", "worker_done", "worker_done_async", "assign_worker_id",
                                         "presence_pace_id"}
    # A synchronous round's reports are the aggregator's; the scheduler hears mode async's too (a task reported
    # frees its slot for the next task).
    assert roles("send", "worker_done") == {"worker"}
    assert roles("receive", "worker_done") == {"aggregator", "tracker"}
    assert roles("send", "worker_done_async") == {"worker"}
    assert roles("receive", "worker_done_async") == {"aggregator", "scheduler", "tracker"}


@pytest.mark.parametrize("module", ["apiary.sdk", "apiary.strategies.base", "apiary.trainers.base"])
def test_every_public_name_the_python_api_page_renders_has_a_docstring(module: str) -> None:
    undocumented = []
    loaded = importlib.import_module(module)
    for name, obj in vars(loaded).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            undocumented += [name] if not inspect.getdoc(obj) else []
        if inspect.isclass(obj):
            undocumented += [f"{name}.{attr}" for attr, member in vars(obj).items() if not attr.startswith("_")
                             and (inspect.isfunction(member) or isinstance(member, property))
                             and not (member.fget if isinstance(member, property) else member).__doc__]

    assert undocumented == []
