"""Put on PYTHONPATH by tfdoctor's file sandbox (interposition) for the Python processes the user's code
starts (DataLoader spawn workers, subprocesses): they install the same sandbox before running anything,
then the sitecustomize this one hides, if there is one."""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("_tfdoctor_sandbox_interpose",
                                               os.path.join(os.path.dirname(_here), "interpose.py"))
_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _module
_spec.loader.exec_module(_module)
_module.install_from_env()

# The sitecustomize this one shadows (a distribution's, a virtual environment's) still runs.
_others = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_found = importlib.machinery.PathFinder.find_spec("sitecustomize", _others)
if _found is not None and _found.loader is not None:
    _other = importlib.util.module_from_spec(_found)
    _found.loader.exec_module(_other)
