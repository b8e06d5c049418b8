"""Held-out evaluation during training: greedy completions of a fixed prompt set, their math accuracy, and (for
distillation) the student's per-token reverse KL to the teacher on those completions. The same numbers at every
evaluation step, on the same prompts, so runs can be compared. Under torchrun every rank evaluates its share of
the prompts and the sums are all-reduced: the numbers of one process, and no rank waits in a collective for the
length of a whole evaluation (--dist_timeout)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from common.errors import RuntimeFailure
from common.seeds import derived_seed
from dataset.collators import IGNORE_INDEX, PromptCollator, build_sequences
from dataset.make_demo_data import ensure_demo_data
from dataset.sources import RowDataset
from eval.grader import grade_batch
from model import Decoder, generate
from trainer.losses import (chunked_generalized_jsd_loss, chunked_loss, completion_hidden,
                            sampled_token_kl_from_logprobs)
from trainer.setup import DistInfo
from trainer.sharding import reshard_root
from trainer.topk_divergence import chunked_topk_divergence

# what an evaluation adds up over its prompts: one process's total, or the ranks' shares all-reduced
SUMS = ("correct", "rows", "generated", "ended", "kl_sum", "kl_tokens")


@torch.no_grad()
def heldout_sums(student, tokenizer, batches: list[dict], max_new_tokens: int, teacher=None,
                 autocast=contextlib.nullcontext, chunk_size: int = 512, beta: float = 1.0,
                 teacher_server=None, seed: int = 0, teacher_topk: int = 0,
                 decoder: Decoder | None = None, all_stopped: Callable[[bool], bool] | None = None,
                 teacher_autocast=contextlib.nullcontext) -> dict[str, float]:
    """`batches`: PromptCollator outputs (on the right device) -> the SUMS over their rows: graded correct, rows,
    generated tokens, rows that ended with EOS and, with a teacher, the generalized JSD at `beta` summed over the
    greedy completions' tokens and their number (with a teacher on a server: with `teacher_topk` K the top-K
    divergence on the same greedy completions, the loss OPD trains with; without, the sampled-token estimate on
    the student's own samples of the prompts). `decoder`: generate's decode step (default: eager). `all_stopped`:
    generate's, for ranks that decode in lockstep. `autocast`: the student's forward context; `teacher_autocast`: the
    local teacher's (in its own dtype: Run.teacher_autocast)."""
    was_training = student.training
    student.eval()
    correct = rows = generated = ended = 0
    kl_sum, kl_tokens = 0.0, 0
    for batch in batches:
        with autocast():
            out = generate(student, batch["prompt_ids"], batch["prompt_attention_mask"], max_new_tokens,
                           do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           vocab_size=len(tokenizer), decoder=decoder, all_stopped=all_stopped)
        texts = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                 for ids, mask in zip(out.completion_ids, out.completion_mask)]
        truths = [row.get("ground_truth") for row in batch["rows"]]
        if all(truth is not None for truth in truths):
            correct += sum(result.correct for result in grade_batch(texts, [str(t) for t in truths]))
        rows += len(texts)
        generated += int(out.completion_mask.sum())
        ended += int((out.completion_ids == tokenizer.eos_token_id).any(dim=1).sum())
        if teacher is not None or teacher_topk:  # the divergence on these greedy completions
            sequences = build_sequences(batch["prompt_ids"], batch["prompt_attention_mask"], out.completion_ids,
                                        out.completion_mask)
        if teacher is not None:
            kl, tokens = divergence_sum(student, teacher, *sequences, len(tokenizer), chunk_size, beta, autocast,
                                        teacher_autocast)
            kl_sum, kl_tokens = kl_sum + kl, kl_tokens + tokens
        if teacher_server is not None and teacher_topk:
            kl, tokens = served_topk_sum(student, teacher_server, *sequences, teacher_topk, len(tokenizer),
                                         chunk_size, beta, autocast)
            kl_sum, kl_tokens = kl_sum + kl, kl_tokens + tokens
        elif teacher_server is not None:
            kl, tokens = sampled_kl_sum(student, teacher_server, tokenizer, batch, max_new_tokens, autocast,
                                        chunk_size, seed, decoder, all_stopped)
            kl_sum, kl_tokens = kl_sum + kl, kl_tokens + tokens
    student.train(was_training)
    if teacher is not None:  # its gathered head is not held on into training (no backward frees it)
        reshard_root(teacher)
    return {"correct": correct, "rows": rows, "generated": generated, "ended": ended, "kl_sum": kl_sum,
            "kl_tokens": kl_tokens}


