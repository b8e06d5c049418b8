"""train_ppo.py's options: RL's (the reward, the clip and CISPO, the update epochs, the reference's KL, sampling, the
rollout server) and the critic's; the OPD term, which PPO here does not have, is refused in one line."""
from __future__ import annotations

import argparse

from common.checks import check_model_dir
from common.errors import refuse_first
from trainer.config.flags import default_student, validate_common_args
from trainer.config.rl import RESUMABLE, rl_parser
from trainer.rollouts.servers import validate_server_args
from trainer.rollouts.source import validate_sampling_args

__all__ = ["RESUMABLE", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = rl_parser("PPO with a critic (GAE) for a Qwen3 student", "ppo")
    g = parser.add_argument_group("PPO's critic (trainer/rl/critic.py, trainer/losses/ppo.py)")
    g.add_argument("--critic_path", type=str, default=None,
                   help="the critic's start: a critic's export (NAME_critic/, transformers' "
                        "Qwen3ForTokenClassification) whole, or a causal LM's body with a zero head; default: the "
                        "student's own --model_path (or --model_config and --seed)")
    g.add_argument("--critic_learning_rate", type=float, default=None, help="default: --learning_rate")
    g.add_argument("--gamma", type=float, default=1.0, help="GAE's discount (TRL's default 1)")
    g.add_argument("--lam", type=float, default=0.95, help="GAE's lambda (TRL's default 0.95)")
    g.add_argument("--value_clip", type=float, default=0.2, help="the value loss's clip around the old value")
    g.add_argument("--whiten", type=int, default=1, choices=[0, 1],
                   help="1: advantages whitened over the step's rollout batch on all ranks (TRL's)")
    parser.set_defaults(num_generations=1)
    args = parser.parse_args(argv)
    default_student(args, "sft", "python trainer/train_sft.py")
    validate_common_args(args)
    validate_sampling_args(args)
    validate_server_args(args, samples=True, teacher=False)
    a = args
    a.clip_eps_high = a.clip_eps if a.clip_eps_high is None else a.clip_eps_high
    a.critic_learning_rate = a.learning_rate if a.critic_learning_rate is None else a.critic_learning_rate
    if a.critic_path:
        check_model_dir(a.critic_path, "--critic_path")
    refuse_first([
        (a.opd_coef or a.teacher_path or a.teacher_url or a.teachers, "PPO here has no OPD term: drop it"),
        (not 0 <= a.gamma <= 1 or not 0 <= a.lam <= 1, "--gamma and --lam must be in [0, 1]"),
        ((a.batch_size * a.accumulation_steps) % a.num_minibatches, "--num_minibatches must divide the step's prompts"),
    ])
    return args
