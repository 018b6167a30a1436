"""One exception per layer, each with a message and a hint. Only cli.py turns them into exit 2."""

from __future__ import annotations


class TfdoctorError(Exception):
    """Base: `message` says what is wrong, `hint` what to do about it."""

    def __init__(self, message: str, hint: str = "") -> None:
        self.message = message
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        return folded(f"{self.message}; {self.hint}" if self.hint else self.message)


def folded(text: str) -> str:
    """`text` on one line: a user's multi-line exception message quoted in tfdoctor's line would
    otherwise leave the last line on stderr someone else's."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return " | ".join(lines)


class UsageError(TfdoctorError):
    """A flag or argument is out of range or contradicts another."""


class LoadError(TfdoctorError):
    """The TARGET could not be imported, found or called."""


class SubjectError(TfdoctorError):
    """The model loaded but cannot be probed: unknown vocabulary, wrong output shape, forward raised."""


class OutputShapeError(SubjectError):
    """The model's output is not logits [B, T, V] (a loss, flattened rows tfdoctor could not place):
    under `tfdoctor run` only the model checks skip; the loop checks still judge the recorded trace."""


class InternalError(Exception):
    """tfdoctor's own code raised while the user's code ran (a hook or patch of the recorder): reported
    as tfdoctor's error with its location, never as the script's."""


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for a one-line report of an exception tfdoctor caught."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def missing_file_hint(path: str, otherwise: str) -> str:
    """The hint for a path that is not a file: the nearest names in its folder ("did you mean
    fixtures/gpt_correct.py?"), else `otherwise`. A folder that does not exist is said first."""
    import difflib
    import os

    folder, name = os.path.split(path)
    folder = folder or "."
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist; {otherwise}"
    try:
        names = [entry for entry in os.listdir(folder)
                 if entry.endswith(".py") or os.path.isdir(os.path.join(folder, entry))]
    except OSError:
        return otherwise
    close = difflib.get_close_matches(name, names, n=2, cutoff=0.6)
    if not close:
        return otherwise
    return "did you mean " + " or ".join(os.path.join(folder, c) if folder != "." else c for c in close) + "?"


def missing_name_hint(name: str, names) -> str:
    """"did you mean 'build'?" for a mistyped attribute, or ""."""
    import difflib

    close = difflib.get_close_matches(name, [n for n in names if not n.startswith("_")], n=2, cutoff=0.6)
    return ("did you mean " + " or ".join(repr(c) for c in close) + "?") if close else ""
