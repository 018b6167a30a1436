"""What a recorded script showed, turned into the facts `tfdoctor run` reports under "discovered" and
the Subject its checks run on: the model and how the script called it, its batches (shape, pad id
and where it was read from, padding side, packed rows), whether it loaded a checkpoint first.

The recorder (script_recorder.py, driven by script.py) only watches; this module reads its Trace and the
recorded forward. The model checks then call the snapshot the way the script did
(`replay_forward`), with every per-token argument rebuilt for the probe's own ids.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Any, Callable, Optional

import torch

from tfdoctor.recording.logits import capturing, flattened, unflattening
from tfdoctor.recording.script import ScriptRun
from tfdoctor.recording.trace import Trace
from tfdoctor.recording.wrappers import unwrap, users_class
from tfdoctor.subject import PACKING_POSITION_IDS as PACKING_BY_POSITION_IDS
from tfdoctor.usercode.call_sites import display_path

# Probe length for the model checks when the script's batches are longer: the dependency map and
# the padding probes cost one perturbed row per position, and every masking bug they catch shows at
# any length, so the battery stays at seconds on a CPU for a 1024-token script.
MAX_PROBE_SEQ_LEN = 64
# A pad id read off the batches must explain this share of the positions its evidence marks (the
# attention mask's zeros, the targets set to ignore_index): prompt tokens masked with -100 in
# instruction tuning spread over many ids and stay below it.
PAD_SHARE_MIN = 0.9
# Runs of one id at the rows' ends read as padding (a script that does not mask its pads) when at
# least this share of the rows ends in such a run, of at least two tokens, with lengths that differ
# (random or natural text almost never does; padded batches always do).
PAD_RUN_ROWS_MIN = 0.5
PAD_RUN_MIN = 2
# Keyword arguments of the recorded forward that the model checks rebuild for their own ids.
_MASK_WORDS = ("mask",)
_POSITION_WORDS = ("position",)
# Arguments that carry document boundaries in packed training (flash-attention varlen, Mamba, custom
# document masks); seen in a recorded forward, they say the rows are packed.
_DOCUMENT_ARGUMENTS = ("doc_ids", "document_ids", "seq_idx", "segment_ids", "sequence_ids")


def _training_forwards(trace: Trace) -> list[dict]:
    return [e.data for e in trace.events if e.kind == "forward" and e.data.get("grad", True)]


def _ids_key(call: Optional[dict]) -> Optional[tuple[str, Any]]:
    """Where the token ids sit in the recorded call: ("arg", i) or ("kwarg", name)."""
    if call is None:
        return None
    for i, spec in enumerate(call["args"]):
        if spec["tensor"] and not spec["floating"] and len(spec["shape"]) == 2:
            return ("arg", i)
    for name in ("input_ids", "idx", "ids", "tokens", "x", "src"):
        spec = call["kwargs"].get(name)
        if spec and spec["tensor"] and not spec["floating"] and len(spec["shape"]) == 2:
            return ("kwarg", name)
    return None


# Keyword arguments that hold the decoder's token ids (tgt, tgt_in, trg, decoder_input_ids), and
# words that say an argument holds something else.
_DECODER_WORDS = ("tgt", "trg", "decoder")
_NOT_DECODER_WORDS = ("label", "target", "mask", "position", "token_type")


def _decoder_key(trace: Trace, call: Optional[dict]) -> Optional[tuple[str, Any]]:
    """Where an encoder-decoder's second id tensor (the decoder input, `model(src, tgt_in)`) sits in
    the recorded call, or None. A second [B, T] integer argument (by keyword: one named tgt / trg /
    decoder) is the decoder's ids unless it is
    what the loss grades (nanoGPT's `model(X, Y)`: the targets of that forward's loss, or ids with
    -100 in them), a mask (only 0 and 1), or positions or document ids (rows that never decrease)."""
    key = _ids_key(call)
    if key is None or type(_value_of(call, key)).__module__.startswith("transformers."):
        return None
    first = next((e.data for e in trace.events if e.kind == "forward" and e.data.get("grad", True)), None)
    graded = [e.data["targets"] for e in trace.events if e.kind == "loss" and "targets" in e.data
              and first is not None and e.data.get("forward") == first["index"]]
    keys = [("arg", i) for i in range(len(call["args"]))] + [("kwarg", name) for name in call["kwargs"]]
    for other in keys:
        spec = call["args"][other[1]] if other[0] == "arg" else call["kwargs"][other[1]]
        if other == key or not spec["tensor"] or spec["floating"] or len(spec["shape"]) != 2:
            continue
        name = str(other[1]).lower()
        if other[0] == "kwarg" and (not any(w in name for w in _DECODER_WORDS)
                                    or any(w in name for w in _NOT_DECODER_WORDS)):
            continue  # by keyword, only a name that says decoder (doc_ids, segment ids are not)
        ids = spec["value"]
        if bool((ids < 0).any()) or bool(((ids == 0) | (ids == 1)).all()):
            continue
        if bool((ids[:, 1:] >= ids[:, :-1]).all()):
            continue  # positions 0..T-1, document / segment ids: rows that never decrease
        if any(t.numel() == ids.numel() and bool((t == ids.reshape(-1).cpu()).all()) for t in graded):
            continue
        return other
    return None


def _value_of(call: dict, key) -> Any:
    return (call["args"][key[1]] if key[0] == "arg" else call["kwargs"][key[1]])["value"]


def _first_ids(trace: Trace, call: Optional[dict]) -> Optional[torch.Tensor]:
    key = _ids_key(call)
    if key is None:
        return None
    spec = call["args"][key[1]] if key[0] == "arg" else call["kwargs"][key[1]]
    return spec["value"]


def _all_ids(trace: Trace, call: Optional[dict]) -> list[torch.Tensor]:
    """The token ids of every recorded forward (the real batches)."""
    key = _ids_key(call)
    if key is None:
        return []
    name = str(key[1])
    return [dict(f["inputs"])[name] for f in _training_forwards(trace) if name in dict(f["inputs"])]


def _majority(values: torch.Tensor) -> Optional[tuple[int, float]]:
    if values.numel() == 0:
        return None
    ids, counts = values.unique(return_counts=True)
    top = int(counts.argmax())
    return int(ids[top]), float(counts[top]) / values.numel()


def _side(ids: torch.Tensor, pad: int) -> Optional[str]:
    """Where the pads of these rows sit: "right" (after the tokens), "left", or None."""
    is_pad = ids == pad
    rows = is_pad.any(-1)
    if not bool(rows.any()):
        return None
    right = bool((is_pad[:, -1] | ~rows).all())
    left = bool((is_pad[:, 0] | ~rows).all())
    return "right" if right and not left else "left" if left and not right else None


def discover_padding(trace: Trace, call: Optional[dict]) -> dict:
    """pad_id, where it was read from, and padding side, from what the batches show."""
    batches = _all_ids(trace, call)
    if not batches:
        return {}
    found: Optional[tuple[int, str]] = None
    forwards = _training_forwards(trace)
    key = str(_ids_key(call)[1])
    # 1. an attention mask given to the model: the ids where it is 0; 2. labels= set to -100 where the
    # ids are pads (Hugging Face)
    for other, blank, source in (("attention_mask", 0, "attention_mask"), ("labels", -100, "labels == -100")):
        values = [inputs[key][inputs[other] == blank] for inputs in (dict(f["inputs"]) for f in forwards)
                  if key in inputs and other in inputs and inputs[other].shape == inputs[key].shape]
        best = _majority(torch.cat(values)) if values else None
        if best and best[1] >= PAD_SHARE_MIN:
            found = (best[0], source)
            break
    # 3. loss targets equal to the loss's ignore_index: the target of position t is input t+1
    if found is None:
        values = []
        by_forward = {f["index"]: dict(f["inputs"]).get(key) for f in forwards}
        for loss in (e.data for e in trace.events if e.kind == "loss" and "targets" in e.data):
            targets = loss["targets"]
            ids = by_forward.get(loss["forward"])  # the forward whose output this loss graded
            if ids is None or ids.numel() != targets.numel():
                continue
            ignored = (targets.reshape(ids.shape) == loss["ignore_index"])[:, :-1]
            values.append(ids[:, 1:][ignored])
        best = _majority(torch.cat(values)) if values else None
        if best and best[1] >= PAD_SHARE_MIN:
            found = (best[0], "targets set to ignore_index")
    # 4. rows that end (or start) in a run of one id, of differing lengths: padding nobody masks
    if found is None:
        found = _runs(batches)
    if found is None:
        return {}
    pad, source = found
    return {"pad_id": pad, "pad_id_source": source, "padding_side": _padding_side(batches, pad)}


def _padding_side(batches: list[torch.Tensor], pad: int) -> Optional[str]:
    sides = Counter(s for s in (_side(ids, pad) for ids in batches) if s)
    return sides.most_common(1)[0][0] if sides else None


def tokenizer_padding(trace: Trace, call: Optional[dict], padding: dict,
                      tokenizers: list[tuple[str, int]]) -> tuple[dict, Optional[str]]:
    """The pad id a visible tokenizer gives (its pad_token_id), which wins over what the batches
    showed; the batches' own evidence is kept beside it, and a disagreement is a note. Unchanged
    `padding` (and no note) when the script holds no tokenizer with a pad token."""
    if not tokenizers:
        return padding, None
    where, pad = tokenizers[0]
    found = {"pad_id": pad, "pad_id_source": "tokenizer.pad_token_id", "tokenizer": where,
             "padding_side": _padding_side(_all_ids(trace, call), pad)}
    note = None
    if padding.get("pad_id") is not None:
        found.update(batch_pad_id=padding["pad_id"], batch_pad_id_source=padding["pad_id_source"])
        if padding["pad_id"] != pad:
            note = (f"the tokenizer ({where}) pads with {pad} but the batches mark {padding['pad_id']} as padding "
                    f"({padding['pad_id_source']}); judged with {pad}: pass --pad-id {padding['pad_id']} if the "
                    "batches are right")
    return found, note


def discover_packing(trace: Trace) -> dict:
    """Whether the script trains on packed rows, as the recorded forwards show it: a document-id
    argument, or position ids that restart inside a row (the Hugging Face flattening collator).
    Either turns packing-isolation on (see _packing_for)."""
    for forward in _training_forwards(trace):
        inputs = dict(forward["inputs"])
        positions = inputs.get("position_ids")
        named = next((name for name in _DOCUMENT_ARGUMENTS if name in inputs), None)
        if named:
            return {"packed": "documents", "packed_source": f"a document-id argument ({named}=...)"}
        if positions is not None and positions.shape[-1] > 1 and bool((positions[:, 1:] <= positions[:, :-1]).any()):
            return {"packed": "position_ids", "packed_source": "position_ids restart inside a row"}
    return {}


def _runs(batches: list[torch.Tensor]) -> Optional[tuple[int, str]]:
    for where, flip in (("end", False), ("start", True)):
        runs = []
        for ids in batches:
            rows = ids.flip(-1) if flip else ids
            for row in rows:
                value = int(row[-1])
                same = (row == value).flip(0).int().cumprod(0)
                runs.append((value, int(same.sum())))
        if not runs:
            continue
        value, _ = Counter(v for v, _ in runs).most_common(1)[0]
        lengths = [n for v, n in runs if v == value and n >= PAD_RUN_MIN]
        if len(lengths) >= PAD_RUN_ROWS_MIN * len(runs) and len(set(lengths)) > 1:
            return value, f"runs of one id at the rows' {where}"
    return None


def _describe_call(call: Optional[dict], ids_key, decoder_key=None) -> str:
    """model(ids, targets) / model(input_ids=ids, labels=..., attention_mask=...) / an
    encoder-decoder's model(src_ids, tgt_ids)."""
    if call is None:
        return "(not called)"
    labels = {ids_key: "src_ids" if decoder_key else "ids", decoder_key: "tgt_ids"}
    parts = []
    for i, spec in enumerate(call["args"]):
        parts.append(labels.get(("arg", i)) or _short(spec))
    for name, spec in call["kwargs"].items():
        parts.append(f"{name}={labels.get(('kwarg', name)) or _short(spec)}")
    return f"model({', '.join(parts)})"


