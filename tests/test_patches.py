"""The one patching helper (tfdoctor/usercode/patches.py) and the surface it patches.

- `Patches` puts back exactly what was there, in reverse order, as a `with` block or on an ExitStack;
- every target in PATCHED_TARGETS is patched while its driver runs, wrapped once (no chain of
  wrappers on a hot path), and the very same object (`is`) is back afterwards; nothing a driver
  changes among the callables of torch, os, io, builtins, shutil, sys, tempfile, warnings (their
  modules and classes) is missing from the table;
- no tfdoctor module outside patches.py assigns to a foreign module's or class's attribute.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import os
import pathlib
import sys
import tempfile
import warnings

import pytest
import torch

from tfdoctor.usercode.patches import PATCHED_TARGETS, Patches

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tfdoctor"


# ---------------------------------------------------------------------------------- the helper


class Base:
    def speak(self):
        return "base"


class Child(Base):
    own = "own"


class Flagged:
    """A property on the type, as torch.backends.cudnn's flags are: nothing lands in the instance's dict."""

    def __init__(self):
        self._flag = False

    @property
    def flag(self):
        return self._flag

    @flag.setter
    def flag(self, value):
        self._flag = value


def test_setattr_puts_back_the_very_object():
    own = Child.__dict__["own"]
    with Patches() as patches:
        patches.setattr(Child, "own", "patched")
        assert Child.own == "patched"
    assert Child.__dict__["own"] is own


def test_an_inherited_attribute_is_deleted_again_not_copied_down():
    with Patches() as patches:
        patches.wrap(Child, "speak", lambda original: lambda self: "child " + original(self))
        assert Child().speak() == "child base"
    assert "speak" not in Child.__dict__ and Child().speak() == "base"


def test_a_property_is_set_back_through_its_setter():
    flagged = Flagged()
    with Patches() as patches:
        patches.setattr(flagged, "flag", True)
        assert flagged.flag is True and "flag" not in vars(flagged)
    assert flagged.flag is False and "flag" not in vars(flagged)


def test_wrap_gives_the_replacement_the_original_as_wrapped_and_returns_it():
    original = Base.__dict__["speak"]
    with Patches() as patches:
        replacement = patches.wrap(Base, "speak", lambda orig: lambda self: orig(self).upper())
        assert Base.__dict__["speak"] is replacement and replacement.__wrapped__ is original
        assert Base().speak() == "BASE"
    assert Base.__dict__["speak"] is original


def test_undo_runs_in_reverse_so_the_same_target_patched_twice_ends_as_it_began():
    original = Base.__dict__["speak"]
    namespace = {"kept": 1}
    patches = Patches()
    patches.wrap(Base, "speak", lambda orig: lambda self: "one")
    patches.wrap(Base, "speak", lambda orig: lambda self: "two " + orig(self))
    patches.setitem(namespace, "kept", 2)
    patches.setitem(namespace, "added", 3)
    assert Base().speak() == "two one" and namespace == {"kept": 2, "added": 3}
    patches.undo()
    assert Base.__dict__["speak"] is original and namespace == {"kept": 1}
    patches.undo()  # idempotent: nothing left to undo
    assert Base.__dict__["speak"] is original


def test_on_an_exit_stack_and_when_the_block_raises():
    original = Base.__dict__["speak"]
    with pytest.raises(RuntimeError), contextlib.ExitStack() as stack:
        stack.enter_context(Patches()).setattr(Base, "speak", lambda self: "patched")
        assert Base().speak() == "patched"
        raise RuntimeError("the user's code raised")
    assert Base.__dict__["speak"] is original


def test_an_absent_attribute_raises_unless_told_otherwise():
    with Patches() as patches:
        with pytest.raises(AttributeError):
            patches.setattr(Base, "missing", 1)
        with pytest.raises(AttributeError):
            patches.wrap(Base, "missing", lambda orig: orig)
        assert patches.wrap(Base, "missing", lambda orig: orig, raising=False) is None
        patches.setattr(Base, "missing", 1, raising=False)
        assert Base.missing == 1
    assert not hasattr(Base, "missing")


def test_every_patch_is_undone_even_when_one_undo_raises():
    namespace = {"a": 1}
    patches = Patches()
    patches.setitem(namespace, "a", 2)
    patches.setitem(namespace, "b", 3)
    patches._undo.append(lambda: 1 / 0)  # a put-back that fails: the others still run, the error is raised
    with pytest.raises(ZeroDivisionError):
        patches.undo()
    assert namespace == {"a": 1}


def test_prepend_puts_an_item_first_until_undone():
    items = ["a", "b"]
    with Patches() as patches:
        patches.prepend(items, "first")
        assert items == ["first", "a", "b"]
    assert items == ["a", "b"]


# ---------------------------------------------------------------------------------- the table


def _resolve(owner: str):
    """'module:Qual.name' -> the object; None when it cannot be imported here (safetensors absent)."""
    module_name, _, qualname = owner.partition(":")
    try:
        obj = __import__(module_name, fromlist=["_"])
    except ImportError:
        return None
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _static(site: str) -> list[tuple[object, str]]:
    """The (owner, attribute) pairs the table declares for `site` whose owner resolves here."""
    pairs = []
    for target in PATCHED_TARGETS:
        if target.site == site and not target.owner.startswith("<") and not target.names[0].startswith("<"):
            owner = _resolve(target.owner)
            if owner is not None:
                pairs += [(owner, name) for name in target.names]
    return pairs


_WATCHED_PREFIXES = ("torch", "os", "io", "builtins", "shutil", "sys", "tempfile", "warnings", "safetensors",
                     "transformers.modeling_utils")


@functools.lru_cache(maxsize=1)
def _owners() -> tuple:
    """The modules under _WATCHED_PREFIXES imported (by the first test that asks) and their classes."""
    owners = {}
    dotted = tuple(prefix + "." for prefix in _WATCHED_PREFIXES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.distributed.reduce_op warns when its class is asked for
        for name, module in list(sys.modules.items()):
            if module is None or not (name in _WATCHED_PREFIXES or name.startswith(dotted)):
                continue
            owners[id(module)] = module
            for value in list(vars(module).values()):
                if isinstance(value, type):
                    owners[id(value)] = value
    return tuple(owners.values())


def _snapshot(owners) -> dict:
    held = {}
    for owner in owners:
        for name, value in list(vars(owner).items()):
            held[(id(owner), name)] = (owner, name, value)
    return held


def _function(value):
    return value.__func__ if isinstance(value, (classmethod, staticmethod)) else value


def _callable(value) -> bool:
    return callable(value) or isinstance(value, (classmethod, staticmethod, property))


def _changed(before: dict, owners) -> set[tuple[int, str]]:
    """(id(owner), name) of the callables put in or taken out since `before` (values that are not
    callables, a module's counters and caches, are not patches)."""
    now = _snapshot(owners)
    changed = {key for key in before.keys() - now.keys() if _callable(before[key][2])}
    for key, (_, _, new) in now.items():
        old = before.get(key)
        if old is None:
            if _callable(new):
                changed.add(key)
        elif old[2] is not new and (_callable(old[2]) or _callable(new)):
            changed.add(key)
    return changed


class Watched:
    """Taken before a driver starts. `patched()`, called while it runs: every static target of `sites`
    is patched, wrapped once (no wrapper of a wrapper on a hot path), and every callable changed is
    declared (statically, or by `dynamic(owner, name)`). `all_back()`, after: every value is the very
    one (`is`) that was there before, nothing left behind. `values`: (owner, name) of targets that
    are not callables (sys.argv), checked for being set."""

    def __init__(self, sites: set[str], dynamic=lambda owner, name: False, values: tuple = ()):
        self.declared = [pair for site in sites for pair in _static(site)]
        self.owners = list(_owners())
        known = {id(owner) for owner in self.owners}
        self.owners += [owner for owner, _ in self.declared if id(owner) not in known]
        self.dynamic, self.values = dynamic, values
        self.before = _snapshot(self.owners)
        self.originals = {(id(owner), name): vars(owner).get(name) for owner, name in self.declared + list(values)}

    def patched(self) -> None:
        changed = _changed(self.before, self.owners)
        for owner, name in self.declared:
            original = self.originals[(id(owner), name)]
            if not _callable(original):
                continue
            assert (id(owner), name) in changed, f"{owner!r}.{name} is declared but not patched"
            inner = getattr(_function(vars(owner)[name]), "__wrapped__", None)
            assert inner is None or inner is _function(original), f"{owner!r}.{name}: a wrapper of a wrapper"
        for owner, name in self.values:
            assert vars(owner).get(name) is not self.originals[(id(owner), name)], f"{owner!r}.{name} is not set"
        by_id = {id(owner): owner for owner in self.owners}
        static = {(id(owner), name) for owner, name in self.declared}
        undeclared = [f"{by_id[key[0]]!r}.{key[1]}" for key in changed
                      if key not in static and not self.dynamic(by_id[key[0]], key[1])]
        assert not undeclared, f"patched but not in PATCHED_TARGETS: {undeclared}"

    def all_back(self) -> None:
        now = _snapshot(self.owners)
        values = {(id(owner), name) for owner, name in self.values}
        moved = [f"{owner!r}.{name}" for key, (owner, name, value) in self.before.items()
                 if now.get(key, (None, None, object()))[2] is not value and (_callable(value) or key in values)]
        added = [f"{owner!r}.{name}" for key, (owner, name, value) in now.items()
                 if key not in self.before and _callable(value)]
        assert not moved and not added, f"not put back: {moved}, left behind: {added}"


def _subclass_of(base):
    return lambda owner, name: isinstance(owner, type) and issubclass(owner, base)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, x):
        return self.dropout(self.linear(x))


