"""The JSON oracle (issue 19): every fixture under `check`, `check --train` and `run`, its JSON report
kept with the timings dropped, so that a redesign can be shown to change no verdict, message or key.

    python bench/json_oracle.py record /tmp/oracle-before          # on the tree before a change
    python bench/json_oracle.py record /tmp/oracle-after --jobs 2  # on the tree after it
    python bench/json_oracle.py compare /tmp/oracle-before /tmp/oracle-after

`record` writes one file per command: the exit code, the JSON on stdout (keys sorted, every key
naming seconds dropped) and, when stdout is not JSON (exit 2), the last line on stderr. `compare`
lists the commands whose files differ, byte for byte, and exits 1 if any does. Each command is
`tfdoctor` as a user types it, from the repository root, with a wall limit (`--timeout`).

What is run:
- `check fixtures/NAME.py:build` for every model fixture with a `build` function;
- `check fixtures/gpt_correct.py:build --train fixtures/loops/NAME.py:train` for every loop, with the
  model and pad id tests/test_trainloop.py pairs it with;
- `run fixtures/scripts/NAME.py` for every script with a `__main__` block (bad/ included; those end
  in exit 2, their line kept), `run --nproc 2` instead for the ddp_*/fsdp_* ones.
Run it twice on one tree first: a command whose output differs between two runs of the same code is
not deterministic, and the comparison then says nothing about it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
TIMING_KEY = re.compile(r"seconds|^time$|^elapsed$|^wall$")


def commands() -> dict[str, list[str]]:
    """name -> tfdoctor arguments, in a stable order."""
    out: dict[str, list[str]] = {}
    for path in sorted(FIXTURES.glob("*.py")):
        if re.search(r"^def build\(", path.read_text(), re.M):
            out[f"check-{path.stem}"] = ["check", f"fixtures/{path.name}:build"]
    model_of, pad_of = _loop_pairs()
    for path in sorted((FIXTURES / "loops").glob("*.py")):
        if not re.search(r"^def train\(", path.read_text(), re.M):
            continue
        model = next((m for prefix, m in model_of.items() if path.stem.startswith(prefix)), "gpt_correct")
        where = "fixtures" if (FIXTURES / f"{model}.py").exists() else "fixtures/loops"
        args = ["check", f"{where}/{model}.py:build", "--train", f"fixtures/loops/{path.name}:train"]
        if path.stem in pad_of:
            args += ["--pad-id", str(pad_of[path.stem])]
        out[f"train-{path.stem}"] = args
    scripts = sorted((FIXTURES / "scripts").glob("*.py")) + sorted((FIXTURES / "scripts" / "bad").glob("*.py"))
    for path in scripts:
        if "__main__" not in path.read_text():
            continue
        relative = path.relative_to(ROOT).as_posix()
        name = relative.removeprefix("fixtures/scripts/").removesuffix(".py").replace("/", "-")
        if path.stem.startswith(("ddp_", "fsdp_")):  # they join a process group: torchrun's ranks only
            out[f"run2-{name}"] = ["run", "--nproc", "2", relative]
        else:
            out[f"run-{name}"] = ["run", relative]
    return out


def _loop_pairs() -> tuple[dict[str, str], dict[str, int]]:
    """The model each loop family trains and the pad ids, as the loop matrix pairs them (tests/helpers.py,
    tests/test_trainloop.py before the suite's helpers had one module)."""
    sys.path[:0] = [str(ROOT / "tests"), str(FIXTURES)]
    try:
        try:  # noqa: PLC0415 - the suite's own table is the one source of the pairs
            import helpers as table
        except ImportError:
            import test_trainloop as table

        return dict(table.MODEL_OF), dict(table.PAD_OF)
    except Exception:  # noqa: BLE001 - a suite that no longer has the table: every loop on the GPT
        return {}, {}


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in sorted(value.items()) if not TIMING_KEY.search(k)}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def record_one(args: list[str], timeout: float) -> str:
    """What one command gave, as the text kept in its file."""
    env = {**os.environ, "COLUMNS": "200"}
    try:
        done = subprocess.run(["tfdoctor", *args, "--format", "json"], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return json.dumps({"args": args, "exit": "timeout"}, indent=1)
    try:
        report = without_timings(json.loads(done.stdout))
        said = ""
    except json.JSONDecodeError:
        report, lines = None, done.stderr.strip().splitlines()
        said = lines[-1] if lines else ""
    return json.dumps({"args": args, "exit": done.returncode, "report": report, "stderr_last_line": said},
                      indent=1, sort_keys=True)


def record(folder: Path, jobs: int, timeout: float, only: str | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    todo = {name: args for name, args in commands().items() if not only or re.search(only, name)}

    def one(item):
        name, args = item
        (folder / f"{name}.json").write_text(record_one(args, timeout) + "\n")
        return name

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for i, name in enumerate(pool.map(one, todo.items()), 1):
            print(f"{i:4d}/{len(todo)} {name}", flush=True)


def compare(before: Path, after: Path) -> int:
    names = sorted({p.name for p in before.glob("*.json")} | {p.name for p in after.glob("*.json")})
    differ = [n for n in names if not (before / n).exists() or not (after / n).exists()
              or (before / n).read_bytes() != (after / n).read_bytes()]
    for name in differ:
        print(f"differs: {name}")
    print(f"{len(names) - len(differ)} of {len(names)} identical")
    return 1 if differ else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("folder", type=Path)
    rec.add_argument("--jobs", type=int, default=1)
    rec.add_argument("--timeout", type=float, default=600)
    rec.add_argument("--only", help="a regular expression on the command names (check-, train-, run-, run2-)")
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        record(args.folder, args.jobs, args.timeout, args.only)
    else:
        sys.exit(compare(args.before, args.after))


if __name__ == "__main__":
    main()
