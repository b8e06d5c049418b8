"""train_opd.py's options: the shared groups, the teacher (local, served, or several from a file), the divergence,
the student's sampling and the servers; the rules between them; what a resume may change."""
from __future__ import annotations

import argparse

from common.errors import ArgumentParser, refuse_first
from trainer.config.flags import (SHARED_RESUMABLE, TEACHER_RESUMABLE, add_common_args, add_teacher_args,
                                  default_student, resolve_teacher_path, validate_common_args)
from trainer.config.opd_signal import add_opd_signal_args, opd_signal_rules
from trainer.config.self_distillation import add_self_distillation_args, self_distillation_rules
from trainer.losses.fused_divergences import SKEW, SKEWS
from trainer.rollouts.servers import SERVER_RESUMABLE, add_server_args, check_server_wait, validate_server_args
from trainer.rollouts.source import add_sampling_args, validate_sampling_args
from trainer.rollouts.tool_turns import add_tool_args, tool_rules
from trainer.teachers.specs import add_teachers_args, served_teacher_rules, teacher_specs, validate_teachers_args

RESUMABLE = SHARED_RESUMABLE | TEACHER_RESUMABLE | SERVER_RESUMABLE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="On-policy distillation of a Qwen3 student from a Qwen3 teacher")
    add_common_args(parser, save_weight="opd")
    add_teacher_args(parser)
    add_teachers_args(parser)
    g = parser.add_argument_group("on-policy distillation")
    g.add_argument("--loss", default="jsd", choices=["jsd", "sampled_kl", *SKEWS],
                   help="jsd: generalized JSD over the full vocabulary (beta=1: reverse KL); sampled_kl: "
                        "policy-gradient reverse KL from the sampled tokens' log-probabilities only; skew_kl / "
                        "skew_rkl: DistiLLM's skew KL(p_T || a p_T + (1 - a) p_S) / skew reverse KL(p_S || (1 - a) "
                        "p_T + a p_S), a local teacher")
    g.add_argument("--skew", type=float, default=SKEW, help="a of --loss skew_kl / skew_rkl, in [0, 1) (0: the KL)")
    g.add_argument("--beta", type=float, default=1.0, help="0: forward KL, 1: reverse KL, between: generalized JSD")
    g.add_argument("--teacher_topk", type=int, default=0,
                   help="K > 0 with --loss jsd: the divergence over the teacher's top-K tokens, the sampled token "
                        "and one tail bucket per position (what a --teacher_url server returns; with --teacher_path "
                        "the same from its logits); 0: the full vocabulary (local teacher only)")
    g.add_argument("--lmbda", type=float, default=1.0, help="probability that an optimizer step is on-policy")
    g.add_argument("--skd_topk", type=int, default=0,
                   help="K > 0: speculative KD, the student samples and each token outside the local teacher's "
                        "top-K is replaced by the teacher's own sample (the built-in engine, either --decode); 0: off")
    add_opd_signal_args(parser, "--loss sampled_kl")
    add_self_distillation_args(parser)
    add_sampling_args(parser)
    add_tool_args(parser)
    add_server_args(parser)
    args = parser.parse_args(argv)
    default_student(args, "kd", "python trainer/train_sft.py && python trainer/train_distillation.py")
    validate_common_args(args)
    refuse_first(self_distillation_rules(args))
    if not args.teacher_url and not args.teachers and args.self_teacher == "none":
        resolve_teacher_path(args)
    validate_sampling_args(args)
    validate_opd_args(args)
    refuse_first(tool_rules(args) + [
        (bool(args.tools) and bool(args.skd_topk), "--tools with --skd_topk: speculative KD decodes one turn; drop "
                                                   "one of them"),
        (bool(args.tools) and args.self_teacher != "none",
         "--tools with --self_teacher: the privileged prompt is built for one turn; use a --teacher_path"),
    ])
    validate_server_args(args, samples=args.lmbda > 0)
    specs = teacher_specs(args)
    validate_teachers_args(args, specs)
    if args.teachers:
        refuse_first(served_teacher_rules(specs, args.loss, args.temperature))
        check_server_wait(args, next((spec.url for spec in specs if spec.url), None))
    return args


def validate_opd_args(args: argparse.Namespace) -> None:
    a, sampled_kl, skewed = args, args.loss == "sampled_kl", args.loss in SKEWS
    # log p_S(y) - log p_T(y) averages to KL(p_S || p_T) only when y is drawn from p_S itself: the loss's
    # temperature-scaled, untruncated student distribution, on-policy at every step
    unbiased = a.gen_temperature == a.temperature and a.top_k == 0 and a.top_p == 1.0
    refuse_first(opd_signal_rules(a, sampled_kl, "--loss sampled_kl") + [
        (not 0.0 <= a.lmbda <= 1.0, f"--lmbda must be in [0, 1], got {a.lmbda}"),
        (not 0.0 <= a.beta <= 1.0, f"--beta must be in [0, 1], got {a.beta}"),
        (not 0.0 <= a.skew < 1.0, f"--skew must be in [0, 1), got {a.skew}"),
        (a.skd_topk < 0, f"--skd_topk must be >= 0, got {a.skd_topk}"),
        (a.skd_topk and (a.teacher_url or a.teachers),
         "--skd_topk: the teacher decodes beside the student, token by token: one local --teacher_path (a served "
         "teacher would be a request per token)"),
        (a.skd_topk and a.rollout_url, "--skd_topk: the teacher replaces tokens inside the built-in engine; drop "
                                       "--rollout_url"),
        (a.skd_topk and sampled_kl, "--skd_topk with --loss sampled_kl: the teacher's tokens are not the student's "
                                    "samples, which the estimate needs; use --loss jsd"),
        (a.skew != SKEW and not skewed, f"--skew is the skew divergences' a: add --loss skew_kl or skew_rkl (got "
                                        f"--loss {a.loss})"),
        (skewed and (a.teacher_url or a.teacher_topk),
         f"--loss {a.loss} needs the teacher's whole distribution: a local --teacher_path (a served teacher's "
         f"top-K: --loss jsd --teacher_topk K)"),
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
        (sampled_kl and a.max_staleness,
         f"--loss sampled_kl needs samples from the current student: with --max_staleness {a.max_staleness} they "
         f"come from weights {a.max_staleness} step(s) older (a biased estimate); use --loss jsd, or the same "
         f"signal corrected: trainer/train_rl.py --reward none --opd_coef 1 --num_generations 1 --rollout_correction "
         f"tis"),
        (sampled_kl and a.rollout_url and a.sync_interval > 1,
         f"--loss sampled_kl needs samples from the current student: with --sync_interval {a.sync_interval} the "
         f"server samples from older weights (a biased estimate); use --sync_interval 1 or --loss jsd, or the same "
         f"signal corrected: trainer/train_rl.py --reward none --opd_coef 1 --num_generations 1 --rollout_correction "
         f"tis"),
    ])
