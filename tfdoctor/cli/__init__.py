"""The `tfdoctor` command: parse, call, render, exit. The only package that prints or exits.

app.py holds the Typer app and the entry point (`main`); options.py declares once the options several
commands take; outcome.py runs a request in the supervised worker and ends every command the same way
(end_command); one module per command registers it on the app (check, run, watch, judge, memory,
catalogue). Torch is imported only by the commands that need it, so `--help`, `checks` and the analytic
`memory` stay fast.
"""

from tfdoctor.cli.app import app, main
# Each module registers its command; --help lists them in this order.
from tfdoctor.cli import check, run, watch, judge, catalogue, memory  # noqa: F401,E402,I001

__all__ = ["app", "main"]
