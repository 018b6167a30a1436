"""tfdoctor on every Hugging Face LM architecture: what it says about correct library models.

    PYTHONPATH=$PWD python bench/hf_sweep.py --jobs 2 --out /tmp/sweep.jsonl --skip overfit-batch,memory
    PYTHONPATH=$PWD python bench/hf_sweep.py --only xlm,llama@bf16,bert/mlm --out /tmp/some.jsonl
    PYTHONPATH=$PWD python bench/hf_sweep.py --heads --jobs 2 --out /tmp/heads.jsonl --skip memory
    python bench/hf_sweep.py --table /tmp/sweep.jsonl          # the table of an earlier run

Every model type of the installed transformers with a causal-LM, masked-LM or seq2seq-LM class is
built tiny from the library's own classes (bench/hf_tiny_configs.py) and checked the way a user
checks it: the request `tfdoctor check bench/hf_tiny_configs.py:build` makes, run by tfdoctor's own
worker code in one child process per model with a wall timeout (forked after torch, transformers and
tfdoctor are imported once), with `--pad-id EOS` where the config has no pad token (users pad with
EOS), plus `--packing position_ids --only packing-isolation` where the forward takes `position_ids`.
A model whose own forward does not run on the tiny config is a row "unbuilt" with the reason.
With --heads, every model type's task heads instead (TYPE/seqcls, /tokcls, /qa, /mc: each
*ForSequenceClassification, *ForTokenClassification, *ForQuestionAnswering and *ForMultipleChoice the
library registers), which tfdoctor must judge as their tasks or skip with a reason.

Each model is one JSON line in --out, appended as it ends, so a run can be resumed (rows already in
the file are skipped; this run's unbuilt rows are tried again). A hang is "timeout", what the command
would end with exit 2 is "exit2" (tfdoctor's UsageError/SubjectError/LoadError line) or "internal"
(any other exception), a dead child "crash". Prints a table of every warn/fail/error per check id.

Cost (2 shared cores, load ~10): 271 rows in about 45 min at --jobs 2 without overfit-batch and
memory; most models take 5-10 s, a few (gemma4, falcon_h1) over 2 minutes.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# Swept first: the architectures issue 17 names, then popular ones; the rest follow alphabetically.
FIRST = ["xlm", "flaubert", "mamba", "falcon_mamba", "recurrent_gemma", "openai-gpt", "reformer", "cpmant",
         "granitemoe", "ibert", "perceiver", "rwkv", "roberta", "llama@bf16", "inkling_text", "youtu",
         "llama", "gpt2", "bert", "t5", "bart", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3",
         "gpt_neox", "opt", "bloom", "falcon", "mixtral", "distilbert", "modernbert", "electra", "mbart",
         "pegasus", "marian", "whisper", "xlm-roberta", "deberta-v2", "granite", "olmo2", "stablelm"]

def worker(spec, skip, checks, packing, details=()):
    """In the child: build, then tfdoctor's own `check` request (the code path of the command)
    for the battery and, where the forward takes position_ids, for --packing position_ids."""
    import inspect
    import warnings

    warnings.filterwarnings("ignore")
    os.environ["HF_SWEEP_TYPE"] = spec  # what bench/hf_tiny_configs.py:build builds
    sys.path.insert(0, str(HERE))
    import transformers

    transformers.logging.set_verbosity_error()
    from hf_tiny_configs import build_model
    from tfdoctor.errors import TfdoctorError
    from tfdoctor.process.worker import run_check_request

    try:
        m = build_model(spec)
    except Exception as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return {"built": False, "reason": f"{type(e).__name__}: {first}"}
    import torch

    c = m.config
    try:  # the library's own forward must run on the tiny config, else the row is "unbuilt", not tfdoctor's
        ids = torch.randint(3, min(c.get_text_config().vocab_size, 512) - 1, (2, 32))
        eos = getattr(c.get_text_config(), "eos_token_id", None)
        if spec.endswith("/seqcls") and isinstance(eos, int) and eos < ids.max() + 2:
            ids[:, -1] = eos  # BART's and T5's classifiers pool each row's end-of-text, as tokenizers append it
        extra = {"decoder_input_ids": ids} if getattr(c, "is_encoder_decoder", False) else {}
        with torch.no_grad():
            m(input_ids=ids.unsqueeze(1) if spec.endswith("/mc") else ids, **extra)  # choices: [B, C, T]
    except Exception as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return {"built": False, "reason": f"forward raised {type(e).__name__}: {first}"}
    c = c.get_text_config() if hasattr(c, "get_text_config") else c
    vocab, pad, eos = c.vocab_size, getattr(c, "pad_token_id", None), getattr(c, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) and eos else eos
    row = {"built": True, "class": type(m).__name__, "params": sum(p.numel() for p in m.parameters()),
           "position_ids": "position_ids" in inspect.signature(m.forward).parameters,
           "attn": getattr(c, "_attn_implementation", None), "vocab": vocab, "pad_token_id": pad}
    fields = {}
    if not isinstance(pad, int):
        # No pad in the config: pad with EOS as users do (tokenizer.pad_token = eos_token): --pad-id EOS.
        fields["pad_id"] = row["pad_id"] = eos if isinstance(eos, int) and 0 <= eos < vocab else vocab - 1
    target = "bench/hf_tiny_configs.py:build"
    passes = [("battery", dict(only=checks, skip=skip, fields=fields))]
    if row["position_ids"] and packing:
        passes.append(("packing", dict(only="packing-isolation", fields=dict(fields, packing="position_ids"))))
    for name, extra in passes:
        start = time.time()
        request = dict(command="check", target=target, train=None, seed=0, device=None, options={}, **extra)
        try:
            report = run_check_request(request)
            result = {"rc": 1 if report.to_dict()["summary"].get("fail") else 0,
                      "findings": _findings(report.to_dict()), "summary": report.to_dict()["summary"]}
            if details:  # --details: the evidence of these checks, whatever their status (calibration)
                result["details"] = {c["id"]: c.get("details") for c in report.to_dict()["checks"]
                                     if c["id"] in details}
        except TfdoctorError as e:  # the command's exit 2, with its one line
            result = {"rc": 2, "ended": "exit2", "line": f"{type(e).__name__}: {e}"[:500]}
        except Exception as e:  # the command's "internal error"
            result = {"rc": 2, "ended": "internal", "line": f"{type(e).__name__}: {e}"[:500]}
        result["seconds"] = round(time.time() - start, 1)
        row[name] = result
    return row


def all_types():
    from transformers.models.auto import modeling_auto as ma

    seq2seq, causal, mlm = (ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                            ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    types = sorted(set(seq2seq) | set(causal) | set(mlm))
    # The masked-LM class too where the type's main class (seq2seq, else causal) is another class.
    extra = [f"{t}/mlm" for t in types if t in mlm and (t in seq2seq or t in causal)
             and mlm[t] != (seq2seq.get(t) or causal.get(t))]
    order = [t for t in FIRST if t.split("@")[0].split("/")[0] in types]
    return order + [t for t in types if t not in order] + extra


def all_heads():
    """TYPE/HEAD for every task head the installed transformers registers (bench/hf_tiny_configs.TASK_HEADS), the
    types of FIRST first."""
    from transformers.models.auto import modeling_auto as ma

    sys.path.insert(0, str(HERE))
    from hf_tiny_configs import TASK_HEADS

    specs = []
    for head, mapping in TASK_HEADS.items():
        types = sorted(getattr(ma, mapping))
        first = [t for t in FIRST if t in types]
        specs += [f"{t}/{head}" for t in first + [t for t in types if t not in first]]
    return specs


def _findings(report):
    return [{"id": c["id"], "status": c["status"], "message": (c.get("message") or "").splitlines()[0][:400]}
            for c in report.get("checks", []) if c["status"] in ("warn", "fail", "error")]


def _child(spec, args, path):
    """In the forked child: quiet, one thread, the row written to `path`; never returns."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        row = worker(spec, args.skip or None, args.checks or None, not args.no_packing,
                     tuple((args.details or "").split(",")) if args.details else ())
        text = json.dumps(row, default=str)
    except BaseException as e:  # noqa: BLE001 - a crash of the child is a row
        text = json.dumps({"built": True, "battery": {"ended": "crash", "line": f"{type(e).__name__}: {e}"[:500]}})
    with open(path, "w") as f:
        f.write(text)
    os._exit(0)


