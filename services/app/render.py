"""A job as people read it: the live table, the end-of-run summary and its printed form."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from apiary.dataset import label_order
from services.app.console import results

STATE_STYLE = {"training": "yellow", "reported": "green", "failed": "red", "rejected": "red",
               "assigned": "dim", "offline": "red", "stopped": "dim"}


def render_job(view: dict[str, Any], started: float | None = None) -> Group:
    """A job's live view: round counter (versions for an async job), per-shard state and latest losses,
    aggregated metrics."""
    unit = "version" if view.get("asynchronous") else "round"
    title = Text.assemble(
        (f"{view.get('name') or view['job_id']} ", "bold"),
        (f"[{view['job_id']}] ", "dim"),
        (view["status"], "bold cyan"),
        f"   {unit} {view['round']}/{view.get('num_rounds') or '?'}",
        f" (attempt {view['attempt']})" if view.get("attempt", 1) > 1 else "",
        f"   {time.time() - started:.0f}s" if started else "",
        (f"   {strategy_text(view)}", "dim") if view.get("strategy") else "",
    )
    parts: list[Text | Table] = [title]
    if view.get("code"):
        parts.append(Text(code_text(view["code"]), style="dim"))
    if (spent := privacy_text(view.get("rounds", []))) is not None:
        parts.append(Text(spent, style="dim"))
    if (kept := shard_state_text(view.get("shard_state"))) is not None:
        parts.append(Text(kept, style="dim"))
    if (buffered := async_text(view.get("asynchronous"))) is not None:
        parts.append(Text(buffered, style="dim"))
    parts += [_shards_table(view), _rounds_table(view, unit)]
    if view.get("data_shards"):
        parts.append(data_table(view))
    return Group(*parts)


def code_text(code: dict[str, Any]) -> str:
    """The job's code bundle in one line: `code 3f2a9c0d1e4b (12.3 kB), entrypoint pkg.train:fl_train_model`."""
    size = code.get("size")
    shown = f" ({_bytes(size)})" if isinstance(size, int) else ""
    return f"code {str(code.get('sha256') or '?')[:12]}{shown}, entrypoint {code.get('entrypoint') or '?'}"


def privacy_text(rounds: list[dict[str, Any]]) -> str | None:
    """What differential privacy has spent, from the last aggregated round's metrics: `differential privacy:
    ε 3.189 at δ 1e-05 after round 2, clipping norm 1`; None for a job without it."""
    last = next((r for r in reversed(rounds) if r["status"] == "aggregated"
                 and "dp_clipping_norm" in (r.get("metrics") or {})), None)
    if last is None:
        return None
    metrics = last["metrics"]
    spent = (f"ε {metrics['dp_epsilon']:.4g} at δ {metrics.get('dp_delta', 0):g}" if "dp_epsilon" in metrics
             else "ε unbounded (no noise)")
    return f"differential privacy: {spent} after round {last['round']}, clipping norm {metrics['dp_clipping_norm']:.4g}"


def shard_state_text(kept: dict[str, Any] | None) -> str | None:
    """What the job keeps with its shards in one line: `shard state: 3 shards, 80.0 kB each (240.0 kB in all);
    server state 59.3 kB a round to each worker`; None for a job that keeps none."""
    if not kept:
        return None
    sizes = list((kept.get("bytes_per_shard") or {}).values())
    parts = []
    if sizes:
        each = _bytes(sizes[0]) if len(set(sizes)) == 1 else f"{_bytes(min(sizes))} to {_bytes(max(sizes))}"
        parts.append(f"{len(sizes)} shards, {each} each ({_bytes(int(kept.get('total_bytes') or 0))} in all)")
    if kept.get("server_state_bytes") is not None:
        parts.append(f"server state {_bytes(int(kept['server_state_bytes']))} a round to each worker")
    return "shard state: " + "; ".join(parts)


def _bytes(size: int) -> str:
    if size < 1000:
        return f"{size} B"
    return f"{size / 1000:.1f} kB" if size < 10**6 else f"{size / 1e6:.1f} MB"


def strategy_text(view: dict[str, Any]) -> str:
    """The job's strategy and its parameters in one line: `fedadam (eta=0.1, tau=0.001)`."""
    params = view.get("strategy_params") or {}
    listed = ", ".join(f"{k}={v}" for k, v in params.items())
    return f"{view.get('strategy')}" + (f" ({listed})" if listed else "")


