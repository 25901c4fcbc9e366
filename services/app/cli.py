"""The `apiary` command: run a job on one machine, or run, feed and watch a deployed system."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from apiary.settings import Settings
from apiary.trainers.environment import quiet_openmp
from services.app import STARTED
from services.app.console import console, fail, guard, quiet_client_logs, results, run_async, setup_logging
from services.app.jobfile import JobFileError, load_job_file
from services.app.render import print_summary, render_job, summary
from services.app.serve import SERVICES
from services.app.stopping import StopSignals
from services.app.tracker_api import ApiSettings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Apiary: federated training of PyTorch models.")


@app.callback()
def _root() -> None:
    """Apiary: federated training of PyTorch models."""


def _job_request(job_file: Path) -> dict[str, Any]:
    """The job file's request, or one error line."""
    try:
        return load_job_file(job_file)
    except JobFileError as e:
        fail(str(e))


@app.command()
def run(
    job_file: Path = typer.Argument(..., help="The job: a YAML or JSON file."),
    workers: int = typer.Option(3, "--workers", "-w", min=1, max=64, help="How many workers to start."),
    as_json: bool = typer.Option(False, "--json", help="Print only the summary, as one JSON object."),
    timeout: float = typer.Option(0, help="Give up after this many seconds (0: never)."),
    gpus: str = typer.Option("auto", "--gpus", help="GPUs the workers take in turn: 'auto' (every GPU this "
                             "process may use), 'none' (train on the CPU) or indices such as 0,1."),
) -> None:
    """Run a job on this machine: every service and N workers in one process tree."""
    wall_started = time.time() - (time.monotonic() - STARTED)
    stop = StopSignals()
    stop.catch()  # from here on a Ctrl-C is a cancel, whenever it comes
    quiet_openmp()
    from services.app.run import RunOptions, gpu_list, run_job

    try:  # the flag first: a GPU this machine lacks is said before anything is read
        gpu_indices = gpu_list(gpus)
    except ValueError as e:
        fail(str(e))
    request, code_root = _checked_job(job_file)
    from services.app.jobcheck import embedded_settings

    settings = embedded_settings(Settings(), request, job_file)
    from apiary import metrics, telemetry
    from services.app.runtime import DatabaseInUse

    options = RunOptions(workers=workers, as_json=as_json, timeout=timeout, gpus=gpu_indices,
                         code_paths=[str(code_root)] if code_root is not None else [],
                         log_path=setup_logging(settings, to_console=False), started=STARTED,
                         wall_started=wall_started)
    telemetry.setup("apiary")
    metrics.setup("apiary", settings.metrics)  # off unless APIARY_METRICS says; /metrics on the tracker's port
    try:
        result = run_async(run_job(settings, request, options, stop))
    except DatabaseInUse as e:
        fail(str(e))
    finally:
        metrics.shutdown()
        telemetry.shutdown()
    _end_run(result, as_json)


def _checked_job(job_file: Path) -> tuple[dict[str, Any], Path | None]:
    """The job file's request and the folder its code imports from, checked before anything starts:
    every problem in one line each, or none."""
    from services.app.jobcheck import check_request

    request = _job_request(job_file)
    checked = check_request(request, job_file)
    if checked.problems:
        fail(*(f"{job_file}: {problem}" for problem in checked.problems))
    return request, checked.code_root


def _end_run(result: dict[str, Any], as_json: bool) -> None:
    """Print the run's summary and exit as the job ended (0 completed, 1 not, 128+N stopped by signal N)."""
    exit_code = result.pop("exit_code")
    if as_json:
        print(json.dumps(result))
    else:
        print_summary(result)
    if exit_code:
        raise typer.Exit(exit_code)
    if result["status"] != "completed":
        raise typer.Exit(1)


@app.command()
def serve(
    service: str = typer.Argument(..., help="One of: scheduler, sharder, aggregator, tracker."),
) -> None:
    """Run one service in this process, on the ports the APIARY_* settings name, until SIGTERM."""
    if service not in SERVICES:
        fail(f"unknown service {service!r}: choose one of {', '.join(SERVICES)}")
    quiet_openmp()
    settings = Settings()
    setup_logging(settings, to_console=True)
    from services.app.serve import serve_service

    try:
        run_async(serve_service(service, settings))
    except ConnectionError as e:  # the broker unreachable or refusing the login
        fail(str(e))