def _short(spec: dict) -> str:
    if spec["tensor"]:
        return f"{spec['dtype']}{spec['shape']}"
    if spec.get("opaque"):
        return spec["opaque"]
    return repr(spec["value"])


def replay_forward(call: Optional[dict], model: torch.nn.Module, pad_id: Optional[int],
                   decoder_key=None) -> tuple[Optional[Callable], str]:
    """forward(model, ids) that calls the model the way the script did, with every [B, T] argument
    rebuilt for the probe's ids: targets and labels from the ids, masks from (ids != pad_id) (all ones
    without a pad id), positions 0..T-1; other arguments as recorded. None (with the reason) when the
    plain call model(ids) is the script's, or the model is a Hugging Face one, whose adapter already
    passes attention_mask, or the call cannot be rebuilt."""
    key = _ids_key(call)
    if call is None or key is None:
        return None, "no forward with token ids was recorded"
    if type(model).__module__.startswith("transformers."):
        return None, "Hugging Face model: called as tfdoctor calls them (input_ids, attention_mask)"
    if key == ("arg", 0) and len(call["args"]) == 1 and not call["kwargs"]:
        return None, "called with the ids alone"
    if decoder_key is not None:
        return _replay_seq2seq(call, key, decoder_key, pad_id)
    shape = (call["args"][key[1]] if key[0] == "arg" else call["kwargs"][key[1]])["shape"]
    recorded_ids = _value_of(call, key)

    def rebuild(name: str, spec: dict, ids: torch.Tensor):
        if not spec["tensor"]:
            return spec["value"]
        if spec["shape"] != shape:  # not per token: passed as recorded (a fixed buffer, a flag tensor)
            return spec["value"]
        dtype = getattr(torch, spec["dtype"])
        lowered = name.lower()
        if any(w in lowered for w in _MASK_WORDS) or _padding_mask(spec, recorded_ids, pad_id):
            # a mask by name, or an unnamed one (model(ids, mask)): its 0/1 values mark the pads
            keep = ids != pad_id if pad_id is not None else torch.ones_like(ids, dtype=torch.bool)
            marks_pads = _padding_mask(spec, recorded_ids, pad_id) == "pads"  # key_padding_mask: True = pad
            return (~keep if marks_pads else keep).to(dtype)
        if any(w in lowered for w in _POSITION_WORDS):
            return torch.arange(ids.shape[1], device=ids.device).expand_as(ids).to(dtype)
        if name in _DOCUMENT_ARGUMENTS:  # a probe row is one document
            return torch.zeros_like(ids, dtype=dtype)
        if spec["floating"]:
            return torch.ones_like(ids, dtype=dtype)
        # targets / labels: the ids themselves (the logits, not the loss, are probed; pads ignored)
        targets = ids.clone().to(dtype)
        if pad_id is not None:
            targets = targets.masked_fill(ids == pad_id, -100)
        return targets

    def forward(m, ids, replaced=None):
        replaced = replaced or {}
        args = [ids if key == ("arg", i) else rebuild(f"arg{i}", spec, ids) for i, spec in enumerate(call["args"])]
        kwargs = {name: ids if key == ("kwarg", name) else replaced[name] if name in replaced
                  else rebuild(name, spec, ids) for name, spec in call["kwargs"].items()}
        return m(*args, **kwargs)

    return forward, "as the script called it"


