"""Held-out evaluation during training: greedy completions of a fixed prompt set, their math accuracy, and (for
distillation) the student's per-token reverse KL to the teacher on those completions. The same numbers at every
evaluation step, on the same prompts, so runs can be compared. Under torchrun every rank evaluates its share of
the prompts and the sums are all-reduced: the numbers of one process, and no rank waits in a collective for the
length of a whole evaluation (--dist_timeout)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from common.errors import RuntimeFailure, UserError
from common.seeds import derived_seed
from dataset.collators import PromptCollator, build_sequences
from dataset.make_demo_data import ensure_demo_data
from dataset.sources import RowDataset
from eval.grader import grade_batch
from model import Decoder, generate
from trainer.losses.chunked import completion_hidden
from trainer.losses.divergences import divergence_sums
from trainer.skeleton.distributed import DistInfo
from trainer.skeleton.sharding import reshard_root
from trainer.teachers.parts import teacher_scores
from trainer.teachers.teacher_set import EvalTeacher

# what an evaluation adds up over its prompts, besides each teacher's divergence sums (`divergence_keys`): one
# process's total, or the ranks' shares all-reduced
SUMS = ("correct", "rows", "generated", "ended")


def divergence_keys(teacher: EvalTeacher) -> tuple[str, str]:
    return f"kl_sum/{teacher.name}", f"kl_tokens/{teacher.name}"


def sum_keys(teachers: Sequence[EvalTeacher]) -> tuple[str, ...]:
    """Every number an evaluation adds up: SUMS and each teacher's divergence sums."""
    return SUMS + tuple(key for teacher in teachers for key in divergence_keys(teacher))


@torch.no_grad()
def heldout_sums(student, tokenizer, batches: list[dict], max_new_tokens: int, teachers: Sequence[EvalTeacher] = (),
                 teacher_of: Callable[[dict], str | None] | None = None, autocast=contextlib.nullcontext,
                 teacher_autocast=contextlib.nullcontext, chunk_size: int = 512, seed: int = 0,
                 decoder: Decoder | None = None, all_stopped: Callable[[bool], bool] | None = None) -> dict[str, float]:
    """`batches`: PromptCollator outputs (on the right device) -> the SUMS over their rows: graded correct, rows,
    generated tokens, rows that ended with EOS and, per teacher (`teachers`; `teacher_of(row)` names a row's, None:
    no divergence for that row; default: every row is the one teacher's), its divergence summed over its rows'
    greedy completion tokens and their number (sampled_kl: over the student's own samples of the prompts, drawn
    with fixed seeds). `decoder`: generate's decode step (default: eager). `all_stopped`: generate's, for ranks that
    decode in lockstep. `autocast`: the student's forward context; `teacher_autocast`: the local teachers' (in their
    own dtype: Run.teacher_autocast)."""
    was_training = student.training
    student.eval()
    sums = dict.fromkeys(sum_keys(teachers), 0.0)
    for batch in batches:
        with autocast():
            out = generate(student, batch["prompt_ids"], batch["prompt_attention_mask"], max_new_tokens,
                           do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           vocab_size=len(tokenizer), decoder=decoder, all_stopped=all_stopped)
        texts = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                 for ids, mask in zip(out.completion_ids, out.completion_mask)]
        truths = [row.get("ground_truth") for row in batch["rows"]]
        if all(truth is not None for truth in truths):
            sums["correct"] += sum(result.correct for result in grade_batch(texts, [str(t) for t in truths]))
        sums["rows"] += len(texts)
        sums["generated"] += int(out.completion_mask.sum())
        sums["ended"] += int((out.completion_ids == tokenizer.eos_token_id).any(dim=1).sum())
        completions = {}  # greedy, and (for a sampled_kl teacher) sampled: each built into sequences once
        for teacher in teachers:
            rows = [i for i, row in enumerate(batch["rows"])
                    if teacher_of is None or teacher_of(row) == teacher.name]
            if not rows:
                continue
            form = "sampled" if teacher.divergence.kind == "sampled_kl" else "greedy"
            if form not in completions:  # an estimate needs the student's own samples, not greedy ones
                drawn = out if form == "greedy" else sample_prompts(student, tokenizer, batch, max_new_tokens,
                                                                   autocast, seed, decoder, all_stopped)
                completions[form] = build_sequences(batch["prompt_ids"], batch["prompt_attention_mask"],
                                                    drawn.completion_ids, drawn.completion_mask)
            sequences = completions[form]
            if len(rows) < len(batch["rows"]):
                sequences = tuple(t[rows] for t in sequences)
            kl, tokens = completion_divergence(teacher, student, sequences, len(tokenizer), chunk_size, autocast,
                                               teacher_autocast)
            kl_key, tokens_key = divergence_keys(teacher)
            sums[kl_key], sums[tokens_key] = sums[kl_key] + kl, sums[tokens_key] + tokens
    student.train(was_training)
    for teacher in teachers:  # a sharded teacher's gathered head is not held on into training (no backward frees it)
        if teacher.model is not None:
            reshard_root(teacher.model)
    return sums


