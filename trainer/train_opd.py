"""On-policy distillation (OPD): the student samples, a same-tokenizer teacher scores every token.

    python trainer/train_sft.py && python trainer/train_distillation.py && python trainer/train_opd.py
                                   # CPU demo: the KD student (checkpoints/kd) learns on-policy from checkpoints/sft
    python trainer/train_opd.py --model_path Qwen3-0.6B --teacher_path Qwen3-4B --data_path dapo.parquet \
        --device cuda --batch_size 8 --accumulation_steps 4 --max_new_tokens 1024 --max_length 1536
    torchrun --nproc_per_node 4 trainer/train_opd.py --model_path Qwen3-0.6B --teacher_path Qwen3-4B ...
    ... --from_resume 1

Per micro-batch, the paper's eq. 2:
  1. with probability lmbda the batch is on-policy: the student samples y ~ pi_student(.|x) (KV cache, eval mode,
     no grad); otherwise the dataset's own completions are used (lmbda=0 is plain KD on the data)
  2. the sequence x + y gets labels on y only, through the first EOS
  3. the teacher scores every position without gradients, the student with gradients
  4. loss per token = generalized JSD over the full vocabulary (beta=1: reverse KL(student || teacher)), computed
     chunk by chunk from hidden states; or --loss sampled_kl, the policy-gradient form that needs only the
     teacher's log-probability of the sampled tokens
The skeleton normalises by the window's loss tokens over all ranks, clips and steps. Each row samples with its own
seed (seed, epoch, row), so a resumed run samples exactly what the killed one would have, and 2 ranks x accumulation
2 sample what 1 rank x accumulation 4 does.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from common.errors import refuse, run_script
from common.seeds import derived_seed
from dataset.collators import IGNORE_INDEX, PromptCollator, SFTCollator, build_sequences
from dataset.make_demo_data import ensure_demo_data
from dataset.sources import RowDataset
from model import generate, load_tokenizer
from trainer.heldout import HeldoutEvaluator
from trainer.losses import chunked_generalized_jsd_loss, chunked_loss, completion_hidden, sampled_token_kl_loss
from trainer.setup import (add_common_args, add_teacher_args, build_model, check_rows, init_distributed_mode,
                           load_teacher, resolve_teacher_path, validate_common_args)
from trainer.trainer_utils import PhaseClock, Run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="On-policy distillation of a Qwen3 student from a Qwen3 teacher")
    add_common_args(parser, save_weight="opd")
    add_teacher_args(parser)
    g = parser.add_argument_group("on-policy distillation")
    g.add_argument("--loss", default="jsd", choices=["jsd", "sampled_kl"],
                   help="jsd: generalized JSD over the full vocabulary (beta=1: reverse KL); sampled_kl: "
                        "policy-gradient reverse KL from the sampled tokens' log-probabilities only")
    g.add_argument("--beta", type=float, default=1.0, help="0: forward KL, 1: reverse KL, between: generalized JSD")
    g.add_argument("--lmbda", type=float, default=1.0, help="probability that a micro-batch is on-policy")
    g = parser.add_argument_group("the student's sampling")
    g.add_argument("--max_new_tokens", type=int, default=64, help="sampled completion length budget")
    g.add_argument("--gen_temperature", type=float, default=1.0, help="sampling temperature of the student")
    g.add_argument("--top_k", type=int, default=0, help="sampling top-k (0 = off)")
    g.add_argument("--top_p", type=float, default=1.0, help="sampling nucleus mass (1 = off)")
    args = parser.parse_args(argv)
    if not args.model_path and not args.model_config:
        args.model_path = os.path.join(args.save_dir, "kd")  # the KD quick-start's student
        if not os.path.isfile(os.path.join(args.model_path, "config.json")):
            refuse(f"no student at {args.model_path}: run `python trainer/train_sft.py && python "
                   f"trainer/train_distillation.py` first, or pass --model_path / --model_config")
    validate_common_args(args)
    resolve_teacher_path(args)
    validate_opd_args(args)
    return args


def validate_opd_args(args: argparse.Namespace) -> None:
    if not 0.0 <= args.lmbda <= 1.0 or not 0.0 <= args.beta <= 1.0:
        refuse(f"--lmbda ({args.lmbda}) and --beta ({args.beta}) must be in [0, 1]")
    if args.loss == "sampled_kl" and args.lmbda < 1.0:
        refuse("--loss sampled_kl is a policy gradient: it is only valid on the student's own samples, so it needs "
               "--lmbda 1 (use --loss jsd to mix in the dataset's completions)")
    if args.max_new_tokens < 1 or args.max_prompt_length + args.max_new_tokens > args.max_length:
        refuse(f"--max_prompt_length ({args.max_prompt_length}) + --max_new_tokens ({args.max_new_tokens}) must be "
               f"<= --max_length ({args.max_length}): raise --max_length or lower one of the budgets")
    if args.gen_temperature <= 0 or not 0.0 < args.top_p <= 1.0 or args.top_k < 0:
        refuse("--gen_temperature must be > 0, --top_p in (0, 1], --top_k >= 0")
    if args.loss == "sampled_kl" and (args.gen_temperature != args.temperature or args.top_k or args.top_p < 1.0):
        # log p_S(y) - log p_T(y) averages to KL(p_S || p_T) only when y is drawn from p_S itself: the loss's
        # temperature-scaled, untruncated student distribution
        refuse(f"--loss sampled_kl estimates the reverse KL of the student at --temperature {args.temperature} from "
               f"its own samples, so it needs --gen_temperature {args.temperature} --top_k 0 --top_p 1 (got "
               f"--gen_temperature {args.gen_temperature} --top_k {args.top_k} --top_p {args.top_p}: a biased "
               f"estimate); use --loss jsd to sample differently")


def on_policy_draw(args: argparse.Namespace, epoch: int, step: int, micro: int) -> bool:
    """Step 1's coin: with probability lmbda the micro-batch is on-policy. One draw per micro-batch, the same on
    every rank (no rank in its seed)."""
    generator = torch.Generator().manual_seed(derived_seed(args.seed, epoch, step, micro))
    return torch.rand(1, generator=generator).item() < args.lmbda


def sample_completions(student, args: argparse.Namespace, tokenizer, batch: dict, epoch: int, device: str,
                       autocast) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-2 on-policy: the student samples (KV cache, eval mode, no grad); -> input_ids, attention_mask and
    labels on the completion through its first EOS."""
    # one generator per row, seeded by (seed, epoch, row): a row's sample depends neither on its batch-mates nor on
    # the world size or accumulation, and a resumed run draws exactly what the killed one would have
    generators = [torch.Generator(device).manual_seed(derived_seed(args.seed, epoch, row["row_index"]))
                  for row in batch["rows"]]
    prompt_ids = batch["prompt_ids"].to(device)
    prompt_mask = batch["prompt_attention_mask"].to(device)
    was_training = student.training
    student.eval()
    with autocast():
        out = generate(student, prompt_ids, prompt_mask, args.max_new_tokens, do_sample=True,
                       temperature=args.gen_temperature, top_k=args.top_k, top_p=args.top_p,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       generator=generators, vocab_size=len(tokenizer))
    student.train(was_training)
    return build_sequences(prompt_ids, prompt_mask, out.completion_ids, out.completion_mask)