def _padding_mask(spec: dict, recorded_ids: Any, pad_id: Optional[int]) -> Optional[str]:
    """Whether a recorded [B, T] argument is the rows' padding mask, told by its values: "keep" when it
    is (ids != pad_id) (an attention mask), "pads" when it is (ids == pad_id) (a key-padding mask), None
    otherwise (or without a pad id to compare with)."""
    value = spec.get("value")
    if pad_id is None or not isinstance(value, torch.Tensor) or not isinstance(recorded_ids, torch.Tensor) \
            or value.shape != recorded_ids.shape or value.is_floating_point():
        return None
    if not bool(((value == 0) | (value == 1)).all()):
        return None
    pads = (recorded_ids == pad_id).to(value.device)
    if torch.equal(value.bool(), ~pads):
        return "keep"
    return "pads" if torch.equal(value.bool(), pads) else None


def _replay_seq2seq(call: dict, key, decoder_key, pad_id: Optional[int]) -> tuple[Optional[Callable], str]:
    """An encoder-decoder's forward(model, src, tgt) as the script called it: model(src, tgt) as
    `check` calls a seq2seq model when those are its only arguments; otherwise every other [B, *]
    argument rebuilt from the probe's source ids (from the target ids when its name says tgt /
    decoder): masks from (ids != pad_id), positions 0..T-1, the rest as recorded."""
    if (key, decoder_key) == (("arg", 0), ("arg", 1)) and len(call["args"]) == 2 and not call["kwargs"]:
        return None, "called as model(src_ids, tgt_ids), as tfdoctor calls an encoder-decoder"

    def rebuild(name: str, spec: dict, src: torch.Tensor, tgt: torch.Tensor):
        if not spec["tensor"] or len(spec["shape"]) != 2:
            return spec["value"]
        ids = tgt if any(w in name.lower() for w in ("tgt", "decoder", "trg")) else src
        dtype = getattr(torch, spec["dtype"])
        if any(w in name.lower() for w in _MASK_WORDS):
            mask = ids != pad_id if pad_id is not None else torch.ones_like(ids, dtype=torch.bool)
            return mask.to(dtype)
        if any(w in name.lower() for w in _POSITION_WORDS):
            return torch.arange(ids.shape[1], device=ids.device).expand_as(ids).to(dtype)
        return spec["value"]

    def forward(m, src, tgt):
        given = {key: src, decoder_key: tgt}
        args = [given.get(("arg", i)) if ("arg", i) in given else rebuild(f"arg{i}", spec, src, tgt)
                for i, spec in enumerate(call["args"])]
        kwargs = {name: given[("kwarg", name)] if ("kwarg", name) in given else rebuild(name, spec, src, tgt)
                  for name, spec in call["kwargs"].items()}
        return m(*args, **kwargs)

    return forward, "as the script called it (source and target ids)"


