"""Stopping a script at the steps asked for, also when it catches the stop (`tfdoctor run`).

The stop is a BaseException raised out of the script's optimizer step, so `except Exception` lets
it through as it lets Ctrl-C through. A bare `except:` or `except BaseException:` around the step
swallows it, and the script would train on with tfdoctor still recording: the verdicts would then
judge hundreds of steps the stop was meant to cut off. So once the stop has been raised:
- the recorder records nothing more (the script driver turns its `record` off): the verdicts judge
  the steps asked for and no others;
- every later optimizer step and backward raises it again, before it runs (`Stopper.again`);
- past SWALLOW_LIMIT swallowed stops, the next line of the script's own code raises it too: a line
  trace armed at each raise, which fires once, from inside the handler that swallowed the stop, so
  the stop leaves that handler (a `while True:` around a bare `except:` ends as well). Only then are
  the script's `finally` blocks cut short; the trace is taken off when the script has unwound.
"""

from __future__ import annotations

import sys
from typing import Optional

from tfdoctor.usercode.call_sites import user_frames

# Stops a script may swallow before its own lines raise it: one for a handler around the step that
# logs and carries on, and a couple more for a handler around each micro-batch.
SWALLOW_LIMIT = 3


class StopScript(BaseException):
    """Raised out of the script's optimizer step once the steps asked for are recorded. A BaseException
    so that the script's own `except Exception` handlers let it through, as they do Ctrl-C."""


class Stopper:
    """How often the stop was raised, and the line trace that ends a script which keeps catching it."""

    def __init__(self) -> None:
        self.raised = 0
        self._armed = False
        self._previous = None  # the trace function before ours (a debugger, coverage)

    @property
    def swallowed(self) -> int:
        """Stops the script caught and carried on after: every raise after the first shows one."""
        return max(0, self.raised - 1)

    def stop(self) -> None:
        self.raised += 1
        if self.raised > SWALLOW_LIMIT:
            self._arm()
        raise StopScript()

    def _arm(self) -> None:
        def on_line(frame, event, arg):  # a trace function that raises is taken off by Python: it fires once
            if event == "line":
                self._armed = False
                raise StopScript()
            return on_line

        def on_call(frame, event, arg):  # the script's own new frames get line events, nothing else does
            frames = user_frames(0)
            return on_line if next(frames, None) is frame else None

        if not self._armed:
            self._previous = sys.gettrace()
        for frame in user_frames(1):
            frame.f_trace, frame.f_trace_lines = on_line, True
        self._armed = True
        sys.settrace(on_call)

    def disarm(self) -> None:
        """After the script unwound: no line trace of ours may stay on (the model checks run the
        script's own model code next)."""
        if self._armed or self.raised > SWALLOW_LIMIT:
            sys.settrace(self._previous)
            self._armed = False

    def note(self, steps: int) -> Optional[str]:
        """The line the report shows when the script caught the stop, or None."""
        if not self.swallowed:
            return None
        return (f"the script caught tfdoctor's stop {self.swallowed} time(s) (a bare `except:` or `except "
                f"BaseException:` around its step) and ran on; nothing after the stop at step {steps} was recorded")