def data_table(view: dict[str, Any]) -> Table:
    """What each worker receives: the split, and each shard's sample count and samples per label."""
    split = view.get("split") or {}
    how = split.get("strategy", "random") + "".join(
        f" {k}={split[k]}" for k in ("alpha", "key", "seed") if k in split and _shows(split["strategy"], k))
    table = Table(box=None, pad_edge=False, show_header=True, header_style="dim", title=f"data: {how}",
                  title_justify="left", title_style="dim")
    for column in ("shard", "samples", "samples per label"):
        table.add_column(column)
    for s in view["data_shards"]:
        table.add_row(str(s["shard"]), str(s["num_samples"]), label_text(s.get("labels")))
    return table


def _shows(strategy: str, key: str) -> bool:
    """Whether a split parameter matters for this split strategy."""
    return key == "seed" or (key == "alpha" and strategy in ("label_skew", "quantity_skew")) or (
        key == "key" and strategy == "group")


MAX_LABELS = 12  # a shard's histogram prints this many labels, the rest as "+N more"


def label_text(labels: dict[str, int] | None) -> str:
    """A label histogram in one line, labels in natural order: `0:48 1:50 2:0 ... +3 more`; '-' without one."""
    if not labels:
        return "-"
    ordered = sorted(labels.items(), key=lambda item: label_order(item[0]))
    shown = " ".join(f"{label}:{count}" for label, count in ordered[:MAX_LABELS])
    return shown + (f" +{len(ordered) - MAX_LABELS} more" if len(ordered) > MAX_LABELS else "")


def _shards_table(view: dict[str, Any]) -> Table:
    table = Table(box=None, pad_edge=False, show_header=True, header_style="dim")
    for column in ("shard", "worker", "state", "loss", "metrics"):
        table.add_column(column)
    for s in view.get("shards", []):
        metrics = s.get("metrics") or {}
        loss = metrics.get("loss")
        others = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k != "loss")
        state = s["state"]
        table.add_row(str(s["shard"]), s.get("worker_id") or "-", Text(state, STATE_STYLE.get(state, "")),
                      f"{loss:.4f}" if isinstance(loss, float) else "-", s.get("error") or others)
    return table


def async_text(view: dict[str, Any] | None) -> str | None:
    """An async job's buffer, staleness and update rates in one line: `async: 5 versions of K=2 from 10 updates;
    staleness 0:6 1:3 2:1; updates/min w1 12.0, w2 2.4`; None for a synchronous job."""
    if not view:
        return None
    histogram = " ".join(f"{h['staleness']}:{h['count']}" for h in view["staleness_histogram"]) or "-"
    rates = ", ".join(f"{w['worker_id']} {w['per_minute']:.3g}" for w in view["workers"]) or "-"
    return (f"async: {view['versions']} versions of K={view['buffer_size']} from {view['updates']} updates "
            f"({view['concurrency']} training at once); staleness {histogram}; updates/min {rates}")


def _rounds_table(view: dict[str, Any], unit: str = "round") -> Table:
    rounds = Table(box=None, pad_edge=False, show_header=True, header_style="dim")
    shown = view.get("rounds", [])[-5:]
    secure = any(r.get("secure_aggregation") for r in shown)
    for column in (unit, "status", "loss", "val_loss", "other aggregated metrics", "evaluation"):
        rounds.add_column(column)
    if secure:
        rounds.add_column("secure aggregation")
    for r in shown:
        metrics = r.get("metrics") or {}
        others = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k not in _ROUND_COLUMNS)
        rounds.add_row(f"{r['round']}" + (f".{r['attempt']}" if r["attempt"] > 1 else ""), r["status"],
                       *(_number(metrics.get(name)) for name in _ROUND_COLUMNS), others or (r.get("reason") or ""),
                       evaluation_text(r), *([secure_text(r.get("secure_aggregation"))] if secure else []))
    return rounds