def distill_loss(run: Run, args: argparse.Namespace, teacher, vocab_size: int, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 3-4: teacher and student hidden states at the completion positions, the summed per-token loss."""
    with torch.no_grad():
        teacher_hidden, _ = completion_hidden(teacher, input_ids, attention_mask, labels)
    student_hidden, targets = completion_hidden(run.model, input_ids, attention_mask, labels)
    heads = dict(student_weight=run.raw_model.lm_head.weight, teacher_hidden=teacher_hidden,
                 teacher_weight=teacher.lm_head.weight, chunk_size=args.loss_chunk_size, vocab_size=vocab_size)
    if args.loss == "jsd":
        return chunked_generalized_jsd_loss(student_hidden, labels=targets, beta=args.beta,
                                            temperature=args.temperature, **heads)

    def sampled_kl(student_logits, teacher_logits, chunk_labels):
        surrogate_sum, kl_sum = sampled_token_kl_loss(student_logits, teacher_logits, chunk_labels, args.temperature)
        return surrogate_sum, kl_sum, (chunk_labels != IGNORE_INDEX).sum()
    surrogate_sum, kl_sum, num_tokens = chunked_loss(sampled_kl, student_hidden, labels=targets, **heads)
    run.metrics.token_mean("reverse_kl_estimate", kl_sum)
    return surrogate_sum, num_tokens


def add_rollout_stats(metrics, input_ids: torch.Tensor, labels: torch.Tensor, eos_token_id: int,
                      on_policy: bool) -> None:
    """Completion length and EOS share per row, the on-policy share of micro-batches, generated tokens."""
    completion = labels != IGNORE_INDEX
    rows = completion.shape[0]
    metrics.ratio("completion_len", completion.sum(), rows)
    metrics.ratio("eos_share", ((input_ids == eos_token_id) & completion).any(dim=1).sum(), rows)
    metrics.ratio("on_policy_share", int(on_policy), 1)
    metrics.total("generated_tokens", completion.sum() if on_policy else 0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = init_distributed_mode(args.device)  # first: each rank builds its models on its own device
    tokenizer_dir = args.tokenizer_path or args.model_path
    tokenizer = load_tokenizer(tokenizer_dir)
    data_path = args.data_path or ensure_demo_data()["opd_prompts"]
    dataset = RowDataset(data_path)
    prompt_collator = PromptCollator(tokenizer, args.max_prompt_length, bool(args.enable_thinking))
    sft_collator = SFTCollator(tokenizer, args.max_length, args.max_prompt_length, bool(args.enable_thinking))
    # with lmbda < 1 some micro-batches distil the dataset's own completions: then every row needs one
    check_rows(dataset, sft_collator if args.lmbda < 1.0 else prompt_collator, need_completion=args.lmbda < 1.0)
    student = build_model(args, info.device, path=args.model_path, config_path=args.model_config)
    teacher = load_teacher(args, tokenizer, student, info.device)
    run = Run(args, info, student, dataset, prompt_collator, tokenizer_dir)
    evaluator = HeldoutEvaluator(args, tokenizer, info.device, info.is_main, run.step)  # rank 0 evaluates

    if evaluator.due(run.step, run.done):  # step 0: the baseline later evaluations compare against
        run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, teacher, args.beta))
    for epoch, window in run.windows():
        clock = PhaseClock(run.device)
        for i, batch in enumerate(window):
            with clock("gen"):  # steps 1-2: the student's samples, or the dataset's completions
                on_policy = on_policy_draw(args, epoch, run.step, i)
                if on_policy:
                    input_ids, attention_mask, labels = sample_completions(run.raw_model, args, tokenizer, batch,
                                                                           epoch, run.device, run.autocast)
                else:
                    data = {k: v.to(run.device) for k, v in sft_collator(batch["rows"]).items()}
                    input_ids, attention_mask, labels = data["input_ids"], data["attention_mask"], data["labels"]
            with clock("train"), run.micro_step(i, len(window)):  # steps 3-4; DDP syncs on the window's last
                with run.autocast():
                    loss_sum, num_tokens = distill_loss(run, args, teacher, len(tokenizer), input_ids,
                                                        attention_mask, labels)
                run.backward(loss_sum, num_tokens)
            add_rollout_stats(run.metrics, input_ids, labels, tokenizer.eos_token_id, on_policy)
        clock.add_to(run.metrics)  # gen_s / train_s and their shares, reduced over ranks with the rest
        metrics = run.optimizer_step()  # exact normalisation over the window and all ranks, clip, AdamW
        run.log(metrics, show=("gen_share", "eos_share", "completion_len", "reverse_kl_estimate"))
        if run.save_due():              # every --save_interval steps, the last one, and on a stop signal
            run.save()
        if evaluator.due(run.step, run.done):  # every --eval_interval steps and the last one
            run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, teacher, args.beta))
        if run.done or run.stop_signal:  # --epochs / --max_steps reached, or SIGTERM / SIGUSR1 / Ctrl-C
            break
    run.finish()


if __name__ == "__main__":
    run_script(main)
