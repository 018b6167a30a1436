"""The one way tfdoctor puts something of its own in place of what the user's process holds, and puts
it back: `Patches`, on pytest's MonkeyPatch shape, and `PATCHED_TARGETS`, every target tfdoctor
patches, in one table (tests/test_patches.py checks each is patched while its driver runs and back
after, and that no other module assigns to a foreign attribute).

    with Patches() as patches:                      # or stack.enter_context(Patches())
        patches.wrap(torch.Tensor, "backward", lambda original: ...)  # gets __wrapped__ = original
        patches.setattr(tempfile, "tempdir", folder)
        patches.setitem(namespace, "clip_grad_norm_", wrapper)
    # everything back, in reverse order

`wrap` adds nothing per call: the replacement `make(original)` returns is what the user's code calls,
so a hook on a hot path (the watch monitor's, 3% budget) costs the frames it costs itself.

Standard library only, and no tfdoctor import: the file sandbox loads this file by its path in child
processes where tfdoctor may not be importable (process/sandbox/interpose.py).
"""

from __future__ import annotations

import builtins
from typing import Any, Callable, NamedTuple

_ABSENT = object()  # the owner had no attribute (or key) of its own by that name


def _own(owner: Any, name: str) -> Any:
    """What `owner` holds under `name` itself (its __dict__ entry: a class's raw staticmethod or
    classmethod, not an inherited value), or _ABSENT."""
    try:
        return vars(owner).get(name, _ABSENT)
    except TypeError:  # no __dict__ (slots, a C type's instance): what getattr sees is what it holds
        return getattr(owner, name, _ABSENT)


