"""TRL 1.16.0's own GRPO numbers for tensors saved by tests/test_rl_reference.py. Runs inside the TRL venv, never in
the repo's environment:

    ~/.cache/distill/trl-venv/bin/python tests/trl_grpo_probe.py IN.pt OUT.pt

GRPOTrainer.__init__ needs a model, a tokenizer and a dataset, so the trainer is made with `GRPOTrainer.__new__` and
given only the attributes that the two methods called read, taken from a real GRPOConfig (TRL's defaults for the
rest). Per case, TRL's real methods run:
    _generate_and_score_completions  rewards -> advantages (group mean, nanstd, scale_rewards, + 1e-4), the completion
                                     mask from its right padding, num_items_in_batch, and, generation and optimisation
                                     aligned, old_per_token_logps None (on-policy)
    _compute_loss                    the clipped ratio, beta * k3 (times the ratio with use_bias_correction_kl), the
                                     dapo / dr_grpo normalisation, and its metrics
Three methods are replaced: `_generate` and `_calculate_rewards` hand back the saved completions and rewards, and
`_get_per_token_logps_and_entropies` the saved reference log-probs or the policy's, from the saved logits through
TRL's selective_log_softmax and entropy_from_logits (in place of the model's fused LM head). An off-policy case puts
the saved old log-probs into the inputs, as the misaligned path of _generate_and_score_completions would.
Saved per case: advantages, loss, the loss's gradient w.r.t. the logits, and TRL's logged kl / entropy / clip means.
"""
import sys
import tempfile
from collections import defaultdict, deque

import torch
from accelerate import Accelerator
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import entropy_from_logits, selective_log_softmax


class Policy(torch.nn.Module):
    """Stands in for the model: _generate_and_score_completions reads `training` and `is_gradient_checkpointing`."""
    is_gradient_checkpointing = False


def make_trainer(data: dict, case: dict, out_dir: str) -> GRPOTrainer:
    n = data["rewards"].numel()
    args = GRPOConfig(output_dir=out_dir, use_cpu=True, report_to="none", per_device_train_batch_size=n,
                      num_generations=data["group_size"], max_completion_length=data["max_completion_length"],
                      temperature=data["temperature"], epsilon=data["epsilon"], epsilon_high=data["epsilon_high"],
                      beta=data["beta"], loss_type=case["loss_type"], scale_rewards=case["scale_rewards"],
                      use_bias_correction_kl=case["use_bias_correction_kl"])
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    # the attributes GRPOTrainer.__init__ sets from args, for those the two methods read
    for name in ("loss_type", "scale_rewards", "beta", "num_generations", "max_completion_length", "temperature",
                 "importance_sampling_level", "off_policy_mask_threshold", "top_entropy_quantile",
                 "mask_truncated_completions", "multi_objective_aggregation", "pad_to_multiple_of", "use_vllm",
                 "vllm_importance_sampling_correction", "log_multimodal", "num_iterations"):
        setattr(trainer, name, getattr(args, name))
    trainer.args = args
    trainer.epsilon_low, trainer.epsilon_high = args.epsilon, args.epsilon_high
    trainer.accelerator = Accelerator(cpu=True)
    trainer.model, trainer.ref_model = Policy(), Policy()
    trainer._tokenizer = type("Tokenizer", (), {"pad_token_id": 0})()
    trainer.environment_factories = trainer.environments = None
    trainer.tools = []
    trainer.reward_weights, trainer.reward_func_names = torch.ones(1), ["saved"]
    trainer.aux_loss_enabled = trainer._entropy_bonus_enabled = False
    trainer.current_gradient_accumulation_steps = 1
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._logs = defaultdict(deque, rewards=defaultdict(deque), extra=defaultdict(deque))
    trainer._pending_extra_logs, trainer._pending_metrics = defaultdict(list), defaultdict(list)
    return trainer


def patch_io(trainer: GRPOTrainer, data: dict, logits: torch.Tensor) -> None:
    lengths = data["completion_lengths"]
    completions = [data["completion_ids"][i, :length].tolist() for i, length in enumerate(lengths)]
    trainer._generate = lambda prompts: ([[1]] * len(prompts), completions, None, ["c"] * len(prompts), None, {},
                                         None, None)
    trainer._calculate_rewards = lambda *_: data["rewards"].float().unsqueeze(1)

    def logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **_):
        if model is trainer.ref_model:
            return data["ref_logp"], None, None
        labels = input_ids[:, -logits_to_keep:]
        entropy = entropy_from_logits(logits / data["temperature"]) if compute_entropy else None
        return selective_log_softmax(logits, labels, data["temperature"]), entropy, None
    trainer._get_per_token_logps_and_entropies = logps_and_entropies


def run_case(data: dict, case: dict, out_dir: str) -> dict:
    trainer = make_trainer(data, case, out_dir)
    logits = data["logits"].clone().requires_grad_(True)
    patch_io(trainer, data, logits)
    inputs = trainer._generate_and_score_completions([{"prompt": "p"}] * data["rewards"].numel())
    on_policy = "old_per_token_logps" not in inputs
    if not case["on_policy"]:
        inputs["old_per_token_logps"] = data["old_logp"]
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = trainer._metrics["train"]
    return {"advantages": inputs["advantages"], "completion_mask": inputs["completion_mask"],
            "num_items_in_batch": inputs["num_items_in_batch"], "trl_on_policy": on_policy,
            "loss": loss.detach(), "grad": logits.grad, "kl": metrics["kl"][-1] if data["beta"] else 0.0,
            "entropy": metrics["entropy"][-1], "clip_low": metrics["clip_ratio/low_mean"][-1],
            "clip_high": metrics["clip_ratio/high_mean"][-1], "clip_region": metrics["clip_ratio/region_mean"][-1]}


def main(in_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    data = torch.load(in_path)
    with tempfile.TemporaryDirectory() as out_dir:
        results = {case["name"]: run_case(data, case, out_dir) for case in data["cases"]}
    torch.save(results, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
