"""Where an on-policy distillation step spends its time: generation, teacher forward, student forward + backward.

    python benchmarks/bench_opd.py                      # CPU: tiny random student/teacher, 8 demo prompts x 64 new
    python benchmarks/bench_opd.py --device cuda        # one GPU, bf16 autocast (teacher stored in bf16)
    python benchmarks/bench_opd.py --student_path checkpoints/kd --teacher_path checkpoints/sft  # trained demo models
    python benchmarks/bench_opd.py --max_new_tokens 256 --steps 3 --json opd.json   # the numbers as JSON too
    python benchmarks/bench_opd.py --threads 1          # steadier on a shared CPU: with 2 threads and busy cores,
                                                        # every small op can wait a scheduler slice for its 2nd thread

One OPD step on one micro-batch, phase by phase, with the calls train_opd.py makes:
  generation       trainer.rollouts.source.sample_completions itself (the loop's rollout, not a copy): one
                   torch.Generator per row seeded derived_seed(seed, epoch, row), student in eval mode under autocast,
                   generate(..., do_sample=True, generator=generators, vocab_size=len(tokenizer)), then build_sequences;
                   the benchmark's step number stands in for the epoch, so every step samples afresh
  teacher forward  completion_hidden(teacher, ...) under no_grad (the teacher's body only: its lm_head is applied
                   chunk by chunk inside the loss)
  student fwd+bwd  completion_hidden(student, ...), chunked_generalized_jsd_loss(...) (trainer/losses/fused_divergences.py:
                   student AND teacher lm_head per chunk, beta=1: reverse KL, the gradients of the student's hidden
                   states and head computed in the same pass), backward of the summed loss (scales those, then the body)
  optimizer        (shown so the rows add up to a step) grads scaled by the token count, clipping, AdamW
Phases are timed with console.PhaseClock (the loop's own clock; its seconds are shown here in ms). The loss
phases are spelled out rather than calling the teachers' loss (Teachers.loss), which would time them as one.
The same 8 demo prompts (opd_prompts rows 0..7, PromptCollator) every step, sampled with per-row seeds that change
with the step. --warmup steps first, then the median of --steps steps per phase; shares are of the sum of medians.
Generation stops at the tokenizer's EOS, as in training (there is no way to switch that off: the benchmark runs the
loop's own rollout). Random weights sample EOS almost never, so with them every row generates --max_new_tokens
tokens; trained models stop early, so their generation time varies with what they sample. Generated tokens are
counted from the labels (positions != IGNORE_INDEX: through the first EOS), decode steps as the sequence length
minus the prompt width.

Then the roofline (benchmarks/roofline.py): the machine's GEMM, exp and copy rates measured in the same run (before
and after the steps, the better of the two: a rate measured while other work ran is too low), each
phase's bound from the work it must do (FLOPs, exponentials, bytes), the measured median as a multiple of it; and
the bounds of the same step's tokens for real shapes (--arithmetic_models, default a Qwen3-0.6B student and a
Qwen3-4B teacher) as arithmetic on those rates. On a GPU of known kind the GEMM rate is its peak dense bf16 rate, so
a phase's multiple is 1 / its MFU.

Then the generation alone is taken apart (separate runs of the same sample_completions, so the extra
synchronisation does not touch the table above; the sequences it returns are all these numbers need, so there is no
separate generate call): the model's forward and each decoder layer are timed with hooks, and model.generate's
next_token_logits (the lm_head) and sample_next_token (temperature, top-k/p, softmax, the batched inverse-CDF
draw) through wrappers installed in that module for the duration. Prefill = from the call to the end of the first
lm_head; decode = the rest, per sampled token. "other" in a decode step is what generate's own loop does between those
calls (vocab masking, EOS bookkeeping, the all-finished check, Python), plus, spread over the steps,
sample_completions' set-up and its build_sequences concatenation.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import harness, roofline  # noqa: E402
from benchmarks.fsdp_estimate import QWEN3_SHAPES, qwen3_config  # noqa: E402
from common.checks import check_device  # noqa: E402
from common.errors import ArgumentParser, refuse, run_script  # noqa: E402
from dataset.collators import IGNORE_INDEX  # noqa: E402
from dataset.sources import RowDataset  # noqa: E402
from model import Decoder, Qwen3Config, create_model, load_pretrained, load_tokenizer  # noqa: E402
from model.generate import DECODE_CHOICES, default_decode  # noqa: E402
from model.precision import resolve_precision  # noqa: E402
from trainer.skeleton.console import PhaseClock  # noqa: E402
from trainer.losses.chunked import completion_hidden  # noqa: E402
from trainer.losses.fused_divergences import chunked_generalized_jsd_loss  # noqa: E402
from trainer.skeleton.optimizer_step import make_optimizer  # noqa: E402
from trainer.rollouts.source import sample_completions  # noqa: E402

# the module itself: `model.generate` as an attribute is the function (model/__init__.py re-exports it)
generate_module = importlib.import_module("model.generate")


# ----------------------------------------------------------------------------------------------------------------
# set-up

def load_models(args):
    """Student: fp32 master weights, train mode. Teacher: frozen, eval mode, in the precision rule's teacher dtype
    (as trainer/teachers/frozen.py's read_frozen loads it)."""
    teacher_dtype = resolve_precision(args.device, args.dtype).teacher
    if args.student_path:
        student = load_pretrained(args.student_path, dtype=torch.float32, device=args.device)
    else:
        student = create_model(Qwen3Config.from_json(args.student_config), seed=args.seed, device=args.device)
    if args.teacher_path:
        teacher = load_pretrained(args.teacher_path, dtype=teacher_dtype, device=args.device)
    else:
        teacher = create_model(Qwen3Config.from_json(args.teacher_config), seed=args.seed + 1, dtype=teacher_dtype,
                               device=args.device)
    teacher.eval().requires_grad_(False)
    return student.train(), teacher


def prompt_batch(args, tokenizer) -> dict:
    if args.data_path:
        dataset = RowDataset(args.data_path)
        rows = [dataset[i] for i in range(min(args.batch_size, len(dataset)))]
    else:
        rows = harness.demo_rows("opd_prompts", range(args.batch_size))
    return harness.prompt_batch(tokenizer, rows, args.device, args.max_prompt_length, bool(args.enable_thinking))


# ----------------------------------------------------------------------------------------------------------------
# one OPD step, phase by phase (train_opd.py's sample_completions itself; Teachers.loss and Run.backward /
# optimizer_step spelled out, so that each is timed on its own)

def rollout(args, student, tokenizer, batch, step: int, decode: str | None = None):
    """trainer.rollouts.source.sample_completions, the loop's own rollout, with `step` as its epoch (fresh samples every
    step) and the loop's decode step (--decode, or `decode`); -> input_ids, attention_mask, labels."""
    return sample_completions(student, args, tokenizer, batch, step, args.device,
                              resolve_precision(args.device, args.dtype).autocast,  # what Run.autocast returns
                              decoder(decode or args.decode, args.device))


@functools.cache
def decoder(choice: str, device: str) -> Decoder:
    """One Decoder per decode step and device for the whole benchmark, as a loop keeps one for its run: a compiled
    step compiles in the warm-up, not in a timed step."""
    if choice == "auto":
        choice = default_decode(torch.device(device).type)
    return Decoder(compiled=choice == "compiled")


def decode_steps(input_ids: torch.Tensor, batch: dict) -> int:
    """generate's loop count: the completion's width (the sequence minus the prompt)."""
    return input_ids.shape[1] - batch["prompt_ids"].shape[1]


def opd_step(args, student, teacher, optimizer, tokenizer, batch, step: int) -> tuple[dict, dict]:
    clock = PhaseClock(args.device)
    vocab_size = len(tokenizer)
    precision = resolve_precision(args.device, args.dtype)  # Run.autocast and Run.teacher_autocast
    with clock("generation"):
        input_ids, attention_mask, labels = rollout(args, student, tokenizer, batch, step)
    with clock("teacher forward"):
        with torch.no_grad(), precision.teacher_autocast():
            teacher_hidden, _ = completion_hidden(teacher, input_ids, attention_mask, labels)
    with clock("student forward"):
        with precision.autocast():
            student_hidden, targets = completion_hidden(student, input_ids, attention_mask, labels)
    with clock("loss forward"):
        with precision.autocast():
            loss_sum, num_tokens = chunked_generalized_jsd_loss(
                student_hidden, student.lm_head.weight, teacher_hidden, teacher.lm_head.weight, targets,
                beta=args.beta, temperature=args.temperature, chunk_size=args.loss_chunk_size, vocab_size=vocab_size)
    loss_divisor = float(args.batch_size * input_ids.shape[1])  # Run.backward divides by a constant, undone later
    with clock("backward"):
        (loss_sum / loss_divisor).backward()
    with clock("optimizer"):
        tokens = max(float(num_tokens), 1.0)
        torch._foreach_mul_([p.grad for p in student.parameters() if p.grad is not None], loss_divisor / tokens)
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    stats = {"generated_tokens": int((labels != IGNORE_INDEX).sum()), "decode_steps": decode_steps(input_ids, batch),
             "loss": loss_sum.item() / tokens, "prompt_len": batch["prompt_ids"].shape[1],
             "prompt_tokens": int(batch["prompt_attention_mask"].sum())}
    return {phase: seconds * 1000.0 for phase, seconds in clock.seconds.items()}, stats


# ----------------------------------------------------------------------------------------------------------------
# generation taken apart

class GenerationProbe:
    """Times the pieces of generate(): model forwards (and the decoder layers inside them) through hooks,
    next_token_logits and sample_next_token through wrappers installed in model.generate while active.
    Records (what, ms, end time) in call order."""

    def __init__(self, model, device: str):
        self.model, self.device = model, device
        self.events: list[tuple[str, float, float]] = []
        self._handles, self._saved, self._start = [], {}, {}

    def now(self) -> float:
        harness.synchronize(self.device)
        return time.perf_counter()

    def _record(self, name: str, start: float) -> None:
        end = self.now()
        self.events.append((name, (end - start) * 1000.0, end))

    def _timed(self, name: str, fn):
        def wrapper(*args, **kwargs):
            start = self.now()
            result = fn(*args, **kwargs)
            self._record(name, start)
            return result
        return wrapper

    def __enter__(self):
        for name in ("next_token_logits", "sample_next_token"):  # generate() looks them up in its module
            self._saved[name] = getattr(generate_module, name)
            setattr(generate_module, name, self._timed(name, self._saved[name]))

        def pre(key):
            def hook(module, args):
                self._start[key] = self.now()
            return hook

        def post(key):
            def hook(module, args, output):
                self._record(key, self._start[key])
            return hook
        modules = [("forward", self.model)] + [("layer", layer) for layer in self.model.model.layers]
        for key, module in modules:
            self._handles += [module.register_forward_pre_hook(pre(key)), module.register_forward_hook(post(key))]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        for name, fn in self._saved.items():
            setattr(generate_module, name, fn)
        self._handles, self._saved = [], {}


def take_generation_apart(args, student, tokenizer, batch, runs: int) -> dict:
    """Mean over `runs` instrumented rollouts (sample_completions): prefill = from the call to the end of the
    first lm_head; decode = the rest, reported per sampled token (a decode step: sample a token, then forward +
    lm_head for the next one; the last token is sampled without a forward after it)."""
    sums: dict[str, float] = {}
    for run in range(runs):
        with GenerationProbe(student, args.device) as probe:
            start = probe.now()
            input_ids, _, _ = rollout(args, student, tokenizer, batch, 10_000 + run, "eager")  # hooks time its ops
            end = probe.now()
        first_head = next(i for i, (name, _, _) in enumerate(probe.events) if name == "next_token_logits")
        prefill_end = probe.events[first_head][2]
        prefill_events, decode_events = probe.events[:first_head + 1], probe.events[first_head + 1:]

        def total(events, name):
            return sum(ms for n, ms, _ in events if n == name)
        tokens = decode_steps(input_ids, batch)
        values = {
            "total": (end - start) * 1000.0, "prefill": (prefill_end - start) * 1000.0,
            "decode": (end - prefill_end) * 1000.0, "tokens_sampled": tokens,
            "forwards": sum(1 for n, _, _ in decode_events if n == "forward"),
            "prefill_layers": total(prefill_events, "layer"),
            "prefill_forward_rest": total(prefill_events, "forward") - total(prefill_events, "layer"),
            "prefill_lm_head": total(prefill_events, "next_token_logits"),
            "step_layers": total(decode_events, "layer") / tokens,
            "step_forward_rest": (total(decode_events, "forward") - total(decode_events, "layer")) / tokens,
            "step_lm_head": total(decode_events, "next_token_logits") / tokens,
            "step_sampling": total(decode_events, "sample_next_token") / tokens,
        }
        values["prefill_other"] = values["prefill"] - total(prefill_events, "forward") - values["prefill_lm_head"]
        values["step"] = values["decode"] / tokens
        values["step_other"] = values["step"] - sum(values[k] for k in ("step_layers", "step_forward_rest",
                                                                         "step_lm_head", "step_sampling"))
        for key, value in values.items():
            sums[key] = sums.get(key, 0.0) + value
    return {key: value / runs for key, value in sums.items()}


# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__)
    g = parser.add_argument_group("models")
    g.add_argument("--student_config", default=harness.STUDENT_CONFIG,
                   help="config.json of a random-weight student (ignored with --student_path)")
    g.add_argument("--teacher_config", default=harness.TEACHER_CONFIG,
                   help="config.json of a random-weight teacher (ignored with --teacher_path)")
    g.add_argument("--student_path", default=None, help="HF folder of the student")
    g.add_argument("--teacher_path", default=None, help="HF folder of the teacher (same tokenizer)")
    g = parser.add_argument_group("data")
    g.add_argument("--data_path", default=None, help="prompts (default: the demo opd_prompts)")
    g.add_argument("--batch_size", type=int, default=8)
    g.add_argument("--max_prompt_length", type=int, default=256)
    g.add_argument("--enable_thinking", type=int, default=0, choices=[0, 1])
    g = parser.add_argument_group("generation and loss")
    g.add_argument("--max_new_tokens", type=int, default=64)
    g.add_argument("--gen_temperature", type=float, default=1.0)
    g.add_argument("--top_k", type=int, default=0)
    g.add_argument("--top_p", type=float, default=1.0)
    g.add_argument("--decode", default="auto", choices=DECODE_CHOICES,
                   help="the rollouts' decode step, as the loops' --decode (auto: compiled on CUDA, eager elsewhere)")
    g.add_argument("--beta", type=float, default=1.0, help="generalized JSD beta (1 = reverse KL)")
    g.add_argument("--temperature", type=float, default=1.0, help="loss temperature")
    g.add_argument("--loss_chunk_size", type=int, default=512)
    g.add_argument("--learning_rate", type=float, default=1e-5)
    g = parser.add_argument_group("run")
    harness.add_device_args(g)
    g.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    g.add_argument("--steps", type=int, default=5, help="timed steps (median per phase)")
    g.add_argument("--breakdown_runs", type=int, default=3, help="instrumented generate calls to average (0 = off)")
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--arithmetic_models", nargs=2, default=["Qwen3-0.6B", "Qwen3-4B"], choices=sorted(QWEN3_SHAPES),
                   metavar=("STUDENT", "TEACHER"), help="the real shapes whose bounds are shown as arithmetic")
    harness.add_json_arg(parser)
    args = parser.parse_args(argv)
    check_device(args.device)
    if min(args.batch_size, args.max_new_tokens, args.steps, args.max_prompt_length) < 1 or args.warmup < 0:
        refuse("--batch_size, --max_new_tokens, --steps, --max_prompt_length must be >= 1, --warmup >= 0")
    for path in (args.student_path, args.teacher_path, args.data_path):
        if path and not os.path.exists(path):
            refuse(f"{path} does not exist")
    return args


