"""`tfdoctor watch`: a second, lighter recorder for whole training runs.

`check --train` and `run` record the first steps of a loop with recording/, which sees every torch
call (a TorchFunctionMode, ~1.3x on its own); a run watched for days may cost 3% of its step time, so
the monitor (monitor.py, hooks.py) sees only the few calls made per step and keeps one row of numbers
per optimizer step (series.py). What it shares with `run` is shared, not copied: the script is run by
usercode/as_main.py, the run judges by runner.run_judges (judging.py), and a scheduler's promised
rates are projected as recording/schedule.py projects them (promise.py).
"""
