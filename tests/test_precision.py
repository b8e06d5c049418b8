# Run: python -m pytest tests/test_precision.py
"""The precision rule (model/precision.py), one for every device: --dtype auto, the CPU running CUDA's recipe when
asked (fp32 masters under CPU autocast, fp16 with the CPU GradScaler), the teacher's dtype, fp16's skipped steps
counted and said, a non-finite loss stopping the run under the scaler too, a teacher computing in its own dtype,
and a resume that would change the dtype the run computes in refused."""
import math

import pytest
import torch

from common.errors import FlagError, RuntimeFailure, UserError
from loop_helpers import loop_args, metrics
from model.precision import cache_dtype, resolve_precision
from trainer.skeleton.resume_checks import trained_dtype
from trainer.train_sft import main as train_sft

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("device, dtype, compute, teacher, scaled", [
    ("cpu", "auto", torch.float32, torch.float32, False),
    ("cpu", "bfloat16", torch.bfloat16, torch.bfloat16, False),
    ("cpu", "float16", torch.float16, torch.bfloat16, True),   # the teacher in bf16: fp16 may overflow a real Qwen3
    ("cuda:1", "auto", torch.bfloat16, torch.bfloat16, False),
    ("cuda", "float32", torch.float32, torch.float32, False),
])
def test_the_rule_is_the_same_for_every_device(device, dtype, compute, teacher, scaled):
    precision = resolve_precision(device, dtype)
    assert (precision.compute, precision.teacher, precision.scaled) == (compute, teacher, scaled)
    assert precision.master == torch.float32
    assert precision.device_type == torch.device(device).type
    if precision.device_type == "cpu":  # a CUDA GradScaler on a machine without CUDA disables itself
        assert precision.scaler().is_enabled() == scaled


def test_a_teacher_dtype_flag_overrides_the_rule():
    assert resolve_precision("cpu", "float16", "float32").teacher == torch.float32
    assert resolve_precision("cpu", "bfloat16", "float32").teacher == torch.float32
    assert resolve_precision("cpu", "float16", "auto").teacher == torch.bfloat16


def test_the_cpu_autocast_is_cpus_and_the_cache_takes_its_dtype(tiny_config_path):
    from model import Qwen3Config, create_model
    model = create_model(Qwen3Config.from_json(tiny_config_path), seed=0)
    assert cache_dtype(model, torch.device("cpu")) == torch.float32
    with resolve_precision("cpu", "bfloat16").autocast():
        assert torch.is_autocast_enabled("cpu")
        assert cache_dtype(model, torch.device("cpu")) == torch.bfloat16
    with resolve_precision("cpu", "auto").autocast():
        assert not torch.is_autocast_enabled("cpu")


def test_a_teacher_computes_in_its_own_dtype_inside_the_students_autocast(tiny_config_path):
    """--dtype float16 loads the teacher in bf16 for bf16's range: its forwards must not then be lowered to fp16 by
    the student's autocast. A teacher whose first MLP's activations reach ~1e6 (real Qwen3s have such outliers) is
    finite under its own context and NaN under the student's fp16 one; --teacher_dtype float32 computes in fp32."""
    from model import Qwen3Config, create_model
    teacher = create_model(Qwen3Config.from_json(tiny_config_path), seed=0)
    with torch.no_grad():
        teacher.model.layers[0].post_attention_layernorm.weight.fill_(3000.0)
    ids = torch.arange(100, 110)[None]
    precision = resolve_precision("cpu", "float16")
    with torch.no_grad(), precision.autocast():
        bf16 = teacher.to(precision.teacher)
        with precision.teacher_autocast():
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert torch.isfinite(bf16(ids).logits).all()
        assert not torch.isfinite(bf16(ids).logits).all()  # the student's fp16: what the teacher must not get
        with resolve_precision("cpu", "float16", "float32").teacher_autocast():
            assert not torch.is_autocast_enabled("cpu")
    with resolve_precision("cpu", "bfloat16").teacher_autocast():  # a teacher in the forwards' dtype: theirs
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_fsdp_with_fp16_is_refused_on_the_cpu_as_on_cuda(tiny_config_path, chat_jsonl, tmp_path):
    with pytest.raises(FlagError, match="--fsdp 1 with --dtype float16"):
        train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, fsdp=1, dtype="float16", max_steps=1))
    assert not (tmp_path / "run").exists()


def test_fp16_skipped_steps_are_counted_and_said(tiny_config_path, chat_jsonl, tmp_path, monkeypatch, capsys):
    """A loss scale so large that the scaled gradients overflow fp16: GradScaler skips the step and halves the
    scale; the run counts each skipped step in its metrics and says it on the console, and the weights do not move
    on a skipped step."""
    from model.precision import Precision
    monkeypatch.setattr(Precision, "scaler", lambda self: torch.amp.GradScaler("cpu", init_scale=2.0 ** 120,
                                                                               enabled=self.scaled))
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, dtype="float16", max_steps=2))
    logged = metrics(tmp_path)
    assert [m["skipped_steps"] for m in logged] == [1, 2]
    assert all(math.isfinite(m["loss"]) and not math.isfinite(m["grad_norm"]) for m in logged)
    out = capsys.readouterr().out
    assert "step 1: fp16 gradients overflowed, the update was skipped and the loss scale lowered to" in out
    assert "(2 skipped in this run)" in out


def test_a_non_finite_loss_stops_an_fp16_run_too(tiny_config_path, chat_jsonl, tmp_path, monkeypatch):
    """Under the scaler a NaN gradient only skips the step: a NaN loss (the data's or the model's, never fp16's
    range: the loss is summed in fp32) would then skip every step silently. It stops the run instead."""
    import trainer.train_sft as sft
    original = sft.fused_cross_entropy

    def nan_loss(*args, **kwargs):
        loss_sum, num_tokens = original(*args, **kwargs)
        return loss_sum * float("nan"), num_tokens
    monkeypatch.setattr(sft, "fused_cross_entropy", nan_loss)
    with pytest.raises(RuntimeFailure, match="non-finite loss"):
        train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, dtype="float16", max_steps=2))


def test_a_resume_that_changes_the_computed_dtype_is_refused(tiny_config_path, chat_jsonl, tmp_path):
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=1))  # auto on a CPU: fp32
    with pytest.raises(UserError, match="--dtype 'float32' -> 'bfloat16'"):
        train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=2, dtype="bfloat16", from_resume=1,
                            resume_changes="max_steps"))
    # the same computation spelled another way is no change
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=2, dtype="float32", from_resume=1,
                        resume_changes="max_steps"))
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2]


def test_a_checkpoint_from_before_the_rule_reads_as_what_it_computed():
    """Files written when the CPU ignored --dtype record no dtype: their CPU runs computed in fp32."""
    assert trained_dtype({"args": {"device": "cpu", "dtype": "bfloat16"}}) == "float32"
    assert trained_dtype({"args": {"device": "cuda", "dtype": "bfloat16"}}) == "bfloat16"
    assert trained_dtype({"dtype": "float16", "args": {"device": "cpu", "dtype": "float16"}}) == "float16"