def heldout_metrics(sums: dict[str, float], teacher: bool, beta: float, teacher_server: bool,
                    teacher_topk: int = 0) -> dict[str, float]:
    """The SUMS of all prompts -> accuracy, mean completion length, EOS share (per row) and, with a teacher, the
    token-weighted mean divergence: beta=1 is the reverse KL(student || teacher), logged as eval/reverse_kl;
    another beta as eval/jsd_beta<beta>; with a teacher on a server, its top-K divergence as eval/reverse_kl_top<K>
    (eval/jsd_beta<beta>_top<K>), or without K the sampled-token estimate, eval/reverse_kl_estimate."""
    rows, kl_tokens = max(sums["rows"], 1), max(sums["kl_tokens"], 1)
    metrics = {"eval/accuracy": sums["correct"] / rows, "eval/completion_len": sums["generated"] / rows,
               "eval/eos_share": sums["ended"] / rows}
    if teacher:
        metrics["eval/reverse_kl" if beta == 1.0 else f"eval/jsd_beta{beta:g}"] = sums["kl_sum"] / kl_tokens
    if teacher_server and teacher_topk:
        name = "eval/reverse_kl" if beta == 1.0 else f"eval/jsd_beta{beta:g}"
        metrics[f"{name}_top{teacher_topk}"] = sums["kl_sum"] / kl_tokens
    elif teacher_server:
        metrics["eval/reverse_kl_estimate"] = sums["kl_sum"] / kl_tokens
    return metrics


def sampled_kl_sum(student, teacher_server, tokenizer, batch: dict, max_new_tokens: int, autocast, chunk_size: int,
                   seed: int, decoder: Decoder | None = None,
                   all_stopped: Callable[[bool], bool] | None = None) -> tuple[float, int]:
    """Sum over the student's sampled tokens y of log p_S(y) - log p_T(y) (a one-sample estimate of the reverse KL
    at each position), and their number. Row r of the held-out set always samples with seed (seed, -1, r): every
    evaluation draws with the same random numbers, so the change between evaluations is the model's."""
    seeds = [derived_seed(seed, -1, row["row_index"]) for row in batch["rows"]]
    device = batch["prompt_ids"].device
    with autocast():
        out = generate(student, batch["prompt_ids"], batch["prompt_attention_mask"], max_new_tokens, do_sample=True,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       generator=[torch.Generator(device).manual_seed(s) for s in seeds], vocab_size=len(tokenizer),
                       decoder=decoder, all_stopped=all_stopped)
    input_ids, attention_mask, labels = build_sequences(batch["prompt_ids"], batch["prompt_attention_mask"],
                                                        out.completion_ids, out.completion_mask)
    teacher_logprobs = teacher_server.completion_logprobs(input_ids, attention_mask,
                                                          (labels != IGNORE_INDEX).sum(dim=1))
    with autocast():
        hidden, targets = completion_hidden(student, input_ids, attention_mask, labels)
        _, kl = chunked_loss(lambda logits, logprobs, chunk_labels: sampled_token_kl_from_logprobs(
            logits, logprobs, chunk_labels), hidden, student.lm_head.weight, targets, chunk_size=chunk_size,
            vocab_size=len(tokenizer), teacher_values=teacher_logprobs)
    return float(kl), int(targets.numel())


def served_topk_sum(student, teacher_server, input_ids, attention_mask, labels, k: int, vocab_size: int,
                    chunk_size: int, beta: float, autocast) -> tuple[float, int]:
    """The top-K divergence at `beta` (trainer/topk_divergence.py) summed over the completions' tokens, against
    a served teacher's top-K log-probabilities there, and their number."""
    support = teacher_server.completion_topk_logprobs(input_ids, attention_mask, (labels != IGNORE_INDEX).sum(dim=1),
                                                      k)
    with autocast():
        hidden, targets = completion_hidden(student, input_ids, attention_mask, labels)
        kl, tokens, _ = chunked_topk_divergence(hidden, student.lm_head.weight, targets, k, teacher_support=support,
                                                beta=beta, chunk_size=chunk_size, vocab_size=vocab_size)
    return float(kl), int(tokens)


