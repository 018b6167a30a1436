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

MODULE = "transformers.modeling_utils"


@contextlib.contextmanager
def pretrained_loads(loaded: dict[int, str]):
    """While open, every model `PreTrainedModel.from_pretrained` returns (a subclass's, an Auto class's)
    is entered in `loaded` as id(model) -> "from_pretrained('name')"; everything is put back after."""
    undo: list[Callable[[], None]] = []

    def patch(module) -> None:
        base = getattr(module, "PreTrainedModel", None)
        original = base.__dict__.get("from_pretrained") if base is not None else None
        if not isinstance(original, classmethod):
            return
        function = original.__func__

        @functools.wraps(function)
        def from_pretrained(cls, *args, **kwargs):
            returned = function(cls, *args, **kwargs)
            model = returned[0] if isinstance(returned, tuple) else returned  # output_loading_info=True
            name = args[0] if args else kwargs.get("pretrained_model_name_or_path")
            loaded.setdefault(id(model), f"from_pretrained({str(name)!r})")
            return returned

        base.from_pretrained = classmethod(from_pretrained)
        undo.append(lambda: setattr(base, "from_pretrained", original))

    if MODULE in sys.modules:
        patch(sys.modules[MODULE])
    else:
        finder = AfterImport({MODULE: patch})
        sys.meta_path.insert(0, finder)
        undo.append(lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None)
    try:
        yield
    finally:
        for step in reversed(undo):
            step()
