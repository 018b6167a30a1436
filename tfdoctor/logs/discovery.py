"""From a path to the runs it holds. A file is read as the format its name and content say; a folder is
searched for every log it holds, each run once: a Trainer output folder (its trainer_state.json and its
checkpoints' copies), a TensorBoard run folder (its event files), a Lightning `version_N/metrics.csv`, an
MLflow run folder, a CSV or JSON-lines log whose columns name a series (a data set's `text,label`
columns do not)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import tfdoctor.logs.mlflow as mlflow  # modules, not the package face: no circle with logs/__init__
import tfdoctor.logs.tables as tables
import tfdoctor.logs.tensorboard as tensorboard
import tfdoctor.logs.trainer_state as trainer_state
from tfdoctor.errors import UsageError, missing_name_hint
from tfdoctor.logs.logged import Columns, LoggedRun, LogUnreadable, NothingLogged
from tfdoctor.logs.mapping import logged_run
from tfdoctor.logs.names import role_of

SKIPPED_FOLDERS = {".git", "__pycache__", "node_modules", ".venv", "venv", "site-packages", "wandb"}
MAX_DEPTH = 8  # a folder's logs lie a few levels down (mlruns/<exp>/<run>/metrics/train/loss)
FORMATS_SAID = ("trainer_state.json, Lightning metrics.csv, TensorBoard events.out.tfevents.*, JSON lines or CSV "
                "with a loss column, an MLflow run folder")
# the series that make a CSV/JSONL file a training log rather than data
LOG_SERIES = ("loss", "eval", "lr", "grad_norm")


def find_runs(path, tags: Optional[dict[str, str]] = None, *, following: bool = False) -> list[LoggedRun]:
    """Every run `path` holds, read and mapped (see LoggedRun). UsageError (NothingLogged, LogUnreadable)
    for a path that holds no log it can read, or a --tag that names a column no run has. `following`:
    read by `judge --follow` (facts["logged"]["still_written"] until the log says its run ended)."""
    tags = dict(tags or {})
    root = Path(path)
    if not root.exists():
        raise UsageError(f"{path} does not exist", _missing_hint(root))
    found = _readers(root, tags.get("step"))
    if not found:
        raise NothingLogged(f"no training log found in {path}", f"tfdoctor judge reads {FORMATS_SAID}")
    runs, unreadable = [], []
    for read in found:
        try:
            runs.append(logged_run(read(), tags, following))
        except LogUnreadable as error:
            if len(found) == 1:
                raise
            unreadable.append(error.message)
    if not runs:
        raise LogUnreadable("; ".join(unreadable), "a log being written reads again in a moment (--follow retries)")
    for run in runs:
        run.notes += [f"not read now: {said}" for said in unreadable]
    _check_tags(runs, tags, str(path))
    _check_series(runs, str(path))
    return runs


def _readers(root: Path, step_tag: Optional[str]) -> list[Callable[[], Columns]]:
    if root.is_file():
        reader = _file_reader(root, root.name, step_tag, explicit=True)
        if reader is None:
            raise NothingLogged(f"{root} is not a training log tfdoctor reads", f"tfdoctor judge reads {FORMATS_SAID}")
        return [reader]
    readers: list[Callable[[], Columns]] = []
    outputs: dict[Path, None] = {}
    for folder, names, depth in _walk(root):
        here = Path(folder)
        if mlflow.is_run(here):
            readers.append(lambda here=here: mlflow.read(here, _name(here, root)))
            names[:] = []  # its metrics/ and params/ are its own
            continue
        if any(tensorboard.is_event_file(Path(n)) for n in os.listdir(here)):
            readers.append(lambda here=here: tensorboard.read(tensorboard.event_files(here), _name(here, root), here))
        for entry in sorted(os.listdir(here)):
            file = here / entry
            if entry == trainer_state.FILE_NAME:
                outputs.setdefault(trainer_state.output_folder(file), None)
            elif not tensorboard.is_event_file(file) and file.is_file():
                # Lightning's run is its version folder (metrics.csv beside hparams.yaml)
                name = _name(here if entry == "metrics.csv" else file, root)
                reader = _file_reader(file, name, step_tag, explicit=False)
                if reader is not None:
                    readers.append(reader)
    for output in outputs:
        readers.append(lambda output=output: trainer_state.read(trainer_state.snapshots(output), _name(output, root)))
    return readers


def _file_reader(file: Path, name: str, step_tag: Optional[str], explicit: bool):
    suffix = file.suffix.lower()
    if file.name == trainer_state.FILE_NAME:
        # the file asked for; a copy in a checkpoint when it does not parse now (being written)
        output = trainer_state.output_folder(file)
        fallbacks = [p for p in trainer_state.snapshots(output) if p != file] if output == file.parent else []
        return lambda: _state_or_copy(file, fallbacks, name)
    if tensorboard.is_event_file(file):
        return lambda: tensorboard.read([file], name, file)
    if suffix in tables.CSV_SUFFIXES:
        if not explicit and not _names_a_series(tables.header_of(file)):
            return None
        fmt = "lightning-csv" if file.name == "metrics.csv" and "step" in tables.header_of(file) else "csv"
        return lambda: tables.read_csv(file, name, step_tag, fmt)
    if suffix in tables.JSONL_SUFFIXES:
        if suffix == ".json" and not tables.looks_like_jsonl(file):
            if explicit and _is_state(file):  # a trainer_state.json under another name
                return lambda: trainer_state.read([file], name)
            return None
        if not explicit and not _names_a_series(tables.header_of(file)):
            return None
        return lambda: tables.read_jsonl(file, name, step_tag)
    return None


def _state_or_copy(file: Path, fallbacks: list[Path], name: str) -> Columns:
    try:
        return trainer_state.read([file], name)
    except LogUnreadable:
        if not fallbacks:
            raise
        read = trainer_state.read(fallbacks, name)
        read.notes.insert(0, f"{file} could not be read now (being written?): its newest checkpoint copy read")
        return read


def _is_state(file: Path) -> bool:
    import json

    try:
        return trainer_state.is_trainer_state(json.loads(file.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False


def _names_a_series(header: list[str]) -> bool:
    return any((role_of(name) or _NO_ROLE).series in LOG_SERIES for name in header)


class _NoRole:
    series = ""


_NO_ROLE = _NoRole()


def _walk(root: Path):
    base = len(root.parts)
    for folder, names, _files in os.walk(root):
        depth = len(Path(folder).parts) - base
        names[:] = sorted(n for n in names if n not in SKIPPED_FOLDERS and not n.startswith("."))
        if depth >= MAX_DEPTH:
            names[:] = []
        yield folder, names, depth


def _name(path: Path, root: Path) -> str:
    """A run's label: its path under the folder given (the folder's own name for the folder itself)."""
    try:
        relative = path.relative_to(root).as_posix()
    except ValueError:
        relative = path.as_posix()
    return relative if relative not in ("", ".") else (root.resolve().name or str(root))


def _check_tags(runs: list[LoggedRun], tags: dict[str, str], path: str) -> None:
    """A --tag that names a column no run holds is the user's error (with the nearest names); one that
    some runs lack is a note on those."""
    lacking = {}
    for run in runs:
        for tag in run.missing_tags:
            lacking.setdefault(tag, []).append(run)
    for tag, runs_without in lacking.items():
        if len(runs_without) == len(runs):
            column = tag.partition("=")[2]
            names = sorted({name for run in runs for name in [*run.unread, *run.sources.values()]})
            close = missing_name_hint(column, names)
            raise UsageError(f"--tag {tag}: no column, tag or key {column!r} in {path}",
                             close or (f"its columns are {', '.join(names[:12])}" if names else "it holds no series"))
        for run in runs_without:
            run.notes.append(f"--tag {tag}: not in this run's log")


def _check_series(runs: list[LoggedRun], path: str) -> None:
    """A log with no series the judges read (names the table does not know): what it holds, and how to map."""
    judged = [run for run in runs if run.sources]
    if judged:
        for run in runs:
            if not run.sources:
                run.notes.append("no series recognised: map one with --tag loss=COLUMN")
        return
    names = sorted({name for run in runs for name in run.unread})
    raise NothingLogged(f"no series tfdoctor knows in {path}: its columns are {', '.join(names[:12]) or 'none'}"
                        + (f" and {len(names) - 12} more" if len(names) > 12 else ""),
                        "name them with --tag, e.g. --tag loss=COLUMN --tag eval=COLUMN")


def _missing_hint(path: Path) -> str:
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        return f"the folder {folder} does not exist"
    import difflib

    close = difflib.get_close_matches(path.name, os.listdir(folder), n=2, cutoff=0.6)
    return ("did you mean " + " or ".join(str(folder / c) if str(folder) != "." else c for c in close) + "?") \
        if close else "give a log file or the folder a run logged into"