# Absent from older torch versions (torch>=2.1 is supported): the sites skip them there.
_NEWER_TORCH = {"clip_grads_with_norm_", "get_total_norm"}


def test_the_table_names_sites_and_attributes_that_exist():
    for target in PATCHED_TARGETS:
        assert (PACKAGE / target.site).is_file(), target
        owner = None if target.owner.startswith("<") or target.names[0].startswith("<") else _resolve(target.owner)
        if owner is not None:
            assert all(hasattr(owner, name) for name in target.names if name not in _NEWER_TORCH), target


def test_the_recorder_patches_what_the_table_says():
    from torch.optim.lr_scheduler import LRScheduler

    from tfdoctor.recording.recorder import Recorder

    namespace = {"clip_grad_norm_": torch.nn.utils.clip_grad_norm_}
    exec("def train(model, batches):\n    clip_grad_norm_(model.parameters(), 1.0)\n", namespace)
    clip, forward = namespace["clip_grad_norm_"], _Tiny.__dict__["forward"]
    watched = Watched({"recording/patched_calls.py"}, _subclass_of(LRScheduler))
    with Recorder(_Tiny(), 4).installed(namespace["train"]):
        watched.patched()
        assert namespace["clip_grad_norm_"].__wrapped__ is clip  # `from torch.nn.utils import clip_grad_norm_`
        assert vars(_Tiny)["forward"].__wrapped__ is forward  # the recorded model's class
    watched.all_back()
    assert namespace["clip_grad_norm_"] is clip and vars(_Tiny)["forward"] is forward


