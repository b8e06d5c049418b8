"""On-policy distillation (OPD): the student samples, a same-tokenizer teacher scores every token.

    python trainer/train_sft.py && python trainer/train_distillation.py && python trainer/train_opd.py
                                   # CPU demo: the KD student (checkpoints/kd) learns on-policy from checkpoints/sft
    python trainer/train_opd.py --model_path Qwen3-0.6B --teacher_path Qwen3-4B --data_path dapo.parquet \
        --device cuda --batch_size 8 --accumulation_steps 4 --max_new_tokens 1024 --max_length 1536
    torchrun --nproc_per_node 4 trainer/train_opd.py --model_path Qwen3-0.6B --teacher_path Qwen3-4B ...
    ... --from_resume 1
    ... --rollout_url http://127.0.0.1:8000/v1     # sample on a vLLM server (docs/serving.md)
    ... --rollout_url ... --max_staleness 1         # the server samples step s+1 while the trainer trains step s
    ... --loss sampled_kl --teacher_url http://127.0.0.1:8001/v1   # the teacher's log-probs from a server
    ... --teacher_topk 16 --teacher_url http://127.0.0.1:8001/v1    # its top-16 per position (--loss jsd)

Per micro-batch, the paper's eq. 2:
  1. with probability lmbda the step is on-policy (one draw per optimizer step, so the same whatever the split into
     ranks and micro-batches): the student samples y ~ pi_student(.|x) (KV cache, eval mode,
     no grad; or on the rollout server, which holds the student's weights: pushed and verified before the step's
     first rollout every --sync_interval steps; with --max_staleness S the server samples step s from the weights
     of step s-S, in the background, trainer/rollout_queue.py); otherwise the dataset's own completions are used
     (lmbda=0 is plain KD on the data)
  2. the sequence x + y gets labels on y only, through the first EOS
  3. the teacher scores every position without gradients (a teacher on a server: the sampled tokens only, or its
     top-K per position), the student with gradients
  4. loss per token = generalized JSD over the full vocabulary (beta=1: reverse KL(student || teacher)), computed
     chunk by chunk from hidden states; with --teacher_topk K over the teacher's top-K, the sampled token and one
     tail bucket (a lower bound of it, exact as S covers the mass); or --loss sampled_kl, the policy-gradient form
     that needs only the teacher's log-probability of the sampled tokens
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

from common.errors import ArgumentParser, refuse, refuse_first, run_script
from common.seeds import derived_seed
from dataset.collators import IGNORE_INDEX, PromptCollator, SFTCollator, build_sequences
from dataset.make_demo_data import ensure_demo_data
from dataset.sources import RowDataset
from model import Decoder, generate, load_tokenizer
from serving.engine import CompletionServer, completions_output, probe_token_ids
from serving.weight_sync import WeightSync
from trainer.console import PhaseClock
from trainer.guard import stop_signals_noted
from trainer.heldout import HeldoutEvaluator
from trainer.rollout_queue import RolloutQueue
from trainer.losses import (chunked_generalized_jsd_loss, chunked_loss, completion_hidden,
                            sampled_token_kl_from_logprobs, sampled_token_kl_loss)
from trainer.servers import (add_server_args, connect_server, rollout_weights_path, say_servers,
                             validate_server_args)
from trainer.setup import (add_common_args, add_teacher_args, build_model, check_rows, init_distributed_mode,
                           load_teacher, resolve_teacher_path, validate_common_args)
from trainer.sharding import reshard_root
from trainer.topk_divergence import chunked_topk_divergence
from trainer.trainer_utils import Run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="On-policy distillation of a Qwen3 student from a Qwen3 teacher")
    add_common_args(parser, save_weight="opd")
    add_teacher_args(parser)
    g = parser.add_argument_group("on-policy distillation")
    g.add_argument("--loss", default="jsd", choices=["jsd", "sampled_kl"],
                   help="jsd: generalized JSD over the full vocabulary (beta=1: reverse KL); sampled_kl: "
                        "policy-gradient reverse KL from the sampled tokens' log-probabilities only")
    g.add_argument("--beta", type=float, default=1.0, help="0: forward KL, 1: reverse KL, between: generalized JSD")
    g.add_argument("--teacher_topk", type=int, default=0,
                   help="K > 0 with --loss jsd: the divergence over the teacher's top-K tokens, the sampled token "
                        "and one tail bucket per position (what a --teacher_url server returns; with --teacher_path "
                        "the same from its logits); 0: the full vocabulary (local teacher only)")
    g.add_argument("--lmbda", type=float, default=1.0, help="probability that an optimizer step is on-policy")
    g = parser.add_argument_group("the student's sampling")
    g.add_argument("--max_new_tokens", type=int, default=64, help="sampled completion length budget")
    g.add_argument("--gen_temperature", type=float, default=1.0, help="sampling temperature of the student")
    g.add_argument("--top_k", type=int, default=0, help="sampling top-k (0 = off)")
    g.add_argument("--top_p", type=float, default=1.0, help="sampling nucleus mass (1 = off)")
    add_server_args(parser)
    args = parser.parse_args(argv)
    if not args.model_path and not args.model_config:
        args.model_path = os.path.join(args.save_dir, "kd")  # the KD quick-start's student
        if not os.path.isfile(os.path.join(args.model_path, "config.json")):
            refuse(f"no student at {args.model_path}: run `python trainer/train_sft.py && python "
                   f"trainer/train_distillation.py` first, or pass --model_path / --model_config")
    validate_common_args(args)
    if not args.teacher_url:
        resolve_teacher_path(args)
    validate_opd_args(args)
    validate_server_args(args)
    return args


def validate_opd_args(args: argparse.Namespace) -> None:
    a, sampled_kl = args, args.loss == "sampled_kl"
    # log p_S(y) - log p_T(y) averages to KL(p_S || p_T) only when y is drawn from p_S itself: the loss's
    # temperature-scaled, untruncated student distribution, on-policy at every step
    unbiased = a.gen_temperature == a.temperature and a.top_k == 0 and a.top_p == 1.0
    refuse_first([
        (not 0.0 <= a.lmbda <= 1.0, f"--lmbda must be in [0, 1], got {a.lmbda}"),
        (not 0.0 <= a.beta <= 1.0, f"--beta must be in [0, 1], got {a.beta}"),
        (a.max_new_tokens < 1, f"--max_new_tokens must be >= 1, got {a.max_new_tokens}"),
        (a.max_prompt_length + a.max_new_tokens > a.max_length,
         f"--max_prompt_length ({a.max_prompt_length}) + --max_new_tokens ({a.max_new_tokens}) must be <= "
         f"--max_length ({a.max_length}): raise --max_length or lower one of the budgets"),
        (a.gen_temperature <= 0, f"--gen_temperature must be > 0, got {a.gen_temperature}"),
        (not 0.0 < a.top_p <= 1.0, f"--top_p must be in (0, 1], got {a.top_p}"),
        (a.top_k < 0, f"--top_k must be >= 0, got {a.top_k}"),
        (a.teacher_topk < 0, f"--teacher_topk must be >= 0, got {a.teacher_topk}"),
        (sampled_kl and a.teacher_topk > 0,
         "--teacher_topk is for --loss jsd (the top-K divergence); --loss sampled_kl needs the sampled tokens' "
         "log-probabilities only"),
        (sampled_kl and a.lmbda < 1.0, "--loss sampled_kl is a policy gradient on the student's own samples: it "
                                       "needs --lmbda 1 (--loss jsd mixes in the dataset's completions)"),
        (sampled_kl and not unbiased,
         f"--loss sampled_kl needs samples from the student at --temperature {a.temperature}: --gen_temperature "
         f"{a.temperature} --top_k 0 --top_p 1 (got --gen_temperature {a.gen_temperature} --top_k {a.top_k} "
         f"--top_p {a.top_p}: a biased estimate); --loss jsd samples any way"),
    ])


def on_policy_draw(args: argparse.Namespace, epoch: int, step: int) -> bool:
    """Step 1's coin: with probability lmbda the optimizer step is on-policy. One draw per step, seeded by (seed,
    epoch, step) alone: every rank and micro-batch of the step agrees, so the global batch's rows are trained the
    same way at any world size x accumulation (a draw per micro-batch would change with the split)."""
    generator = torch.Generator().manual_seed(derived_seed(args.seed, epoch, step))
    return torch.rand(1, generator=generator).item() < args.lmbda


def row_seeds(args: argparse.Namespace, batch: dict, epoch: int) -> list[int]:
    """One seed per row, (seed, epoch, row): a row's sample depends neither on its batch-mates nor on the world size
    or accumulation, and a resumed run draws exactly what the killed one would have."""
    return [derived_seed(args.seed, epoch, row["row_index"]) for row in batch["rows"]]


def sampling_settings(args: argparse.Namespace, tokenizer) -> dict:
    return dict(do_sample=True, temperature=args.gen_temperature, top_k=args.top_k, top_p=args.top_p,
                eos_token_id=tokenizer.eos_token_id, vocab_size=len(tokenizer))


def sample_completions(student, args: argparse.Namespace, tokenizer, batch: dict, epoch: int, device: str,
                       autocast, decoder: Decoder | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-2 on-policy with the built-in engine (KV cache, eval mode, no grad; `decoder`'s decode step, eager by
    default) -> input_ids, attention_mask and labels on the completion through its first EOS."""
    prompt_ids = batch["prompt_ids"].to(device)
    prompt_mask = batch["prompt_attention_mask"].to(device)
    was_training = student.training
    student.eval()
    with autocast():
        out = generate(student, prompt_ids, prompt_mask, args.max_new_tokens,
                       generator=[torch.Generator(device).manual_seed(seed) for seed in row_seeds(args, batch, epoch)],
                       pad_token_id=tokenizer.pad_token_id, decoder=decoder, **sampling_settings(args, tokenizer))
    student.train(was_training)
    return build_sequences(prompt_ids, prompt_mask, out.completion_ids, out.completion_mask)