def sweep(specs, args, sink, start):
    """Up to --jobs models at a time, each in a child forked from this process after torch,
    transformers and tfdoctor are imported (a fresh interpreter each would spend most of its time
    importing); a child past --timeout is killed and is a row "timeout", one that dies a row "crash"."""
    import signal
    import tempfile

    import torch  # noqa: F401 - imported once, before the forks
    import transformers  # noqa: F401

    import tfdoctor.process.worker  # noqa: F401

    os.environ.update(TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    tmp = tempfile.mkdtemp(prefix="hf_sweep_")
    queue, running = list(specs), {}
    while queue or running:
        while queue and len(running) < max(1, min(args.jobs, 2)):
            spec = queue.pop(0)
            path = os.path.join(tmp, f"{len(queue)}.json")
            pid = os.fork()
            if pid == 0:
                _child(spec, args, path)
            running[pid] = (spec, path, time.time())
        time.sleep(0.2)
        for pid, (spec, path, began) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            row = {"spec": spec}
            if done:
                try:
                    with open(path) as f:
                        row.update(json.loads(f.read()))
                except (OSError, ValueError):
                    row.update(built=True, battery={"ended": "crash", "line": f"child died, wait status {status}"})
            elif time.time() - began > args.timeout:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                row.update(built=True, battery={"ended": "timeout", "line": f"no answer in {args.timeout} s"})
            else:
                continue
            del running[pid]
            row["wall"] = round(time.time() - began, 1)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            print(f"{time.time() - start:7.0f}s {spec:28s} {verdict(row)}", file=sys.stderr, flush=True)


def verdict(row):
    """quiet / warn / fail / error / exit2 / timeout / unbuilt for one row."""
    if not row.get("built"):
        return "unbuilt"
    worst = "quiet"
    rank = ["quiet", "warn", "fail", "error", "exit2", "internal", "crash", "timeout"]
    for name in ("battery", "packing"):
        result = row.get(name)
        if not result:
            continue
        for f in result.get("findings", []):
            worst = max(worst, f["status"], key=rank.index)
        if "ended" in result:
            worst = max(worst, result["ended"] if result["ended"] in rank else "exit2", key=rank.index)
    return worst


def table(rows):
    from collections import Counter, defaultdict

    counts = Counter(verdict(r) for r in rows)
    print("architectures:", len(rows), dict(counts))
    by_check = defaultdict(list)
    for r in rows:
        if not r.get("built"):
            by_check["(unbuilt)"].append((r["spec"], "unbuilt", r.get("reason", "")))
            continue
        for name in ("battery", "packing"):
            result = r.get(name) or {}
            tag = "" if name == "battery" else " [packing]"
            for f in result.get("findings", []):
                by_check[f["id"]].append((r["spec"] + tag, f["status"], f["message"]))
            if "ended" in result:
                by_check["(" + result["ended"] + ")"].append((r["spec"] + tag, result["ended"], result.get("line", "")))
    for check_id, items in sorted(by_check.items(), key=lambda kv: -len(kv[1])):
        print(f"\n## {check_id} ({len(items)})")
        for spec, status, message in items:
            print(f"  {spec:32s} {status:8s} {message[:300]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated model types (TYPE, TYPE@bf16, TYPE/mlm)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", default="hf_sweep.jsonl")
    parser.add_argument("--timeout", type=int, default=120, help="wall seconds per tfdoctor run")
    parser.add_argument("--skip", default=None, help="tfdoctor --skip for the battery (e.g. overfit-batch,memory)")
    parser.add_argument("--checks", default=None, help="tfdoctor --only for the battery")
    parser.add_argument("--details", default=None,
                        help="comma-separated check ids whose details every row keeps (to calibrate a threshold)")
    parser.add_argument("--no-packing", action="store_true", help="no --packing position_ids pass")
    parser.add_argument("--heads", action="store_true", help="sweep the task heads (TYPE/seqcls, /tokcls, /qa, /mc)")
    parser.add_argument("--table", metavar="JSONL", help="print the table of an earlier run and exit")
    args = parser.parse_args()
    if args.table:
        table([json.loads(line) for line in Path(args.table).read_text().splitlines() if line.strip()])
        return
    specs = args.only.split(",") if args.only else all_heads() if args.heads else all_types()
    out = Path(args.out)
    old = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    wanted = set(specs)
    kept = [r for r in old if r.get("built") or r["spec"] not in wanted]  # this run's unbuilt rows are tried again
    done = {r["spec"] for r in kept}
    if len(kept) < len(old):
        out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    todo = [s for s in specs if s not in done]
    start = time.time()
    print(f"{len(todo)} to run ({len(done)} already in {out})", file=sys.stderr)
    with out.open("a") as sink:
        sweep(todo, args, sink, start)
    print(f"wall {time.time() - start:.0f} s", file=sys.stderr)
    table([json.loads(line) for line in out.read_text().splitlines() if line.strip()])


if __name__ == "__main__":
    main()
