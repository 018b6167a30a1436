"""Leave the user's model and process as they were found: dropout and batch-norm switched off for a
probe and put back, the RNGs and thread settings a probe may touch (`preserved_process_state`).
The train/eval flags of a block are tfdoctor/modes.py's `evaluation`, one floor down."""

from __future__ import annotations

import contextlib
import random
from typing import Callable, Iterator, TypeVar

import torch

from tfdoctor.modes import evaluation
from tfdoctor.usercode.patches import Patches

T = TypeVar("T")


def _numpy_random():
    """numpy's global RandomState when numpy is already imported (tfdoctor never imports it)."""
    import sys

    numpy = sys.modules.get("numpy")
    return getattr(numpy, "random", None) if numpy is not None else None


# Process-wide switches a user's factory or loop (or a check) may flip, with how to read and set each.
# A check that leaves one changed would change every later check and the user's own process.
_SWITCHES = (
    ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("deterministic algorithms", lambda: (torch.are_deterministic_algorithms_enabled(),
                                          torch.is_deterministic_algorithms_warn_only_enabled()),
     lambda state: torch.use_deterministic_algorithms(state[0], warn_only=state[1])),
    ("anomaly mode", lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
     lambda state: torch.set_anomaly_enabled(state[0], state[1])),
    ("mkldnn", lambda: torch.backends.mkldnn.enabled, lambda v: setattr(torch.backends.mkldnn, "enabled", v)),
    ("cudnn", lambda: (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
                       torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32),
     lambda v: [setattr(torch.backends.cudnn, name, value)
                for name, value in zip(("enabled", "benchmark", "deterministic", "allow_tf32"), v)]),
    # The legacy tf32 flag before the precision: torch refuses to read the precision while the two
    # APIs disagree, and setting the precision last makes them agree again.
    ("cuda matmul tf32", lambda: torch.backends.cuda.matmul.allow_tf32,
     lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v)),
    ("matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
)
_UNREADABLE = object()


def _read(getter):
    try:
        return getter()
    except RuntimeError:  # e.g. the matmul precision while the user has mixed its two APIs: left alone
        return _UNREADABLE


@contextlib.contextmanager
def preserved_process_state() -> Iterator[None]:
    """Restore the RNG streams (Python, numpy, torch CPU and CUDA), thread count, grad mode, and the
    process-wide switches in _SWITCHES (default dtype, deterministic mode, anomaly mode, matmul
    precision, mkldnn/cudnn/tf32 flags)."""
    python_state = random.getstate()
    numpy_random = _numpy_random()
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    cpu_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    threads = torch.get_num_threads()
    grad_enabled = torch.is_grad_enabled()
    switches = [(getter, setter, _read(getter)) for _, getter, setter in _SWITCHES]
    try:
        yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            numpy_random.set_state(numpy_state)
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_grad_enabled(grad_enabled)
        for getter, setter, value in switches:
            # Set only what changed: use_deterministic_algorithms imports TorchDynamo (seconds).
            if value is not _UNREADABLE and _read(getter) != value:
                setter(value)


def training_flags(model: torch.nn.Module) -> list[bool]:
    return [module.training for module in model.modules()]


# A module's registries, left to the checks that change them on purpose (hooks removed in `finally`).
_REGISTRIES = ("_parameters", "_modules")


@contextlib.contextmanager
def preserved_attributes(model: torch.nn.Module) -> Iterator[None]:
    """Every module's plain attributes and buffers as they were: what a forward left on the model (the
    Annotated Transformer's `self.attn = p_attn`, a cache, a rotary table recomputed for a longer
    input) is put back afterwards, and attributes it added are removed. A forward that tracks gradients
    leaves a non-leaf tensor there, which copy.deepcopy(model) refuses: the next check that copies the
    model would end in error where the check run alone passes."""
    saved = [(module, {k: v for k, v in vars(module).items() if k not in _REGISTRIES}, dict(module._buffers))
             for module in model.modules()]
    try:
        yield
    finally:
        for module, attributes, buffers in saved:
            state = module.__dict__
            for name in [k for k in state if k not in attributes and k not in _REGISTRIES]:
                del state[name]
            for name, value in attributes.items():
                if state.get(name, _MISSING) is not value:
                    state[name] = value
            if module._buffers.keys() != buffers.keys() or any(
                    module._buffers[k] is not v for k, v in buffers.items()):
                module._buffers.clear()
                module._buffers.update(buffers)