def measure(args, student, teacher, tokenizer, batch) -> dict:
    """--warmup untimed steps, then --steps timed ones: each phase's median (ms), the step and what it generated."""
    optimizer = make_optimizer(student, argparse.Namespace(learning_rate=args.learning_rate, weight_decay=0.0))
    for step in range(args.warmup):
        opd_step(args, student, teacher, optimizer, tokenizer, batch, step)
    per_phase: dict[str, list[float]] = {}
    totals, stats = [], []
    for step in range(args.warmup, args.warmup + args.steps):
        ms, step_stats = opd_step(args, student, teacher, optimizer, tokenizer, batch, step)
        for phase, value in ms.items():
            per_phase.setdefault(phase, []).append(value)
        totals.append(sum(ms.values()))
        stats.append(step_stats)
    phases = {phase: statistics.median(values) for phase, values in per_phase.items()}
    generated = statistics.median(s["generated_tokens"] for s in stats)
    prompt_tokens = statistics.median(s["prompt_tokens"] for s in stats)
    decode = statistics.median(s["decode_steps"] for s in stats)
    generation_s = phases["generation"] / 1000.0
    return {"phases_ms": phases, "step_ms": sum(phases.values()), "measured_step_ms": statistics.median(totals),
            "generated_tokens": generated, "prompt_tokens": prompt_tokens, "decode_steps": decode,
            "generation_tokens_per_s": generated / generation_s,
            "row_steps_per_s": decode * args.batch_size / generation_s,
            "loss_per_token": statistics.median(s["loss"] for s in stats)}


