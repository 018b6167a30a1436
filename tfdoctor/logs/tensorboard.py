"""TensorBoard event files (`events.out.tfevents.*`), read with TensorBoard's own reader: every scalar,
by its tag, at the event's step, with the event's wall_time (seconds) as the clock. A run is a folder:
its event files (a resumed run writes a new one) are read in the order they were created, and a step
logged again by a later file replaces the earlier value.

TensorBoard is an optional extra (`pip install 'tfdoctor[logs]'`). Its reader stops at a record cut
short (a file still being written), so a log judged mid-run is read up to the cut.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tfdoctor.errors import UsageError
from tfdoctor.logs.logged import Columns, Point

PREFIX = "events.out.tfevents."


def is_event_file(path: Path) -> bool:
    return path.name.startswith(PREFIX)


def event_files(folder: Path) -> list[Path]:
    # the name holds the creation time (events.out.tfevents.<seconds>.<host>.<pid>.<n>): sorted by it
    return sorted((p for p in folder.iterdir() if is_event_file(p) and p.is_file()), key=_created)


def read(files: list[Path], name: str, where: Path) -> Columns:
    loader = _loader()
    columns = Columns("tensorboard", str(where), name, step_from="the events' step")
    values: dict[str, dict[int, Point]] = {}
    for path in files:
        columns.modified = max(columns.modified, path.stat().st_mtime)
        for event in loader(str(path)).Load():
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                number = _scalar(value)
                if number is not None:
                    values.setdefault(value.tag, {})[int(event.step)] = Point(int(event.step), number, event.wall_time)
    for tag, points in values.items():
        columns.columns[tag] = [points[step] for step in sorted(points)]
    if len(files) > 1:
        columns.notes.append(f"{len(files)} event files read as one run (a later file's value of a step kept)")
    columns.facts["complete"] = None  # an event file never says its run ended
    return columns


def _scalar(value):
    """A summary value's number: TF1 / torch SummaryWriter write simple_value, TF2 a 0-d tensor."""
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor") and not value.tensor.tensor_shape.dim:
        from tensorboard.util import tensor_util

        try:
            array = tensor_util.make_ndarray(value.tensor)
        except Exception:  # noqa: BLE001 - a tensor of a kind we do not read (a string, an image)
            return None
        if array.dtype.kind in "fiu":
            return float(array.item())
    return None


def _loader():
    try:
        logging.getLogger("tensorboard").setLevel(logging.ERROR)  # its "running without TensorFlow" notice
        from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    except ImportError as error:
        raise UsageError(f"reading TensorBoard event files needs the tensorboard package ({error.name} is not "
                         "installed)", "install tfdoctor[logs]: pip install 'tfdoctor[logs]'") from None
    return LegacyEventFileLoader


def _created(path: Path):
    parts = path.name[len(PREFIX):].split(".")
    return (int(parts[0]) if parts and parts[0].isdigit() else 0, path.name)
