"""`tfdoctor watch`: a second, lighter recorder for whole training runs.

`check --train` and `run` record the first steps of a loop with recording/, which sees every torch
call (a TorchFunctionMode, ~1.3x on its own); a run watched for days may cost 3% of its step time, so
the monitor (monitor.py, hooks.py) sees only the few calls made per step and keeps one row of numbers
per optimizer step (series.py). What it shares with `run` is shared, not copied: the script is run by
usercode/as_main.py, the run judges by runner.run_judges (judging.py), and a scheduler's promised
rates are projected as recording/schedule.py projects them (promise.py).

- `driver.py`: the script run as __main__ with the monitor installed, to its end or its limits;
- `monitor.py`: the watch monitor, one StepRow per optimizer step, cheap enough to leave on for days;
- `hooks.py`: puts the monitor's hooks and patches in place, process-wide, and takes them off;
- `readings.py`: what the monitor reads off the run's objects (norms, sizes, loaders, devices);
- `rss.py`: the process's resident memory each step, and malloc's heap every few steps;
- `fingerprints.py`: the rows the loop trained on, hashed, so an evaluation on training rows is seen;
- `sources.py`: the evaluation losses between two steps, told apart into passes (held-out or training);
- `promise.py`: the rate a learning-rate scheduler promises after each of its steps (lr-trajectory);
- `series.py`: the RunSeries, what a watched run recorded, as plain data;
- `judging.py`: the run judges on a RunSeries, and the Report `watch` and the callbacks hand over;
- `protection.py`: when a watched run writes for real, and what the user is told when it does not.
"""