def print_step(results: dict, args) -> None:
    phases, step_ms = results["phases_ms"], results["step_ms"]
    student_ms = phases["student forward"] + phases["loss forward"] + phases["backward"]
    rows = [("generation (rollout)", phases["generation"]), ("teacher forward (no grad)", phases["teacher forward"]),
            ("student fwd + loss + bwd", student_ms), ("  student forward", phases["student forward"]),
            ("  loss forward (chunked JSD)", phases["loss forward"]), ("  backward", phases["backward"]),
            ("optimizer (clip + AdamW)", phases["optimizer"]), ("step (sum of medians)", step_ms)]
    print("\n" + harness.table(["phase", "ms (median)", "share"],
                               [[name, f"{ms:.1f}", f"{ms / step_ms:.1%}"] for name, ms in rows]))
    print(f"median of the measured step totals {results['measured_step_ms']:.1f} ms; generated "
          f"{results['generated_tokens']:.0f} tokens (through the first EOS) in {results['decode_steps']:.0f} decode "
          f"steps x {args.batch_size} rows -> {results['generation_tokens_per_s']:.0f} tokens/s of generation "
          f"({results['row_steps_per_s']:.0f} row-steps/s); loss (per token) {results['loss_per_token']:.4f}")


# ----------------------------------------------------------------------------------------------------------------
# the roofline (benchmarks/roofline.py)