_MISSING = object()


# Modules whose `p` is a dropout probability, and the words that name a dropout-like rate in a
# module's or a config's attributes (HF: attention_dropout, hidden_dropout_prob, layerdrop,
# drop_path_rate; modules often keep `self.dropout = config.attention_dropout` as a float and call
# F.dropout(x, p=self.dropout, training=self.training)).
DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                   torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)
# Modules that also run differently in train() and eval(): batch statistics against running ones.
BATCH_NORM_MODULES = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
_DROP_WORDS = ("dropout", "layerdrop", "drop_path", "drop_prob", "drop_rate")


def _drop_rates(owner) -> list[str]:
    """The attributes of `owner` that hold a dropout-like rate (a float, never a bool)."""
    return [name for name, value in vars(owner).items()
            if isinstance(value, float) and not isinstance(value, bool) and value > 0
            and any(word in name.lower() for word in _DROP_WORDS)]


@contextlib.contextmanager
def training_without_dropout(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """model.train() for the block with every dropout off: each dropout module's p, each float
    dropout rate a module or a config holds (model.config and its sub-configs) set to 0. Every flag
    and value is put back exactly afterwards.

    For models whose backward refuses eval(): Reformer's reversible layers assert model.training,
    and RWKV's eval forward updates its recurrent state in place, which autograd then rejects."""
    flags = [(module, module.training) for module in model.modules()]
    zeroed = Patches()
    seen: set[int] = set()

    def zero(owner, names) -> None:
        for name in names:
            zeroed.setattr(owner, name, 0.0)

    def zero_config(config) -> None:
        if config is None or id(config) in seen or not hasattr(config, "__dict__"):
            return
        seen.add(id(config))
        zero(config, _drop_rates(config))
        for value in list(vars(config).values()):  # text_config, vision_config, ...
            if type(value).__name__.endswith("Config"):
                zero_config(value)

    try:
        for module in model.modules():
            if isinstance(module, DROPOUT_MODULES) and module.p > 0:
                zero(module, ["p"])
            zero(module, _drop_rates(module))
            zero_config(getattr(module, "config", None))
        model.train()
        yield model
    finally:
        zeroed.undo()
        for module, training in flags:
            module.training = training


class BackwardRefused(Exception):
    """The model could run a forward and backward neither in eval() nor in train() with every
    dropout at p=0 (Reformer in train() needs the sequence length its axial positions factor)."""

    def __init__(self, in_eval: Exception, in_train: Exception):
        from tfdoctor.errors import first_line

        self.in_eval, self.in_train = in_eval, in_train
        super().__init__(f"its backward fails in eval() ({first_line(in_eval)}) and in train() with every "
                         f"dropout at p=0 ({first_line(in_train)})")


class DropoutOff:
    """Dropout off for a training loop on a private copy of a model: eval() for the block, and when
    the first step cannot run there (a backward that refuses eval()), train() with every dropout at
    p=0 from then on (training_without_dropout). `mode` says which."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.mode = "eval"
        self._stack = contextlib.ExitStack()
        self._steps = 0

    def __enter__(self) -> "DropoutOff":
        self._stack.enter_context(evaluation(self.model))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def step(self, step: Callable[[], T]) -> T:
        """step() (a forward and a backward); the first one is retried in train() if eval() fails,
        and BackwardRefused is raised when it fails there too in another way (the same exception
        in both modes is the model's own, and is raised as it is)."""
        self._steps += 1
        if self._steps > 1:
            return step()
        try:
            return step()
        except Exception as first:
            self._stack.close()
            self._stack.enter_context(training_without_dropout(self.model))
            self.mode = "train"
            try:
                return step()
            except Exception as second:
                if type(second) is type(first) and str(second) == str(first):
                    raise  # the same failure in both modes: the model's own, not the mode's
                raise BackwardRefused(first, second) from second
