"""Each rank's GPU memory in one training step, estimated on the CPU with fake tensors (bench_fsdp.py --estimate).

The step is the loops' own (train_sft.py, train_distillation.py): a window of micro-batches, each the frozen teacher's
forward without gradients (distillation), the student's forward to its final hidden states, the fused loss through
`lm_head.weight` (trainer/losses/fused_linear.py: the cross entropy, KD), the backward, the teacher's gathered root
freed (trainer/skeleton/sharding.reshard_root); then Run.optimizer_step's arithmetic (the gradients scaled by one
foreach multiply, clipped by the global norm, AdamW, zero_grad). The models are built on the meta device and sharded
by trainer/skeleton/sharding.shard exactly as `--fsdp 1` does it (each RMSNorm, each decoder layer, the root; the
layers gathered in bf16), then materialised as fake tensors -- shapes and dtypes, no storage -- under a fake process
group of W ranks, so that the real Qwen3 shapes run on a laptop. torch's FSDPMemTracker counts every tensor a rank
would hold (its shards, the gathered units, all-gather and reduce-scatter buffers, activations, gradients, AdamW's
moments and the foreach temporaries) and `PhasePeaks` keeps the most of it per phase. The student is fully trained,
or a LoRA student (`lora_rank`: its base frozen in bf16, fp32 adapters, they alone in AdamW, no gradient of its
frozen head).

What stands in for CUDA, and what is left out:
- autocast: CPU bf16 autocast (this build has no CUDA). For the ops of this model it lowers what CUDA's lowers --
  the linear layers, the loss's `hidden @ weight.T`, scaled_dot_product_attention -- and everything else is cast
  explicitly in model/qwen3.py and trainer/losses/closed_forms.py, so the dtypes, hence the bytes, are CUDA's.
- attention: the CPU flash kernel, which saves what CUDA's flash kernel saves (the output and the fp32
  log-sum-exp) and takes grouped-query heads without expanding k and v.
- AdamW: foreach=True stands in for the loops' fused kernel (trainer/skeleton/optimizer_step.make_optimizer), which
  allocates no temporaries: the optimizer phase here is high by one temporary per gradient shard, an upper bound.
  The fused step itself is miscounted on fake DTensors (1.46x what two real gloo ranks allocate, measured with
  --estimate_check) and breaks the estimate's linearity in depth.
- left out: the CUDA context, NCCL's buffers, the caching allocator's rounding and fragmentation, and kernels'
  internal workspaces (cuBLAS, flash attention's backward accumulators): the reserve `RESERVE_GB` is for those.
- the positions: every position of a row but the last predicts a label (the most `completion_hidden` can keep);
  `completion_hidden` itself is not called, since its data-dependent gather has no fake shape.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from model import Qwen3Config, Qwen3ForCausalLM
from model.checkpoint_io import hf_layout
from model.lora import TARGETS, adapter_count, add_lora
from model.value import Qwen3ValueModel
from trainer.skeleton.sharding import reshard_root, shard
from trainer.losses.fused_divergences import fused_kd_loss
from trainer.losses.fused_linear import fused_cross_entropy, release_workspace

# The public config.json of each Qwen/Qwen3-* model (huggingface.co/Qwen): hidden, intermediate, layers, attention
# heads, key/value heads, tied embeddings; all have head_dim 128 and the 151,936-row vocabulary.
QWEN3_SHAPES = {"Qwen3-0.6B": (1024, 3072, 28, 16, 8, True), "Qwen3-1.7B": (2048, 6144, 28, 16, 8, True),
                "Qwen3-4B": (2560, 9728, 36, 32, 8, True), "Qwen3-8B": (4096, 12288, 36, 32, 8, False),
                "Qwen3-14B": (5120, 17408, 40, 40, 8, False), "Qwen3-32B": (5120, 25600, 64, 64, 8, False)}
PHASES = ("teacher", "forward", "backward", "optimizer")
GPU_GB = 80.0
# the CUDA context (~0.5 GB), NCCL's buffers, allocator rounding and fragmentation, kernel workspaces: none of
# them is a tensor the tracker sees
RESERVE_GB = 8.0


def qwen3_config(name: str) -> Qwen3Config:
    hidden, intermediate, layers, heads, kv_heads, tied = QWEN3_SHAPES[name]
    return Qwen3Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128,
                       tie_word_embeddings=tied)


@dataclass(frozen=True)
class StepShape:
    """One optimizer step: `window` micro-batches of `batch` rows x `seq` tokens, the loss `chunk` positions at a
    time (--loss_chunk_size), with or without --gradient_checkpointing."""
    batch: int = 2
    seq: int = 2048
    window: int = 2
    chunk: int = 512
    gradient_checkpointing: bool = False


def build(config: Qwen3Config, world: int, trained: bool, lora_rank: int = 0) -> Qwen3ForCausalLM:
    """The model as the loops hold it on a GPU, on the meta device: sharded over `world` ranks (not for one rank),
    a student with fp32 master weights, a teacher stored in bf16 and frozen (read_teacher on CUDA). `lora_rank`: a
    LoRA student as trainer/skeleton/loading.build_model builds it -- its base frozen in bf16 (the compute dtype),
    fp32 adapters of that rank on all seven projections of every layer, added before sharding. `materialise` then
    gives it this rank's tensors."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    if not trained:
        # frozen as load_teacher freezes it, but for requires_grad (torch's MemTracker refuses a frozen parameter a
        # forward uses; ours below take it): under no_grad no graph, no byte, differs
        model.to(torch.bfloat16).eval()
    if lora_rank:
        model.to(torch.bfloat16)
        add_lora(model, rank=lora_rank, seed=None)  # on the meta device: filled by `materialise`'s caller
    if world > 1:
        shard(model, "cpu", torch.bfloat16)
    return model