@app.command()
def worker(
    worker_id: str = typer.Option(None, "--id", help="This worker's id (default: APIARY_WORKER_ID or host name)."),
    gpu: int = typer.Option(None, "--gpu", help="The GPU this worker trains on: the index nvidia-smi shows (PCI "
                            "bus order), or, where CUDA_VISIBLE_DEVICES is set, the N-th GPU it lists. Default: "
                            "the first one, if any."),
    kind: str = typer.Option(None, "--kind", help="What this worker is, for mixed worker selection: 'own' "
                             "(the user's machine) or 'platform' (ours). Default: undeclared."),
) -> None:
    """Run one worker: it takes pool assignments and those pinned to its id, until SIGTERM."""
    from services.worker.gpu import GpuChoiceError, require_gpu

    quiet_openmp()
    overrides: dict[str, Any] = {}
    if worker_id:
        overrides["worker_id"] = worker_id
    if gpu is not None:
        overrides["gpu"] = gpu
    if kind is not None:
        if kind not in ("own", "platform"):
            fail(f"--kind {kind!r} is not a worker kind: expected 'own' or 'platform'")
        overrides["worker_kind"] = kind
    settings = Settings(**overrides)
    try:
        if settings.gpu is not None:
            require_gpu(settings.gpu)
    except GpuChoiceError as e:
        fail(str(e))
    setup_logging(settings, to_console=True)
    from services.app.serve import serve_worker

    try:
        run_async(serve_worker(settings))
    except ConnectionError as e:  # the broker unreachable, refusing the login, or without the services' queues
        fail(str(e))


@app.command()
def submit(
    job_file: Path = typer.Argument(..., help="The job: a YAML or JSON file."),
    job_id: str = typer.Option(None, "--job-id", help="Choose the job id (default: a new one)."),
    wait: bool = typer.Option(False, "--wait", help="Wait for the job to end and print its summary."),
) -> None:
    """Publish a job request to a deployed system; print the job id."""
    from services.app import jobs

    quiet_client_logs()
    settings = ApiSettings()
    request = _job_request(job_file)
    if job_id:
        request["job_id"] = job_id
    jid, view = guard(lambda: run_async(jobs.submit(settings, request, wait)))
    print(jid)
    if view is not None:
        print_summary(summary(view, time.time() - view["created_at"]))
        if view["status"] != "completed":
            raise typer.Exit(1)


@app.command()
def status(
    job_id: str = typer.Argument(..., help="The job's id."),
    watch: bool = typer.Option(False, "--watch", help="Keep the view live until the job ends."),
    as_json: bool = typer.Option(False, "--json", help="Print the job's view as JSON."),
) -> None:
    """Show a job: status, round, each shard's worker and loss, metrics per round, failure reason."""
    from services.app import jobs

    settings = ApiSettings()
    view, where = guard(lambda: run_async(jobs.status(settings, job_id, live=watch and not as_json)))
    if view is None:
        fail(f"no job {job_id!r} is known to the tracker at {where}")
    if as_json:  # the reason is one of its fields
        print(json.dumps(view, default=str))
        return
    # After --watch's live view (on stderr, gone once the job ended): the view it ended with.
    results.print(render_job(view))
    if view.get("reason"):
        results.print(f"[red]reason:[/red] {escape(view['reason'])}")


@app.command()
def cancel(
    job_id: str = typer.Argument(..., help="The job's id."),
    reason: str = typer.Option("cancelled by user", "--reason", help="Why; shown with the job's status."),
) -> None:
    """Stop a job on a deployed system: no further round starts and it ends cancelled (also when its
    request has not been handled yet)."""
    from services.app import jobs

    quiet_client_logs()
    outcome = guard(lambda: run_async(jobs.cancel(ApiSettings(), job_id, reason)))
    if outcome == "unknown":
        print(f"cancel of job {job_id} sent; no such job is known yet: if its request comes, it will not start")
    elif outcome.startswith("ended:"):
        fail(outcome.removeprefix("ended:"))
    else:
        print(f"cancel of job {job_id} sent")


dataset_app = typer.Typer(help="Datasets kept in storage, for jobs to name by dataset_id.", no_args_is_help=True)
app.add_typer(dataset_app, name="dataset")
model_app = typer.Typer(help="Models kept in storage, for jobs to name by model_id.", no_args_is_help=True)
app.add_typer(model_app, name="model")


@dataset_app.command("upload")
def dataset_upload(
    path: Path = typer.Argument(..., help="A dataset folder or zip with a manifest.json, or a JSONL file of text "
                                "records (or a folder or zip holding one)."),
    name: str = typer.Option(None, "--name", help="A name for people (default: the folder or file name)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: dataset_id, name, uri, sha256, size."),
) -> None:
    """Register a dataset; print its dataset_id and URI."""
    _register("datasets", path, name, as_json)


@model_app.command("add")
def model_add(
    path: Path = typer.Argument(..., help="A Hugging Face model folder, a .gguf file or a .safetensors checkpoint."),
    name: str = typer.Option(None, "--name", help="A name for people (default: the folder or file name)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: model_id, name, uri, sha256, size."),
) -> None:
    """Register a model; print its model_id and URI."""
    _register("models", path, name, as_json)