def heldout_metrics(sums: dict[str, float], teachers: Sequence[EvalTeacher] = ()) -> dict[str, float]:
    """The sums of all prompts -> accuracy, mean completion length, EOS share (per row) and each teacher's
    divergence as its token-weighted mean: eval/<its metric name> with one teacher (eval/reverse_kl for beta=1 with
    a local teacher); with several eval/<name>/<metric name> for each one some held-out row names, and the overall
    eval/<metric name> when they all report the same divergence."""
    rows = max(sums["rows"], 1)
    metrics = {"eval/accuracy": sums["correct"] / rows, "eval/completion_len": sums["generated"] / rows,
               "eval/eos_share": sums["ended"] / rows}
    names = {teacher.divergence.metric_name() for teacher in teachers}
    for teacher in teachers:
        kl_key, tokens_key = divergence_keys(teacher)
        if len(teachers) > 1 and sums[tokens_key]:  # a teacher no held-out row names has no number
            metrics[f"eval/{teacher.name}/{teacher.divergence.metric_name()}"] = sums[kl_key] / sums[tokens_key]
    if len(names) == 1:
        kl = sum(sums[divergence_keys(t)[0]] for t in teachers)
        tokens = sum(sums[divergence_keys(t)[1]] for t in teachers)
        metrics[f"eval/{names.pop()}"] = kl / max(tokens, 1)
    return metrics


def sample_prompts(student, tokenizer, batch: dict, max_new_tokens: int, autocast, seed: int,
                   decoder: Decoder | None = None, all_stopped: Callable[[bool], bool] | None = None):
    """The student's samples of the batch's prompts. Row r of the held-out set always samples with seed (seed, -1,
    r): every evaluation draws with the same random numbers, so the change between evaluations is the model's."""
    seeds = [derived_seed(seed, -1, row["row_index"]) for row in batch["rows"]]
    device = batch["prompt_ids"].device
    with autocast():
        return generate(student, batch["prompt_ids"], batch["prompt_attention_mask"], max_new_tokens, do_sample=True,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        generator=[torch.Generator(device).manual_seed(s) for s in seeds], vocab_size=len(tokenizer),
                        decoder=decoder, all_stopped=all_stopped)


def completion_divergence(teacher: EvalTeacher, student, sequences: tuple, vocab_size: int, chunk_size: int,
                          autocast, teacher_autocast) -> tuple[float, int]:
    """The teacher's divergence summed over the completions' tokens of `sequences` (input_ids, attention_mask,
    labels), and their number: the teacher's scores first (in its own context), then the student's forward."""
    scores = teacher_scores(teacher.divergence, teacher.model, teacher.server, teacher_autocast, *sequences)
    with autocast():
        hidden, targets = completion_hidden(student, *sequences)
        sums = divergence_sums(teacher.divergence, hidden, student.lm_head.weight, targets, scores,
                               None if teacher.model is None else teacher.model.lm_head.weight, chunk_size,
                               vocab_size)
    return float(sums.value), int(sums.tokens)


