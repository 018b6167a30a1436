"""Living inside the user's process: what tfdoctor needs while the user's code runs.

- `call_sites.py`: where in the user's code a recorded call was made (file:line);
- `as_main.py`: run a script as `python train.py ARGS` or `python -m pkg.mod ARGS` would;
- `import_hooks.py`: act on a library the moment the user's code imports it;
- `patches.py`: the one way to patch (`Patches`) and the table of every target tfdoctor patches;
- `auditing.py`: which tfdoctor command is auditing this process (the callbacks stand aside);
- `world.py`: this process's rank and the job's size, from torchrun's environment;
- `environment.py`: every TFDOCTOR_* variable, declared once with its meaning (docs/environment.md);
- `torch_compat.py`: every private torch name tfdoctor uses, with the versions it was checked on.

No torch import at module level here.
"""