def phase_work(args, student_config, teacher_config, vocab: int, results: dict) -> dict:
    """What each phase of the measured step must do, from the models' shapes and the step's median tokens."""
    precision = resolve_precision(args.device, args.dtype)
    return roofline.opd_work(
        student_config, teacher_config, vocab, args.batch_size, results["prompt_tokens"], results["generated_tokens"],
        results["decode_steps"], roofline.exps_per_logit(args.beta),
        weight_bytes=precision.compute.itemsize, teacher_bytes=precision.teacher.itemsize)


def roofline_rows(work: dict, rates: roofline.Rates, phases_ms: dict | None) -> tuple[list[list[str]], dict]:
    """Table rows phase | ms | bound ms | x bound (only the bound without measured times) and the numbers."""
    measured = None if phases_ms is None else {
        "generation": phases_ms["generation"], "teacher forward": phases_ms["teacher forward"],
        "training": phases_ms["student forward"] + phases_ms["loss forward"] + phases_ms["backward"],
        "optimizer": phases_ms["optimizer"]}
    work = {**work, "step": sum(work.values(), roofline.Work())}
    rows, numbers = [], {}
    for phase, w in work.items():
        bound = w.seconds(rates) * 1000.0
        ms = None if measured is None else (sum(measured.values()) if phase == "step" else measured[phase])
        numbers[phase] = {"bound_ms": bound, **({} if ms is None else {"ms": ms, "multiple": ms / bound})}
        cells = [f"{bound:.1f}"] if ms is None else [f"{ms:.1f}", f"{bound:.1f}", f"{ms / bound:.2f}x"]
        rows.append([phase, *cells])
    return rows, numbers