def test_the_script_recorder_patches_what_the_table_says():
    pytest.importorskip("transformers.modeling_utils")  # imported: its from_pretrained is patched at once
    from torch.optim.lr_scheduler import LRScheduler

    from tfdoctor.recording.script_recorder import ScriptRecorder

    forward = _Tiny.__dict__["forward"]
    sites = {"recording/patched_calls.py", "recording/script_recorder.py", "recording/pretrained.py",
             "recording/collectives.py"}
    watched = Watched(sites, _subclass_of(LRScheduler))
    with ScriptRecorder(2, None).installed_process_wide():
        _Tiny()(torch.randn(2, 4))  # the first call under grad binds the model: its class's forward is wrapped
        watched.patched()
        assert vars(_Tiny)["forward"].__wrapped__ is forward
    watched.all_back()
    assert vars(_Tiny)["forward"] is forward


def test_from_pretrained_waits_for_transformers_with_a_finder_first_on_meta_path():
    from tfdoctor.recording.pretrained import MODULE, pretrained_loads

    meta_path = list(sys.meta_path)
    held = sys.modules.pop(MODULE, None)  # as in a script that imports transformers after the recorder starts
    try:
        with pretrained_loads({}):
            assert type(sys.meta_path[0]).__name__ == "AfterImport" and sys.meta_path[1:] == meta_path
    finally:
        if held is not None:
            sys.modules[MODULE] = held
    assert sys.meta_path == meta_path


