"""train_rl.py's options: the shared groups, the RL method's (group size, advantage, reward, clip, KL, the OPD
term and its teachers), the student's sampling and the rollout server; the rules between them; what a resume may
change."""
from __future__ import annotations

import argparse
import os

from common.errors import ArgumentParser, refuse, refuse_first
from trainer.config.flags import (SHARED_RESUMABLE, TEACHER_RESUMABLE, add_common_args, add_frozen_model_args,
                                  default_student, validate_common_args)
from trainer.config.opd_signal import add_opd_signal_args, opd_signal_rules
from trainer.losses.policy_gradient import ADVANTAGES, POLICY_LOSSES
from trainer.losses.rollout_correction import CORRECTIONS
from trainer.rl.rewards import REWARDS
from trainer.rollouts.servers import SERVER_RESUMABLE, add_server_args, check_server_wait, validate_server_args
from trainer.rollouts.source import add_sampling_args, validate_sampling_args
from trainer.rollouts.tool_turns import add_tool_args, tool_rules
from trainer.teachers.specs import add_teachers_args, read_teachers_file, teacher_specs, validate_teachers_args

RESUMABLE = SHARED_RESUMABLE | TEACHER_RESUMABLE | SERVER_RESUMABLE


def rl_parser(description: str, save_weight: str) -> ArgumentParser:
    """The flags of the RL family's loops (train_rl.py, train_ppo.py): the shared groups, the RL method's, the OPD
    term and its teachers, the student's sampling, the rollout server."""
    parser = ArgumentParser(description=description)
    add_common_args(parser, save_weight=save_weight)
    add_rl_args(parser)
    add_opd_signal_args(parser, "the OPD term, --opd_coef")
    add_teachers_args(parser)
    add_sampling_args(parser)
    add_server_args(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = rl_parser("RL with verifiable rewards (GRPO family) for a Qwen3 student", "rl")
    add_tool_args(parser)
    args = parser.parse_args(argv)
    default_student(args, "sft", "python trainer/train_sft.py")  # the demo's only model whose answers end
    validate_common_args(args)
    validate_sampling_args(args)
    validate_rl_args(args)
    refuse_first(tool_rules(args))
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
    g.add_argument("--policy_loss", default="clip", choices=POLICY_LOSSES,
                   help="clip: PPO's clipped surrogate -min(rho A, clip(rho) A); cispo: MiniMax-M1's -sg(clip(rho)) A "
                        "log pi, no token's gradient dropped (its paper: no lower bound, --clip_eps 1, and a tuned "
                        "--clip_eps_high)")
    g.add_argument("--clip_eps", type=float, default=0.2, help="PPO's clip: rho within [1 - eps_low, 1 + eps_high]")
    g.add_argument("--clip_eps_high", type=float, default=None,
                   help="the upper clip when it differs (DAPO: 0.28); default --clip_eps")
    g.add_argument("--update_epochs", type=int, default=1,
                   help="E: passes over each rollout batch, each minibatch one optimizer update (minimind's "
                        "ppo_update_iters); > 1 records log pi_old by a forward before the batch's first update")
    g.add_argument("--num_minibatches", type=int, default=1,
                   help="M: the rollout batch (a step's prompts) split into M minibatches of whole groups, one "
                        "update each: E x M updates per step")
    g.add_argument("--rollout_correction", default="none", choices=CORRECTIONS,
                   help="rollouts a server sampled from older weights (--max_staleness > 0, --sync_interval > 1), "
                        "weighted by rho = pi_old / mu against the server's log-probabilities: tis, token-level "
                        "truncated IS min(rho, --is_cap); mis, sequence-level masked IS (an answer's prod rho, 0 above "
                        "--is_cap); icepop, rho where --icepop_low <= rho <= --icepop_high, else 0; none: trained as "
                        "if on-policy (biased)")
    g.add_argument("--is_cap", type=float, default=2.0,
                   help="C of --rollout_correction tis and mis (their sources': 2)")
    g.add_argument("--icepop_low", type=float, default=0.5, help="the lower end of IcePop's band (its source's: 0.5)")
    g.add_argument("--icepop_high", type=float, default=5.0, help="the upper end of IcePop's band (its source's: 5)")
    g.add_argument("--target_kl", type=float, default=0.0,
                   help="> 0: a step's remaining updates are skipped once a minibatch's approximate KL(pi_old || pi) "
                        "(mean of rho - 1 - log rho over its tokens, all ranks) passes it; 0: off")
    g.add_argument("--kl_coef", type=float, default=0.0,
                   help="weight of the k3 estimate of KL(student || reference) per token (0: no reference loaded)")
    g.add_argument("--reference_path", default=None,
                   help="the KL's frozen model (default: the student's starting model)")
    g.add_argument("--opd_coef", type=float, default=0.0,
                   help="lambda: A_t = A_group - lambda (log p_S(y_t) - log p_T(y_t)), a teacher's dense signal "
                        "(--teacher_path, --teacher_url, or several: --teachers)")
    g.add_argument("--teacher_path", default=None, help="a local teacher for --opd_coef (same tokenizer)")
    add_frozen_model_args(g, "reference, teacher")


def validate_rl_args(args: argparse.Namespace) -> None:
    a = args
    a.clip_eps_high = a.clip_eps if a.clip_eps_high is None else a.clip_eps_high
    teacher = a.teacher_path or a.teacher_url or a.teachers
    served = a.teacher_url or a.teachers and any(spec.url for spec in read_teachers_file(a.teachers))
    refuse_first(opd_signal_rules(a, bool(a.opd_coef), "--opd_coef (e.g. 1) and a teacher") + [
        (a.num_generations < 1, f"--num_generations must be >= 1, got {a.num_generations}"),
        (a.num_generations == 1 and not a.opd_coef,
         "--num_generations 1: a group of one has no relative reward (its advantage is 0): sample 2 or more, or "
         "train on --opd_coef alone"),
        (not (0 < a.clip_eps < 1 or a.policy_loss == "cispo" and a.clip_eps == 1) or a.clip_eps_high <= 0,
         f"--clip_eps must be in (0, 1) (cispo: (0, 1], 1 for no lower bound) and --clip_eps_high > 0, got "
         f"{a.clip_eps} and {a.clip_eps_high}"),
        (a.update_epochs < 1 or a.num_minibatches < 1,
         f"--update_epochs and --num_minibatches must be >= 1, got {a.update_epochs} and {a.num_minibatches}"),
        ((a.batch_size * a.accumulation_steps) % a.num_minibatches,
         f"--num_minibatches {a.num_minibatches} must divide a step's prompts per rank, --batch_size x "
         f"--accumulation_steps = {a.batch_size * a.accumulation_steps} (minibatches of whole groups, the same "
         f"rows on any world size)"),
        (a.target_kl < 0, f"--target_kl must be >= 0, got {a.target_kl}"),
        (a.target_kl and a.update_epochs * a.num_minibatches == 1,
         "--target_kl stops a step's later updates: it needs --update_epochs or --num_minibatches > 1"),
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
        (a.rollout_correction != "none" and not a.rollout_url,
         f"--rollout_correction {a.rollout_correction} weighs rollouts a server sampled from older weights: add "
         f"--rollout_url with --max_staleness or --sync_interval (the built-in engine samples from the current ones)"),
        (a.is_cap <= 1 or not 0 < a.icepop_low < 1 < a.icepop_high,
         f"--is_cap must be > 1 and 0 < --icepop_low < 1 < --icepop_high, got {a.is_cap}, {a.icepop_low} and "
         f"{a.icepop_high}"),
    ])
    for flag in ("teacher_path", "reference_path"):
        path = getattr(args, flag)
        if path and not os.path.isfile(os.path.join(path, "config.json")):
            refuse(f"--{flag} {path}: no model there (config.json)")
