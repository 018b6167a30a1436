"""Run the user's code in a supervised child process, and end everything it starts.

The process model, in order:
- the command line (tfdoctor/cli/) builds a request and hands it to `supervisor.supervise`;
- the supervisor starts `worker.py` in a fresh interpreter (`python -m tfdoctor.process.worker`) and
  reads its events, one JSON object per line on a pipe (`protocol.py` defines both sides), holding the
  run's budgets (`--timeout`, per check) and Ctrl-C;
- the worker loads the user's target and runs the command's driver (recording/, watching/, memory/);
  `live.py` is the worker's live feed of a watched run, `launch.py` starts `--nproc N` ranks;
- whatever the run starts ends with it: `reaper.py` (descendant processes), `fds.py` (the worker's
  own pipe survives the user's closes), `tempdirs.py` (a private TMPDIR), `signals.py` (SIGTERM and
  SIGHUP end a run as Ctrl-C does);
- `sandbox/` keeps `run`, `check` and a cut-short `watch` from writing the user's files.
"""
