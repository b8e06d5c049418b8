"""RL with verifiable rewards (GRPO family): the student samples a group of G answers per prompt, math-verify grades
each against the row's ground truth, and each answer's reward relative to its group is the advantage of every one
of its tokens; optionally OPD's dense signal, a teacher's per-token log-ratio, added to that advantage.

    python trainer/train_rl.py --num_generations 4 --batch_size 8 --max_steps 32 --learning_rate 1e-4 \
        --eval_interval 8          # CPU demo: checkpoints/sft (the only demo model that ends its answers) by RL
    python trainer/train_rl.py --model_path Qwen3-0.6B --data_path dapo-math-17k.parquet --device cuda \
        --batch_size 16 --num_generations 8 --accumulation_steps 4 --max_new_tokens 2048 --max_length 2560 \
        --learning_rate 1e-6 --warmup_ratio 0 --grad_clip 1.0 --clip_eps 0.2 --clip_eps_high 0.28 \
        --advantage drgrpo --kl_coef 0 --rollout_url http://127.0.0.1:8000/v1 --eval_interval 50
                                   # the GPU recipe: DAPO-Math-17K, DAPO's asymmetric clip, no KL, a vLLM server
    ... --opd_coef 1 --teacher_path Qwen3-8B     # + OPD as a dense advantage (or --teacher_url: a served teacher)
    ... --opd_coef 1 --teachers teachers.json    # each row's OPD term from the teacher its `teacher` column names
    ... --from_resume 1

Per micro-batch (its --batch_size prompts, each G times: a group is never split across ranks or micro-batches):
  1. the student samples G completions per prompt (built-in engine or --rollout_url; per-row seeds (seed, epoch,
     row, g)), labels on each completion through its first EOS
  2. rewards: 1 for a completion math-verify finds equal to the ground truth, else 0 (+ --format_reward for a final
     \\boxed{} answer); advantages within each group: grpo (r - mean) / (std + 1e-4), drgrpo r - mean
  3. optional frozen models, no gradients: the reference's log-probabilities of the sampled tokens (--kl_coef), the
     teacher's (--opd_coef: local, or the served teacher's)
  4. loss per token = - min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + kl_coef k3(ref, student), with
     A = A_group - opd_coef (log p_S(y_t) - log p_T(y_t)) and rho = 1 (the rollouts come from the weights being
     trained; trainer/losses/policy_gradient.py); summed, the skeleton divides by the window's completion tokens over all
     ranks (drgrpo: by its rows x --max_new_tokens), clips and steps
One optimizer step per rollout batch (no PPO epochs). With --reward none, --opd_coef 1, G = 1 and --kl_coef 0 this is
train_opd.py's --loss sampled_kl, step for step.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from common.errors import ArgumentParser, refuse, refuse_first, run_script
from dataset.collators import IGNORE_INDEX
from model import Decoder
from trainer.losses.chunked import completion_hidden
from trainer.skeleton.console import PhaseClock
from trainer.skeleton.distributed import init_distributed_mode, print0
from trainer.losses.divergences import Divergence, evaluation_divergence
from trainer.config.flags import add_common_args, validate_common_args
from trainer.teachers.frozen import frozen_hidden, load_reference
from trainer.skeleton.guard import stop_signals_noted
from trainer.evaluation.heldout import HeldoutEvaluator
from trainer.skeleton.loading import build_model, load_prompt_data
from trainer.losses.policy_gradient import (ADVANTAGE, ADVANTAGES, OLD_LOGP, REF_LOGP, TEACHER_LOGP, chunked_policy_loss,
                                     group_advantages, token_logprobs)
from trainer.rl.rewards import REWARDS, GroupCollator, check_ground_truths, reward_of
from trainer.rollouts.source import Rollouts, add_sampling_args, validate_sampling_args
from trainer.skeleton.run import Run
from trainer.rollouts.servers import add_server_args, check_server_wait, connect_server, say_servers, validate_server_args
from trainer.skeleton.sharding import reshard_root
from trainer.teachers.parts import add_part_metrics, part_scores, split_by_teacher
from trainer.teachers.teacher_set import (Teachers, add_teachers_args, check_teachers, load_teachers, read_teachers_file, routing,
                              say_teachers, teacher_specs, validate_teachers_args)

SAMPLED_KL = Divergence("sampled_kl")  # what a teacher gives the OPD term: its log-probability of each sampled token


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="RL with verifiable rewards (GRPO family) for a Qwen3 student")
    add_common_args(parser, save_weight="rl")
    add_rl_args(parser)
    add_teachers_args(parser)
    add_sampling_args(parser)
    add_server_args(parser)
    args = parser.parse_args(argv)
    if not args.model_path and not args.model_config:
        args.model_path = os.path.join(args.save_dir, "sft")  # the demo's only model whose answers end (EOS 100%)
        if not os.path.isfile(os.path.join(args.model_path, "config.json")):
            refuse(f"no student at {args.model_path}: run `python trainer/train_sft.py` first, or pass "
                   f"--model_path / --model_config")
    validate_common_args(args)
    validate_sampling_args(args)
    validate_rl_args(args)
    validate_server_args(args, samples=True, teacher=False)
    specs = teacher_specs(args) if args.opd_coef else []
    validate_teachers_args(args, specs)
    check_server_wait(args, next((spec.url for spec in specs if spec.url), None))
    return args


def add_rl_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("RL with verifiable rewards (trainer/losses/policy_gradient.py)")
    g.add_argument("--num_generations", type=int, default=8, help="G: completions sampled per prompt (a group)")
    g.add_argument("--advantage", default="grpo", choices=ADVANTAGES,
                   help="grpo: (r - mean) / (std + 1e-4) within the group, the loss per token over the window; "
                        "drgrpo: r - mean, the loss divided by rows x --max_new_tokens (Dr. GRPO)")
    g.add_argument("--reward", default="math", choices=REWARDS,
                   help="math: 1 when math-verify finds the answer equal to the row's ground truth; none: 0 (the "
                        "OPD term alone)")
    g.add_argument("--format_reward", type=float, default=0.0,
                   help="added to the reward of a completion with a final \\boxed{} answer, right or wrong")
    g.add_argument("--clip_eps", type=float, default=0.2, help="PPO's clip: rho within [1 - eps_low, 1 + eps_high]")
    g.add_argument("--clip_eps_high", type=float, default=None,
                   help="the upper clip when it differs (DAPO: 0.28); default --clip_eps")
    g.add_argument("--kl_coef", type=float, default=0.0,
                   help="weight of the k3 estimate of KL(student || reference) per token (0: no reference loaded)")
    g.add_argument("--reference_path", default=None,
                   help="the KL's frozen model (default: the student's starting model)")
    g.add_argument("--opd_coef", type=float, default=0.0,
                   help="lambda: A_t = A_group - lambda (log p_S(y_t) - log p_T(y_t)), a teacher's dense signal "
                        "(--teacher_path, --teacher_url, or several: --teachers)")
    g.add_argument("--teacher_path", default=None, help="a local teacher for --opd_coef (same tokenizer)")
    g.add_argument("--teacher_dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the frozen models' weights (reference, teacher); auto as the KD teacher's")
    g.add_argument("--replicate_teacher", type=int, default=0, choices=[0, 1],
                   help="with --fsdp 1: 1 keeps whole frozen models on every rank instead of sharding them")


def validate_rl_args(args: argparse.Namespace) -> None:
    a = args
    a.clip_eps_high = a.clip_eps if a.clip_eps_high is None else a.clip_eps_high
    teacher = a.teacher_path or a.teacher_url or a.teachers
    served = a.teacher_url or a.teachers and any(spec.url for spec in read_teachers_file(a.teachers))
    refuse_first([
        (a.num_generations < 1, f"--num_generations must be >= 1, got {a.num_generations}"),
        (a.num_generations == 1 and not a.opd_coef,
         "--num_generations 1: a group of one has no relative reward (its advantage is 0): sample 2 or more, or "
         "train on --opd_coef alone"),
        (not 0 < a.clip_eps < 1 or a.clip_eps_high <= 0,
         f"--clip_eps must be in (0, 1) and --clip_eps_high > 0, got {a.clip_eps} and {a.clip_eps_high}"),
        (a.kl_coef < 0 or a.opd_coef < 0 or a.format_reward < 0,
         "--kl_coef, --opd_coef and --format_reward must be >= 0"),
        (a.opd_coef and not teacher, "--opd_coef needs a teacher: --teacher_path DIR, --teacher_url URL or "
                                     "--teachers FILE"),
        (a.teacher_path and a.teacher_url, "give one teacher: --teacher_path or --teacher_url"),
        (teacher and not a.opd_coef, "a teacher is read only by the OPD term: add --opd_coef (e.g. 1)"),
        (a.reward == "none" and not a.opd_coef, "--reward none with no --opd_coef: nothing to learn from"),
        (served and a.gen_temperature != 1.0,
         f"a served teacher: a server's log-probabilities are at temperature 1, the student's at --gen_temperature "
         f"{a.gen_temperature}: sample at 1 or use a local --teacher_path"),
        # the ratio rho needs the probability the sampling engine gave each token; the loop has it only when the
        # weights that sampled are the ones being trained (rho = 1)
        (a.max_staleness or a.sync_interval > 1,
         f"--max_staleness {a.max_staleness} / --sync_interval {a.sync_interval}: rollouts from older weights need "
         f"the sampling engine's log-probabilities for the importance ratio, which this loop does not take; use "
         f"--max_staleness 0 --sync_interval 1 (strictly on-policy)"),
    ])
    for flag in ("teacher_path", "reference_path"):
        path = getattr(args, flag)
        if path and not os.path.isfile(os.path.join(path, "config.json")):
            refuse(f"--{flag} {path}: no model there (config.json)")


def sampled_rewards(args: argparse.Namespace, tokenizer, batch: dict, input_ids: torch.Tensor,
                    labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2's rewards of the micro-batch's completions (decoded without special tokens, as eval_math.py grades
    them) -> (rewards, correct), one per row."""
    completion = labels != IGNORE_INDEX
    texts = [tokenizer.decode(input_ids[i][completion[i]].tolist(), skip_special_tokens=True)
             for i in range(input_ids.shape[0])]
    return reward_of(texts, [row.get("ground_truth") for row in batch["rows"]], args.reward, args.format_reward)


