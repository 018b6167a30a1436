"""Which encoder positions each decoder position reads: perturb the encoder's *output* position by
position (source tokens would not do: the encoder already mixes the whole source into every
position) and watch the decoder's logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tfdoctor.probes.dependency import finite_scale
from tfdoctor.subject import Subject, call, is_hugging_face, random_tokens
from tfdoctor.tolerances import RELATIVE_TOLERANCE

PERTURBATION_STDS = 3.0


@dataclass
class CrossMap:
    delta: torch.Tensor  # [T_tgt, S]: largest change of decoder output i when encoder output j moves
    scale: float
    tolerance: float
    hooked: str  # the module whose output was perturbed

    @property
    def reads(self) -> torch.Tensor:
        return self.delta > self.tolerance


def encoder_of(subject: Subject) -> tuple[str, torch.nn.Module] | None:
    model = subject.model
    if is_hugging_face(model) and hasattr(model, "get_encoder"):
        return "get_encoder()", model.get_encoder()
    named = [(name, module) for name, module in model.named_modules()
             if name and name.split(".")[-1] in ("encoder", "transformer_encoder", "enc")]
    return min(named, key=lambda item: item[0].count(".")) if named else None


def _hidden(output):
    """(tensor, rebuild) for an encoder's output: a tensor, a tuple, or a ModelOutput."""
    if isinstance(output, torch.Tensor):
        return output, lambda h: h
    if hasattr(output, "last_hidden_state"):
        def rebuild(h):
            output.last_hidden_state = h
            if isinstance(output, dict):
                output["last_hidden_state"] = h
            return output
        return output.last_hidden_state, rebuild
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0], lambda h: (h, *output[1:])
    return None, None


def cross_map(subject: Subject, generator: torch.Generator) -> CrossMap | None:
    found = encoder_of(subject)
    if found is None:
        return None
    name, encoder = found
    S = T = subject.seq_len
    rows = S + 1  # the base, then one row per encoder position; S + 1 != S tells the layout apart
    source = random_tokens(subject, 1, S, generator).expand(rows, -1)
    target = random_tokens(subject, 1, T, generator).expand(rows, -1)
    seen = []

    def hook(module, args, output):
        hidden, rebuild = _hidden(output)
        if hidden is None or hidden.dim() != 3:
            return None
        batch_first = hidden.shape[0] == rows and hidden.shape[1] == S
        if not batch_first and not (hidden.shape[0] == S and hidden.shape[1] == rows):
            return None
        seen.append(name)
        view = hidden if batch_first else hidden.transpose(0, 1)  # (rows, S, C)
        noise = torch.randn(view.shape[-1], generator=generator).to(view.device, view.dtype)
        bump = torch.zeros_like(view)
        scale = PERTURBATION_STDS * float(view.detach().float().std().clamp_min(1e-3))
        bump[torch.arange(1, rows), torch.arange(S)] = noise * scale
        moved = view + bump
        return rebuild(moved if batch_first else moved.transpose(0, 1))

    handle = encoder.register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = call(subject, source, target).float()
    finally:
        handle.remove()
    if not seen:
        return None
    delta = (logits[1:] - logits[0:1]).abs().amax(dim=-1)  # (S rows perturbed, T outputs)
    delta = torch.nan_to_num(delta, nan=float("inf")).T.contiguous().cpu()  # (T, S)
    scale = finite_scale(logits[0])
    return CrossMap(delta, scale, RELATIVE_TOLERANCE * max(scale, 1e-30), name)
