"""When a watched run writes for real, and what the user is told when it does not.

`tfdoctor watch` is the user's real run: its checkpoints, logs and metrics files are the run's result,
and a watched run leaves exactly what `python train.py` leaves. Only where tfdoctor itself cuts the run
short (--max-steps, --max-time) are the user's files protected as under `run` and `check`: a checkpoint
written at step 200 of a run stopped there would otherwise replace the one a finished run left. The
user is told before the run starts and after it ends; `--keep-writes DIR` keeps a copy of what the run
wrote in DIR, never over the user's own files. A --timeout does not protect: it only stops a run that
hangs, and a run that finishes inside it must keep what it made.

Plain strings here: the CLI prints them.
"""

from __future__ import annotations

from typing import Optional

from tfdoctor.usercode.call_sites import display_path

SHOWN = 3  # files named in the line after the run; the report lists up to 20


def cut_short_by(max_steps: Optional[int], max_time: Optional[float]) -> list[str]:
    """The flags that make tfdoctor cut the run short (then the user's files are protected)."""
    return [flag for flag, value in (("--max-steps", max_steps), ("--max-time", max_time)) if value is not None]


def before_line(flags: list[str], keep_in: Optional[str]) -> str:
    kept = f"a copy of them is kept in {keep_in}" if keep_in else "--keep-writes DIR keeps a copy"
    return (f"tfdoctor: {' and '.join(flags)} may cut this run short, so your files are protected: what the run "
            f"writes or deletes goes to a scratch folder, thrown away at the end ({kept}); without "
            f"{'/'.join(flags)} the run writes for real")


def after_line(record: dict, flags: list[str]) -> Optional[str]:
    """What the protected run tried to write, and where it went; None when it wrote nothing."""
    if record.get("error"):
        return f"tfdoctor: the run's files were protected ({' and '.join(flags)}); {record['error']}"
    written, deleted = record.get("written_count", 0), record.get("deleted_count", 0)
    if not written and not deleted:
        return None
    names = [display_path(path) for path in record.get("written", []) + record.get("deleted", [])][:SHOWN]
    more = written + deleted - len(names)
    said = ", ".join(names) + (f" and {more} more" if more > 0 else "")
    where = (f"a copy is kept in {record['kept_in']}" if record.get("kept_in")
             else "thrown away; --keep-writes DIR keeps a copy")
    return (f"tfdoctor: the run wrote or deleted {said} while {' and '.join(flags)} protected your files: "
            f"{where}; your files are as they were")
