"""Evidence as data: every key an event carries is declared by its kind's TypedDict
(tfdoctor/recording/events.py), and every key a judge reads off an event is declared too, so a key
renamed on one side only fails here instead of reading as a silent None.

Three views of the same contract:
- written: real traces of fixture loops (`check --train`) and scripts (`run`, in this process) carry
  no undeclared key, and every declared key is written by some trace;
- read at run time: the loop judges (and run's discovery) judge those traces with each payload noting
  every key read off it, which must be declared for that event's kind (aliases included: `first =
  scales[0].data; first["scale"]`);
- read in the source: a static scan of the package for payload reads (`.data["k"]`, `.data.get("k")`,
  `"k" in e.data`, and the same through names bound to payloads) finds no key that no kind declares,
  also on paths the fixtures do not reach.
"""

import ast

import pytest
import torch

from helpers import PAD_ID, PAD_OF, ROOT, model_for, train_fn
from tfdoctor import run_checks
from tfdoctor.recording.events import LOCATED_EVENTS, PAYLOADS, declared_keys
from tfdoctor.registry import select
from tfdoctor.result import Status

# Loops chosen so that every event kind and every optional key is written by at least one of them: the
# plain correct loop (forward, loss, backward, clip, opt_step, zero_grad, sched_step), GradScaler and
# autocast calls on a CUDA scaler disabled on this CPU, a scheduler stepped per micro-batch, a loop that
# updates the weights itself, train()/eval() calls, two optimizers stepped together, a fused LM head, a
# clip handed an exhausted iterator and an optimizer holding frozen parameters.
LOOPS = ["correct", "clip_before_unscale_cuda", "fp16_no_scaler_cuda", "scheduler_every_batch", "manual_sgd",
         "eval_mode_after_validation", "muon_aux_adam", "fused_head", "clip_consumed_iterator",
         "optimizer_of_frozen"]
# Scripts under `run`: two models trained side by side (forwards tagged with their module), nanoGPT's loop
# with a GradScaler (recorded by the script recorder).
SCRIPTS = ["two_models", "nanogpt_clip_before_unscale"]
# Declared keys no finished trace holds: the script recorder removes a backward's `reaches` when it
# settles on the script's model (script_recorder.keep_own_events).
TRANSIENT = {("backward", "reaches")}
# The judges that read a Trace: every check whose function takes the recorded loop.
TRACE_CHECKS = [spec.id for spec in select() if "trace" in spec.inputs]


class NotingPayload(dict):
    """An event's payload (a plain dict, as recorded) that notes every key read off it: (kind, key)."""

    def __init__(self, kind: str, data: dict, reads: set):
        super().__init__(data)
        self.kind, self.reads = kind, reads

    def __getitem__(self, key):
        self.reads.add((self.kind, key))
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.reads.add((self.kind, key))
        return super().get(key, default)

    def __contains__(self, key):
        self.reads.add((self.kind, key))
        return super().__contains__(key)

    def pop(self, key, *default):
        self.reads.add((self.kind, key))
        return super().pop(key, *default)


def noting(trace) -> set:
    """Swap every event's payload for a NotingPayload; returns the set the reads go into."""
    reads: set = set()
    for event in trace.events:
        event.data = NotingPayload(event.kind, event.data, reads)
    return reads


def written(trace) -> set:
    return {(event.kind, key) for event in trace.events for key in event.data}


def undeclared(pairs) -> list:
    return sorted((kind, key) for kind, key in pairs if kind not in PAYLOADS or key not in declared_keys(kind))


def judged_loop(loop: str):
    """(keys written, keys read, the Report) of the trace judges on a loop of fixtures/loops/, recorded as
    `check --train` records it (runner._record_loop: the batches of train_batches, seeded as the run)."""
    from tfdoctor.recording.loop import record_loop, train_batches
    from tfdoctor.subject import Subject, resolve

    torch.manual_seed(0)
    subject = resolve(Subject(model_for(loop), pad_id=PAD_OF.get(loop, PAD_ID), train=train_fn(loop)))
    trace = record_loop(subject, train_batches(subject, 16, torch.Generator().manual_seed(5)))
    keys = written(trace)
    reads = noting(trace)
    report = run_checks(subject, only=TRACE_CHECKS, trace=trace)
    return keys, reads, report


def judged_script(script: str):
    """The same for a script of fixtures/scripts/, recorded and judged as `tfdoctor run` does in its
    worker (process/worker.run_script_request), discovery's reads included."""
    from tfdoctor.recording.discovery import discover, subject_of
    from tfdoctor.recording.script import record_script

    torch.manual_seed(0)
    run = record_script(str(ROOT / "fixtures" / "scripts" / f"{script}.py"), steps=2)
    keys = written(run.trace)
    reads = noting(run.trace)
    facts = discover(run)
    report = run_checks(subject_of(run, facts, {}), only=TRACE_CHECKS, trace=run.trace)
    return keys, reads, report