def served_sampler(server: CompletionServer, args: argparse.Namespace, tokenizer, model_vocab_size: int):
    """Step 1 on the rollout server, for the rollout queue: (batch, epoch) -> each row's completion token ids,
    from the weights the server holds (requests only: it runs in the queue's background thread)."""
    def sample(batch: dict, epoch: int) -> list[list[int]]:
        return server.sample_tokens(batch["prompt_ids"], batch["prompt_attention_mask"], args.max_new_tokens,
                                    seeds=row_seeds(args, batch, epoch), model_vocab_size=model_vocab_size,
                                    **sampling_settings(args, tokenizer))
    return sample


def served_sequences(batch: dict, completions: list[list[int]], tokenizer,
                     device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2 for served rollouts: the rows' completion token ids -> input_ids, attention_mask and labels."""
    prompt_ids = batch["prompt_ids"].to(device)
    prompt_mask = batch["prompt_attention_mask"].to(device)
    out = completions_output(prompt_ids, completions, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return build_sequences(prompt_ids, prompt_mask, out.completion_ids, out.completion_mask)


def teacher_scores(teacher, teacher_server: CompletionServer | None, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, labels: torch.Tensor, autocast,
                   topk: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Step 3, without gradients: a local teacher's hidden states at the completion positions (its lm_head is
    applied chunk by chunk inside the loss, where --teacher_topk takes its top-K), or a served teacher's
    log-probabilities of the sampled tokens -- with topk K, the ids of its top-K and the sampled token and its
    log-probabilities of them, ((N, K+1), (N, K+1)). `autocast`: the teacher's forward context (Run.teacher_autocast:
    the teacher's dtype, not the student's)."""
    if teacher_server is not None:
        lengths = (labels != IGNORE_INDEX).sum(dim=1)
        if topk:
            return teacher_server.completion_topk_logprobs(input_ids, attention_mask, lengths, topk)
        return teacher_server.completion_logprobs(input_ids, attention_mask, lengths)
    with torch.no_grad(), autocast():
        return completion_hidden(teacher, input_ids, attention_mask, labels)[0]


def distill_loss(run: Run, args: argparse.Namespace, teacher, scores: torch.Tensor, vocab_size: int,
                 input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4: the student's hidden states at the completion positions, the summed per-token loss against the
    teacher's `scores` (teacher None: they are a served teacher's log-probabilities of the labels, or its top-K)."""
    student_hidden, targets = completion_hidden(run.model, input_ids, attention_mask, labels)
    common = dict(student_weight=run.raw_model.lm_head.weight, labels=targets, chunk_size=args.loss_chunk_size,
                  vocab_size=vocab_size)
    heads = dict(teacher_values=scores) if teacher is None else \
        dict(teacher_hidden=scores, teacher_weight=teacher.lm_head.weight)
    if args.loss == "jsd" and args.teacher_topk:  # the K+2 buckets: served and local, the same function
        support = dict(teacher_support=scores) if teacher is None else heads
        loss_sum, num_tokens, tail_sum = chunked_topk_divergence(student_hidden, k=args.teacher_topk, beta=args.beta,
                                                                 temperature=args.temperature, **common, **support)
        run.metrics.token_mean("teacher_tail_mass", tail_sum)  # the teacher's mass outside S, per token
        return loss_sum, num_tokens
    if args.loss == "jsd":
        return chunked_generalized_jsd_loss(student_hidden, beta=args.beta, temperature=args.temperature,
                                            **common, **heads)

    def sampled_kl(student_logits, teacher_logits_or_logprobs, chunk_labels):
        loss = sampled_token_kl_from_logprobs if teacher is None else sampled_token_kl_loss
        surrogate_sum, kl_sum = loss(student_logits, teacher_logits_or_logprobs, chunk_labels, args.temperature)
        return surrogate_sum, kl_sum, (chunk_labels != IGNORE_INDEX).sum()
    surrogate_sum, kl_sum, num_tokens = chunked_loss(sampled_kl, student_hidden, **common, **heads)
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
    with stop_signals_noted():  # SIGTERM / SIGUSR1 from here on: the step is finished and saved; at the end
        train(args)            # (done, refused or failed) the process's own handlers are back


def train(args: argparse.Namespace) -> None:
    info = init_distributed_mode(args.device, args.dist_timeout)  # first: each rank builds its models on its own device
    tokenizer_dir = args.tokenizer_path or args.model_path
    tokenizer = load_tokenizer(tokenizer_dir)
    data_path = args.data_path or ensure_demo_data()["opd_prompts"]
    dataset = RowDataset(data_path)
    prompt_collator = PromptCollator(tokenizer, args.max_prompt_length, bool(args.enable_thinking))
    sft_collator = SFTCollator(tokenizer, args.max_length, args.max_prompt_length, bool(args.enable_thinking))
    # with lmbda < 1 some micro-batches distil the dataset's own completions: then every row needs one
    check_rows(dataset, sft_collator if args.lmbda < 1.0 else prompt_collator, need_completion=args.lmbda < 1.0)
    server = connect_server(args, "rollout")  # servers that are down are refused before any model loads
    teacher_server = connect_server(args, "teacher", tokenizer)
    student = build_model(args, info.device, path=args.model_path, config_path=args.model_config)
    teacher = None if teacher_server else load_teacher(args, tokenizer, student, info.device)
    run = Run(args, info, student, dataset, prompt_collator, tokenizer_dir)
    decoder = Decoder(compiled=bool(args.use_compile) and not args.fsdp)  # step 1's decode step (CUDA graphs on CUDA)
    evaluator = HeldoutEvaluator(args, tokenizer, info, run.step, decoder)  # each rank its share (--fsdp 1: all)
    weight_sync = None if server is None else WeightSync(
        server, rollout_weights_path(args), probe_token_ids(tokenizer), run.precision.compute,
        active=info.is_main)
    say_servers(args)

    with run.fail_together(teacher_server is not None):  # a teacher server failing in the evaluation
        if evaluator.due(run.step, run.done):  # step 0: the baseline later evaluations compare against
            run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, teacher, args.beta, teacher_server,
                                            teacher_autocast=run.teacher_autocast))
    # served rollouts: sampled --max_staleness steps ahead, in the background while the trainer trains
    rollouts = None if server is None else RolloutQueue(
        served_sampler(server, args, tokenizer, student.config.vocab_size), run.state, args.max_staleness,
        overlap=bool(args.overlap))
    for epoch, window, coming in run.windows_ahead(args.max_staleness):
        clock = PhaseClock(run.device)
        on_policy = on_policy_draw(args, epoch, run.step)  # step 1's coin, for the whole optimizer step
        # the steps whose rollouts come from the current weights (this one with --max_staleness 0, the one S ahead
        # otherwise): once the server is done with older weights, it gets these, verified, and starts sampling
        jobs = [] if rollouts is None else rollouts.due(run.step, [(run.step, epoch, window), *coming],
                                                        lambda e, s: on_policy_draw(args, e, s))
        if jobs:
            with clock("drain"), run.fail_together():  # the rollouts in flight, sampled from older weights, finish
                rollouts.wait()
            if weight_sync.due(run.step, args.sync_interval):
                with clock("sync"), run.fail_together():    # rank 0 writes them, the server loads them
                    weight_sync.push(run.raw_model, run.step)  # --fsdp 1: gathered tensor by tensor
                with clock("verify"), run.fail_together():  # its log-probs of a probe == ours, or the run stops
                    agreement = weight_sync.verify(run.raw_model, run.autocast)
                    run.metrics.total("sync_logprob_diff", agreement["max"])  # bf16: the mean decides (docs/serving.md)
                    run.metrics.total("sync_logprob_mean", agreement["mean"])
            rollouts.start(jobs, run.step)  # a failure is raised where they are waited for
        for i, batch in enumerate(window):
            with clock("gen"), run.fail_together(server is not None):  # steps 1-2: samples or the data's completions
                if on_policy and rollouts:  # the queue's, waited for when they are not there yet
                    completions, version = rollouts.take(run.step, batch)
                    input_ids, attention_mask, labels = served_sequences(batch, completions, tokenizer, run.device)
                    # steps the rollouts lag, per optimizer step: averaged over the window's micro-batches and ranks
                    run.metrics.ratio("staleness", run.step - version, 1)
                elif on_policy:
                    input_ids, attention_mask, labels = sample_completions(run.raw_model, args, tokenizer, batch,
                                                                           epoch, run.device, run.autocast, decoder)
                else:
                    data = {k: v.to(run.device) for k, v in sft_collator(batch["rows"]).items()}
                    input_ids, attention_mask, labels = data["input_ids"], data["attention_mask"], data["labels"]
            with clock("teacher"), run.fail_together(teacher_server is not None):  # step 3: the teacher scores them
                scores = teacher_scores(teacher, teacher_server, input_ids, attention_mask, labels,
                                        run.teacher_autocast, args.teacher_topk)
            with clock("train"), run.micro_step(i, len(window)):  # step 4; DDP syncs on the window's last
                with run.autocast():
                    loss_sum, num_tokens = distill_loss(run, args, teacher, scores, len(tokenizer), input_ids,
                                                        attention_mask, labels)
                run.backward(loss_sum, num_tokens)
            reshard_root(teacher)  # a sharded teacher's head, gathered for its forward, is read until here
            add_rollout_stats(run.metrics, input_ids, labels, tokenizer.eos_token_id, on_policy)
        clock.add_to(run.metrics)  # gen_s / train_s and their shares, reduced over ranks with the rest
        if rollouts:  # seconds the trainer waited for rollouts, and the server sat idle between its jobs
            rollouts.add_to(run.metrics)
        metrics = run.optimizer_step()  # exact normalisation over the window and all ranks, clip, AdamW
        run.log(metrics, show=("gen_share", "eos_share", "completion_len", "reverse_kl_estimate", "wait_s"))
        if run.save_due():              # every --save_interval steps, the last one, and on a stop signal
            if rollouts:  # the checkpoint keeps the rollouts sampled ahead (token ids): a resume needs them
                with run.fail_together():
                    rollouts.wait()
            run.save()
        with run.fail_together(teacher_server is not None):
            if evaluator.due(run.step, run.done):  # every --eval_interval steps and the last one
                run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, teacher, args.beta,
                                                teacher_server, teacher_autocast=run.teacher_autocast))
        if run.done or run.stop_signal:  # --epochs / --max_steps reached, or SIGTERM / SIGUSR1 / Ctrl-C
            break
    run.finish()


if __name__ == "__main__":
    run_script(main)