def materialise(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """Only this rank's shards, on the CPU, in the active tensor mode (fake or real); RoPE's fp32 buffer recomputed."""
    return model.to_empty(device="cpu")


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """Run.make_optimizer's AdamW over the parameters that train, foreach in place of fused (the module's docstring
    says why); its moments created by one step of zero gradients (a later step's forward already holds them)."""
    trained = [p for p in model.parameters() if p.requires_grad]  # a LoRA student's adapters alone
    optimizer = torch.optim.AdamW(trained, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
    for p in trained:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


class PhasePeaks:
    """The most a memory counter saw within each phase, per occurrence (`peaks[phase]`: one entry per micro-batch,
    or one for the optimizer). `current()` / `peak()` read the counter; `reset(phase)` starts a new running peak."""

    def __init__(self, current: Callable[[], int], peak: Callable[[], int], reset: Callable[[str], None]):
        self.current, self.peak, self.reset = current, peak, reset
        self.peaks: dict[str, list[int]] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.reset(name)
        yield
        self.peaks.setdefault(name, []).append(self.peak())


def track_teacher(tracker: MemTracker, teacher: Qwen3ForCausalLM) -> None:
    """Count the teacher's tensors (shards or whole weights, RoPE's buffer) from the start. FSDPMemTracker follows
    one FSDP root, the student's; the teacher's own tensors are registered as "Inputs" (the one category of its own
    that it takes from outside) -- the teacher's all-gathers and frees are seen like any op's."""
    if not isinstance(tracker, FSDPMemTracker):
        tracker.track_external(teacher)
        return
    tensors = [*teacher.parameters(), *teacher.buffers()]
    tracker.track_inputs(tuple(t.to_local() if hasattr(t, "to_local") else t for t in tensors))


class _RunningPeak:
    """The trackers' running peak only: their own update also refreshes every active module's peak snapshot on
    every op, a cost that grows with the number of modules (hours for a 32B teacher and a 14B student on two
    cores); the estimate reads the peak per phase, not per module."""

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            self._peak_mem[dev] = max(self._peak_mem.get(dev, 0), snap["Total"])

    def _track_module_params_and_buffers(self, module: torch.nn.Module,
                                         install_grad_hooks: bool = True) -> tuple[int, int]:
        """The trackers' own, but a gradient hook only on a parameter that trains: register_hook refuses a frozen
        one (a LoRA student's base), which never has a gradient to count. Every parameter's bytes are counted."""
        memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        for param in module.parameters() if install_grad_hooks else ():
            if param.requires_grad and param not in self._param_to_grad_hook_handles:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(self._count_gradient),
                    param.register_post_accumulate_grad_hook(lambda p: self._count_gradient(p.grad)))
        return memory

    def _count_gradient(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)


class RunningPeakFSDPTracker(_RunningPeak, FSDPMemTracker):
    pass


class RunningPeakTracker(_RunningPeak, MemTracker):
    pass


def tracker_phases(tracker: MemTracker) -> PhasePeaks:
    """PhasePeaks over a RunningPeak tracker. Its running peak has no public reset: it is set to the
    current total as the tracker's own __enter__ does. At a micro-batch's first phase, `reset_mod_stats` lets its
    module hooks see the micro-batch's forwards (the trackers refuse a module's second forward otherwise; a
    backward needs the stats of the forwards before it, the teacher's included)."""
    last = [None]

    def current() -> int:
        return sum(snap["Total"] for snap in tracker.get_tracker_snapshot().values())

    def reset(phase: str) -> None:
        if phase in ("teacher", "forward") and last[0] != "teacher":  # a micro-batch's first forward
            tracker.reset_mod_stats()
        last[0] = phase
        tracker._peak_mem = {dev: snap["Total"] for dev, snap in tracker.get_tracker_snapshot().items()}
    return PhasePeaks(current, lambda: sum(tracker._peak_mem.values()), reset)


def predicting(hidden: torch.Tensor) -> torch.Tensor:
    """(B, T, H) final hidden states -> the (B * (T - 1), H) positions that predict a label."""
    return hidden[:, :-1].reshape(-1, hidden.shape[-1])


def training_step(student: Qwen3ForCausalLM, teachers: list[Qwen3ForCausalLM], optimizer: torch.optim.Optimizer,
                  shape: StepShape, phases: PhasePeaks, seed: int = 0) -> None:
    """One optimizer step as train_sft.py (no teacher) / train_distillation.py take it, under CPU bf16 autocast
    (standing in for CUDA's), each phase measured by `phases`. Several teachers (--teachers): the rows of a
    micro-batch dealt out among them (teacher k scores rows k, k + K, ...; one with no row still runs its forward,
    on row 0, as a sharded teacher does), each loss term on its teacher's rows, and every teacher's head gathered
    until the backward's end, as in the loop."""
    student.gradient_checkpointing = shape.gradient_checkpointing
    generator = torch.Generator().manual_seed(seed)
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    vocab = student.config.vocab_size
    for _ in range(shape.window):
        ids = torch.randint(0, vocab, (shape.batch, shape.seq), generator=generator)
        labels = ids[:, 1:].reshape(-1)
        rows = [list(range(k, shape.batch, len(teachers))) for k in range(len(teachers))]
        teacher_hidden = []
        for teacher, mine in zip(teachers, rows):
            with phases.phase("teacher"), torch.no_grad(), autocast():
                teacher_hidden.append(predicting(teacher(ids[mine or [0]], return_hidden=True).hidden_states))
        with phases.phase("forward"), autocast():
            hidden = student(ids, return_hidden=True).hidden_states
            if not teachers:
                loss, _ = fused_cross_entropy(predicting(hidden), student.lm_head.weight, labels,
                                              chunk_size=shape.chunk)
            else:
                loss = 0.0
            for teacher, mine, scores in zip(teachers, rows, teacher_hidden):
                if mine:
                    loss = loss + fused_kd_loss(predicting(hidden[mine]), student.lm_head.weight, scores,
                                                teacher.lm_head.weight, ids[mine, 1:].reshape(-1), alpha=0.5,
                                                chunk_size=shape.chunk)[0]
        with phases.phase("backward"):
            loss.backward()
        for teacher in teachers:
            reshard_root(teacher)  # where the loops free it: after the backward
        del hidden, loss, teacher_hidden  # as the loop's next micro-batch rebinds them
    with phases.phase("optimizer"):
        params = list(student.parameters())
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], 1.0 / (shape.batch * shape.seq))
        clip_gradients(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """Run.optimizer_step's clip_grad_norm_. Under fake tensors the norm is taken of the local shards: there,
    DTensor's norm of a sharded gradient is counted holding that gradient whole (an artefact: on real ranks the
    same clip allocates nothing but the norms, --estimate_check), and the shards' norms and the in-place multiply
    are the bytes the real clip allocates (a sharded run all-reduces the scalar in between)."""
    if active_fake_mode() is None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, torch.nn.utils.get_total_norm(grads))


