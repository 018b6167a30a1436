"""What the running script holds: the (name, value) pairs of its own frames and its __main__ globals
(`script_objects`), and the tokenizers among them (`find_tokenizers`, `find_eos_ids`), which tell
the pad and end-of-sequence ids the script's batches were made with. Read once, at the first optimizer step.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from tfdoctor.usercode.call_sites import user_frames


def script_objects() -> list[tuple[str, Any]]:
    """(name, value) the script holds right now: the locals of its own frames on the stack, innermost
    first, then its __main__ globals (runpy puts the running script in sys.modules["__main__"])."""
    found = [item for frame in user_frames() for item in frame.f_locals.items()]
    main = sys.modules.get("__main__")
    if main is not None:
        found += list(vars(main).items())
    return found


# Where a tokenizer is held when the script does not name it: a Trainer (processing_class, formerly
# tokenizer), a data collator, a DataLoader's collate_fn (a collator object).
_TOKENIZER_HOLDERS = ("tokenizer", "processing_class", "data_collator", "collate_fn")


def find_tokenizers(objects) -> list[tuple[str, int]]:
    """(where, pad_token_id) of each tokenizer the script holds: an object with an integer
    pad_token_id and an encode method (a model config carries pad_token_id too, but it is not what
    made the batches), directly or one or two attributes down (trainer.data_collator.tokenizer)."""
    return _tokenizer_ids(objects, "pad_token_id")


def find_eos_ids(objects) -> list[tuple[str, int]]:
    """(where, eos_token_id) of each tokenizer the script holds, found as find_tokenizers finds them:
    the end-of-sequence id its documents were tokenized with (eos-trained)."""
    return _tokenizer_ids(objects, "eos_token_id")


def _tokenizer_ids(objects, attribute: str) -> list[tuple[str, int]]:
    found, seen = [], set()

    def visit(name: str, value, depth: int) -> None:
        if id(value) in seen or isinstance(value, (torch.nn.Module, torch.Tensor, type)):
            return
        seen.add(id(value))
        held = _attribute(value, attribute) if _attribute(value, "encode") is not None else None
        if isinstance(held, int) and not isinstance(held, bool):
            found.append((name, held))
            return
        if depth:
            for attr in _TOKENIZER_HOLDERS:
                inner = _attribute(value, attr)
                if inner is not None:
                    visit(f"{name}.{attr}", inner, depth - 1)

    for name, value in objects:
        if not name.startswith("__"):
            visit(name, value, 2)
    return found


def _attribute(value, name: str):
    try:
        return getattr(value, name, None)
    except Exception:  # a property of the user's object that raises: nothing to read there
        return None
