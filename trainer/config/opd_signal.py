"""The flags of the sampled-token OPD signal's variants (trainer/losses/token_signals.py), shared by the OPD loop's
--loss sampled_kl and the RL loop's OPD term, and the rules between them."""
from __future__ import annotations

import argparse

from trainer.losses.token_signals import POSITION_WEIGHTS, REWARDS

POWER_ALPHA, IW_GAMMA = 5.0, 0.5  # PowerOPD's and IW-OPD's defaults, their papers'


def add_opd_signal_args(parser: argparse.ArgumentParser, where: str) -> None:
    g = parser.add_argument_group(f"the sampled-token OPD signal's variants ({where})")
    g.add_argument("--opd_reward", default="log_ratio", choices=REWARDS,
                   help="the per-token reward: log_ratio, log p_T(y) - log p_S(y) (vanilla OPD); power, "
                        "p_T(y)^a - p_S(y)^a, bounded in [-1, 1] (PowerOPD)")
    g.add_argument("--power_alpha", type=float, default=POWER_ALPHA,
                   help="PowerOPD's exponent a > 0 (as a -> 0 the reward is the log-ratio times a)")
    g.add_argument("--position_weight", default="none", choices=POSITION_WEIGHTS,
                   help="iw: IW-OPD's weight per token, 1 + g (1 - the share of its row's summed |reward| before "
                        "it): the early tokens weigh more")
    g.add_argument("--iw_gamma", type=float, default=IW_GAMMA, help="IW-OPD's gain g >= 0")


def opd_signal(args: argparse.Namespace) -> dict:
    """The variant flags by trainer/losses/divergences.py's Divergence field names."""
    return dict(reward=args.opd_reward, power_alpha=args.power_alpha, position_weight=args.position_weight,
                iw_gamma=args.iw_gamma)


def opd_signal_rules(args: argparse.Namespace, applies: bool, needs: str) -> list[tuple[bool, str]]:
    """`applies`: the run has a sampled-token signal; `needs`: what to pass to have one."""
    a = args
    return [
        (not a.power_alpha > 0, f"--power_alpha must be > 0, got {a.power_alpha}"),
        (a.iw_gamma < 0, f"--iw_gamma must be >= 0, got {a.iw_gamma}"),
        (a.power_alpha != POWER_ALPHA and a.opd_reward != "power",
         f"--power_alpha is PowerOPD's exponent: add --opd_reward power (got --opd_reward {a.opd_reward})"),
        (a.iw_gamma != IW_GAMMA and a.position_weight != "iw",
         f"--iw_gamma is IW-OPD's gain: add --position_weight iw (got --position_weight {a.position_weight})"),
        ((a.opd_reward != "log_ratio" or a.position_weight != "none") and not applies,
         f"--opd_reward {a.opd_reward} / --position_weight {a.position_weight} change the sampled-token OPD "
         f"signal, which this run does not have: add {needs}"),
    ]