def replay_packed(call: Optional[dict], model: torch.nn.Module, pad_id: Optional[int]) -> Optional[Callable]:
    """packing-isolation's fn(model, ids, doc_ids, position_ids) for a model the script fed packed
    rows by keyword (position_ids=..., doc_ids=...): the recorded call with those two replaced by the
    probe's own. None for Hugging Face models (the position-ids convention serves them) or when the
    call cannot be rebuilt."""
    forward, _ = replay_forward(call, model, pad_id)
    if forward is None:
        return None
    positions = [name for name in call["kwargs"] if any(w in name.lower() for w in _POSITION_WORDS)]
    documents = [name for name in call["kwargs"] if name in _DOCUMENT_ARGUMENTS]

    def packed(m, ids, doc_ids, position_ids):
        replaced = {**{name: position_ids for name in positions}, **{name: doc_ids for name in documents}}
        return forward(m, ids, replaced)

    return packed


@dataclasses.dataclass
class Audited:
    """The model the checks judge: the module the script trains, or the LM it holds when its own
    forward returns no logits. `snapshot` is its copy at the first forward, `call` how it was called."""

    model: torch.nn.Module
    snapshot: torch.nn.Module
    call: Optional[dict]
    held_as: Optional[str] = None  # the attribute path inside the trained module, when it is held
    logits_from: Optional[str] = None  # the submodule whose output inside the whole call holds the logits


