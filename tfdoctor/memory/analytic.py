"""Analytic mode: the peak memory of one training step of a GPT-2-style decoder, from its shape alone.

Pure Python, no torch: it replays the step as a ledger of tensor allocations and frees (what each op
makes, what autograd saves for backward, when backward lets go of it) and keeps the maximum.

What it models (tfdoctor/memory/gpt.py is the same model written in torch, and the tests hold the two
to each other): a pre-norm decoder with learned token and position embeddings, biases, LayerNorm, a
GELU MLP, an untied LM head unless `tied`, no dropout; and the steady-state step: optimizer states
already allocated (every step after the first), forward, cross-entropy on float32 logits, backward,
optimizer step, gradients freed by zero_grad(set_to_none=True), with the caller holding `logits` and
`loss` until the step returns.

Notation as in the papers: B batch, T sequence length, C d_model, nh heads, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tfdoctor.errors import UsageError
from tfdoctor.memory import fsdp_shards

DEFAULT_D_MODEL = 512
DEFAULT_LAYERS = 6
DEFAULT_VOCAB = 50257  # GPT-2's BPE vocabulary
HEAD_DIM = 64  # default heads = d_model / 64, GPT-2's head size
DTYPES = ("fp32", "bf16", "fp16")
ATTENTIONS = ("naive", "sdpa")
CHECKPOINTING = ("none", "full")
OPTIMIZERS = ("adamw", "sgd", "none")
SHARDS = ("none", "zero1", "zero2", "zero3")
FSDP2_SHARDS = ("zero2", "zero3")  # modelled as FSDP2 does them (fsdp_shards.Fsdp2Schedule); zero1 has no FSDP2 setting
_MAX_SEARCH = 1 << 24  # the largest sequence or batch the fit search tries

# Ledger categories, in the order the report lists them (FSDP2's schedule files its buffers under the first two).
PARAMETERS = fsdp_shards.PARAMETERS
GRADIENTS = fsdp_shards.GRADIENTS
OPTIMIZER = "optimizer states"
SCORES = "attention scores and probabilities"
ACTIVATIONS = "other activations"
LOGITS = "logits and their float32 softmax"
TEMPORARIES = "backward temporaries"
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER, SCORES, ACTIVATIONS, LOGITS, TEMPORARIES)


@dataclass(frozen=True)
class Config:
    """One training configuration. `batch` is per device (each data-parallel process holds its own)."""

    batch: int
    seq: int
    d_model: int = DEFAULT_D_MODEL
    heads: int | None = None
    layers: int = DEFAULT_LAYERS
    vocab: int = DEFAULT_VOCAB
    d_ff: int | None = None
    dtype: str = "fp32"
    attention: str = "naive"
    checkpointing: str = "none"
    optimizer: str = "adamw"
    gpus: int = 1
    shard: str = "none"
    tied: bool = False

    @property
    def n_head(self) -> int:
        return self.heads if self.heads is not None else max(1, self.d_model // HEAD_DIM)

    @property
    def ff(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element: mixed precision keeps activations in 16 bits."""
        return 4 if self.dtype == "fp32" else 2

    def validated(self) -> "Config":
        for name in ("batch", "seq", "d_model", "layers", "vocab", "gpus"):
            value = getattr(self, name)
            if value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
        for name in ("heads", "d_ff"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.d_model % self.n_head:
            how = "" if self.heads is not None else f" (the default, d_model / {HEAD_DIM})"
            raise UsageError(f"{self.n_head} heads{how} do not divide d_model {self.d_model}",
                             "pass --heads N with N a divisor of --d-model")
        for name, allowed in (("dtype", DTYPES), ("attention", ATTENTIONS), ("checkpointing", CHECKPOINTING),
                              ("optimizer", OPTIMIZERS), ("shard", SHARDS)):
            if getattr(self, name) not in allowed:
                raise UsageError(f"--{name} {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        return self

    def describe(self) -> str:
        parts = [f"{self.layers} layers", f"d_model {self.d_model}", f"{self.n_head} heads", f"d_ff {self.ff}",
                 f"vocab {self.vocab}", f"batch {self.batch} x seq {self.seq}",
                 "float32" if self.dtype == "fp32" else f"{self.dtype} mixed precision",
                 f"{self.attention} attention", f"optimizer {self.optimizer}"]
        if self.checkpointing != "none":
            parts.append(f"{self.checkpointing} activation checkpointing")
        if self.gpus > 1 or self.shard != "none":
            parts.append(f"{self.gpus} devices, shard {self.shard}")
        if self.tied:
            parts.append("tied LM head")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["heads"], data["d_ff"] = self.n_head, self.ff
        return data


def parameter_count(c: Config) -> int:
    C, V, ff = c.d_model, c.vocab, c.ff
    per_layer = (2 * C  # ln_1
                 + C * 3 * C + 3 * C  # c_attn
                 + C * C + C  # attention c_proj
                 + 2 * C  # ln_2
                 + C * ff + ff  # MLP up
                 + ff * C + C)  # MLP down
    embeddings = V * C + c.seq * C  # tokens, positions (the context is the trained length)
    head = 0 if c.tied else V * C
    return embeddings + c.layers * per_layer + 2 * C + head


@dataclass
class Estimate:
    """What the analytic model predicts for one configuration."""

    config: Config
    peak_bytes: int
    peak_phase: str
    peak_op: str
    at_peak: dict[str, int]  # bytes alive at the peak, by category
    parameter_count: int
    parameter_bytes: int
    gradient_bytes: int  # all gradients, once backward is done
    optimizer_bytes: int
    kept_per_layer: dict[str, int]  # activations one layer keeps for backward
    kept_model: dict[str, int]  # activations outside the layers kept for backward
    largest: list[dict[str, Any]]
    attention_scores_bytes: int
    logits_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(), "peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase,
            "peak_op": self.peak_op, "at_peak": dict(self.at_peak), "parameter_count": self.parameter_count,
            "parameter_bytes": self.parameter_bytes, "gradient_bytes": self.gradient_bytes,
            "optimizer_bytes": self.optimizer_bytes, "kept_per_layer": dict(self.kept_per_layer),
            "kept_model": dict(self.kept_model), "largest_tensors": list(self.largest),
            "attention_scores_bytes": self.attention_scores_bytes, "logits_bytes": self.logits_bytes,
        }


class _Ledger:
    """Tensors alive, by name and category; the maximum of their sum and where it happened."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[int, str]] = {}
        self.now = 0
        self.peak = -1
        self.where = ("", "")
        self.at_peak: dict[str, int] = {}
        self.phase = "forward"

    def alloc(self, name: str, nbytes: int, category: str) -> None:
        assert name not in self.live, name
        self.live[name] = (nbytes, category)
        self.now += nbytes

    def free(self, *names: str) -> None:
        for name in names:
            self.now -= self.live.pop(name)[0]

    def mark(self, op: str) -> None:
        if self.now > self.peak:
            self.peak, self.where = self.now, (self.phase, op)
            totals = dict.fromkeys(CATEGORIES, 0)
            for nbytes, category in self.live.values():
                totals[category] += nbytes
            self.at_peak = totals


def _fsdp2_schedule(c: Config, led: "_Ledger") -> fsdp_shards.Fsdp2Schedule | None:
    """FSDP2's buffers for `c` (see fsdp_shards.Fsdp2Schedule), or None when it does not shard with FSDP2."""
    if c.shard not in FSDP2_SHARDS:
        return None
    block = fsdp_shards.block_shapes(c.d_model, c.ff)
    root = fsdp_shards.root_shapes(c.vocab, c.d_model, c.seq, c.tied)
    sizes = (fsdp_shards.unsharded_bytes(block, c.gpus), fsdp_shards.sharded_bytes(block, c.gpus))
    groups = {fsdp_shards.ROOT: (fsdp_shards.unsharded_bytes(root, c.gpus), fsdp_shards.sharded_bytes(root, c.gpus))}
    groups.update((f"layer {i}", sizes) for i in range(c.layers))
    return fsdp_shards.Fsdp2Schedule(led, c.shard == "zero3", groups)


def estimate(c: Config) -> Estimate:
    """Replay one steady-state training step of `c` and return its peak and what makes it."""
    c = c.validated()
    B, T, C, nh, V, ff, L = c.batch, c.seq, c.d_model, c.n_head, c.vocab, c.ff, c.layers
    a = c.act_bytes
    u = B * T * C * a  # one [B, T, C] activation
    f = B * T * ff * a  # one [B, T, d_ff] activation
    S = B * nh * T * T * a  # one [B, nh, T, T] attention score tensor
    stats = 2 * B * T * 4  # LayerNorm's saved mean and rstd, float32
    lse = B * nh * T * 4  # the fused kernel's saved log-sum-exp, float32
    logits = B * T * V * a
    logits32 = B * T * V * 4
    naive = c.attention == "naive"
    ckpt = c.checkpointing == "full"

    n_params = parameter_count(c)
    led = _Ledger()
    fsdp = _fsdp2_schedule(c, led)
    shard_o = c.gpus if c.shard != "none" else 1
    states_per_param = {"adamw": 8, "sgd": 4, "none": 0}[c.optimizer]  # exp_avg(+_sq) / momentum, float32
    if fsdp:  # FSDP2: padded shards of everything; gradients whole until reduce-scattered (see the schedule)
        shards = sum(shard for _, shard in fsdp.groups.values())  # the persistent parameter shards
        param_bytes = shards
        state_bytes = states_per_param * shards // 4
        shard_g = 1
    else:  # zero1 shards only the optimizer states
        param_bytes = n_params * 4  # float32 (master) weights
        state_bytes = states_per_param * n_params // shard_o
        shard_g = 1
    train = c.optimizer != "none"

    def grad_bytes(count: int) -> int:
        return count * 4 // shard_g

    layer_params = {"c_attn": 3 * C * C + 3 * C, "c_proj": C * C + C, "fc": C * ff + ff, "proj": ff * C + C,
                    "ln": 2 * C}

    led.alloc("params", param_bytes, PARAMETERS)
    if naive:  # the causal mask buffer, bool [T, T]
        led.alloc("mask", T * T, PARAMETERS)
    if state_bytes:
        led.alloc("states", state_bytes, OPTIMIZER)
    if a != 4:  # autocast's half-precision copies of the weights, saved by the matmuls for backward
        led.alloc("half weights", (n_params - V * C - T * C) * 2 + (0 if c.tied else V * C * 2), PARAMETERS)

    # ---- forward ------------------------------------------------------------------------------
    led.phase = "forward"
    led.alloc("ids", 2 * B * T * 8, ACTIVATIONS)  # input ids and targets, int64
    if fsdp:
        fsdp.root_pre_forward()
    led.alloc("tok", u, ACTIVATIONS)
    led.alloc("pos", T * C * a, ACTIVATIONS)
    led.alloc("x0", u, ACTIVATIONS)
    led.mark("embedding add")
    led.free("tok", "pos")

    def layer_forward(i: int, keep: bool) -> None:
        p = f"L{i}."
        led.alloc(p + "ln1", u, ACTIVATIONS)
        led.alloc(p + "stats1", stats, ACTIVATIONS)
        led.mark(f"layer {i} ln_1")
        led.alloc(p + "qkv", 3 * u, ACTIVATIONS)
        led.mark(f"layer {i} c_attn")
        if naive:
            led.alloc(p + "q", u, ACTIVATIONS)  # matmul copies the strided q, k^T and v views
            led.alloc(p + "k", u, ACTIVATIONS)
            led.alloc(p + "raw", S, SCORES)  # q @ k^T
            led.mark(f"layer {i} q @ k^T")
            led.alloc(p + "scaled", S, SCORES)
            led.mark(f"layer {i} scale")
            led.free(p + "raw")
            led.alloc(p + "masked", S, SCORES)
            led.mark(f"layer {i} masked_fill")
            led.free(p + "scaled")
            led.alloc(p + "probs", S, SCORES)
            led.mark(f"layer {i} softmax")
            led.free(p + "masked")
            led.alloc(p + "v", u, ACTIVATIONS)
            led.alloc(p + "att_v", u, ACTIVATIONS)
            led.mark(f"layer {i} probs @ v")
            led.alloc(p + "y", u, ACTIVATIONS)  # y.transpose(1, 2).contiguous()
            led.mark(f"layer {i} transpose")
            led.free(p + "att_v")
        else:
            led.alloc(p + "y", u, ACTIVATIONS)  # the fused kernel writes [B, T, nh, hs]: no copy after
            led.alloc(p + "lse", lse, ACTIVATIONS)
            led.mark(f"layer {i} scaled_dot_product_attention")
        led.alloc(p + "proj_out", u, ACTIVATIONS)
        led.mark(f"layer {i} attention c_proj")
        if naive:
            led.free(p + "qkv")  # only the copies are saved
        led.alloc(p + "resid_a", u, ACTIVATIONS)
        led.mark(f"layer {i} residual")
        led.free(p + "proj_out")
        led.alloc(p + "ln2", u, ACTIVATIONS)
        led.alloc(p + "stats2", stats, ACTIVATIONS)
        led.mark(f"layer {i} ln_2")
        led.alloc(p + "fc", f, ACTIVATIONS)
        led.mark(f"layer {i} MLP up")
        led.alloc(p + "gelu", f, ACTIVATIONS)
        led.mark(f"layer {i} GELU")
        led.alloc(p + "mlp_out", u, ACTIVATIONS)
        led.mark(f"layer {i} MLP down")
        led.alloc(p + "resid_b", u, ACTIVATIONS)
        led.mark(f"layer {i} residual")
        led.free(p + "mlp_out")
        if not keep:  # checkpointed or no grad: only the layer's output survives, as the next one's input
            led.free(*[n for n in list(led.live) if n.startswith(p) and n != p + "resid_b"])

    grad_mode = train
    for i in range(L):
        if fsdp:
            fsdp.pre_forward(f"layer {i}")
        layer_forward(i, keep=grad_mode and not ckpt)
        if fsdp:
            fsdp.post_forward(f"layer {i}")
        if not grad_mode:  # inference: a layer's input dies once the layer is done
            led.free(f"L{i - 1}.resid_b" if i else "x0")
    led.alloc("lnf", u, ACTIVATIONS)
    led.alloc("stats_f", stats, ACTIVATIONS)
    led.mark("ln_f")
    led.alloc("logits", logits, LOGITS)
    led.mark("LM head")
    if fsdp:
        fsdp.root_post_forward()
    if not grad_mode:
        led.free("lnf", "stats_f", f"L{L - 1}.resid_b")

    # ---- loss: cross-entropy on float32 logits --------------------------------------------------
    led.phase = "loss"
    if a != 4:
        led.alloc("logits32", logits32, LOGITS)
        led.mark("logits.float()")
    led.alloc("log_softmax", logits32, LOGITS)
    led.mark("log_softmax")
    if a != 4:
        led.free("logits32")
    if not grad_mode:
        led.free("log_softmax")
        return _finish(c, led, n_params, param_bytes, 0, state_bytes, u, f, S, stats, lse, logits, logits32)

    # ---- backward ---------------------------------------------------------------------------------
    led.phase = "backward"

    def grad(name: str, count: int) -> None:
        led.alloc("grad." + name, grad_bytes(count), GRADIENTS)

    led.alloc("g_lsm", logits32, TEMPORARIES)
    led.mark("nll_loss backward")
    led.alloc("g_logits32", logits32, TEMPORARIES)
    led.mark("log_softmax backward")
    led.free("g_lsm", "log_softmax")
    if a != 4:
        led.alloc("g_logits", logits, TEMPORARIES)
        led.mark("float() backward")
        led.free("g_logits32")
    g_logits = "g_logits" if a != 4 else "g_logits32"
    if fsdp:
        fsdp.root_pre_backward()  # fires when the gradient of the logits is ready
    led.alloc("g_lnf", u, TEMPORARIES)
    grad("head", V * C)
    led.mark("LM head backward")
    led.free(g_logits, "lnf")
    led.alloc("g_x", u, TEMPORARIES)
    grad("ln_f", 2 * C)
    led.mark("ln_f backward")
    led.free("g_lnf", "stats_f", f"L{L - 1}.resid_b")

    for i in reversed(range(L)):
        p = f"L{i}."
        if fsdp:
            fsdp.pre_backward(f"layer {i}")
        if ckpt:  # recompute this layer's forward, keeping what backward needs; its output is dropped
            led.phase = "backward (recompute)"
            layer_forward(i, keep=True)
            led.free(p + "resid_b")
            led.phase = "backward"
        led.alloc(p + "g_gelu", f, TEMPORARIES)
        grad(p + "proj", layer_params["proj"])
        led.mark(f"layer {i} MLP down backward")
        led.free(p + "gelu")
        led.alloc(p + "g_fc", f, TEMPORARIES)
        led.mark(f"layer {i} GELU backward")
        led.free(p + "g_gelu", p + "fc")
        led.alloc(p + "g_ln2", u, TEMPORARIES)
        grad(p + "fc", layer_params["fc"])
        led.mark(f"layer {i} MLP up backward")
        led.free(p + "g_fc", p + "ln2")
        led.alloc(p + "g_res_part", u, TEMPORARIES)
        grad(p + "ln2", layer_params["ln"])
        led.mark(f"layer {i} ln_2 backward")
        led.free(p + "g_ln2", p + "stats2", p + "resid_a")
        led.alloc(p + "g_res", u, TEMPORARIES)
        led.mark(f"layer {i} residual backward")
        led.free("g_x", p + "g_res_part")
        led.alloc(p + "g_y", u, TEMPORARIES)
        grad(p + "c_proj", layer_params["c_proj"])
        led.mark(f"layer {i} attention c_proj backward")
        led.free(p + "y")
        if naive:
            led.alloc(p + "g_probs", S, TEMPORARIES)  # dy @ v^T
            led.alloc(p + "g_v", u, TEMPORARIES)  # probs^T @ dy
            led.mark(f"layer {i} probs @ v backward")
            led.free(p + "g_y", p + "v")
            led.alloc(p + "g_scores", S, TEMPORARIES)
            led.mark(f"layer {i} softmax backward")
            led.free(p + "g_probs", p + "probs")
            led.alloc(p + "g_masked", S, TEMPORARIES)
            led.mark(f"layer {i} masked_fill backward")
            led.free(p + "g_scores")
            led.alloc(p + "g_scaled", S, TEMPORARIES)
            led.mark(f"layer {i} scale backward")
            led.free(p + "g_masked")
            led.alloc(p + "g_q", u, TEMPORARIES)
            led.alloc(p + "g_k", u, TEMPORARIES)
            led.mark(f"layer {i} q @ k^T backward")
            led.free(p + "g_scaled", p + "q", p + "k")
            led.alloc(p + "g_qkv", 3 * u, TEMPORARIES)
            led.mark(f"layer {i} split backward")
            led.free(p + "g_q", p + "g_k", p + "g_v")
        else:
            led.alloc(p + "g_qkv_parts", 3 * u, TEMPORARIES)
            led.mark(f"layer {i} scaled_dot_product_attention backward")
            led.free(p + "g_y", p + "lse")
            led.alloc(p + "g_qkv", 3 * u, TEMPORARIES)
            led.mark(f"layer {i} split backward")
            led.free(p + "g_qkv_parts", p + "qkv")
        led.alloc(p + "g_ln1", u, TEMPORARIES)
        grad(p + "c_attn", layer_params["c_attn"])
        led.mark(f"layer {i} c_attn backward")
        led.free(p + "g_qkv", p + "ln1")
        led.alloc(p + "g_in_part", u, TEMPORARIES)
        grad(p + "ln1", layer_params["ln"])
        led.mark(f"layer {i} ln_1 backward")
        led.free(p + "g_ln1", p + "stats1", f"L{i - 1}.resid_b" if i else "x0")
        led.alloc("g_x_new", u, TEMPORARIES)
        led.mark(f"layer {i} residual backward")
        led.free(p + "g_res", p + "g_in_part")
        led.live["g_x"] = led.live.pop("g_x_new")
        if fsdp:  # fires once the gradient of the block's input is whole
            fsdp.post_backward(f"layer {i}", [f"grad.{p}{n}" for n in ("proj", "fc", "ln2", "c_proj", "c_attn", "ln1")])
    grad("embeddings", (0 if c.tied else V * C) + T * C)
    led.mark("embedding backward")
    led.free("g_x")
    if fsdp:
        fsdp.post_backward(fsdp_shards.ROOT, ["grad.head", "grad.ln_f", "grad.embeddings"])
        fsdp.end_backward()
    if a != 4:
        led.free("half weights")

    # ---- optimizer step ---------------------------------------------------------------------------
    led.phase = "optimizer"
    largest_param = max(V * C, C * ff)
    led.alloc("step temporaries", 2 * largest_param * 4 // shard_o, TEMPORARIES)  # AdamW's denominator etc.
    led.mark("optimizer step")
    led.free("step temporaries")
    gradient_bytes = param_bytes if fsdp else grad_bytes(n_params)  # FSDP2: reduce-scattered shards
    return _finish(c, led, n_params, param_bytes, gradient_bytes, state_bytes, u, f, S, stats, lse,
                   logits, logits32)


def _finish(c: Config, led: _Ledger, n_params, param_bytes, gradient_bytes, state_bytes, u, f, S, stats, lse,
            logits, logits32) -> Estimate:
    naive = c.attention == "naive"
    B, T, nh, V = c.batch, c.seq, c.n_head, c.vocab
    if c.optimizer == "none":
        kept_layer: dict[str, int] = {}
        kept_model: dict[str, int] = {}
    elif c.checkpointing == "full":
        kept_layer = {"layer input (checkpoint)": u}
        kept_model = {"embeddings output": u, "ln_f output": u + stats, "logits": logits,
                      "float32 log-softmax": logits32}
    else:
        kept_layer = {"attention probabilities [B, nh, T, T]": S} if naive else {
            "attention output and log-sum-exp": u + lse}
        kept_layer["q, k, v"] = 3 * u
        kept_layer["LayerNorm outputs and statistics"] = 2 * (u + stats)
        kept_layer["attention output (c_proj input)"] = u if naive else 0
        kept_layer["MLP hidden (up and GELU)"] = 2 * f
        kept_layer["residual stream"] = 2 * u
        kept_layer = {k: v for k, v in kept_layer.items() if v}
        kept_model = {"embeddings output": u, "ln_f output": u + stats, "logits": logits,
                      "float32 log-softmax": logits32}
    scores = B * nh * T * T * c.act_bytes
    largest = [
        {"name": "attention scores [B, nh, T, T]", "shape": [B, nh, T, T], "bytes": scores,
         "note": "materialised" if naive else "never materialised by the fused kernel"},
        {"name": "logits [B, T, V]", "shape": [B, T, V], "bytes": logits, "note": ""},
        {"name": "float32 log-softmax of the logits [B, T, V]", "shape": [B, T, V], "bytes": logits32, "note": ""},
        {"name": "MLP hidden [B, T, d_ff]", "shape": [B, T, c.ff], "bytes": f, "note": ""},
    ]
    return Estimate(
        config=c, peak_bytes=led.peak, peak_phase=led.where[0], peak_op=led.where[1], at_peak=led.at_peak,
        parameter_count=n_params, parameter_bytes=param_bytes, gradient_bytes=gradient_bytes,
        optimizer_bytes=state_bytes, kept_per_layer=kept_layer, kept_model=kept_model,
        largest=sorted(largest, key=lambda d: -d["bytes"]),
        attention_scores_bytes=scores, logits_bytes=logits,
    )


# ----------------------------------------------------------------------------------------------------
# Judging against a budget


def peak(c: Config) -> int:
    return estimate(c).peak_bytes


def largest_fitting(c: Config, name: str, budget: int) -> int:
    """The largest value of `name` ("seq" or "batch") whose peak fits `budget`; 0 when even 1 does not."""
    def fits(value: int) -> bool:
        return peak(dataclasses.replace(c, **{name: value})) <= budget

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= _MAX_SEARCH and fits(high):
        low, high = high, high * 2
    if high > _MAX_SEARCH:
        return low
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


@dataclass
class Remedy:
    name: str
    change: str
    peak_bytes: int
    fits: bool
    changes_training: bool = False  # shorter sequences change what the model learns

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def remedies(c: Config, budget: int) -> list[Remedy]:
    """Each standard remedy alone, then the best combination that keeps the training the same."""
    out: list[Remedy] = []

    def add(name: str, change: str, config: Config, changes_training: bool = False) -> None:
        value = peak(config)
        out.append(Remedy(name, change, value, value <= budget, changes_training))

    if c.attention == "naive":
        add("fused attention", "--attention sdpa (never stores T x T)",
            dataclasses.replace(c, attention="sdpa"))
    if c.dtype == "fp32":
        add("mixed precision", "--dtype bf16 (16-bit activations)",
            dataclasses.replace(c, dtype="bf16"))
    if c.checkpointing == "none" and c.optimizer != "none":
        add("activation checkpointing", "--checkpointing full (recompute in backward)",
            dataclasses.replace(c, checkpointing="full"))
    if c.batch > 1:
        micro = largest_fitting(c, "batch", budget)
        micro = max(1, min(micro, c.batch - 1)) if micro else 1
        while c.batch % micro:
            micro -= 1
        add("gradient accumulation", f"micro-batch {micro} x {c.batch // micro} accumulation steps",
            dataclasses.replace(c, batch=micro))
    if c.optimizer != "none":
        gpus = c.gpus if c.gpus > 1 else 8
        add("ZeRO-3 / FSDP sharding", f"--gpus {gpus} --shard zero3",
            dataclasses.replace(c, gpus=gpus, shard="zero3"))
    seq = largest_fitting(c, "seq", budget)
    if seq < c.seq:
        shorter = max(seq, 1)
        add("shorter sequences", f"--seq {shorter} (largest that fits)" if seq else "--seq 1 still does not fit",
            dataclasses.replace(c, seq=shorter), changes_training=True)

    best = dataclasses.replace(c, attention="sdpa", dtype="bf16" if c.dtype == "fp32" else c.dtype,
                               checkpointing="full" if c.optimizer != "none" else "none")
    parts = [p for p, on in (("fused attention", c.attention == "naive"), ("bf16", c.dtype == "fp32"),
                             ("checkpointing", c.checkpointing == "none" and c.optimizer != "none")) if on]
    if peak(best) > budget and best.batch > 1:
        micro = largest_fitting(best, "batch", budget)
        if micro and micro < best.batch:
            while best.batch % micro:
                micro -= 1
            parts.append(f"micro-batch {micro} x {best.batch // micro}")
            best = dataclasses.replace(best, batch=micro)
    if parts:
        add("best combination", " + ".join(parts), best)
    return out


@dataclass
class Verdict:
    """The estimate judged against the budget."""

    estimate: Estimate | None  # None in traced mode
    budget_bytes: int
    budget_source: str
    largest_seq: int
    largest_batch: int
    remedies: list[Remedy] = field(default_factory=list)
    mode: str = "analytic"
    traced: dict[str, Any] | None = None  # the trace, in traced mode

    @property
    def peak_bytes(self) -> int:
        return self.traced["peak_bytes"] if self.traced else self.estimate.peak_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes


def judge(c: Config, budget: int, budget_source: str) -> Verdict:
    est = estimate(c)
    return Verdict(est, budget, budget_source, largest_fitting(c, "seq", budget), largest_fitting(c, "batch", budget),
                   remedies(c, budget))
