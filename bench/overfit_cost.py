"""What overfit-batch through the user's loop (--train) costs next to the loop itself, measured side
by side in one run on the heaviest fixture: the Muon-trained GPT (fixtures/muon_gpt.py trained by
fixtures/loops/muon.py, Newton-Schulz orthogonalisation at every step).

    python bench/overfit_cost.py

Prints
- the bare loop on the check's 160 batches, at this process's thread count and on one thread (what
  run_checks gives models under 20M parameters);
- the check as it was before issue 9 item 11 (the loop run on all 160 batches, then judged: the
  same work as the bare loop), and the check now (it measures the loss every 10 batches and stops
  the feed once the loss has fallen to 90% of its start);
- the whole battery with --train on that model (per-check seconds as the report gives them), and
  the battery as it was, i.e. with the check's old cost in place of its new one;
- a loop the check must replay (nanoGPT's 2000-step warm-up on the fixture GPT): bare loop vs the
  check (loop plus replay of its optimizer with a correct loss).
"""

import copy
import sys
import time

import torch

from timing import ROOT

sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT))

BATCHES = 160  # tfdoctor.checks.learning.LOOP_BATCHES


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def subject_of(build, loop: str):
    from tfdoctor.loader import load_function
    from tfdoctor.subject import Subject, resolve

    return resolve(Subject(build(), pad_id=0, train=load_function(str(ROOT / "fixtures" / "loops" / loop) + ":train")))


def old_check(subject) -> None:
    """overfit-batch with --train before item 11: copy, feed all 160 batches, judge the loss."""
    from tfdoctor.probes.loss import eval_loss, lm_batch_of
    from tfdoctor.recording.loop import train_batches

    model = copy.deepcopy(subject.model)
    raw = train_batches(subject, 1, torch.Generator().manual_seed(2))[0]
    batch = lm_batch_of(subject, raw)
    eval_loss(subject, model, batch)
    subject.train(model, [raw] * BATCHES)
    eval_loss(subject, model, batch)


def bare(subject, threads: int) -> float:
    from tfdoctor.recording.loop import train_batches

    raw = train_batches(subject, 1, torch.Generator().manual_seed(2))[0]
    model = copy.deepcopy(subject.model)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return seconds(lambda: subject.train(model, [raw] * BATCHES))
    finally:
        torch.set_num_threads(before)


def main():
    import warnings

    from tfdoctor import run_checks

    warnings.simplefilter("ignore")
    from gpt_correct import build as build_gpt
    from muon_gpt import build as build_muon

    threads = torch.get_num_threads()
    torch.manual_seed(0)
    muon = subject_of(build_muon, "muon.py")
    params = sum(p.numel() for p in muon.model.parameters())
    print(f"Muon GPT ({params / 1e6:.1f}M parameters), {BATCHES} batches of {muon.batch_size}x{muon.seq_len}; "
          f"this process runs {threads} threads")
    bare_n = bare(muon, threads)
    bare_1 = bare(muon, 1)
    print(f"  bare loop, {threads} threads            {bare_n:7.1f} s")
    print(f"  bare loop, 1 thread              {bare_1:7.1f} s")
    torch.set_num_threads(1)
    before = seconds(lambda: old_check(muon))
    torch.set_num_threads(threads)
    report = run_checks(muon.model, only="overfit-batch", pad_id=0, train=muon.train)
    now = report["overfit-batch"]
    print(f"  check before item 11 (1 thread)  {before:7.1f} s   = {before / bare_1:5.2f} x bare on 1 thread, "
          f"{before / bare_n:5.2f} x on {threads}")
    print(f"  check now (run_checks, 1 thread) {now.seconds:7.1f} s   "
          f"= {now.seconds / bare_1:5.2f} x bare on 1 thread, "
          f"{now.seconds / bare_n:5.2f} x on {threads} ({now.status.value}, {now.details['batches']} batches fed)")

    battery = run_checks(muon.model, pad_id=0, train=muon.train)
    total = sum(r.seconds for r in battery.results)
    top = sorted(battery.results, key=lambda r: -r.seconds)[:4]
    slowest = ", ".join(f"{r.id} {r.seconds:.1f} s" for r in top)
    print(f"  battery with --train now         {total:7.1f} s   ({slowest})")
    old_total = total - battery["overfit-batch"].seconds + before
    print(f"  battery with the old check       {old_total:7.1f} s   (derived: its overfit-batch at the old cost)")

    torch.manual_seed(0)
    warmup = subject_of(build_gpt, "nanogpt_long_warmup.py")
    bare_w = bare(warmup, 1)
    replayed = run_checks(warmup.model, only="overfit-batch", pad_id=0, train=warmup.train)["overfit-batch"]
    print("fixture GPT, nanoGPT loop with a 2000-step warm-up (the check must replay it), 1 thread")
    print(f"  bare loop                        {bare_w:7.1f} s")
    print(f"  check now                        {replayed.seconds:7.1f} s   = {replayed.seconds / bare_w:5.2f} x "
          f"bare ({replayed.status.value}, {replayed.details['reference']['steps']} steps replayed)")


if __name__ == "__main__":
    main()