def estimate(student_config: Qwen3Config, teacher_config: Qwen3Config | list[Qwen3Config] | None, world: int,
             shape: StepShape, lora_rank: int = 0) -> dict:
    """One step at `world` fake ranks (rank 0's view; every rank holds the same) with no teacher, one, or a list
    of them (--teachers), of a fully trained student or a LoRA one (`lora_rank`: `build`) -> {"peaks": {phase:
    [bytes per occurrence]}, "state": bytes held before the step (shards and AdamW's moments)}. Needs no process
    group: a fake one is started, and destroyed afterwards."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        # the mesh is made from real tensors: outside
        student = build(student_config, world, trained=True, lora_rank=lora_rank)
        configs = teacher_config if isinstance(teacher_config, list) else [teacher_config] if teacher_config else []
        teachers = [build(config, world, trained=False) for config in configs]
        # meta tensors (the modules as built) are copied into fake ones by to_empty: hence non-fake inputs
        with FakeTensorMode(allow_non_fake_inputs=True):
            materialise(student)
            optimizer = adamw(student)
            tracker = RunningPeakFSDPTracker(student, optimizer) if world > 1 else RunningPeakTracker()
            if world == 1:
                tracker.track_external(student, optimizer)
            for teacher in teachers:
                track_teacher(tracker, materialise(teacher))
            with tracker:
                phases = tracker_phases(tracker)
                state = phases.current()
                training_step(student, teachers, optimizer, shape, phases)
    finally:
        dist.destroy_process_group()
    return {"peaks": phases.peaks, "state": state}


def parameter_count(config: Qwen3Config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())


def adapter_parameter_count(config: Qwen3Config, lora_rank: int) -> int:
    """Elements of the LoRA adapters `build` puts on a student of `config` (all seven projections of every layer)."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    add_lora(model, rank=lora_rank, seed=None)
    return adapter_count(model)