def test_one_rank_of_a_distributed_run_patches_what_the_table_says():
    from torch.utils.data.distributed import DistributedSampler

    from tfdoctor.recording.distributed import RankSession
    from tfdoctor.recording.ranks import RankRecorder
    from tfdoctor.usercode.world import World

    watched = Watched({"recording/ranks.py", "recording/distributed.py"}, _subclass_of(DistributedSampler))
    with RankRecorder(0, 2), RankSession(World(0, 2), 1.0, 1.0).teardown_deferred():
        watched.patched()
    watched.all_back()


def test_the_launcher_patches_what_the_table_says():
    from tfdoctor.process.launch import _loopback_stores, _private_temp

    watched = Watched({"process/launch.py"}, values=((tempfile, "tempdir"),))
    with _private_temp() as folder, _loopback_stores():
        watched.patched()
        assert tempfile.gettempdir() == folder
    watched.all_back()


def test_the_watch_monitor_patches_what_the_table_says():
    from torch.optim.lr_scheduler import LRScheduler

    from tfdoctor.watching.hooks import watching
    from tfdoctor.watching.monitor import Monitor

    watched = Watched({"watching/hooks.py"}, _subclass_of(LRScheduler))
    with watching(Monitor()):
        watched.patched()
    watched.all_back()


def test_the_kept_descriptors_patch_what_the_table_says():
    from tfdoctor.process.fds import keep_open

    read, write = os.pipe()
    try:
        watched = Watched({"process/fds.py"})
        kept = keep_open([read])
        watched.patched()
        os.close(read)  # left open
        os.fstat(read)
        kept.undo()  # the worker never does: its process ends with the run
        watched.all_back()
    finally:
        os.close(read)
        os.close(write)


def test_the_sandbox_patches_what_the_table_says(tmp_path):
    from tfdoctor.process.sandbox.interpose import VIEW_ENV, install

    environment, meta_path = dict(os.environ), list(sys.meta_path)
    (tmp_path / "user").mkdir()
    bytecode = sys.dont_write_bytecode
    watched = Watched({"process/sandbox/interpose.py"})
    installed = install([str(tmp_path / "user")], str(tmp_path / "scratch"))
    try:
        watched.patched()
        assert sys.dont_write_bytecode is True and os.environ["PYTHONDONTWRITEBYTECODE"] == "1"
        assert VIEW_ENV in os.environ and type(sys.meta_path[0]).__name__ == "AfterImport"
        with open(tmp_path / "user" / "written.txt", "w") as out:  # lands in the mirror, not in the folder
            out.write("x")
    finally:
        installed.uninstall()
    watched.all_back()
    assert dict(os.environ) == environment and sys.meta_path == meta_path and sys.dont_write_bytecode == bytecode
    assert not (tmp_path / "user" / "written.txt").exists()


def test_the_probes_patch_what_the_table_says():
    from tfdoctor.probes.own_decoder import _argmax_draws
    from tfdoctor.probes.process_state import training_without_dropout
    from tfdoctor.probes.ties import ties_broken_by_position

    watched = Watched({"probes/own_decoder.py"})
    with _argmax_draws(True):
        watched.patched()
        assert torch.multinomial(torch.tensor([[0.1, 0.9]]), 1).item() == 1
    watched.all_back()
    assert "multinomial" not in vars(torch.Tensor)  # inherited from TensorBase: deleted again, not copied down
    watched = Watched({"probes/ties.py"})
    with ties_broken_by_position():
        watched.patched()
        assert torch.zeros(40).topk(3).indices.tolist() == [0, 1, 2]  # ties: the lowest positions first
    watched.all_back()
    assert "topk" not in vars(torch.Tensor)
    model = _Tiny()
    with training_without_dropout(model):
        assert model.dropout.p == 0.0
    assert model.dropout.p == 0.1


def test_running_a_script_as_main_patches_what_the_table_says(tmp_path):
    from tfdoctor.recording.script import _shown_and_kept
    from tfdoctor.usercode.as_main import as_main

    script = tmp_path / "train.py"
    script.write_text("")
    argv = sys.argv
    watched = Watched({"usercode/as_main.py", "recording/script.py"}, values=((sys, "argv"),))
    with as_main(str(script), None, ("--steps", "2")), warnings.catch_warnings(), _shown_and_kept() as kept:
        watched.patched()
        assert sys.argv == [str(script), "--steps", "2"]
        warnings.warn("heard", UserWarning)
    watched.all_back()
    assert sys.argv is argv and [str(w.message) for w in kept] == ["heard"]