def machine_rates(args, vocab: int) -> roofline.Rates:
    return roofline.measure_rates(args.device, resolve_precision(args.device, args.dtype).compute, vocab)


def measured_roofline(args, student_config, teacher_config, vocab: int, results: dict,
                      rates_before: roofline.Rates | None = None) -> tuple[list, dict]:
    """The machine's rates now (the better of them and `rates_before`, measured before the steps), and each
    measured phase against its bound -> (table rows, the numbers)."""
    rates = machine_rates(args, vocab)
    rates = rates if rates_before is None else rates.best(rates_before)
    rows, phases = roofline_rows(phase_work(args, student_config, teacher_config, vocab, results), rates,
                                 results["phases_ms"])
    return rows, {"rates": vars(rates), "phases": phases}


def print_roofline(args, student, teacher, vocab: int, results: dict, rates_before: roofline.Rates) -> dict:
    rows, numbers = measured_roofline(args, student.config, teacher.config, vocab, results, rates_before)
    rates = numbers["rates"]
    print(f"\nroofline: GEMM {rates['gemm'] / 1e9:.0f} GFLOP/s ({rates['source']}), exp {rates['exp'] / 1e9:.2f} G/s, "
          f"memory {rates['bandwidth'] / 1e9:.1f} GB/s; bound = max(FLOPs / GEMM + exps / exp, bytes / memory) "
          f"(benchmarks/roofline.py); training = student forward + loss + backward, both vocabulary projections in it")
    print(harness.table(["phase", "ms", "bound ms", "x bound"], rows))
    student_name, teacher_name = args.arithmetic_models
    work = phase_work(args, qwen3_config(student_name), qwen3_config(teacher_name), vocab, results)
    rows, arithmetic = roofline_rows(work, roofline.Rates(**rates), None)
    print(f"\n{student_name} student, {teacher_name} teacher at this step's tokens, as arithmetic on these rates:\n"
          + harness.table(["phase", "bound ms"], rows))
    return {**numbers, "arithmetic": {"models": [student_name, teacher_name], "phases": arithmetic}}


