"""What the CLI shows: progress bars and tables (on ``out_console``/``err_console``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from shared.client import JobInfo, SyncClient

TERMINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")
err_console = Console(stderr=True)
out_console = Console()


def _describe(progress: dict[str, Any]) -> str:
    """One line of a job event's progress: epoch, loss, accuracy, throughput, load."""
    parts = []
    if "epoch" in progress:
        parts.append(f"epoch {progress['epoch']}/{progress.get('epochs', '?')}")
    if "loss" in progress:
        parts.append(f"loss {progress['loss']:.4f}")
    acc = progress.get("test_accuracy")
    if isinstance(acc, float) and acc == acc:
        parts.append(f"acc {acc:.3f}")
    for key, label in (("test_r2", "r2"), ("test_perplexity", "ppl")):
        value = progress.get(key)
        if isinstance(value, float) and value == value:
            parts.append(f"{label} {value:.3f}")
    if "samples_per_s" in progress:
        parts.append(f"{progress['samples_per_s']:.0f} samples/s")
    if "iteration_ms" in progress:
        parts.append(f"{progress['iteration_ms']:.1f} ms/iter")
    if "convergence" in progress:  # a memory job's iteration
        parts.append(f"convergence {progress['convergence']:.3f}")
    if progress.get("phase") == "load":  # a memory job upserting before its iterations
        parts.append(f"loading {progress.get('loaded', 0)}/{progress.get('memories', '?')}")
    return "  ".join(parts)


class HistoryTable:
    """Prints a train job's history on stdout as its epochs end: a header, then a row each.

    Rows are rich tables of one row with fixed column widths, so that they line up. The
    accuracy column is the task's (``shared.training.tasks``): ``test_acc``, or for a
    regression ``test_mae`` and ``test_r2``, for a language model ``ppl`` and ``tokens/s``,
    chosen by the keys of the first entry; ``convergence`` (L_0 / L_e) last, when the entries
    have it.
    """

    # (title, history key, width in characters, format)
    COLUMNS = (
        ("epoch", "epoch", 5, "{}"),
        ("train_loss", "train_loss", 10, "{:.4f}"),
        ("test_loss", "test_loss", 9, "{:.4f}"),
        ("test_acc", "test_accuracy", 8, "{:.4f}"),
        ("lr", "lr", 9, "{:.3g}"),
        ("samples/s", "samples_per_s", 9, "{:,.0f}"),
    )

    TASK_COLUMNS = {
        "test_r2": (("test_mae", "test_mae", 8, "{:.4f}"), ("test_r2", "test_r2", 8, "{:.4f}")),
        "test_perplexity": (
            ("ppl", "test_perplexity", 8, "{:.3f}"),
            ("tokens/s", "tokens_per_s", 10, "{:,.0f}"),
        ),
    }

    def __init__(self) -> None:
        """Nothing printed yet."""
        self.last_epoch = 0
        self._columns: tuple[tuple[str, str, int, str], ...] = self.COLUMNS

    def update(self, history: list[dict[str, Any]]) -> None:
        """Print the entries of epochs after the last one printed (in epoch order)."""
        for entry in history:
            if entry["epoch"] > self.last_epoch:
                self._row(entry, header=self.last_epoch == 0)
                self.last_epoch = entry["epoch"]

    CONVERGENCE = ("convergence", "convergence", 11, "{:.3f}")

    def _row(self, entry: dict[str, Any], header: bool) -> None:
        if header:
            for key, columns in self.TASK_COLUMNS.items():
                if key in entry:
                    self._columns = (*self.COLUMNS[:3], *columns, *self.COLUMNS[4:])
            if "convergence" in entry:
                self._columns = (*self._columns, self.CONVERGENCE)
        table = Table(show_header=header, box=None, pad_edge=False)
        for title, _, width, _ in self._columns:
            table.add_column(title, justify="right", width=width, no_wrap=True)
        table.add_row(
            *(fmt.format(entry.get(key, float("nan"))) for _, key, _, fmt in self._columns)
        )
        out_console.print(table)


class IterationTable:
    """Prints a memory job's iterations on stdout as their progress events arrive.

    One row per event received (events are coalesced to about 10 a second, so a fast job
    shows a sample of its iterations; the last one always): iteration, milliseconds,
    convergence, and the table's quality (count, mean, min, max strength).
    """

    # (title, width in characters, format, how to read it from a progress event)
    COLUMNS: tuple[tuple[str, int, str, Callable[[dict[str, Any]], Any]], ...] = (
        ("iteration", 9, "{}", lambda p: p["iteration"]),
        ("ms", 9, "{:.1f}", lambda p: p["iteration_ms"]),
        ("convergence", 11, "{:.4f}", lambda p: p["convergence"]),
        ("memories", 12, "{:,}", lambda p: p["quality"]["count"]),
        ("mean", 7, "{:.4f}", lambda p: p["quality"]["mean"]),
        ("min", 7, "{:.4f}", lambda p: p["quality"]["min"]),
        ("max", 7, "{:.4f}", lambda p: p["quality"]["max"]),
    )

    def __init__(self) -> None:
        """Nothing printed yet."""
        self.last_iteration = 0

    def update(self, progress: dict[str, Any]) -> None:
        """Print a row for an iterate event later than the last one printed."""
        if progress.get("phase") != "iterate" or "convergence" not in progress:
            return
        if progress["iteration"] <= self.last_iteration:
            return
        table = Table(show_header=self.last_iteration == 0, box=None, pad_edge=False)
        for title, width, _, _ in self.COLUMNS:
            table.add_column(title, justify="right", width=width, no_wrap=True)
        table.add_row(*(fmt.format(read(progress)) for _, _, fmt, read in self.COLUMNS))
        out_console.print(table)
        self.last_iteration = progress["iteration"]


