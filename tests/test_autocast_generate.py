# Run: python -m pytest tests/test_autocast_generate.py
"""Generation under the CUDA recipe, on the CPU: a fp32 student under torch.autocast("cpu", bf16) (what OPD's
rollouts and the held-out evaluation run with --dtype bfloat16) and a teacher stored in bf16, with the eager decode
step and the compiled one. Each must run (the eager step's cache write once raised on the keys' fp32 against the
cache's bf16), give greedy tokens equal to fp32's up to the first position where fp32's own top-2 margin is below
MARGIN (there a bf16 rounding may legitimately choose the other token), and log-probabilities of its completions,
teacher-forced, within the bf16 tolerance of fp32's."""
import pytest
import torch

from model.generate import Decoder, generate
from test_generate import models, prompts  # noqa: F401  (the module fixture: HF-saved random weights, ours loaded)

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 12
MARGIN = 0.05  # logits: below it, bf16's rounding of a logit (~0.4% of |logit|, here up to ~0.02) can swap the two
# teacher-forced log-probs of the same tokens, bf16 autocast (or bf16 weights) against fp32, on these weights (logits
# of std ~1): measured max 0.026 / mean 0.0057 (fp32 student under autocast) and 0.025 / 0.0094 (bf16 teacher), eager
# and compiled alike; the bounds leave 2-4x for another CPU's kernels
MAX_LOGPROB_DIFF, MEAN_LOGPROB_DIFF = 0.1, 0.02


def bf16_copy(model):
    teacher = type(model)(model.config)
    teacher.load_state_dict(model.state_dict())
    return teacher.to(torch.bfloat16).eval()


def completion_logprobs(model, sequences: torch.Tensor, mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """(B, R) log-probabilities of each completion token under `model`, in one forward over prompt + completion."""
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, prompt_len:])], dim=1)
    with torch.no_grad():
        logits = model(sequences, attention_mask=full_mask).logits[:, prompt_len - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)


def top2_margins(model, sequences: torch.Tensor, mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """(B, R) fp32 logit gap between the best and the second-best token at each completion position."""
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, prompt_len:])], dim=1)
    with torch.no_grad():
        logits = model(sequences, attention_mask=full_mask).logits[:, prompt_len - 1:-1].float()
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def assert_equal_until_a_close_call(tokens: torch.Tensor, reference: torch.Tensor, margins: torch.Tensor) -> None:
    """Each row's tokens equal the reference's up to its first position whose reference margin is below MARGIN."""
    for row in range(len(tokens)):
        close = (margins[row] < MARGIN).nonzero()
        agree_until = int(close[0]) if len(close) else tokens.shape[1]
        assert torch.equal(tokens[row, :agree_until], reference[row, :agree_until]), \
            f"row {row} differs before position {agree_until}, where the reference's margin is >= {MARGIN}"


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("stored", ["fp32 student", "bf16 teacher"])
def test_greedy_under_bf16_autocast_follows_fp32_within_rounding(models, stored, compiled):
    _, fp32 = models
    model = fp32 if stored == "fp32 student" else bf16_copy(fp32)
    ids, mask = prompts()
    P = ids.shape[1]
    reference = generate(fp32, ids, mask, NEW_TOKENS, do_sample=False).sequences
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(model, ids, mask, NEW_TOKENS, do_sample=False, decoder=Decoder(compiled=compiled))
    assert out.completion_ids.shape == (len(ids), NEW_TOKENS)

    assert_equal_until_a_close_call(out.completion_ids, reference[:, P:], top2_margins(fp32, reference, mask, P))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = completion_logprobs(model, out.sequences, mask, P)
    high = completion_logprobs(fp32, out.sequences, mask, P)
    diff = (low - high).abs()
    assert diff.max() < MAX_LOGPROB_DIFF and diff.mean() < MEAN_LOGPROB_DIFF, (diff.max(), diff.mean())


@pytest.mark.slow
def test_the_compiled_step_under_autocast_reads_bf16_weights_refreshed_once_per_rollout(models):
    """The compiled step runs a twin whose linear weights are bf16 copies, made once per rollout at fixed addresses
    (a compiled graph would otherwise cast every fp32 weight at every token): its tokens are eager autocast's (up to
    a close call: inductor's fused kernels round differently), and after the weights change (a training step) the
    next rollout decodes with the new ones, at the same addresses."""
    _, fp32 = models
    model = bf16_copy(fp32).float()  # a model of its own: this test changes its weights
    ids, mask = prompts()
    decoder = Decoder(compiled=True)
    for change in (None, 1.05):
        if change:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.mul_(change)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            compiled = generate(model, ids, mask, NEW_TOKENS, do_sample=False, decoder=decoder).completion_ids
            eager = generate(model, ids, mask, NEW_TOKENS, do_sample=False).sequences
        P = ids.shape[1]
        assert_equal_until_a_close_call(compiled, eager[:, P:], top2_margins(model, eager, mask, P))
        twin = decoder.twins["model"][0]
        if change is None:
            first, addresses = twin, [p.data_ptr() for p in twin.parameters()]
        assert twin is first and [p.data_ptr() for p in twin.parameters()] == addresses
        linears = [(a, b) for a, b in zip(twin.modules(), model.modules()) if isinstance(b, torch.nn.Linear)]
        assert all(torch.equal(a.weight, b.weight.to(torch.bfloat16)) for a, b in linears)
        assert twin.model.embed_tokens.weight is model.model.embed_tokens.weight  # fp32, shared, as autocast reads it