def audited(recorder) -> Audited:
    trained = unwrap(recorder.bound)
    if recorder.returns_logits is False and recorder.inner is not None:
        inner, call = recorder.inner
        name = next((n for n, m in trained.named_modules() if m is inner and n), None)
        if name is not None:  # a model that could not be copied has a stand-in, and no submodules
            held = recorder.snapshot.get_submodule(name) if recorder.uncopied is None else recorder.snapshot
            return Audited(inner, held, call, name)
    deep = recorder.deep
    if recorder.returns_logits is False and deep is not None and recorder.uncopied is None:
        name = next((n for n, m in trained.named_modules() if m is deep and n), None)
        return Audited(trained, recorder.snapshot, recorder.call, logits_from=name)
    return Audited(trained, recorder.snapshot, recorder.call)


def discover(run: ScriptRun) -> dict:
    """The facts the script showed, JSON-safe (the report's "discovered")."""
    recorder, trace = run.recorder, run.trace
    judged = audited(recorder)
    model = judged.model
    call = recorder.call  # the batches are read from the trained module's forwards
    decoder = _decoder_key(trace, judged.call)  # the audited model's own call: model(src, tgt_in)?
    ids = _first_ids(trace, call)
    facts: dict[str, Any] = {
        "script": run.name,
        "model": users_class(model).__name__,
        "model_defined_in": _defined_in(users_class(model)),
        "model_called_at": (judged.call or {}).get("where"),  # the user's line of its first training call
        "parameters": sum(p.numel() for p in model.parameters()),
        "wrapper": (type(recorder.bound).__name__ if recorder.bound is not unwrap(recorder.bound)
                    else "fully_shard (FSDP2)" if users_class(model) is not type(model) else None),
        "called_as": _describe_call(judged.call, _ids_key(judged.call), decoder),
        # two id arguments, the second not the loss's targets: an encoder-decoder, judged as one
        "kind": "seq2seq" if decoder else None,
        "decoder_ids": _key_name(decoder),
        "batch_shape": list(ids.shape) if ids is not None else None,
        "vocab_size": recorder.vocab,
        "optimizers": sorted({o.class_name for o in trace.optimizers}) or (["manual update"] if trace.manual else []),
        "steps": trace.steps,
        "steps_asked": run.steps_asked,
        "seconds_to_stop": round(run.seconds, 3),
        "ended": run.ended,
        "stopped_at": recorder.stopped_at,
        "checkpoint": recorder.snapshot_loaded,
    }
    facts.update(discover_lightning(recorder.lightning, model))
    notes = list(run.notes)
    if judged.held_as:
        notes.append(f"{type(unwrap(recorder.bound)).__name__}'s forward returns no logits over the vocabulary; "
                     f"the model checks judge the {type(model).__name__} it calls as .{judged.held_as}")
    facts["other_models"] = list(recorder.others)
    if recorder.others:
        notes.append(_several_models_note(recorder))
    padding, disagreement = tokenizer_padding(trace, call, discover_padding(trace, call), recorder.tokenizers)
    facts.update(padding)
    if disagreement:
        notes.append(disagreement)
    facts.update(discover_packing(trace))
    facts.update(discover_task(trace, facts.get("batch_shape"), recorder.vocab))
    if getattr(recorder, "eos_ids", None):  # the tokenizer's end-of-sequence id (eos-trained)
        facts.update(eos_id=recorder.eos_ids[0][1], eos_id_source=f"{recorder.eos_ids[0][0]}.eos_token_id")
    facts.setdefault("pad_id", None)
    facts.setdefault("padding_side", None)
    if notes:
        facts["notes"] = notes
    return facts