@pytest.fixture(scope="module")
def judged():
    """target -> (keys written, keys read, Report), each loop and script recorded and judged once."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_checks does for small models: 5 s here, against 60 s on 2 busy cores
    try:
        found = {f"loop {name}": judged_loop(name) for name in LOOPS}
        found.update({f"script {name}": judged_script(name) for name in SCRIPTS})
    finally:
        torch.set_num_threads(threads)
    return found


def test_every_key_written_is_declared_by_its_kind(judged):
    for target, (keys, _, _) in judged.items():
        assert not undeclared(keys), f"{target} wrote keys events.py does not declare: {undeclared(keys)}"


def test_every_declared_key_is_written_by_some_trace(judged):
    """A declaration left behind by a renamed or removed writer is as misleading as a missing one."""
    seen = set().union(*(keys for keys, _, _ in judged.values()))
    declared = {(kind, key) for kind in PAYLOADS for key in declared_keys(kind)}
    assert declared - seen - TRANSIENT == set(), "declared but never written"


def test_every_key_a_judge_reads_is_declared_for_the_kind_it_reads(judged):
    for target, (_, reads, report) in judged.items():
        assert reads, f"no judge read any event of {target}: nothing was checked"
        assert not undeclared(reads), f"judging {target} read undeclared keys: {undeclared(reads)}"
        crashed = {r.id: r.message for r in report.results if r.status is Status.ERROR}
        assert not crashed, f"{target}: the judges must run as on a plain dict"


def test_located_kinds_always_carry_where(judged):
    assert {kind for kind in PAYLOADS if "where" in PAYLOADS[kind].__required_keys__} == LOCATED_EVENTS
    assert "where" not in declared_keys("forward") and "where" not in declared_keys("batch")


def test_noting_payload_reports_a_read_under_another_kinds_key():
    """The run-time view can fail: a judge reading "lr" off an opt_step (its key is "lrs")."""
    from tfdoctor.recording.trace import Event, Trace

    trace = Trace([Event("opt_step", 0, {"lrs": [1e-3], "grad_norm": 1.0})], 1, [], [], [], 0)
    reads = noting(trace)
    assert trace.of("opt_step")[0].data.get("lr") is None
    assert undeclared(reads) == [("opt_step", "lr")]


# --- the source: what the package reads off event payloads ------------------------------------------------

_READERS = ("get", "pop", "setdefault")


class PayloadReads(ast.NodeVisitor):
    """The string keys a module reads off event payloads: `x.data[...]`, `x.data.get(...)` (pop, setdefault)
    and `"k" in x.data`, and the same on names bound to a payload within a function (`first =
    scales[0].data`, `next((e.data for ...), None)`, `forwards.get(i)` of `{...: e.data for ...}`) or to
    a collection of them (`[e.data for ...]`, and a comprehension or loop over one)."""

    def __init__(self):
        self.reads: list[tuple[int, str]] = []
        self.payloads: set[str] = set()  # names bound to one payload in the function being read
        self.collections: set[str] = set()  # names bound to several

    def visit_FunctionDef(self, node):
        outer = self.payloads, self.collections
        self.payloads, self.collections = set(), set()
        for _ in range(3):  # bindings made from other bindings: a few passes reach the fixed point
            for inner in ast.walk(node):
                self._bind(inner)
        self.generic_visit(node)
        self.payloads, self.collections = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def _is_payload(self, node) -> bool:
        if isinstance(node, ast.Attribute) and node.attr == "data":
            return True
        if isinstance(node, ast.Name):
            return node.id in self.payloads
        if isinstance(node, ast.Subscript) or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                                                and node.func.attr == "get"):
            return self._is_collection(node.value if isinstance(node, ast.Subscript) else node.func.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "next":
            return bool(node.args) and self._is_collection(node.args[0])
        return False

    def _is_collection(self, node) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.collections
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            return self._is_payload(node.elt)
        if isinstance(node, ast.DictComp):
            return self._is_payload(node.value)
        return False

    def _bind(self, node) -> None:
        pairs = []
        if isinstance(node, ast.Assign):
            pairs = [(target, node.value) for target in node.targets]
        elif isinstance(node, (ast.For, ast.comprehension)) and self._is_collection(node.iter):
            self._bind_name(node.target, self.payloads)
        for target, value in pairs:
            if self._is_payload(value):
                self._bind_name(target, self.payloads)
            elif self._is_collection(value):
                self._bind_name(target, self.collections)

    @staticmethod
    def _bind_name(target, names: set) -> None:
        if isinstance(target, ast.Name):
            names.add(target.id)

    def visit_Subscript(self, node):
        if self._is_payload(node.value) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            self.reads.append((node.lineno, node.slice.value))
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _READERS and self._is_payload(func.value) \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            self.reads.append((node.lineno, node.args[0].value))
        self.generic_visit(node)

    def visit_Compare(self, node):
        if isinstance(node.left, ast.Constant) and isinstance(node.left.value, str) \
                and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(self._is_payload(c) for c in node.comparators):
            self.reads.append((node.lineno, node.left.value))
        self.generic_visit(node)


def payload_reads(source: str) -> list[tuple[int, str]]:
    """(line, key) of every payload read PayloadReads finds in `source`."""
    visitor = PayloadReads()
    visitor.visit(ast.parse(source))
    return visitor.reads


def _writer_call(node):
    """`node` (a call, or the value assigned, either branch of a conditional) as a writer call
    `X.event("kind", ...)`, or None."""
    if isinstance(node, ast.Assign):
        node = node.value
    if isinstance(node, ast.IfExp):
        node = node.body
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "event" \
            and node.args and isinstance(node.args[0], ast.Constant):
        return node
    return None


def event_writes(source: str) -> list[tuple[int, str, str]]:
    """(line, kind, key) of every key written by a writer call in `source`: the keywords of
    `recorder.event("kind", key=...)`, and `data["key"] = ...` on the payload such a call returned."""
    found = set()  # a nested function is walked with the one around it too
    functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for function in functions:
        returned = {}  # name -> the kind of the payload a writer call returned to it
        for node in ast.walk(function):
            call = _writer_call(node)
            if call is None:
                continue
            kind = call.args[0].value
            found.update((call.lineno, kind, k.arg) for k in call.keywords if k.arg is not None)
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                returned[node.targets[0].id] = kind
        for node in ast.walk(function):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in returned \
                    and isinstance(node.slice, ast.Constant):
                found.add((node.lineno, returned[node.value.id], node.slice.value))
    return sorted(found)


def test_every_key_the_writers_name_is_declared_for_their_kind():
    """The writers, statically: also the keys written on paths the fixtures do not take."""
    found, unknown = 0, []
    for path in sorted((ROOT / "tfdoctor" / "recording").glob("*.py")):
        writes = event_writes(path.read_text())
        found += len(writes)
        unknown += [f"{path.relative_to(ROOT)}:{line} writes {key!r} on {kind}" for line, kind, key in writes
                    if kind not in PAYLOADS or key not in declared_keys(kind)]
    assert found > 40, "the scan no longer sees the writers"  # 62 when written
    assert not unknown, "\n".join(unknown)


def test_the_package_reads_no_key_that_no_kind_declares():
    every = set().union(*(declared_keys(kind) for kind in PAYLOADS))
    found, unknown = 0, []
    for path in sorted((ROOT / "tfdoctor").rglob("*.py")):
        reads = payload_reads(path.read_text())
        found += len(reads)
        unknown += [f"{path.relative_to(ROOT)}:{line} reads {key!r}" for line, key in reads if key not in every]
    assert found > 80, "the scan no longer sees the judges' reads"  # 125 when written
    assert not unknown, "\n".join(unknown)


def test_the_scan_sees_reads_through_names_bound_to_payloads():
    """The static view can fail: each way the package binds a payload, with a misspelt key."""
    source = '''
def judge(trace):
    first = trace.of("scale")[0].data
    regions = [e.data for e in trace.of("autocast") if e.data["requestd"]]
    fp16 = [r for r in regions if r["dtyp"] == "float16"]
    forwards = {e.data["index"]: e.data for e in trace.of("forward")}
    loss = next((e.data for e in trace.of("loss")), None)
    for r in fp16:
        r.get("enabld")
    return first["scael"], forwards.get(0)["input"], "target" in loss, trace.of("clip")[0].data.get("limt")
'''
    keys = sorted(key for _, key in payload_reads(source))
    assert keys == ["dtyp", "enabld", "index", "input", "limt", "requestd", "scael", "target"]


def test_the_scan_sees_the_keys_a_writer_names():
    source = '''
def clip(recorder, params):
    data = recorder.event("clip", how="norm", limt=1.0, **extra)
    data["global_pre_nrom"] = 0.0
    found = recorder.event("scaler_step", scaler=1) if recorder.record else {}
    found["skiped"] = True
'''
    assert [(kind, key) for _, kind, key in event_writes(source)] == [
        ("clip", "how"), ("clip", "limt"), ("clip", "global_pre_nrom"), ("scaler_step", "scaler"),
        ("scaler_step", "skiped")]
