"""The command-line options several commands take are declared once (tfdoctor/cli/options.py) and taken
by every command they belong to, read off the parser Typer builds and off the cli sources (no process)."""

import re

import pytest

from helpers import ROOT

CLI = ROOT / "tfdoctor" / "cli"
REPORTING = ("check", "run", "watch", "judge", "memory")  # each writes a report: --format, --output
SELECTING = ("check", "run", "watch", "judge")  # each runs checks or judges: --only, --skip, --strict
# memory's flags that share a name with check's but mean a training step's shape or its own formats
# (--batch is the training batch, --format offers rich/json/html): declared with memory, not shared.
MEMORY_OWN = {"--batch", "--vocab", "--device", "--budget", "--format"}
DECLARED = re.compile(r'typer\.(?:Option|Argument)\([^)]*?"(--[\w-]+)"', re.S)


@pytest.fixture(scope="module")
def commands():
    import typer.main

    from tfdoctor.cli import app

    return typer.main.get_command(app).commands


def _flags(command) -> dict:
    return {opt: param for param in command.params for opt in param.opts}


@pytest.mark.parametrize("name", REPORTING)
def test_every_reporting_command_takes_format_and_output(commands, name):
    flags = _flags(commands[name])
    assert {"--format", "--output"} <= set(flags), name
    assert flags["--output"].default is None  # stdout unless told


@pytest.mark.parametrize("flag", ["--only", "--skip", "--strict", "--output"])
def test_a_shared_option_says_the_same_in_every_command(commands, flag):
    helps = {name: _flags(commands[name])[flag].help for name in SELECTING}
    what = {name: text.replace("check ids (comma-separated)", "judges (comma-separated ids)")
            for name, text in helps.items()}  # checks for check and run, judges for watch and judge
    assert len(set(what.values())) == 1, helps


def test_the_seed_and_timeout_defaults_differ_where_the_help_says_so(commands):
    flags = {name: _flags(commands[name]) for name in ("check", "run", "watch")}
    assert flags["check"]["--seed"].default == flags["run"]["--seed"].default == 0
    assert flags["check"]["--timeout"].default == flags["run"]["--timeout"].default == 600
    for flag in ("--seed", "--timeout"):  # watch leaves the user's real run alone unless told
        assert flags["watch"][flag].default is None and "(default: none" in flags["watch"][flag].help


def test_a_flag_two_command_modules_take_is_declared_in_options_only():
    declared: dict[str, set[str]] = {}
    for path in CLI.glob("*.py"):
        for flag in DECLARED.findall(path.read_text(encoding="utf-8")):
            declared.setdefault(flag, set()).add(path.name)
    assert {"--only", "--skip", "--format", "--output", "--strict", "--seed", "--timeout"} <= set(declared)
    twice = {}
    for flag, files in declared.items():
        commands = files - {"options.py"} - ({"memory.py"} if flag in MEMORY_OWN else set())
        if len(commands) > 1 or (commands and "options.py" in files):
            twice[flag] = sorted(files)
    assert not twice, f"declare these once in cli/options.py: {twice}"
