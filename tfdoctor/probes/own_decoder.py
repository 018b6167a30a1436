"""Decode with the model's own generate() method, the way the user's sampling script calls it.

nanoGPT, minGPT and most hand-written GPTs carry `generate(idx, max_new_tokens, temperature=1.0,
top_k=None)`: it crops the context, runs the forward (or a cache of its own) and samples. That code
never runs in training, so a window left-filled with a filler token or a cached token embedded at the
wrong position only shows when this method decodes. This probe finds such a method (defined in the
user's code, not a library's), reads its signature, and calls it greedily on given prompts:

- the prompt is the first positional parameter, as a LongTensor [B, t] on the model's device (one
  Python list per row where the batch is refused, as nanochat's generate(tokens, max_tokens) takes);
- the count of new tokens goes to the parameter that names it (max_new_tokens, max_tokens, steps, ...),
  the total length where the name says so (max_length);
- greedy through its own switches: do_sample=False (or greedy=True, sample=False), top_k=1, else a
  temperature of TEMPERATURE; a seed where it takes one; the model's device where it asks for one;
- with none of those switches, every torch.multinomial draw is taken as its most likely choice for
  the call (the argmax path), and the result says so;
- what it returns is read as prompt + continuation or as the continuation alone (a tensor, the first
  tensor of a tuple, nested lists, or the tokens a generator yields).

Tokens only; the generation check judges them against the memorised batch.
"""

from __future__ import annotations

import contextlib
import inspect
import io
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from tfdoctor.subject import device_of, is_hugging_face
from tfdoctor.usercode.patches import Patches

# The parameter that counts the new tokens, by name (nanoGPT: max_new_tokens; nanochat: max_tokens;
# minGPT: max_new_tokens; other hand-written decoders: steps, num_tokens, n_tokens, length).
NEW_TOKEN_NAMES = ("max_new_tokens", "max_tokens", "new_tokens", "num_new_tokens", "n_new_tokens", "num_tokens",
                   "n_tokens", "tokens_to_generate", "gen_len", "steps", "num_steps", "n_steps", "n", "length")
# Names that count the whole sequence, prompt included (Hugging Face's convention for max_length).
TOTAL_LENGTH_NAMES = ("max_length", "max_len", "total_length", "seq_len")
# Switches that turn sampling off: the value that means greedy.
GREEDY_SWITCHES = {"do_sample": False, "sample": False, "sampling": False, "use_sampling": False, "greedy": True}
# A temperature where the decoder has no other switch: logits / 1e-4 make a token 1e-3 nats behind
# the top one 1e-4 times as likely (exp(-10)); the memorised tokens the check judges lead by >= 1 nat.
TEMPERATURE = 1e-4
# A first parameter that takes text or a tokenizer, not token ids (mamba.py's generate(tokenizer, prompt, ...)).
TEXT_WORDS = ("tokenizer", "enc", "text", "string")


class NotDrivable(Exception):
    """The model's generate() cannot be called or read here: the reason, in the user's terms."""


@dataclass
class OwnDecode:
    method: str  # "GPT.generate"
    location: str  # "path:line" of its def
    tokens: torch.Tensor  # [B, n] prompt then the decoded tokens (n may be shorter than asked: it stopped)
    how: str  # how greedy decoding was asked for: "top_k=1", "do_sample=False", "argmax of torch.multinomial"
    arguments: dict = field(default_factory=dict)  # what it was called with, besides the prompt
    returned: str = ""  # "prompt + new tokens" or "new tokens only"
    sampled: bool = False  # greedy only through the multinomial patch (the argmax path)
    repeatable: Optional[bool] = None  # a second call with another seed gave the same tokens (None: not tried)


def own_generate(model: torch.nn.Module) -> Optional[Callable]:
    """The model's generate method when it is the user's own (defined in a file outside tfdoctor,
    torch and installed packages), else None. A Hugging Face model's generate() (the library's or a
    user's override) is already what cache-consistency and generation drive through transformers."""
    from tfdoctor.usercode.call_sites import is_library

    if is_hugging_face(model):
        return None
    raw = inspect.getattr_static(type(model), "generate", None)
    if raw is None or isinstance(raw, (staticmethod, classmethod, torch.nn.Module)) or not callable(raw):
        return None
    code = getattr(inspect.unwrap(raw), "__code__", None)
    if code is None or is_library(code.co_filename):
        return None
    return getattr(model, "generate")


