"""Which models the user's script loaded with Hugging Face's `from_pretrained` (their weights are
trained: `init-loss` skips them).

Why a watch on the call rather than the config: `config._name_or_path` names the checkpoint a config
came from, and a model built with `from_config(AutoConfig.from_pretrained(name))` carries it too
although its weights are fresh (Hugging Face's run_clm.py with `--config_name`): its initialisation is
the user's and is judged. transformers may be imported by the script after the recorder is
installed, so the patch waits for `transformers.modeling_utils` to load when it is not loaded yet.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Callable

from tfdoctor.usercode.import_hooks import AfterImport
from tfdoctor.usercode.patches import Patches

MODULE = "transformers.modeling_utils"


@contextlib.contextmanager
def pretrained_loads(loaded: dict[int, str]):
    """While open, every model `PreTrainedModel.from_pretrained` returns (a subclass's, an Auto class's)
    is entered in `loaded` as id(model) -> "from_pretrained('name')"; everything is put back after."""
    patches = Patches()

    def patch(module) -> None:
        base = getattr(module, "PreTrainedModel", None)
        if base is not None and isinstance(base.__dict__.get("from_pretrained"), classmethod):
            patches.wrap(base, "from_pretrained", lambda original: classmethod(_noting(original.__func__, loaded)))

    if MODULE in sys.modules:
        patch(sys.modules[MODULE])
    else:
        patches.prepend(sys.meta_path, AfterImport({MODULE: patch}))
    with patches:
        yield


def _noting(function: Callable, loaded: dict[int, str]) -> Callable:
    """`from_pretrained`'s function, entering the model it returns in `loaded`."""

    @functools.wraps(function)
    def from_pretrained(cls, *args, **kwargs):
        returned = function(cls, *args, **kwargs)
        model = returned[0] if isinstance(returned, tuple) else returned  # output_loading_info=True
        name = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        loaded.setdefault(id(model), f"from_pretrained({str(name)!r})")
        return returned

    return from_pretrained