def print_breakdown(b: dict, generation_ms: float, batch: dict, args) -> None:
    print(f"\ngeneration taken apart (instrumented, mean of {args.breakdown_runs} calls; total {b['total']:.1f} ms "
          f"vs {generation_ms:.1f} ms uninstrumented):")
    print(f"  prefill ({batch['prompt_ids'].shape[1]} prompt tokens x {args.batch_size} rows) "
          f"{b['prefill']:8.1f} ms {b['prefill'] / b['total']:6.1%} of generation: layers "
          f"{b['prefill_layers']:.1f}, embed/mask/rope/norm {b['prefill_forward_rest']:.1f}, lm_head "
          f"{b['prefill_lm_head']:.1f}, cache + set-up {b['prefill_other']:.1f}")
    print(f"  decode ({b['tokens_sampled']:.0f} tokens sampled, {b['forwards']:.0f} one-token forwards)"
          f" {b['decode']:8.1f} ms {b['decode'] / b['total']:6.1%} of generation, {b['step']:.2f} ms per token:")
    for key, name in (("step_layers", "decoder layers"), ("step_forward_rest", "embed/mask/rope/final norm"),
                      ("step_lm_head", "lm_head (next_token_logits)"),
                      ("step_sampling", "sampling (sample_next_token)"),
                      ("step_other", "other (vocab mask, EOS bookkeeping, Python)")):
        print(f"    {name:<44} {b[key]:7.2f} ms {b[key] / b['step']:6.1%}")
    head_and_sampling = b["step_lm_head"] + b["step_sampling"]
    print(f"    -> lm_head + sampling {head_and_sampling / b['step']:.0%} of a decode step, the transformer "
          f"(layers + embed/mask/norm) {(b['step_layers'] + b['step_forward_rest']) / b['step']:.0%}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    harness.set_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.student_path)
    student, teacher = load_models(args)
    batch = prompt_batch(args, tokenizer)
    s_cfg, t_cfg = student.config, teacher.config
    print(f"{harness.machine()}\nOPD step on {args.device} ({resolve_precision(args.device, args.dtype).name}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}): "
          f"student {student.num_parameters() / 1e6:.1f}M (hidden {s_cfg.hidden_size}, {s_cfg.num_hidden_layers} "
          f"layers), teacher {teacher.num_parameters() / 1e6:.1f}M (hidden {t_cfg.hidden_size}, "
          f"{t_cfg.num_hidden_layers} layers), vocab {s_cfg.vocab_size}; batch {args.batch_size} prompts "
          f"(padded to {batch['prompt_ids'].shape[1]} tokens) x max_new_tokens {args.max_new_tokens}; "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    rates_before = machine_rates(args, len(tokenizer))  # and again after the steps: the better of the two counts
    results = measure(args, student, teacher, tokenizer, batch)
    print_step(results, args)
    results["roofline"] = print_roofline(args, student, teacher, len(tokenizer), results, rates_before)
    if args.breakdown_runs:
        results["generation_breakdown"] = take_generation_apart(args, student, tokenizer, batch, args.breakdown_runs)
        print_breakdown(results["generation_breakdown"], results["phases_ms"]["generation"], batch, args)
    harness.write_json(args.json, results)
    return results


if __name__ == "__main__":
    run_script(main)