def discover_task(trace: Trace, batch_shape: Optional[list], vocab: Optional[int]) -> dict:
    """What the model predicts, as the loss the loop grades its output with shows it: cross-entropy over
    [B, C] scores (one label per row: a sequence classifier) or over [B * T, C] / [B, C, T] ones with C
    not the vocabulary (a label per token). {} when no loss says (a language model's [*, V], an MSE)."""
    if not batch_shape or len(batch_shape) != 2:
        return {}
    B, T = batch_shape
    for loss in (e.data for e in trace.events if e.kind == "loss" and e.data.get("input_shape")):
        shape = loss["input_shape"]
        if shape[-1] == vocab or (len(shape) == 3 and shape[1] == vocab):
            return {}
        if shape == [B, shape[-1]] and shape[-1] >= 2:
            return {"task": "sequence-classification",
                    "task_source": f"the loss grades {shape} scores against one label per row ({loss['function']})"}
        if (len(shape) == 2 and shape[0] == B * T) or (len(shape) == 3 and shape[0] == B and shape[2] == T):
            return {"task": "token-classification",
                    "task_source": f"the loss grades {shape} scores against a label per token ({loss['function']})"}
    return {}


def _key_name(key) -> Optional[str]:
    if key is None:
        return None
    return f"argument {key[1]}" if key[0] == "arg" else f"{key[1]}="