def secure_text(summary: dict[str, Any] | None) -> str:
    """What secure aggregation did in a round, in one line: `unmasked; threshold 2 of 3; participants 0,1,2;
    masked 0,1; dropped 2 (recovered from shares); signed 0,1; shares from 0,1`; '-' for a round in the clear."""
    if not summary:
        return "-"

    def listed(shards: list[int]) -> str:
        return ",".join(str(s) for s in shards) or "none"

    parts = [summary["stage"], f"threshold {summary['threshold']} of {summary['num_shares']}",
             f"participants {listed(summary.get('participants') or [])}"]
    if summary.get("survivors"):
        parts.append(f"masked {listed(summary['survivors'])}")
    if summary.get("dropped"):
        recovered = " (recovered from shares)" if summary["stage"] == "unmasked" else ""
        parts.append(f"dropped {listed(summary['dropped'])}{recovered}")
    if summary.get("signers"):
        parts.append(f"signed {listed(summary['signers'])}")
    if summary.get("revealed"):
        parts.append(f"shares from {listed(summary['revealed'])}")
    return "; ".join(parts)


def evaluation_text(r: dict[str, Any]) -> Text | str:
    """A round's evaluation of its global model (on a worker): its metrics, why it failed, or nothing."""
    if r.get("evaluation_error"):
        return Text(f"failed: {r['evaluation_error']}", style="red")
    text = ", ".join(f"{k}={v:.4g}" for k, v in (r.get("evaluation") or {}).items())
    shards = r.get("evaluation_shards") or {}
    if not shards:
        return text
    # A personal-layers job: the mean above, then each shard's personalised model by the mean's first score.
    first = next((k for k in (r.get("evaluation") or {}) if k != "num_samples"), None)
    ordered = sorted(shards.items(), key=lambda item: int(item[0]))
    each = " ".join(f"{shard}:{metrics[first]:.3g}" for shard, metrics in ordered if first in metrics)
    return f"{text}; mean of {len(shards)} shards, {first} by shard {each}" if first else text


# The training loss and the held-out (validation) loss, sample-weighted over the round's workers, side by side.
_ROUND_COLUMNS = ("loss", "val_loss")


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "-"


def summary(view: dict[str, Any], duration: float) -> dict[str, Any]:
    """The end-of-run summary (also what `--json` prints)."""
    return {
        "job_id": view["job_id"],
        "name": view.get("name"),
        "status": view["status"],
        "rounds_completed": sum(1 for r in view.get("rounds", []) if r["status"] == "aggregated"),
        "num_rounds": view.get("num_rounds"),
        "final_model": view.get("final_model"),
        "metrics": view.get("metrics") or {},
        "reason": view.get("reason"),
        "privacy": privacy_text(view.get("rounds", [])),
        "errors": view.get("errors") or [],
        "evaluation": before_and_after(view.get("rounds", [])),
        "duration_s": round(duration, 2),
    }


def before_and_after(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The first and the last evaluated rounds' evaluations, `{"before": {"round", "metrics"}, "after": ...}`
    (a built-in job's round 0 is its starting model; a user-code job's first is round 1 or later); only
    `after` where a single round was evaluated, nothing where none was."""
    evaluated = sorted((r for r in rounds if r.get("evaluation")), key=lambda r: (r["round"], r["attempt"]))
    ends = {"before": evaluated[0], "after": evaluated[-1]} if len(evaluated) > 1 else \
        {"after": evaluated[0]} if evaluated else {}
    return {side: {"round": r["round"], "metrics": r["evaluation"]} for side, r in ends.items()}


def print_summary(result: dict[str, Any]) -> None:
    """The summary for people, on stdout: status, rounds, metrics, final model, reason."""
    results.print()
    ok = result["status"] == "completed"
    results.print(f"[bold {'green' if ok else 'red'}]{result['status']}[/] job {result['job_id']} "
                  f"({result['rounds_completed']}/{result['num_rounds'] or '?'} rounds, {result['duration_s']}s)")
    if result["metrics"]:
        results.print("metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in result["metrics"].items()))
    for side, evaluated in (result.get("evaluation") or {}).items():
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in evaluated["metrics"].items())
        results.print(f"evaluation {side} (round {evaluated['round']}): {metrics}")
    if result.get("privacy"):
        results.print(result["privacy"])
    if result["final_model"]:
        results.print(f"final model: {result['final_model']}")
    if result["reason"]:
        # A completed job's reason is not a failure: it stopped early, or its last evaluation failed.
        results.print(f"[{'yellow' if ok else 'red'}]reason:[/] {result['reason']}")


__all__ = ["STATE_STYLE", "before_and_after", "data_table", "label_text", "print_summary", "render_job",
           "strategy_text", "summary"]