# ---------------------------------------------------------------------------------- no patch elsewhere

# Where a module assigns to a foreign attribute on purpose, and why it is not a patch to undo.
ALLOWED = {
    "tfdoctor/usercode/patches.py": "the helper itself",
    "tfdoctor/process/worker.py": "the worker process's own stdout, stderr and argv, set once at its start (the "
                                  "process ends with the run)",
    "tfdoctor/probes/process_state.py": "torch.backends flags: process switches read and set as values beside "
                                        "torch's setter functions, put back by preserved_process_state",
    "tfdoctor/memory/counter.py": "setattr on the counter's own record (_Storage), not a foreign object",
}


_ANNOTATIONS_ONLY = ("tfdoctor", "typing", "__future__", "collections.abc", "dataclasses")


def _foreign_names(tree: ast.Module) -> set[str]:
    """Names bound to a module or an object imported from outside tfdoctor (typing's are not owners)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names
                      if not alias.name.startswith(_ANNOTATIONS_ONLY)}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and \
                not (node.module or "").startswith(_ANNOTATIONS_ONLY):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _foreign(node: ast.AST, foreign: set[str]) -> bool:
    """A foreign import or an attribute path from one (torch.nn.Module, dist), or a type(...) call. An
    object made by a call (ET.SubElement(...), Console(...)) is the caller's own."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type":
        return True
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in foreign


def foreign_assignments(source: str) -> list[str]:
    """`x.y = ...`, `del x.y`, `setattr(x, ...)` and `delattr(x, ...)` where x is a foreign module or
    class, or a name bound to one in the same function (`cls = type(model)`, `for owner in (dist,
    backend)`, a parameter annotated with a foreign type). setattr/delattr on anything count: their
    first argument is rarely tfdoctor's own."""
    found: list[str] = []
    tree = ast.parse(source)
    _scan(tree, _foreign_names(tree), found)
    return found


def _scan(scope: ast.AST, foreign: set[str], found: list[str]) -> None:
    foreign = set(foreign)
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        foreign |= {arg.arg for arg in scope.args.args + scope.args.kwonlyargs if arg.annotation is not None
                    and any(isinstance(n, ast.Name) and n.id in foreign for n in ast.walk(arg.annotation))}
    body = list(_own_nodes(scope))
    for node in body:  # names bound to a foreign owner in this scope
        if isinstance(node, ast.Assign) and _foreign(node.value, foreign):
            foreign |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.For) and isinstance(node.target, ast.Name) and \
                isinstance(node.iter, (ast.Tuple, ast.List)) and any(_foreign(e, foreign) for e in node.iter.elts):
            foreign.add(node.target.id)
    for node in body:
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
            if isinstance(target, ast.Attribute) and _foreign(target.value, foreign):
                found.append(f"{node.lineno}: {ast.unparse(target)} =")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            found.append(f"{node.lineno}: {ast.unparse(node)[:60]}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            _scan(node, foreign, found)


def _own_nodes(scope: ast.AST):
    """The nodes of `scope` outside the functions and classes nested in it (those themselves included)."""
    for child in ast.iter_child_nodes(scope):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from _own_nodes(child)


def test_the_scan_sees_the_patches_it_is_for():
    bad = '''
import torch
import torch.distributed as dist
from transformers import Trainer

torch.nn.Module.__call__ = None
dist.destroy_process_group, x = None, 1
cls = type(model)
cls.forward = None
for owner in (dist, torch):
    owner.TCPStore = None
def guard(trainer: Trainer):
    trainer.train = None
setattr(owner, "name", None)
'''
    assert len(foreign_assignments(bad)) == 6
    good = '''
import torch
from tfdoctor.usercode.patches import Patches

class Mine:
    def __init__(self):
        self.value = 1
def f(patches: Patches, model):
    patches.setattr(torch.nn.Module, "__call__", None)
    result = Mine()
    result.value = 2
'''
    assert foreign_assignments(good) == []


def test_no_module_patches_outside_the_helper():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name not in ALLOWED:
            found.update({f"{name}:{line}": None for line in foreign_assignments(path.read_text())})
    assert not found, "assign through tfdoctor.usercode.patches.Patches (and add the target to PATCHED_TARGETS), " \
                      f"or allow-list the file with a reason: {list(found)}"