def _several_models_note(recorder) -> str:
    audited = recorder.audited
    why = "named by --model" if recorder.wanted else "the one with the most trained parameters"
    others = ", ".join(_model_named(m) for m in recorder.others)
    return (f"the script trains {len(recorder.others) + 1} models, each with its own optimizer: audited "
            f"{_model_named(audited)} ({why}); its loop checks judge its optimizer's steps alone. "
            f"--model NAME audits another: {others}")


def _model_named(model: dict) -> str:
    return f"{model['model']} ({model['names'][0]})" if model["names"] else model["model"]


def discover_lightning(lightning: Optional[torch.nn.Module], model: torch.nn.Module) -> dict:
    """A Lightning script: which LightningModule stepped, whether the audited model is that module or
    one it holds (its training_step calls `self.lm(x)`), and what the Trainer did around the loop."""
    if lightning is None:
        return {}
    if model is lightning:
        audited = "the LightningModule"
    else:
        audited = next((f"its .{name}" for name, m in lightning.named_modules() if m is model and name),
                       "a module it does not hold")
    facts: dict[str, Any] = {"module": type(lightning).__name__, "audited": audited}
    trainer = getattr(lightning, "_trainer", None)  # the `trainer` property raises when detached
    if trainer is not None:
        facts.update(strategy=type(trainer.strategy).__name__, precision=str(trainer.precision),
                     accumulate_grad_batches=trainer.accumulate_grad_batches,
                     gradient_clip_val=trainer.gradient_clip_val)
    return {"lightning": facts}


def _defined_in(cls) -> Optional[str]:
    import inspect

    try:
        path = inspect.getsourcefile(cls)
        line = inspect.getsourcelines(cls)[1]
    except (TypeError, OSError):
        return _defined_in_script(cls)
    return f"{display_path(path)}:{line}" if path else None


