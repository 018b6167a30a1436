"""Recording what training code really does, whoever drives it.

One recorder installs the hooks and patches and yields a plain-data Trace; every driver shares it
(`check --train` calls the user's `train(model, batches)`, `tfdoctor run` runs an unmodified script
as __main__, a torchrun job adds each rank's digest), and the judges in tfdoctor/checks/ read the
Trace through the measures at the end of this map. tfdoctor/usercode/call_sites.py names the user's
line behind each recorded call.

The data:
- `trace.py`: the Trace, the ordered events of one recorded loop as plain, picklable data;
- `events.py`: what each kind of event carries, one TypedDict per kind, keys and units.

The instrument:
- `recorder.py`: the Recorder, a TorchFunctionMode and hooks that turn a loop's calls into events;
- `patched_calls.py`: the recorder's wrappers of what PyTorch offers no hook for (GradScaler, clip, ...);
- `grads.py`: what the recorder reads off tensors and autograd graphs (norms, samples, short walks);
- `scores.py`: what the gradient at the scores says about each row (target, weight, loss);
- `schedule.py`: a learning-rate scheduler seen stepping, copied and projected forward;
- `updates.py`: whether an optimizer step moved the low-precision weights it had gradients for;
- `collectives.py`: whether the model's own forward calls torch.distributed collectives.

The drivers:
- `loop.py`: `check --train`: the random batches, the Feed that hands them out, record_loop;
- `overfit.py`: the user's loop fed one batch over and over, and its optimizer replayed (overfit-batch);
- `script.py`: `tfdoctor run`: the script run as __main__, recorded, stopped after its first steps;
- `script_recorder.py`: the recorder bound late to whichever model the script trains;
- `stopping.py`: the stop at the steps asked for, also when the script catches it;
- `ranks.py`: what one rank of a distributed run did, as the rank checks compare it;
- `distributed.py`: the ranks of a torchrun job meet at their stop point; rank 0 judges and sends the exit code.

Model handling:
- `wrappers.py`: the wrapper zoo (DDP, FSDP, torch.compile, accelerate, Lightning) and sharded parameters;
- `snapshot.py`: the copy of the script's model that the model checks judge;
- `unshard.py`: a whole, plain copy of a model sharded with FSDP2;
- `pretrained.py`: which models the script loaded with `from_pretrained` (trained weights);
- `logits.py`: logits recovered from a forward that does not return them as [B, T, V].

Reading a trace (and what the script showed):
- `windows.py`: measures on a Trace that the loop judges share (windows, norms, weights, alignment);
- `targets_at_boundaries.py`: graded targets at EOS and across packed documents' boundaries;
- `discovery.py`: what a recorded script showed, as `run`'s discovered facts and the Subject;
- `script_objects.py`: the objects the running script holds, and the tokenizers among them.
"""