def token_values(args: argparse.Namespace, run: Run, advantages: torch.Tensor, labels: torch.Tensor, reference,
                 teachers: Teachers | None, route: torch.Tensor, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Step 3: per completion token (in completion_hidden's order) its group's advantage, log pi_old (NaN: the
    weights being trained), the reference's and the row's teacher's log-probabilities of the sampled token (0 when
    not read; several teachers: each scores its own rows) -> (n, 4)."""
    completion = labels != IGNORE_INDEX
    n = int(completion.sum())
    values = torch.zeros(n, 4, device=run.device)
    values[:, ADVANTAGE] = advantages.to(run.device)[:, None].expand_as(labels)[completion]
    values[:, OLD_LOGP] = float("nan")
    targets = labels[completion]
    if reference is not None:
        hidden = frozen_hidden(reference, run.teacher_autocast, input_ids, attention_mask, labels)
        with run.teacher_autocast():
            values[:, REF_LOGP] = token_logprobs(hidden, reference.lm_head.weight, targets, args.loss_chunk_size,
                                                 vocab, args.gen_temperature)
    for part in [] if teachers is None else split_by_teacher(teachers, route, labels):
        scores = part_scores(part, SAMPLED_KL, run.teacher_autocast, input_ids, attention_mask, labels)
        if scores is not None and part.teacher.model is not None:
            with run.teacher_autocast():
                scores = token_logprobs(scores, part.teacher.lm_head_weight, part.select(targets),
                                        args.loss_chunk_size, vocab, args.gen_temperature)
        if scores is not None:
            values[part.index, TEACHER_LOGP] = scores.to(values.dtype)
        add_part_metrics(run.metrics, teachers, part, None, 0 if scores is None else scores.numel())
    return values


def add_group_stats(metrics, rewards: torch.Tensor, correct: torch.Tensor, labels: torch.Tensor, input_ids, eos: int,
                    group_size: int) -> None:
    """Reward mean and std (over the window's completions), pass@1 and pass@G, groups with no reward variance
    (no signal), completion length and EOS share."""
    groups = rewards.view(-1, group_size)
    rows = rewards.numel()
    metrics.ratio("reward", rewards.sum(), rows)
    metrics.ratio("reward_sq", (rewards ** 2).sum(), rows)  # -> reward_std at the step (the window's)
    metrics.ratio("pass@1", correct.sum(), rows)
    metrics.ratio(f"pass@{group_size}", correct.view(-1, group_size).any(dim=1).sum(), groups.shape[0])
    metrics.ratio("zero_variance_share", (groups == groups[:, :1]).all(dim=1).sum(), groups.shape[0])
    completion = labels != IGNORE_INDEX
    metrics.ratio("completion_len", completion.sum(), rows)
    metrics.ratio("eos_share", ((input_ids == eos) & completion).any(dim=1).sum(), rows)


def reward_std(metrics: dict) -> None:
    """The window's reward standard deviation from its mean and mean square (replaces reward_sq)."""
    mean_sq = metrics.pop("reward_sq")
    metrics["reward_std"] = max(mean_sq - metrics["reward"] ** 2, 0.0) ** 0.5


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with stop_signals_noted():  # SIGTERM / SIGUSR1 from here on: the step is finished and saved; at the end
        train(args)            # (done, refused or failed) the process's own handlers are back


def train(args: argparse.Namespace) -> None:
    info = init_distributed_mode(args.device, args.dist_timeout)  # first: each rank builds its models on its own device
    tokenizer_dir, tokenizer, dataset, collator = load_prompt_data(args, "opd_prompts", need_completion=False)
    if args.reward == "math":
        check_ground_truths(dataset, os.path.relpath(dataset.path))
    specs = teacher_specs(args) if args.opd_coef else []  # the OPD term's teachers
    routing(args, specs).check(dataset)  # every row's teacher is one of the run's
    server = connect_server(args, "rollout")  # servers that are down are refused before any model loads
    servers = check_teachers(args, specs, tokenizer, dataset)  # teacher servers, vocabularies, chat templates
    student = build_model(args, info.device, path=args.model_path, config_path=args.model_config)
    reference = load_reference(args, tokenizer, student, info.device) if args.kl_coef else None
    teachers = load_teachers(args, specs, servers, tokenizer, student, info.device) if specs else None
    served = teachers is not None and teachers.served
    run = Run(args, info, student, dataset, GroupCollator(collator, args.num_generations), tokenizer_dir)
    decoder = Decoder(compiled=bool(args.use_compile) and not args.fsdp)  # step 1's decode step
    evaluator = HeldoutEvaluator(args, tokenizer, info, run.step, decoder,  # each rank its share (--fsdp 1: all)
                                 **({} if teachers is None else teachers.for_evaluation(
                                     lambda t: evaluation_divergence(1.0, t.model is not None))))
    rollouts = Rollouts(args, run, tokenizer, server, decoder, lambda epoch, step: True)
    say_servers(args)
    if teachers is not None:
        say_teachers(teachers)
    print0(f"groups of {args.num_generations}: each prompt sampled {args.num_generations} times, "
           f"{args.batch_size * args.num_generations} completions per micro-batch; reward {args.reward}"
           + (f" + {args.format_reward:g} for a final boxed answer" if args.format_reward else "")
           + f", advantage {args.advantage}" + (f", KL {args.kl_coef:g}" if args.kl_coef else "")
           + (f", OPD term {args.opd_coef:g}" if args.opd_coef else ""))
    head, vocab, g = run.raw_model.lm_head.weight, len(tokenizer), args.num_generations
    settings = dict(temperature=args.gen_temperature, clip_low=args.clip_eps, clip_high=args.clip_eps_high,
                    kl_coef=args.kl_coef, opd_coef=args.opd_coef)

    with run.fail_together(served):
        if evaluator.due(run.step, run.done):  # step 0: the baseline later evaluations compare against
            run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, run.teacher_autocast))
    for epoch, window, coming in run.windows_ahead(args.max_staleness):
        clock = PhaseClock(run.device)
        rollouts.before_step(epoch, window, coming, clock)  # served: push + verify the weights, then sample
        for i, batch in enumerate(window):
            # 1. G samples per prompt, labels on each completion
            input_ids, attention_mask, labels = rollouts.sequences(batch, epoch, True, clock)
            with clock("reward"):  # 2. graded against the ground truth, compared within the group
                rewards, correct = sampled_rewards(args, tokenizer, batch, input_ids, labels)
                advantages = group_advantages(rewards, g, args.advantage)
            with clock("teacher"), run.fail_together(served):  # 3. the frozen models
                values = token_values(args, run, advantages, labels, reference, teachers,
                                      None if teachers is None else teachers.routes.route(batch["rows"]), input_ids,
                                      attention_mask, vocab)
            with clock("train"), run.micro_step(i, len(window)):  # 4. the loss; DDP syncs on the window's last
                with run.autocast():
                    hidden, targets = completion_hidden(run.model, input_ids, attention_mask, labels)
                    sums = chunked_policy_loss(hidden, head, targets, values, args.loss_chunk_size, vocab, **settings)
                divisor = labels.shape[0] * args.max_new_tokens if args.advantage == "drgrpo" else sums.tokens
                run.backward(sums.loss, divisor)
            reshard_root(reference)  # a sharded frozen model's head, gathered for its forward, is read until here
            if teachers is not None:
                teachers.reshard()
            run.metrics.ratio("clip_fraction", sums.clipped, sums.tokens)
            run.metrics.ratio("entropy", sums.entropy, sums.tokens)
            if args.kl_coef:
                run.metrics.ratio("kl", sums.kl, sums.tokens)
            if args.opd_coef:
                run.metrics.ratio("reverse_kl_estimate", sums.opd, sums.tokens)
            add_group_stats(run.metrics, rewards, correct, labels, input_ids, tokenizer.eos_token_id, g)
        clock.add_to(run.metrics)  # gen / reward / teacher / train seconds and their shares
        rollouts.add_to(run.metrics)
        metrics = run.optimizer_step()  # exact normalisation over the window and all ranks, clip, AdamW
        reward_std(metrics)
        run.log(metrics, show=("reward", f"pass@{g}", "zero_variance_share", "eos_share", "completion_len"))
        if run.save_due():              # every --save_interval steps, the last one, and on a stop signal
            rollouts.before_save()
            run.save()
        with run.fail_together(served):
            if evaluator.due(run.step, run.done):  # every --eval_interval steps and the last one
                run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, run.teacher_autocast))
        if run.done or run.stop_signal:  # --epochs / --max_steps reached, or SIGTERM / SIGUSR1 / Ctrl-C
            break
    rollouts.close()
    run.finish()


if __name__ == "__main__":
    run_script(main)