def hf_tensors(config: Qwen3Config) -> list[tuple[str, int, int, int]]:
    """(HF name, rows, columns, rows of the parameter it is a block of) of every tensor of the export, a fused
    parameter's blocks each on their own (model/checkpoint_io.py: hf_layout)."""
    with torch.device("meta"):
        parameters = dict(Qwen3ForCausalLM(config).named_parameters())
    return [(name, len(block.rows), parameters[block.parameter][0].numel(), parameters[block.parameter].shape[0])
            for name, block in hf_layout(parameters, config).items()]


def export_bytes(config: Qwen3Config, world: int, lora_rank: int = 0) -> int:
    """What the save's HF export adds on rank 0, which writes it tensor by tensor (model/checkpoint_io.py:
    `_rows_in_order`), beyond the state the optimizer step leaves (its gradients freed): the most, over the HF
    tensors, of what rank 0 holds of one at once on the device. Sharded, the rows one other rank sends (its share
    of the parameter: at most ceil(rows / W)), two of them at the turn to the next rank (the previous still bound
    while the next is allocated); one GPU, none (a tensor goes to the host from its own memory). A LoRA student's
    adapted projection is written merged, W + scaling B A in fp32, on the device: the rows cast to fp32, the delta
    and the sum, 12 bytes per element (beside the received bf16 rows), and its factors gathered whole; its other
    tensors go to the host in bf16 and are cast there (a blocking copy converts on the host)."""
    element = 2 if lora_rank else 4  # the student's weights: a LoRA student's base in bf16, else fp32
    most = 0
    for name, rows, columns, parameter_rows in hf_tensors(config):
        held = min(rows, -(-parameter_rows // world)) if world > 1 else rows
        received = held * columns * element if world > 1 else 0
        if lora_rank and name.endswith(tuple(f"{target}.weight" for target in TARGETS)):
            factors = 4 * lora_rank * (2 * rows + columns)  # B gathered, scaling B, A: fp32
            most = max(most, received + 12 * held * columns + factors)
        else:
            most = max(most, 2 * received)
    return most


def digest_bytes(config: Qwen3Config, world: int, lora_rank: int) -> int:
    """What a LoRA student's start-up adds on every rank beyond its shards: the sha256 of its frozen base
    (model/lora.py: base_digest, taken by Run and by a resume) all-gathers each base tensor whole, in bf16, one at a
    time -- the largest, the embedding (or the head). Nothing without LoRA or on one GPU."""
    if not lora_rank or world == 1:
        return 0
    with torch.device("meta"):
        return 2 * max(p.numel() for p in Qwen3ForCausalLM(config).parameters())


def critic_state_bytes(config: Qwen3Config, world: int, sharded: bool, lora_rank: int = 0) -> int:
    """What PPO's critic (model/value.py: the student's body and a one-row head, trainer/rl/critic.py) adds to a
    rank's training state: fully trained, its fp32 weights, gradients and AdamW's two moments, 16 bytes per
    parameter (over the W ranks when sharded; under DDP 4 more, its reducer's fp32 gradient buckets); a LoRA
    critic, 16 bytes per adapter parameter and per element of its head (trained whole in fp32), and its frozen
    body in bf16 only when sharded (unsharded it is the student's own tensors: nothing more). Its forward and
    backward come after the student's backward and hold less than the student's (the same body, a head of one row):
    the step's peak grows by this state, not by a second transient (docs/fsdp.md). tests/test_fsdp_estimate.py
    holds it against a critic train_ppo.py's code builds and steps, rank by rank."""
    with torch.device("meta"):
        critic = Qwen3ValueModel(config)
    head = config.hidden_size
    body = sum(p.numel() for p in critic.parameters()) - head
    share = world if sharded else 1
    if lora_rank:
        add_lora(critic, rank=lora_rank, seed=None)
        return (16 * (adapter_count(critic) + head) + (2 * body if sharded else 0)) // share
    return (16 + (4 if world > 1 and not sharded else 0)) * (body + head) // share


def extra_teacher_bytes(student_config: Qwen3Config, teacher_config: Qwen3Config, world: int,
                        replicated: bool = False) -> int:
    """What one more teacher (--teachers) adds to a rank's peak, at the forward's end: its bf16 weights (2 bytes per
    parameter, over the W ranks when sharded), its gathered root (bf16 embedding and head, whole from its forward to
    the backward's end; nothing when it is whole anyway: one rank or --replicate_teacher 1), and one more fp32
    gradient of the student's head (each teacher's fused loss term computes the head's gradient with its loss,
    trainer/losses/fused_linear.py, and holds it until autograd sums the terms').
    tests/test_fsdp_estimate.py holds it against the estimate of one step with one teacher and with two."""
    sharded = world > 1 and not replicated
    weights = 2 * parameter_count(teacher_config) // (world if sharded else 1)
    heads = 1 if teacher_config.tie_word_embeddings else 2
    root = 2 * teacher_config.vocab_size * teacher_config.hidden_size * heads if sharded else 0
    return weights + root + 4 * student_config.vocab_size * student_config.hidden_size


def by_depth(student_config: Qwen3Config, teacher_config: Qwen3Config | None, world: int, shape: StepShape,
             base: int = 2) -> dict:
    """`estimate` at the full depths, from three shallow ones: every decoder layer holds the same bytes (its shards,
    its AdamW moments, its saved activations and gradients) whatever the depth, so each phase's peak and the state
    are linear in each model's number of layers -- base and base + 1 layers of the student, then of the teacher,
    give the slopes. The tracker's cost grows with the number of modules (a 64-layer teacher takes minutes per
    estimate here); a depth extrapolated this way equals a direct estimate to the byte (tests/test_fsdp_estimate.py,
    and 6 layers of 8B / 32B predicted from 2 and 3) -- while a phase's peak is at the same moment at both shallow
    depths and the full one. Where it moves, it is low: sharded without checkpointing, the backward's peak at 2
    layers is its end (the root's whole gradient), from 4 on its start (every layer's activations) -- Qwen3-14B's SFT
    on 8 ranks, 73.8 GB extrapolated, 92.1 direct; `full_depth` estimates the full depth itself. -> {"peaks": {phase:
    the most over its occurrences}, "state"}."""
    def at(student_layers: int, teacher_layers: int) -> dict[str, int]:
        result = estimate(dataclasses.replace(student_config, num_hidden_layers=student_layers),
                          teacher_config and dataclasses.replace(teacher_config, num_hidden_layers=teacher_layers),
                          world, shape)
        return {"state": result["state"], **{phase: max(values) for phase, values in result["peaks"].items()}}
    low = at(base, base)
    student_slope = {k: v - low[k] for k, v in at(base + 1, base).items()}
    teacher_slope = {k: v - low[k] for k, v in at(base, base + 1).items()} if teacher_config else dict.fromkeys(low, 0)
    extra_student = student_config.num_hidden_layers - base
    extra_teacher = teacher_config.num_hidden_layers - base if teacher_config else 0
    full = {k: low[k] + extra_student * student_slope[k] + extra_teacher * teacher_slope[k] for k in low}
    return {"state": full.pop("state"), "peaks": full}


def full_depth(student_config: Qwen3Config, teacher_config: Qwen3Config | None, world: int, shape: StepShape,
               lora_rank: int = 0) -> dict:
    """`estimate` at the models' own depths, no extrapolation (`by_depth` says when that is low), in by_depth's
    form: {"peaks": {phase: the most over its occurrences}, "state"}. A minute or two for a 64-layer model here."""
    result = estimate(student_config, teacher_config, world, shape, lora_rank)
    return {"state": result["state"], "peaks": {phase: max(values) for phase, values in result["peaks"].items()}}


def measured_step(config: Qwen3Config, shape: StepShape, lora_rank: int = 0) -> dict:
    """The same step on real tensors, in this process (of a gloo group under torchrun: sharded over its ranks), of
    a fully trained student or a LoRA one (`lora_rank`) -> the same {"peaks", "state"}, counted by the CPU allocator
    itself -- torch.profiler's memory events, every allocation and free the allocator makes, kernels' own buffers
    included -- on top of the bytes of the tensors alive when the step starts (parameters, AdamW's moments, RoPE's
    buffer)."""
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    world = dist.get_world_size() if dist.is_initialized() else 1
    student = materialise(build(config, world, trained=True, lora_rank=lora_rank))
    with torch.no_grad():
        for p in student.parameters():
            p.normal_(0.0, 0.02)  # to_empty leaves whatever the memory held: NaNs would be fine for bytes, not here
    optimizer = adamw(student)
    state = live_bytes(student, optimizer)
    # the fused loss's CPU workspace, kept from call to call for speed, where a GPU's (and the estimate's) lives only
    # within the loss: one an earlier call left would be freed in the step, never having been counted
    release_workspace()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        phases = PhasePeaks(lambda: 0, lambda: 0, lambda name: None)
        phases.phase = marked_phase  # marks only; the peaks are read from the trace
        training_step(student, [], optimizer, shape, phases)
    return {"peaks": allocator_peaks(prof, state), "state": state}


@contextlib.contextmanager
def marked_phase(name: str) -> Iterator[None]:
    """A record_function range for the trace, begun once every rank is there: a gloo worker thread can still be
    freeing the last phase's collective buffers when the next phase starts, which would count them in its peak."""
    from torch.profiler import record_function
    if dist.is_initialized():
        dist.barrier()
    with record_function(name):
        yield
        if name == "forward":  # within the range: a free between ranges would count in the next one's start
            release_workspace()


def live_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's storages held by the model (local shards) and the optimizer's state, each once."""
    tensors = [*model.parameters(), *model.buffers(),
               *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))]
    storages = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def allocator_peaks(prof, start: int) -> dict[str, list[int]]:
    """From a profile with memory events: the most bytes allocated within each occurrence of each phase's
    record_function range, counting from `start` bytes at the profile's beginning."""
    events = prof.profiler.kineto_results.events()
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    ranges = sorted((e.start_ns(), e.end_ns(), e.name()) for e in events if e.name() in PHASES)
    peaks: dict[str, list[int]] = {}
    allocated, index = start, 0
    for begin, end, name in ranges:
        most = allocated
        while index < len(memory) and memory[index][0] <= end:
            allocated += memory[index][1]
            if memory[index][0] >= begin:
                most = max(most, allocated)
            index += 1
        peaks.setdefault(name, []).append(most)
    return peaks

