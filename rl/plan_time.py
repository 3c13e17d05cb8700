"""The planner's time estimate: seconds a GRPO step takes on the recipe's layout, split by phase, from the
work the step does and the rates of rl/rates.yaml (each figure measured on a device kind by a bench command,
with its date and command, or assumed from a vendor's spec, with its source).

    est = estimate_step(cfg, make_plan(cfg))       # StepTime: phases in seconds, bytes moved, the rates used
    print("\\n".join(format_time(est)))

The work of one step (S = data.train_batch_size x rollout.n sequences of Lp prompt and R response tokens; Lp
and R default to rollout.max_prompt_len and rollout.max_response_len, the bounds; `sparkrl plan
--prompt-len/--response-len` give expected lengths instead):
- rollout decode, per engine: its S / rollout.num_workers sequences in waves of at most rollout.max_num_seqs
  (and what the KV cache holds on GPUs), R steps a wave; a step costs the engine's host time per step
  (`decode_step_s` with CUDA graphs; with rollout.enforce_eager, `decode_layer_step_eager_s` a decoder
  layer, where the device kind has it: each layer's kernels launched one by one), plus a sequence's own cost
  a step where measured in that mode (`decode_seq_s` with CUDA graphs, `decode_seq_eager_s` eager:
  sampling, log-probs, routing capture), plus reading the weights an engine GPU holds
  (`hbm_gbps`; of the experts, the share a wave's tokens route to: 1 - (1 - top_k / num_experts)^wave),
  plus 2 N_active FLOPs a sequence over TP GPUs (`decode_tflops`). The read and the FLOPs add: a decode
  step's expert matmuls see a few tokens an expert and are bound by the read, while the attention, the
  LoRA, the head and the sampler grow with the wave (on one H100 at full width the sum fits batch 64, 128
  and 256 within 2 %; the larger of the two missed batch 128 by 23 %);
- rollout prefill: 2 N_active FLOPs a prompt token (a prompt once with rollout.enable_prefix_caching, n times
  without) at `prefill_tflops` a GPU;
- the log-prob pass (when it runs: docs/design.md, step 4): 2 N_active FLOPs a trainer token (Lp + R) at
  `logprob_tflops` a rank; the train passes: 6 N_active a token a epoch (8 N_active with
  trainer.activation_checkpointing: the forward recomputed) at `train_tflops` a rank; each pass also costs
  what does not scale with FLOPs, where the device kind has the figures: `train_call_s` a call (the Ray
  call, batching, the optimizer) and a decoder layer a micro-batch (the layer's kernels launched, its
  gather and hooks) by how the layers run: `train_layer_pass_eager_s` uncompiled (CPU, trainer.compile
  false: each kernel launched one by one), `train_layer_pass_s` compiled; `logprob_call_s` and
  `logprob_layer_pass_eager_s` / `logprob_layer_pass_s` for the log-prob pass;
- FSDP2 all-gathers per micro-batch and pass (the forward, and the backward's re-gather): every rank receives
  (g - 1) / g of each gathered weight, g the ranks sharing it; without expert parallelism (EP) every weight
  over all trainer ranks, with EP the experts (bank and LoRA) over the num_ranks / EP ranks holding the same
  ones and the rest over all ranks; the nvfp4 base moves packed, the LoRA in model.dtype. LoRA gradients are
  reduce-scattered (fp32) once a micro-batch over the same groups;
- EP all-to-all: each MoE layer sends a micro-batch's tokens x top_k rows of the expert width (model.dtype)
  out and back, (EP - 1) / EP of them to other ranks: forward, recompute and backward;
- a link is NVLink (`intra_node_gbps`, resources.intra_node_gbps) when the group lies in one node, else
  InfiniBand (`inter_node_gbps`, resources.inter_node_gbps); on CPU both are the measured gloo all-gather;
- dequantization (trainer.base_format nvfp4): the packed weights a rank computes with, written in model.dtype
  once a pass and micro-batch, at `dequant_gbps`;
- adapter sync: `sync_s` + the adapter's bytes (merged weights for sync.mode merged) at `sync_gbps`;
- colocated engines (GPU, rollout.placement colocated) sleep before the trainer's phases and wake after:
  `colocate_switch_s` + the engine's weights to host memory and back at `host_link_gbps`;
- the driver's own work (reward scoring, advantages, Ray calls): `step_overhead_s`.

The phases add up (the synchronous loop); with rollout.max_staleness > 0 the rollout overlaps the trainer's
phases and the step is the longer of the two plus the rest. The bottleneck is the largest phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

RATES_FILE = Path(__file__).with_name("rates.yaml")
DEVICE_KINDS = ("cpu-2core-dev", "h100-80gb", "h200")


@cache
def load_rates(path: str = str(RATES_FILE)) -> dict:
    import yaml

    return yaml.safe_load(Path(path).read_text())


def device_kind(cfg) -> str:
    """resources.device, or for `auto`: the CPU figures without GPUs, h100-80gb for GPUs of at most 96 GiB
    (resources.gpu_memory_gib), else h200."""
    res = cfg.resources
    if res.device != "auto":
        return res.device
    if not res.num_gpus:
        return "cpu-2core-dev"
    return "h100-80gb" if res.gpu_memory_gib <= 96 else "h200"


@dataclass
class Rate:
    name: str
    value: float
    measured: bool
    source: str  # "command, date" (measured) or the source it is assumed from
    active_params: float = 0.0  # of the model a FLOP rate was measured on (0: not recorded)
    hidden_size: int = 0  # of that model's layers (0: not recorded)


def rate(kind: str, name: str, ranks: int = 0, rates: dict | None = None, hidden: int = 0) -> Rate:
    """A figure of the device kind: `name@<ranks>` where the file has it (CPU ranks share the cores), else
    `name`, else the figure at the fewest ranks measured. A FLOP rate may also hold the same figure measured
    on layers of other widths (`by_size`, each with its `hidden_size`): for a model of hidden size `hidden`
    (the matmuls' shapes set the rate), the one measured at the nearest width, by ratio."""
    table = (rates or load_rates())["devices"][kind]["rates"]
    per_ranks = sorted((k for k in table if k.startswith(name + "@")), key=lambda k: int(k.split("@")[1]))
    key = next((k for k in (f"{name}@{ranks}", name, *per_ranks) if k in table), name)
    f = table[key]
    if hidden and f.get("by_size"):
        f = min([f, *f["by_size"]], key=lambda g: abs(math.log(hidden / g["hidden_size"])))
    measured = f["kind"] == "measured"
    src = f"{f['command']} ({f['date']})" if measured else f["source"]
    return Rate(
        key,
        float(f["value"]),
        measured,
        src,
        float(f.get("active_params", 0.0)),
        int(f.get("hidden_size", 0)),
    )


def optional_rate(
    kind: str, name: str, ranks: int = 0, rates: dict | None = None, hidden: int = 0
) -> Rate | None:
    """`rate`, or None where the device kind's table lacks the figure (the per-call costs bench.rates
    measures on a GPU: a kind without them is timed by its FLOP and byte rates alone)."""
    table = (rates or load_rates())["devices"][kind]["rates"]
    if not any(k == name or k.startswith(name + "@") for k in table):
        return None
    return rate(kind, name, ranks, rates, hidden)


@dataclass
class StepTime:
    kind: str
    prompt_len: float
    response_len: float
    lengths_why: str
    phases: dict[str, float] = field(default_factory=dict)  # seconds
    bytes: dict[str, float] = field(default_factory=dict)  # bytes a rank receives (or writes) a step
    links: dict[str, str] = field(default_factory=dict)  # collective -> "intra-node" / "inter-node"
    rates: dict[str, Rate] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    overlapped: bool = False

    @property
    def step_s(self) -> float:
        p = self.phases
        if not self.overlapped:
            return sum(p.values())
        rollout = p.get("rollout decode", 0) + p.get("rollout prefill", 0)
        trainer = sum(
            v for k, v in p.items() if not k.startswith("rollout") and k not in ("adapter sync", "driver")
        )
        return max(rollout, trainer) + p.get("adapter sync", 0) + p.get("driver", 0)

    @property
    def bottleneck(self) -> str:
        return max(self.phases, key=self.phases.get)


def active_params(s) -> float:
    """Parameters one token computes with: the experts at top_k / num_experts, the output head (vocab x hidden)
    and everything else but the embedding table."""
    p = s.params
    n = sum(v for k, v in p.items() if k not in ("experts", "embeddings"))
    if s.num_experts:
        n += p.get("experts", 0) * s.top_k / s.num_experts
    return n + s.vocab * s.hidden


def logprob_pass_runs(cfg) -> bool:
    """Whether step 4 is a pass of its own (docs/design.md): not for one on-policy optimizer step a batch
    without TIS/MIS, LoRA dropout, live-routing KL or stop_on_violation."""
    from rl.config import rollout_correction_caps

    tr = cfg.trainer
    mini = math.ceil(cfg.data.train_batch_size / tr.mini_batch_size) if tr.mini_batch_size else 1
    one_step = mini * tr.ppo_epochs == 1
    fused = one_step and not any(rollout_correction_caps(cfg)) and not cfg.lora.dropout
    fused = fused and not (cfg.r3.enabled and cfg.r3.measure_live_kl) and not cfg.monitor.stop_on_violation
    return not fused or cfg.rollout.max_staleness > 0


def micro_batch_count(tr, tokens_per_rank: float, seq_len: float) -> int:
    """Micro-batches a rank runs a pass over `tokens_per_rank` tokens in sequences of `seq_len`
    (trainer.micro_batch_tokens, else trainer.micro_batch_size sequences)."""
    micro = tr.micro_batch_tokens or tr.micro_batch_size * seq_len
    return max(1, math.ceil(tokens_per_rank / micro))


def trainer_nodes(cfg, ranks: int) -> int:
    """Nodes `ranks` consecutive trainer ranks span (rank r on node r // gpus_per_node, rl/placement.py)."""
    res = cfg.resources
    return 1 if not res.num_gpus else math.ceil(ranks / res.gpus_per_node)


def estimate_step(
    cfg, plan, prompt_len: float = 0, response_len: float = 0, rates: dict | None = None
) -> StepTime:
    """The step time of `cfg` (with `plan`, its make_plan) on resources.device's rates."""
    from rollout.config import engine_setting

    kind = device_kind(cfg)
    ro, tr, res, s = cfg.rollout, cfg.trainer, cfg.resources, plan.shape
    ranks, ep = tr.num_ranks, max(tr.expert_parallel_size, 1)
    why = []
    Lp = prompt_len or ro.max_prompt_len
    why.append(
        "prompt " + (f"{Lp:g} tokens (given)" if prompt_len else f"rollout.max_prompt_len {Lp} (the bound)")
    )
    R = response_len or ro.max_response_len
    why.append(
        "response "
        + (f"{R:g} tokens (given)" if response_len else f"rollout.max_response_len {R} (the bound)")
    )
    est = StepTime(kind, Lp, R, "; ".join(why), overlapped=ro.max_staleness > 0)
    N = active_params(s)
    H = s.hidden
    r = lambda name, n=0: est.rates.setdefault(  # noqa: E731
        name + (f"@{n}" if n else ""), rate(kind, name, n, rates, H)
    )

    def o(name: str, n: int = 0) -> Rate | None:
        f = optional_rate(kind, name, n, rates, H)
        if f is not None:
            est.rates.setdefault(name + (f"@{n}" if n else ""), f)
        return f

    wbytes = plan.weight_bytes
    S = cfg.data.train_batch_size * ro.n
    gpus = bool(res.num_gpus)

    # ---- rollout ----
    engines, tp = max(ro.num_workers, 1), max(ro.tensor_parallel_size, 1)
    per_engine = math.ceil(S / engines)
    wave = min(per_engine, engine_setting(ro, "max_num_seqs"))
    if gpus and plan.seqs_fit:
        wave = max(1, min(wave, plan.seqs_fit))
    waves = math.ceil(per_engine / wave)
    weights_gpu = plan.r_weights + plan.r_lora
    mem_s = plan.decode_read_bytes(wave) / (r("hbm_gbps").value * 1e9)
    flop_s = 2 * N * wave / tp / (r("decode_tflops").value * 1e12)
    enforce_eager = engine_setting(ro, "enforce_eager")
    eager = o("decode_layer_step_eager_s") if enforce_eager else None
    host = s.num_layers * eager.value if eager else r("decode_step_s").value
    if enforce_eager and not eager and gpus:
        est.notes.append("rollout.enforce_eager: no eager decode figure for this device; the CUDA-graph one")
    per_seq = o("decode_seq_eager_s" if enforce_eager else "decode_seq_s")
    step = host + (per_seq.value * wave if per_seq else 0.0) + mem_s + flop_s
    est.phases["rollout decode"] = waves * R * step
    prompts = S if not ro.enable_prefix_caching else cfg.data.train_batch_size
    est.phases["rollout prefill"] = 2 * N * prompts * Lp / (engines * tp * r("prefill_tflops").value * 1e12)

    # ---- trainer ----
    tokens = S * (Lp + R)
    per_rank = tokens / ranks
    micro = tr.micro_batch_tokens or tr.micro_batch_size * (Lp + R)
    micro_batches = micro_batch_count(tr, per_rank, Lp + R)
    n_tr = ranks if not gpus else 0  # CPU ranks share the cores: the rate measured at that rank count
    logprob = logprob_pass_runs(cfg)

    compiled = gpus and tr.compile  # the trainer compiles its layers on GPUs only
    mode = "" if compiled else "_eager"

    def fixed(pass_: str, passes: int) -> float:  # the pass's cost besides its FLOPs, where measured
        call, layer = o(f"{pass_}_call_s", n_tr), o(f"{pass_}_layer_pass{mode}_s", n_tr)
        per_layer = layer.value * s.num_layers * micro_batches * passes if layer else 0.0
        return (call.value if call else 0.0) + per_layer

    if logprob:
        est.phases["log-prob pass"] = 2 * N * per_rank / (r("logprob_tflops", n_tr).value * 1e12) + fixed(
            "logprob", 1
        )
    train_flops = (8 if tr.activation_checkpointing else 6) * N * per_rank * tr.ppo_epochs
    est.phases["train passes"] = train_flops / (r("train_tflops", n_tr).value * 1e12) + fixed(
        "train", tr.ppo_epochs
    )

    # passes that gather the weights, a micro-batch each: the log-prob forward, each epoch's forward and backward
    gathers = micro_batches * ((1 if logprob else 0) + 2 * tr.ppo_epochs)
    packed = plan.base_format == "nvfp4"
    experts = s.params.get("experts", 0)
    expert_bytes = plan.t_base_bytes.get("experts", 0.0)
    rest_bytes = sum(plan.t_base_bytes.values()) - expert_bytes
    lora_exp = plan.lora_params_experts
    lora_rest = plan.lora_params_trainer - lora_exp
    dp = ranks // ep
    intra, inter = _links(cfg, kind, r)

    def link(group: int, span_ranks: int) -> tuple[float, str]:
        nodes = trainer_nodes(cfg, span_ranks)
        return (inter, "inter-node") if nodes > 1 else (intra, "intra-node")

    frac = lambda g: (g - 1) / g if g > 1 else 0.0  # noqa: E731
    # over all ranks: the non-expert weights and their LoRA; the experts (bank and LoRA) over their dp group,
    # ranks e, e + EP, ... (all ranks at EP 1), which has a rank on every node the trainer spans
    ag_all = gathers * (rest_bytes + lora_rest * wbytes) * frac(ranks)
    ag_exp = gathers * (expert_bytes + lora_exp * wbytes) / ep * frac(dp)
    updates = micro_batches * tr.ppo_epochs  # the LoRA gradients (fp32) reduce-scattered once a micro-batch
    rs_all, rs_exp = updates * lora_rest * 4 * frac(ranks), updates * lora_exp * 4 / ep * frac(dp)
    bw_all, where_all = link(ranks, ranks)
    bw_exp, where_exp = link(dp, ranks if dp > 1 else 1)
    est.bytes["all-gather (non-expert)"] = ag_all
    est.bytes["all-gather (experts)"] = ag_exp
    est.bytes["reduce-scatter (LoRA grads)"] = rs_all + rs_exp
    est.links["all-gather (non-expert)"] = where_all
    est.links["all-gather (experts)"] = where_exp
    est.phases["all-gather"] = (ag_all + rs_all) / (bw_all * 1e9) + (ag_exp + rs_exp) / (bw_exp * 1e9)

    if ep > 1 and s.num_experts:
        exchanges = micro_batches * (
            (2 if logprob else 0) + tr.ppo_epochs * (6 if tr.activation_checkpointing else 4)
        )
        a2a = exchanges * s.moe_layers * min(micro, per_rank) * s.top_k * s.expert_width * wbytes * frac(ep)
        bw, where = link(ep, ep)
        est.bytes["all-to-all"] = a2a
        est.links["all-to-all"] = where
        est.phases["all-to-all"] = a2a / (bw * 1e9)

    if packed:
        quantized = sum(
            v for k, v in s.params.items() if k in ("attention", "latent", "shared_experts", "dense_mlp")
        )
        deq = gathers * (quantized + experts / ep) * wbytes
        est.bytes["dequantized"] = deq
        est.phases["dequantization"] = deq / (r("dequant_gbps").value * 1e9)

    sync_bytes = (plan.lora_params_trainer if cfg.sync.mode == "adapter" else s.total_params) * wbytes
    est.bytes["adapter sync"] = sync_bytes
    est.phases["adapter sync"] = r("sync_s").value + sync_bytes / (r("sync_gbps").value * 1e9)
    est.phases["driver"] = r("step_overhead_s").value
    if gpus and ro.placement == "colocated":
        switch = o("colocate_switch_s")
        if switch:
            moved = 2 * weights_gpu  # to host memory at sleep, back at wake
            est.bytes["sleep and wake"] = moved
            est.phases["sleep and wake"] = switch.value + moved / (r("host_link_gbps").value * 1e9)
        else:
            est.notes.append("not timed: the colocated engines' sleep and wake around the trainer's phases")
    for name, f in est.rates.items():
        # a FLOP rate grows with the matmuls' sizes: one measured on layers of another width, or (where the
        # width is not recorded) on a much smaller or larger model, may not hold
        if f.hidden_size and f.hidden_size != H:
            est.notes.append(
                f"{name} was measured on layers of hidden size {f.hidden_size:,}, this model's are {H:,}: FLOP "
                "rates change with the matmuls' sizes"
            )
        elif not f.hidden_size and f.active_params and not 1 / 3 <= N / f.active_params <= 3:
            est.notes.append(
                f"{name} was measured on a model of {f.active_params / 1e9:.3g}B active parameters, this one has "
                f"{N / 1e9:.3g}B: FLOP rates change with the matmuls' sizes"
            )
    if ro.env:
        est.notes.append(
            f"rollout.env: the response is the whole episode (up to {ro.max_turns} turns and the environment's "
            "messages, generated tokens timed as decode); the environment's own time is not timed"
        )
    if not gpus:
        est.notes.append(
            "CPU: the figures were measured on the demo's tiny model; they are per-call costs more than FLOP rates"
        )
    return est


def _links(cfg, kind: str, r) -> tuple[float, float]:
    res = cfg.resources
    intra = res.intra_node_gbps or r("intra_node_gbps").value
    inter = res.inter_node_gbps or r("inter_node_gbps").value
    return intra, inter


def format_time(est: StepTime, title: str = "time") -> list[str]:
    lines = [f"{title} per step (resources.device {est.kind}: its rates in rl/rates.yaml; {est.lengths_why})"]
    for name, sec in est.phases.items():
        lines.append(f"  {name:<16} {sec:10.2f} s")
    loop = (
        "the rollout overlapping the trainer (rollout.max_staleness > 0)"
        if est.overlapped
        else "phases in sequence"
    )
    lines.append(f"  step             {est.step_s:10.2f} s   {loop}; bottleneck: {est.bottleneck}")
    for name, b in est.bytes.items():
        where = f", {est.links[name]}" if name in est.links else ""
        size = f"{b / 1e9:,.1f} GB" if b >= 1e9 else f"{b / 1e6:,.1f} MB"
        lines.append(f"    {name}: {size} a rank a step{where}")
    measured = sorted(k for k, v in est.rates.items() if v.measured)
    assumed = sorted(k for k, v in est.rates.items() if not v.measured)
    if measured:
        lines.append("  measured: " + ", ".join(f"{k} {est.rates[k].value:g}" for k in measured))
    if assumed:
        lines.append("  assumed: " + ", ".join(f"{k} {est.rates[k].value:g}" for k in assumed))
    lines += [f"  note: {n}" for n in est.notes]
    return lines


EP_LAYOUTS = (1, 8, 16)


def compare_ep(
    cfg, make_plan, sizes=EP_LAYOUTS, prompt_len: float = 0, response_len: float = 0
) -> list[tuple[int, str, StepTime | None, object]]:
    """(EP, verdict, StepTime or None, Plan or None) for each expert-parallel size on cfg's layout, each
    planned by `make_plan(cfg)`; a size the config refuses has its reason as the verdict."""
    from rl.config import validate

    out = []
    for ep in sizes:
        c = _with(cfg, ep)
        refused = [f"{k}: {why}" for k, why in validate(c) if k == "trainer.expert_parallel_size"]
        if refused:
            out.append((ep, "refused: " + "; ".join(refused), None, None))
            continue
        p = make_plan(c)
        est = estimate_step(c, p, prompt_len, response_len)
        out.append((ep, "fits" if p.fits else "does not fit", est, p))
    return out


def _with(cfg, ep: int):
    import copy

    c = copy.deepcopy(cfg)
    c.trainer.expert_parallel_size = ep
    return c


def format_compare(rows) -> list[str]:
    lines = ["expert parallelism on this layout (trainer.expert_parallel_size):"]
    for ep, verdict, est, _ in rows:
        if est is None:
            lines.append(f"  EP {ep:>2}: {verdict}")
            continue
        moved = sum(v for k, v in est.bytes.items() if k.startswith(("all-", "reduce")))
        lines.append(
            f"  EP {ep:>2}: {est.step_s:8.1f} s a step ({verdict}); all-gather {est.phases['all-gather']:.1f} s, "
            f"all-to-all {est.phases.get('all-to-all', 0):.1f} s, dequantization {est.phases.get('dequantization', 0):.1f} s; "
            f"{moved / 1e9:,.0f} GB a rank moved; bottleneck {est.bottleneck}"
        )
    ok = [(est.step_s, ep) for ep, v, est, _ in rows if est is not None and v == "fits"]
    if ok:
        lines.append(f"  fastest that fits: EP {min(ok)[1]}")
    return lines