def describe(method: Callable) -> tuple[str, str]:
    """("Class.generate", "path:line" of its def line) for the report."""
    from tfdoctor.usercode.call_sites import display_path

    func = inspect.unwrap(getattr(method, "__func__", method))
    code = func.__code__
    line = code.co_firstlineno
    try:  # co_firstlineno is the first decorator's line (@torch.no_grad()); the report names the def
        lines, start = inspect.getsourcelines(func)
        line = start + next((i for i, text in enumerate(lines) if text.lstrip().startswith(("def ", "async def "))), 0)
    except (OSError, TypeError):
        pass
    return func.__qualname__, f"{display_path(code.co_filename)}:{line}"


@dataclass
class _Plan:
    prompt: inspect.Parameter
    count: inspect.Parameter
    total: bool  # the count is the whole length, prompt included
    fixed: dict  # argument name -> value, besides the prompt and the count
    how: str
    patch_multinomial: bool


def _plan(method: Callable, device: torch.device, seed: int) -> _Plan:
    try:
        parameters = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError) as exc:
        raise NotDrivable(f"its signature cannot be read ({exc})") from None
    named = [p for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [p for p in named if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional:
        raise NotDrivable("it takes no positional prompt (generate(idx, max_new_tokens, ...) is what is called)")
    prompt = positional[0]
    if any(word in prompt.name.lower() for word in TEXT_WORDS) or prompt.annotation in (str, "str"):
        raise NotDrivable(f"its first parameter is {prompt.name}: it decodes text, not token ids (tfdoctor calls "
                          "generate(ids, n, ...))")
    by_name = {p.name.lower(): p for p in named[1:]}
    count = next((by_name[n] for n in NEW_TOKEN_NAMES + TOTAL_LENGTH_NAMES if n in by_name), None)
    if count is None:  # the second positional parameter without a default, as generate(idx, 100) passes it
        count = next((p for p in positional[1:] if p.default is p.empty and p.name.lower() != "device"), None)
    if count is None:
        raise NotDrivable("none of its parameters says how many tokens to generate "
                          f"({', '.join(p.name for p in named)})")
    fixed: dict = {}
    hows = []
    for p in named:
        name = p.name.lower()
        if p in (prompt, count):
            continue
        if name in GREEDY_SWITCHES:
            fixed[p.name] = GREEDY_SWITCHES[name]
            hows.append(f"{p.name}={GREEDY_SWITCHES[name]}")
        elif name == "top_k":
            fixed[p.name] = 1
            hows.append(f"{p.name}=1")
        elif name in ("seed", "random_seed"):
            fixed[p.name] = seed
        elif name == "device":
            fixed[p.name] = device if "str" not in str(p.annotation) else str(device)
    temperature = next((p for p in named if p.name.lower() in ("temperature", "temp")), None)
    if not hows and temperature is not None:
        fixed[temperature.name] = TEMPERATURE
        hows.append(f"{temperature.name}={TEMPERATURE:g}")
    required = [p.name for p in named if p.default is p.empty and p not in (prompt, count) and p.name not in fixed]
    if required:
        raise NotDrivable(f"it requires {', '.join(required)} besides {prompt.name} and {count.name}, which "
                          "tfdoctor cannot give")
    patch = not hows
    how = ", ".join(hows) if hows else "every torch.multinomial draw taken as its most likely choice"
    return _Plan(prompt, count, count.name.lower() in TOTAL_LENGTH_NAMES, fixed, how, patch)


@contextlib.contextmanager
def _argmax_draws(active: bool) -> Iterator[None]:
    """torch.multinomial (function and method) returning the most likely index for the block: a
    decoder with no greedy switch then decodes its argmax path."""
    if not active:
        yield
        return

    def most_likely(probs, num_samples=1, replacement=False, *, generator=None, out=None):
        top = probs.topk(num_samples, dim=-1).indices
        if out is not None:
            return out.copy_(top)
        return top

    with Patches() as patches:
        patches.setattr(torch, "multinomial", most_likely)
        patches.setattr(torch.Tensor, "multinomial", most_likely)
        yield


def _tokens_of(value) -> Optional[torch.Tensor]:
    """What a generate() returned, as token ids [B, n] on the CPU, or None when it cannot be read."""
    if inspect.isgenerator(value) or (hasattr(value, "__next__") and not isinstance(value, torch.Tensor)):
        value = list(value)
    if isinstance(value, tuple) and value:  # (ids, scores) and the like: the first integer tensor or list
        value = next((v for v in value if isinstance(v, (torch.Tensor, list)) and not
                      (isinstance(v, torch.Tensor) and v.is_floating_point())), value[0])
    if isinstance(value, list):
        try:
            value = torch.tensor([int(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in value])
        except (TypeError, ValueError, RuntimeError):
            return None
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.dim() not in (1, 2):
        return None
    return (value[None] if value.dim() == 1 else value).long().cpu()


def _lined_up(out: torch.Tensor, prompt: torch.Tensor, new: int) -> tuple[torch.Tensor, str]:
    """prompt + continuation, from an output that holds both or the continuation alone (either may
    stop early, at an end-of-sequence token)."""
    B, t = prompt.shape
    if out.shape[0] != B:
        raise NotDrivable(f"it returned {out.shape[0]} sequence(s) for a batch of {B}")
    n = out.shape[1]
    starts_with_prompt = n > t and bool((out[:, :t] == prompt).all())
    if n == t + new and starts_with_prompt:
        return out, "prompt + new tokens"
    if n == new:
        return torch.cat([prompt, out], dim=1), "new tokens only"
    if starts_with_prompt and n < t + new:
        return out, "prompt + new tokens"
    if 0 < n < new:
        return torch.cat([prompt, out], dim=1), "new tokens only"
    raise NotDrivable(f"it returned {list(out.shape)} token ids for a {list(prompt.shape)} prompt and "
                      f"{new} new tokens: neither the prompt followed by its continuation nor the continuation")


def _call(method: Callable, plan: _Plan, prompt, amount: int, seed: int):
    device = prompt.device if isinstance(prompt, torch.Tensor) else None
    devices = [device] if device is not None and device.type == "cuda" else []
    kwargs = dict(plan.fixed)
    args = [prompt]
    if plan.count.kind is plan.count.POSITIONAL_ONLY:
        args.append(amount)
    else:
        kwargs[plan.count.name] = amount
    # a sampler that prints what it decodes (or a progress bar) prints into tfdoctor's report: kept out
    with torch.random.fork_rng(devices=devices), _argmax_draws(plan.patch_multinomial), torch.no_grad(), \
            contextlib.redirect_stdout(io.StringIO()):
        torch.manual_seed(seed)
        out = method(*args, **kwargs)
        # a generator runs its body only when iterated: inside the patch and the seed
        return list(out) if inspect.isgenerator(out) else out


def _row_by_row(method, plan: _Plan, prompt: torch.Tensor, new: int, amount: int, seed: int, device,
                refused: Exception) -> tuple[torch.Tensor, str]:
    """A decoder of one sequence at a time (`assert idx.size(0) == 1`), given each row as a [1, t]
    tensor or, where it takes one (nanochat's generate(tokens, max_tokens)), as a Python list;
    `refused` (what the batch call raised) is raised again where neither works."""
    from tfdoctor.probes.decoding import MODEL_ERRORS

    def one(given):
        out = _tokens_of(_call(method, plan, given, amount, seed))
        if out is None:
            raise NotDrivable("not token ids")
        return out

    rows, how = [], None
    for row in prompt:
        for form, given in (("one [1, t] tensor", row[None].to(device)), ("one Python list", row.tolist())):
            if how not in (None, form):
                continue
            try:
                rows.append(_lined_up(one(given), row[None], new))
                how = form
                break
            except (MODEL_ERRORS + (NotDrivable,)):
                continue
        else:
            raise refused
    width = min(seq.shape[1] for seq, _ in rows)
    return torch.cat([seq[:, :width] for seq, _ in rows]), f"{rows[0][1]}, {how} per sequence"


def decode_with_own_generate(model: torch.nn.Module, prompt: torch.Tensor, new: int, seed: int) -> OwnDecode:
    """The model's own generate() on `prompt` [B, t] for `new` tokens, greedy (see the module doc).
    Raises NotDrivable with the reason when it cannot be called or its output cannot be read; an
    exception the method raises on a batch is retried one row at a time as a Python list, then
    propagates (the caller tells the model's from tfdoctor's)."""
    from tfdoctor.probes.decoding import MODEL_ERRORS

    method = own_generate(model)
    if method is None:
        raise NotDrivable("the model has no generate() method of its own")
    name, location = describe(method)
    device = device_of(model)
    plan = _plan(method, device, seed)
    amount = prompt.shape[1] + new if plan.total else new
    arguments = {plan.count.name: amount, **{k: str(v) if isinstance(v, torch.device) else v
                                              for k, v in plan.fixed.items()}}
    try:
        out = _tokens_of(_call(method, plan, prompt.to(device), amount, seed))
        if out is None:
            raise NotDrivable(f"what {name}() returned is not token ids")
        tokens, returned = _lined_up(out, prompt.cpu(), new)
    except (MODEL_ERRORS + (NotDrivable,)) as refused:
        tokens, returned = _row_by_row(method, plan, prompt.cpu(), new, amount, seed, device, refused)
    return OwnDecode(name, location, tokens, plan.how, arguments, returned, plan.patch_multinomial)