class Patches:
    """Patches made, undone in reverse order by `undo()` (or on leaving the `with` block) so that every
    owner holds exactly what it held before: an attribute it only inherited is deleted again, not
    set to the inherited value; a property (torch.backends' flags) is set back through its setter."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> "Patches":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def setattr(self, owner: Any, name: str, value: Any, raising: bool = True) -> None:
        """`owner.name = value` until undone. raising: an AttributeError when owner has no `name`."""
        held = _own(owner, name)
        seen = getattr(owner, name, _ABSENT) if held is _ABSENT else held
        if seen is _ABSENT and raising:
            raise AttributeError(f"{owner!r} has no attribute {name!r}")
        builtins.setattr(owner, name, value)
        self._undo.append(lambda: _put_back(owner, name, held, seen))

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any], raising: bool = True) -> Any:
        """`owner.name = make(original)` until undone, the replacement's `__wrapped__` the original (a
        class's own __dict__ entry, or the inherited value; for a classmethod or staticmethod, their
        functions). Returns the replacement; with raising=False an absent `name` is left alone and
        None returned."""
        held = _own(owner, name)
        original = getattr(owner, name, _ABSENT) if held is _ABSENT else held
        if original is _ABSENT:
            if raising:
                raise AttributeError(f"{owner!r} has no attribute {name!r}")
            return None
        replacement = make(original)
        _function(replacement).__wrapped__ = _function(original)
        builtins.setattr(owner, name, replacement)
        self._undo.append(lambda: _put_back(owner, name, held, original))
        return replacement

    def setitem(self, mapping: Any, key: Any, value: Any) -> None:
        """`mapping[key] = value` until undone (the key deleted again when it was not there)."""
        held = mapping[key] if key in mapping else _ABSENT
        mapping[key] = value

        def put_back() -> None:
            if held is _ABSENT:
                mapping.pop(key, None)
            else:
                mapping[key] = held

        self._undo.append(put_back)

    def prepend(self, sequence: list, item: Any) -> None:
        """`item` first in `sequence` (sys.meta_path) until undone, then removed if still there."""
        sequence.insert(0, item)
        self._undo.append(lambda: sequence.remove(item) if item in sequence else None)

    def undo(self) -> None:
        """Put everything back, the last patch first; every patch is undone even if one raises."""
        failed: BaseException | None = None
        while self._undo:
            try:
                self._undo.pop()()
            except BaseException as error:  # noqa: BLE001 - the rest still go back; the first is raised
                failed = failed or error
        if failed is not None:
            raise failed


def _function(value: Any) -> Any:
    """A classmethod's or staticmethod's function (their own __wrapped__ is read-only), else `value`."""
    return value.__func__ if isinstance(value, (classmethod, staticmethod)) else value


def _put_back(owner: Any, name: str, held: Any, seen: Any) -> None:
    if held is not _ABSENT:
        builtins.setattr(owner, name, held)
    elif _own(owner, name) is not _ABSENT:  # the patch shadowed an inherited value: gone again
        builtins.delattr(owner, name)
    elif seen is not _ABSENT:  # a descriptor on the owner's type (a property) took the value: set it back
        builtins.setattr(owner, name, seen)


# ------------------------------------------------------------------ every target tfdoctor patches


class Target(NamedTuple):
    """What is patched: `owner` is "module:Qualname" (resolvable), or "<...>" for an owner known only
    while the user's code runs (its model's class, its Trainer); `names` the attributes or keys."""

    owner: str
    names: tuple[str, ...]
    site: str  # the tfdoctor module that patches it
    driver: str  # which command or context manager has it patched, and for how long


_RECORDER = "recording/patched_calls.py"
_HOOKS = "watching/hooks.py"
_SANDBOX = "process/sandbox/interpose.py"
_CLIP = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                "broadcast", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "send", "recv")
_OS_FILE_CALLS = ("open", "remove", "unlink", "rmdir", "mkdir", "rename", "replace", "truncate", "chmod", "chown",
                  "utime", "setxattr", "removexattr", "link", "symlink", "stat", "lstat", "access", "listdir",
                  "scandir", "listxattr", "getxattr")

PATCHED_TARGETS: tuple[Target, ...] = (
    # The loop recorder (check --train, and run through the script recorder): recorder.installed
    Target("torch.nn.utils:", _CLIP, _RECORDER, "recorder"),
    Target("torch.nn.utils.clip_grad:", _CLIP, _RECORDER, "recorder"),
    Target("<the train function's module globals>", _CLIP, _RECORDER, "recorder (check --train)"),
    Target("torch.amp:GradScaler", ("__init__", "scale", "unscale_", "step", "update"), _RECORDER, "recorder"),
    Target("torch.optim:Optimizer", ("zero_grad",), _RECORDER, "recorder"),
    Target("torch.nn:Module", ("zero_grad", "train"), _RECORDER, "recorder"),
    Target("torch.optim.lr_scheduler:LRScheduler", ("step",), _RECORDER, "recorder"),
    Target("<each LRScheduler subclass defining its own step>", ("step",), _RECORDER, "recorder"),
    Target("torch.amp.autocast_mode:autocast", ("__init__", "__enter__", "__exit__"), _RECORDER, "recorder"),
    Target("<the recorded model's class>", ("forward",), _RECORDER, "recorder"),
    # The script recorder (run): ScriptRecorder.installed_process_wide, around the recorder
    Target("torch.nn:Module", ("__call__", "load_state_dict"), "recording/script_recorder.py", "run"),
    Target("torch.optim:Optimizer", ("__init__",), "recording/script_recorder.py", "run"),
    Target("<each candidate model's class>", ("forward",), "recording/script_recorder.py", "run"),
    Target("transformers.modeling_utils:PreTrainedModel", ("from_pretrained",), "recording/pretrained.py", "run"),
    Target("sys:meta_path", ("<an AfterImport finder, first>",), "recording/pretrained.py",
           "run, until transformers.modeling_utils is imported"),
    Target("torch.distributed:", _COLLECTIVES, "recording/collectives.py", "run"),
    Target("warnings:", ("showwarning",), "recording/script.py", "run"),
    Target("sys:", ("argv",), "usercode/as_main.py", "run, watch"),
    # One rank of run --nproc
    Target("torch.distributed:", ("destroy_process_group",), "recording/distributed.py", "run --nproc, a rank"),
    Target("torch.utils.data.distributed:DistributedSampler", ("__init__",), "recording/ranks.py",
           "run --nproc, a rank"),
    Target("torch.utils.data:DataLoader", ("__init__", "__iter__"), "recording/ranks.py", "run --nproc, a rank"),
    Target("<DistributedSampler and each subclass defining its own>", ("__iter__", "set_epoch"), "recording/ranks.py",
           "run --nproc, a rank"),
    # The launcher of run/watch --nproc
    Target("torch.distributed:", ("TCPStore",), "process/launch.py", "--nproc, the launcher"),
    Target("torch.distributed.elastic.rendezvous.c10d_rendezvous_backend:", ("TCPStore",), "process/launch.py",
           "--nproc, the launcher"),
    Target("tempfile:", ("tempdir",), "process/launch.py", "--nproc, the launcher"),
    # The watch monitor: watching.hooks.watching
    Target("torch.nn.functional:", ("cross_entropy", "nll_loss"), _HOOKS, "watch"),
    Target("torch:Tensor", ("backward",), _HOOKS, "watch"),
    Target("torch.nn:Module", ("train",), _HOOKS, "watch"),
    Target("torch.nn.utils:", ("clip_grad_norm_", "get_total_norm"), _HOOKS, "watch"),
    Target("torch.nn.utils.clip_grad:", ("clip_grad_norm_",), _HOOKS, "watch"),
    Target("torch.amp:GradScaler", ("scale", "unscale_", "step", "update"), _HOOKS, "watch"),
    Target("torch.utils.data:DataLoader", ("__iter__",), _HOOKS, "watch"),
    Target("torch.utils.data.dataloader:_BaseDataLoaderIter", ("__next__",), _HOOKS, "watch"),
    Target("torch.optim.lr_scheduler:LRScheduler", ("__init__", "step"), _HOOKS, "watch"),
    Target("<each LRScheduler subclass defining its own>", ("__init__", "step"), _HOOKS, "watch"),
    # The Hugging Face callback: from Trainer(...) (or on_train_begin) until train() returns or raises
    Target("<the Trainer instance>", ("train",), "integrations/huggingface.py", "TfdoctorCallback"),
    # The worker process (run, watch, check): for its whole life
    Target("os:", ("close", "closerange"), "process/fds.py", "the worker, permanently"),
    # The file sandbox (interposition, where user namespaces are forbidden), in the worker and its children
    Target("os:", _OS_FILE_CALLS, _SANDBOX, "sandbox"),
    Target("builtins:", ("open",), _SANDBOX, "sandbox"),
    Target("io:", ("open",), _SANDBOX, "sandbox"),
    Target("shutil:", ("rmtree",), _SANDBOX, "sandbox"),
    Target("torch:", ("save", "load"), _SANDBOX, "sandbox"),
    Target("torch.serialization:", ("save", "load"), _SANDBOX, "sandbox"),
    Target("safetensors.torch:", ("save_file", "load_file"), _SANDBOX, "sandbox"),
    Target("sys:", ("dont_write_bytecode",), _SANDBOX, "sandbox"),
    Target("<os.environ>", ("TFDOCTOR_SANDBOX_VIEW", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE"), _SANDBOX, "sandbox"),
    Target("sys:meta_path", ("<an AfterImport finder, first>",), _SANDBOX, "sandbox"),
    # Probes (check, run's model checks), for one measurement
    Target("torch:", ("topk",), "probes/ties.py", "a padding probe telling pads from top-k ties"),
    Target("torch:Tensor", ("topk",), "probes/ties.py", "a padding probe telling pads from top-k ties"),
    Target("torch:", ("multinomial",), "probes/own_decoder.py", "a greedy decode"),
    Target("torch:Tensor", ("multinomial",), "probes/own_decoder.py", "a greedy decode"),
    Target("<the model's modules and their configs>", ("p", "<dropout rates>"), "probes/process_state.py",
           "a backward without dropout"),
)