def _register(kind: str, path: Path, name: str | None, as_json: bool) -> None:
    """Register a model or dataset through the tracker's API and print its id and URI (`as_json`: one JSON
    object), or fail in one line."""
    from services.app.registries import describe, register, summary

    quiet_client_logs()
    info = guard(lambda: run_async(register(ApiSettings(), kind, path, name)))
    id_field = f"{kind[:-1]}_id"
    if as_json:
        print(json.dumps(summary(info, id_field)))
        return
    print(f"{info[id_field]} {info['uri']}")
    console.print(f"[dim]{describe(info)}; use it with {id_field}: {info[id_field]}[/dim]")


token_app = typer.Typer(help="Tokens of the tracker's HTTP API (kept as hashes in its database: set "
                        "APIARY_DATABASE_URL to the deployment's).", no_args_is_help=True)
app.add_typer(token_app, name="token")


@token_app.command("create")
def token_create(
    name: str = typer.Option(..., "--name", help="Who or what holds it (a person, a CI job); unique."),
    role: str = typer.Option("submitter", "--role", help="viewer (read), submitter (also submit, and cancel its "
                             "own jobs) or admin (everything)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: token, name, role."),
) -> None:
    """Make an API token and print it: this is the only time it is shown (only its hash is kept)."""
    from services.app import tokens
    from services.tracker.token_store import TokenError

    try:
        token = run_async(tokens.create(Settings(), name, role))
    except TokenError as e:
        fail(str(e))
    if as_json:
        print(json.dumps({"token": token, "name": name, "role": role}))
        return
    print(token)
    console.print(f"[dim]{role} token {name!r}: send it as 'Authorization: Bearer TOKEN', or set APIARY_TOKEN for "
                  "the CLI; it is not shown again[/dim]")


@token_app.command("list")
def token_list() -> None:
    """List the tokens: name, role, when made (never the tokens themselves)."""
    from services.app import tokens

    for row in run_async(tokens.listed(Settings())):
        made = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(row["created_at"]))
        print(f"{row['name']}\t{row['role']}\t{made} UTC")


@token_app.command("revoke")
def token_revoke(name: str = typer.Argument(..., help="The token's name.")) -> None:
    """Revoke a token: requests carrying it are refused from now on."""
    from services.app import tokens
    from services.tracker.token_store import TokenError

    try:
        run_async(tokens.revoke(Settings(), name))
    except TokenError as e:
        fail(str(e))
    print(f"token {name!r} revoked")


broker_app = typer.Typer(help="The message broker's users: one per service role and one per worker.",
                         no_args_is_help=True)
app.add_typer(broker_app, name="broker")


@broker_app.command("setup")
def broker_setup(
    workers: list[str] = typer.Option([], "--worker", "-w", help="A worker id to make a user for (repeat it)."),
    shared_workers: bool = typer.Option(False, "--shared-workers", help="Also the one account interchangeable "
                                        "workers share (apiary-workers: any worker's queues; no identity check)."),
    vhost: str = typer.Option(None, "--vhost", help="The broker's virtual host (default: APIARY_BUS_URL's, or /)."),
    definitions: Path = typer.Option(None, "--definitions", help="Write the definitions (vhost, every user with "
                                     "its password hash, permissions) to this file for a broker to load at start, "
                                     "instead of applying them with rabbitmqctl."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: vhost, users (name, role, worker_id, "
                                 "password where made now)."),
) -> None:
    """Create the broker's users with only the rights each role needs (idempotent: a user that exists keeps its
    password); new passwords are printed once and kept in APIARY_HOME/broker-credentials.json (mode 0600)."""
    from urllib.parse import unquote, urlsplit

    from services.app import broker_setup as setup

    settings = Settings()
    where = vhost or unquote(urlsplit(settings.bus_url).path.removeprefix("/")) or "/"
    credentials = settings.home / setup.CREDENTIALS_FILE
    try:
        if definitions is not None:
            made = setup.full_definitions(settings.exchange, where, workers, credentials, shared_workers=shared_workers)
            definitions.write_text(json.dumps(made, indent=1) + "\n")
            print(f"definitions written to {definitions}; passwords in {credentials}")
            return
        result = setup.setup(settings.exchange, where, workers, credentials, shared_workers=shared_workers)
    except (setup.BrokerSetupError, ValueError) as e:
        fail(str(e))
    users = [{"name": u.name, "role": u.role, "worker_id": u.worker_id, "password": result.created.get(u.name)}
             for u in result.users]
    if as_json:
        print(json.dumps({"vhost": where, "users": users}))
        return
    for user in users:
        made = f"APIARY_BUS_USER={user['name']} APIARY_BUS_PASSWORD={user['password']}" if user["password"] else \
            "exists (password unchanged)"
        print(f"{user['role']:<10} {user['worker_id'] or '':<16} {made}")
    console.print(f"[dim]vhost {where}; new passwords are also in {credentials}[/dim]")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