def divergence_sum(student, teacher, input_ids, attention_mask, labels, vocab_size: int, chunk_size: int,
                   beta: float, autocast=contextlib.nullcontext,
                   teacher_autocast=contextlib.nullcontext) -> tuple[float, int]:
    # the teacher's forward in its own context, outside the student's: under fp16 the student's autocast would
    # lower a bf16 teacher's matmuls to fp16 (model/precision.py)
    with teacher_autocast():
        teacher_hidden, _ = completion_hidden(teacher, input_ids, attention_mask, labels)
    with autocast():
        student_hidden, targets = completion_hidden(student, input_ids, attention_mask, labels)
        kl, tokens = chunked_generalized_jsd_loss(student_hidden, student.lm_head.weight, teacher_hidden,
                                                  teacher.lm_head.weight, targets, beta=beta, chunk_size=chunk_size,
                                                  vocab_size=vocab_size)
    return float(kl), int(tokens)


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

    def __init__(self, args, tokenizer, info: DistInfo, start_step: int, decoder: Decoder | None = None):
        self.args, self.tokenizer, self.info = args, tokenizer, info
        self.decoder = decoder  # generate's decode step: OPD's compiled one with --use_compile 1, else eager
        self.lockstep = bool(args.fsdp) and info.enabled
        self.all_stopped = stop_together(info.device) if self.lockstep else None
        self.batches = self.load_batches() if args.eval_interval else []
        # a resumed run's checkpoint step was already evaluated (if due) by the run that wrote it
        self.evaluated_step = start_step if start_step > 0 else -1

    def load_batches(self) -> list[dict]:
        """This rank's share of the held-out batches (all of them in lockstep or in one process)."""
        args = self.args
        dataset = RowDataset(args.eval_data_path or ensure_demo_data()["eval"])
        rows = [dataset[i] for i in range(min(args.eval_rows, len(dataset)))]
        collator = PromptCollator(self.tokenizer, args.max_prompt_length, bool(args.enable_thinking))
        starts = list(range(0, len(rows), args.batch_size))
        if not self.lockstep:
            starts = starts[self.info.rank::self.info.world_size]
        batches = []
        for start in starts:
            batch = collator(rows[start:start + args.batch_size])
            batches.append({**batch, "prompt_ids": batch["prompt_ids"].to(self.info.device),
                            "prompt_attention_mask": batch["prompt_attention_mask"].to(self.info.device)})
        return batches

    def due(self, step: int, last: bool) -> bool:
        """On every rank (even one whose share is empty: it joins the reduction): before training (step 0), every
        --eval_interval steps and at the last step, once per step."""
        if not self.args.eval_interval or step == self.evaluated_step:
            return False
        return step % self.args.eval_interval == 0 or last

    def evaluate(self, step: int, student, autocast, teacher=None, beta: float = 1.0,
                 teacher_server=None, teacher_autocast=contextlib.nullcontext) -> dict[str, float]:
        """Greedy completions of the held-out prompts: accuracy, length, EOS share; with a teacher also the
        student's divergence from it on those completions (beta=1: reverse KL; OPD passes its training beta);
        with a teacher on a server, its top-K divergence there (--teacher_topk K) or the sampled-token reverse-KL
        estimate. Every rank returns the same numbers. `autocast` / `teacher_autocast`: the student's and the local
        teacher's forward contexts (Run.autocast, Run.teacher_autocast)."""
        self.evaluated_step = step
        args = self.args
        # a served teacher's top-K divergence needs the server's K; a local teacher gives the exact divergence
        topk = getattr(args, "teacher_topk", 0) if teacher_server is not None else 0

        def work() -> dict[str, float]:
            return heldout_sums(student, self.tokenizer, self.batches, args.eval_max_new_tokens, teacher, autocast,
                                args.loss_chunk_size, beta, teacher_server, args.seed, topk, self.decoder,
                                self.all_stopped, teacher_autocast)
        sums = work() if self.lockstep or not self.info.enabled else self.all_ranks_sums(work)
        return heldout_metrics(sums, teacher is not None, beta, teacher_server is not None, topk)

    def all_ranks_sums(self, work: Callable[[], dict[str, float]]) -> dict[str, float]:
        """This rank's sums, all-reduced with the others'. A rank whose share fails (a teacher server that stopped
        answering) still joins the all-reduce, with a failure flag, and then raises; so does every other rank:
        none is left waiting, and the loop's fail_together sees the failure on every rank."""
        failure = None
        try:
            sums = work()
        except RuntimeFailure as error:
            failure, sums = error, dict.fromkeys(SUMS, 0.0)
        values = torch.tensor([float(sums[name]) for name in SUMS] + [float(failure is not None)],
                              dtype=torch.float64, device=self.info.device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        if failure is not None:
            raise failure
        if values[-1].item():
            raise RuntimeFailure("the held-out evaluation failed on another rank (its message is above)")
        return dict(zip(SUMS, values.tolist()))


def stop_together(device: str) -> Callable[[bool], bool]:
    """generate's `all_stopped` for ranks decoding in lockstep: whether this rank's rows have all stopped -> whether
    every rank's have (one all-reduce of a flag per decoding step)."""
    def all_stopped(stopped: bool) -> bool:
        flag = torch.tensor([float(stopped)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())
    return all_stopped