class HeldoutEvaluator:
    """`--eval_interval` for a training loop: a fixed prompt set (the first --eval_rows rows of --eval_data_path,
    default the demo eval set), evaluated before training, every --eval_interval optimizer steps and at the last
    step. Everything it needs comes in as arguments; it knows nothing of the run.

    The prompts are cut into the batches one process would use, and rank r evaluates batches r, r + W, ...: each
    batch computes exactly what it computes in one process, the all-reduced sums are one process's (up to float64
    summation order), and the ranks' shares differ by at most one batch. With --fsdp 1 (a sharded model needs every
    rank in each forward) every rank evaluates all the prompts in step instead, as one process, and nothing is
    reduced; the ranks stop decoding together (`stop_together`): greedy gives every rank the same completions only
    up to rounding, and one rank leaving generation while the others wait in its all-gathers would hang them for
    --dist_timeout. Rank 0 logs."""

    def __init__(self, args, tokenizer, info: DistInfo, start_step: int, decoder: Decoder | None = None,
                 teachers: Sequence[EvalTeacher] = (), teacher_of: Callable[[dict], str | None] | None = None):
        """`teachers`: each one's divergence is reported on the greedy completions of its rows (none: accuracy,
        length and EOS share only); `teacher_of(row)` names a held-out row's teacher (None: the row has none),
        default: every row is the one teacher's. A row naming a teacher the run does not have is refused now."""
        self.args, self.tokenizer, self.info = args, tokenizer, info
        self.teachers, self.teacher_of = tuple(teachers), teacher_of
        # generate's decode step (--decode): the on-policy loops share theirs with their rollouts
        self.decoder = decoder or Decoder(compiled=args.decode == "compiled")
        self.lockstep = bool(args.fsdp) and info.enabled
        self.all_stopped = stop_together(info.device) if self.lockstep else None
        self.batches = self.load_batches() if args.eval_interval else []
        # a resumed run's checkpoint step was already evaluated (if due) by the run that wrote it
        self.evaluated_step = start_step if start_step > 0 else -1

    def load_batches(self) -> list[dict]:
        """This rank's share of the held-out batches (all of them in lockstep or in one process)."""
        args = self.args
        rows = self.held_out_rows()
        collator = PromptCollator(self.tokenizer, args.max_prompt_length, bool(args.enable_thinking))
        batches = []
        for start in self.batch_starts(len(rows)):
            batch = collator(rows[start:start + args.batch_size])
            batches.append({**batch, "prompt_ids": batch["prompt_ids"].to(self.info.device),
                            "prompt_attention_mask": batch["prompt_attention_mask"].to(self.info.device)})
        return batches

    def held_out_rows(self) -> list[dict]:
        """The first --eval_rows rows of --eval_data_path (default: the demo eval set), each row's teacher checked."""
        dataset = RowDataset(self.args.eval_data_path or ensure_demo_data()["eval"])
        rows = [dataset[i] for i in range(min(self.args.eval_rows, len(dataset)))]
        names = {teacher.name for teacher in self.teachers}
        for i, row in enumerate(rows if self.teacher_of else []):
            if self.teacher_of(row) not in names | {None}:
                raise UserError(f"{dataset.path}: held-out row {i} names teacher {self.teacher_of(row)!r}, which "
                                f"the run does not have ({', '.join(sorted(names))})")
        return rows

    def batch_starts(self, num_rows: int) -> list[int]:
        """The first row of each of this rank's batches of --batch_size held-out rows: batches r, r + W, ... (all
        of them in lockstep or in one process)."""
        starts = list(range(0, num_rows, self.args.batch_size))
        return starts if self.lockstep else starts[self.info.rank::self.info.world_size]

    def due(self, step: int, last: bool) -> bool:
        """On every rank (even one whose share is empty: it joins the reduction): before training (step 0), every
        --eval_interval steps and at the last step, once per step."""
        if not self.args.eval_interval or step == self.evaluated_step:
            return False
        return step % self.args.eval_interval == 0 or last

    def evaluate(self, step: int, student, autocast, teacher_autocast=contextlib.nullcontext) -> dict[str, float]:
        """Greedy completions of the held-out prompts: accuracy, length, EOS share, and the divergence from the
        teacher when there is one. Every rank returns the same numbers. `autocast` / `teacher_autocast`: the
        student's and the local teacher's forward contexts (Run.autocast, Run.teacher_autocast)."""
        self.evaluated_step = step
        args = self.args

        def work() -> dict[str, float]:
            return heldout_sums(student, self.tokenizer, self.batches, args.eval_max_new_tokens, self.teachers,
                                self.teacher_of, autocast, teacher_autocast, args.loss_chunk_size, args.seed,
                                self.decoder, self.all_stopped)
        sums = work() if self.lockstep or not self.info.enabled else self.all_ranks_sums(work)
        return heldout_metrics(sums, self.teachers)

    def all_ranks_sums(self, work: Callable[[], dict[str, float]]) -> dict[str, float]:
        """This rank's sums, all-reduced with the others'. A rank whose share fails (a teacher server that stopped
        answering) still joins the all-reduce, with a failure flag, and then raises; so does every other rank:
        none is left waiting, and the loop's fail_together sees the failure on every rank."""
        failure, keys = None, sum_keys(self.teachers)
        try:
            sums = work()
        except RuntimeFailure as error:
            failure, sums = error, dict.fromkeys(keys, 0.0)
        values = torch.tensor([float(sums[name]) for name in keys] + [float(failure is not None)],
                              dtype=torch.float64, device=self.info.device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        if failure is not None:
            raise failure
        if values[-1].item():
            raise RuntimeFailure("the held-out evaluation failed on another rank (its message is above)")
        return dict(zip(keys, values.tolist()))


def stop_together(device: str) -> Callable[[bool], bool]:
    """generate's `all_stopped` for ranks decoding in lockstep: whether this rank's rows have all stopped -> whether
    every rank's have (one all-reduce of a flag per decoding step)."""
    def all_stopped(stopped: bool) -> bool:
        flag = torch.tensor([float(stopped)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())
    return all_stopped
