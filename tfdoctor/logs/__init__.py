"""The logs users already keep, read as the run series `watch` records, for `tfdoctor judge`.

`find_runs(path, tags)` finds every run a file or folder holds (formats: trainer-state, lightning-csv,
tensorboard, jsonl, csv, mlflow), maps each log's names onto the series the run judges read (names.py,
overridden by `tags`: {"loss": "train/loss_epoch"}) and returns one `LoggedRun` per run. A path with no
log it can read raises tfdoctor.errors.UsageError.

No torch anywhere in this package: `tfdoctor judge` starts fast and runs where torch is not installed.
"""

from tfdoctor.logs.discovery import find_runs
from tfdoctor.logs.logged import FORMATS, LoggedRun, LogUnreadable, NothingLogged

__all__ = ["find_runs", "LoggedRun", "FORMATS", "LogUnreadable", "NothingLogged"]