def _defined_in_script(cls) -> Optional[str]:
    """A class defined in the script itself: its module was the script's __main__, gone once the script
    stopped, so inspect cannot find it; its methods still name the file, and the file the line."""
    import re

    code = next((f.__code__ for f in vars(cls).values() if hasattr(f, "__code__")), None)
    if code is None or not os.path.isfile(code.co_filename):
        return None
    with open(code.co_filename, encoding="utf-8", errors="replace") as source:
        lines = source.read().splitlines()
    header = re.compile(rf"\s*class\s+{re.escape(cls.__name__)}\b")
    line = next((i + 1 for i, text in enumerate(lines[:code.co_firstlineno]) if header.match(text)), None)
    return f"{display_path(code.co_filename)}:{line}" if line else None


def _packing_for(facts: dict, recorder, pad_id: Optional[int]):
    """The Subject's packing for the rows the script packed: the position-ids convention for Hugging
    Face models, the recorded call with the probe's documents and positions for the others."""
    if not facts.get("packed"):
        return None
    judged = audited(recorder)
    if type(judged.snapshot).__module__.startswith("transformers."):
        # TRL's padding-free collator passes seq_idx / cu_seq_lens beside restarting position_ids: the
        # model reads its documents from the positions, as the convention feeds them
        fed_positions = "position_ids" in ((judged.call or {}).get("kwargs") or {})
        return PACKING_BY_POSITION_IDS if facts.get("packed") == "position_ids" or fed_positions else None
    return replay_packed(judged.call, judged.snapshot, pad_id)


def subject_of(run: ScriptRun, facts: dict, overrides: dict):
    """The Subject the checks run on: the snapshot, called as the script called it (the loop checks
    judge `run.trace`, handed to the runner beside it). `overrides` are the command's flags
    (vocab_size, seq_len, batch_size, pad_id, kind, padding_side); given ones win."""
    from tfdoctor.subject import Subject

    recorder = run.recorder
    pad_id = overrides.get("pad_id", facts.get("pad_id"))
    judged = audited(recorder)
    decoder = _decoder_key(run.trace, judged.call)
    forward, why = replay_forward(judged.call, judged.snapshot, pad_id, decoder)
    key = decoder or _ids_key(judged.call)
    shape = recorder.logits_shapes.get(id(judged.model)) or recorder.logits_shapes.get(id(recorder.bound))
    if key is not None and flattened(shape, _value_of(judged.call, key)):
        forward = unflattening(forward)
        why += f"; its logits come flattened, {shape}, and are read as [B, T, V]"
    elif judged.logits_from:
        forward = capturing(forward, judged.logits_from)
        why += f"; it returns no logits, so they are read off its .{judged.logits_from} inside the call"
    facts["probe_call"] = why
    T = (facts.get("batch_shape") or [None, None])[1]
    seq_len = overrides.get("seq_len") or (min(T, MAX_PROBE_SEQ_LEN) if T and T >= 2 else None)
    vocab = overrides.get("vocab_size") or facts.get("vocab_size")
    eos_id = overrides.get("eos_id")
    if eos_id is None and facts.get("eos_id") is not None and (not vocab or facts["eos_id"] < vocab):
        eos_id = facts["eos_id"]  # a tokenizer's id past the model's vocabulary is not the model's eos
    fields = dict(vocab_size=vocab, seq_len=seq_len, eos_id=eos_id,
                  batch_size=overrides.get("batch_size"), pad_id=pad_id,
                  kind=overrides.get("kind") or facts.get("kind"),
                  padding_side=overrides.get("padding_side") or facts.get("padding_side"), forward=forward,
                  packing=overrides.get("packing") or _packing_for(facts, recorder, pad_id),
                  task=overrides.get("task") or facts.get("task"))
    given = {"vocab_size": "--vocab", "seq_len": "--seq-len", "batch_size": "--batch", "pad_id": "--pad-id",
             "eos_id": "--eos-id",
             "kind": "--kind", "padding_side": "--padding-side", "packing": "--packing", "task": "--task"}
    facts["overridden"] = {flag: overrides[name] for name, flag in given.items() if overrides.get(name) is not None}
    return Subject(judged.snapshot, **fields)