def follow_job(client: SyncClient, job: JobInfo, as_json: bool) -> JobInfo:
    """Show a progress bar (on stderr, when it is a terminal) until the job ends.

    A train job's history is printed on stdout as a table as its epochs end, a memory job's
    iterations as their events arrive (``IterationTable``), not with ``--json``, whose
    document holds the result. Then prints the final JSON document (``--json``)
    or a short summary on stdout.

    Args:
        client: the client the job was submitted with.
        job: the job as submitted.
        as_json: print ``job.summary()`` as JSON instead of a summary for people.

    Returns:
        The job's final state (asked for once more if the stream ended before the job did).

    Raises:
        NeuroshardError: the job cannot be followed (NOT_FOUND, UNAVAILABLE).
    """
    final = job
    history = HistoryTable()
    iterations = IterationTable()
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=err_console, disable=not err_console.is_terminal) as bar:
        task = bar.add_task(f"{job.job_id} QUEUED", total=None, info="")
        for final, progress in client.watch(job.job_id):
            total = progress.get("steps") or progress.get("iterations")
            done = progress.get("step") or progress.get("iteration") or 0
            bar.update(
                task,
                total=total,
                completed=done,
                info=_describe(progress),
                description=f"{final.job_id} {final.state}",
            )
            if not as_json:
                history.update(progress.get("history", []))
                iterations.update(progress)
    if final.state not in TERMINAL_STATES:  # the stream ended early: ask for the final state
        final = client.get_job(job.job_id)
    if as_json:
        print(json.dumps(final.summary()))
    else:
        history.update((final.result or {}).get("history", []))
        print_result(final)
    return final


def print_result(job: JobInfo) -> None:
    """Print a finished job for people: its state and error, or its result's fields.

    A train job's ``history`` is left out: ``HistoryTable`` prints it.
    """
    if job.state != "SUCCEEDED":
        print(f"{job.job_id} {job.state}: {job.error}")
        return
    print(f"{job.job_id} SUCCEEDED")
    for key, value in (job.result or {}).items():
        if key == "history":
            continue
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, dict | list):
            value = json.dumps(value)
        print(f"  {key}: {value}")


def print_status(status: dict[str, Any]) -> None:
    """Print ``Client.status()`` for people: workers, their links, job counts, slot figures."""
    print_workers(
        status["workers"],
        [
            ("name", "name"),
            ("address", "address"),
            ("state", "state"),
            ("device", "device"),
            ("training", "train_device"),  # the training device; "device" is the memory kernels'
            ("memories", "memories"),
            ("primary", "slots_primary"),
            ("replica", "slots_replica"),
        ],
        title="workers",
    )
    print_workers(
        status["workers"],
        [
            ("name", "name"),
            ("rtt_ms", "rtt_ms"),
            ("bandwidth_mbit", "bandwidth_mbit"),
            ("step_ms", "step_ms"),
            ("health", "health"),
            ("excluded", "excluded"),
        ],
        title="links (measured by the coordinator; - not yet)",
    )
    for w in status["workers"]:
        if w.get("excluded_reason"):
            out_console.print(f"{w['name']} excluded: {w['excluded_reason']}")
        if w.get("readmit_holddown_s"):
            out_console.print(
                f"{w['name']} held down: may rejoin in {w['readmit_holddown_s']:.1f} s, "
                "once the coordinator reaches it"
            )
    jobs = ", ".join(f"{k.lower()} {v}" for k, v in status["jobs"].items() if v) or "none"
    out_console.print(f"jobs: {jobs}")
    if status.get("slots"):
        out_console.print(slot_figures(status))


def print_workers(
    workers: list[dict[str, Any]], columns: list[tuple[str, str]], title: str | None = None
) -> None:
    """Print a table of workers, one row each.

    Args:
        workers: the workers of ``Client.status()`` (or a subset of each one's keys).
        columns: ``(heading, key)`` of each column, in order; values are shown with ``str``
            (floats to 4 significant digits; ``-`` for None or a missing key).
        title: the table's title, if any.
    """
    table = Table(title=title)
    for heading, _ in columns:
        table.add_column(heading)
    for w in workers:
        table.add_row(*(_cell(w.get(key)) for _, key in columns))
    out_console.print(table)


def _cell(value: Any) -> str:
    """A table cell: ``-`` for a figure not measured (None), floats to 4 digits."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def slot_figures(status: dict[str, Any]) -> str:
    """One line of a status's slot figures: slots, map epoch, replication, under-replicated."""
    return (
        f"slots: {status['slots']}  epoch {status['slot_map_epoch']}  replication factor "
        f"{status['replication_factor']}  under-replicated {status['under_replicated_slots']}"
    )


def print_jobs(jobs: list[JobInfo]) -> None:
    """Print a table of jobs: id, kind, state, workers and error."""
    table = Table()
    for col in ("job", "kind", "state", "workers", "error"):
        table.add_column(col)
    for j in jobs:
        table.add_row(j.job_id, j.kind, j.state, ",".join(j.workers), j.error)
    out_console.print(table)


@contextlib.contextmanager
def memories_bar(what: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar of ``total`` memories on stderr when it is a terminal (else nothing).

    Yields:
        ``advance(n)``: count n more memories done.
    """
    columns = (what, BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(
        *columns, console=err_console, disable=not err_console.is_terminal, transient=True
    ) as progress:
        task = progress.add_task(what, total=total)
        yield lambda n: progress.advance(task, n)
