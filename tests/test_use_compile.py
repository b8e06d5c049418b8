# python -m pytest tests/test_use_compile.py
"""--use_compile {auto,0,1}: auto compiles the decoder layers on CUDA and not on a CPU, resolved before the run records
its flags (a resume compares the values the runs used); a CPU run with the default flags compiles nothing, and
`--use_compile 1` on a CPU still compiles each layer with torch.compile's defaults (inductor), saying so on the
console. The compiled layers' numerics: tests/test_model.py (test_torch_compile_matches_eager) and the slow recipe
tests (tests/test_cpu_recipe.py, tests/test_train_opd.py)."""
import os

import pytest
import torch
from torch._dynamo.utils import counters

from loop_helpers import loop_args
from model.qwen3 import default_compile
from trainer.config.flags import resolve_use_compile
from trainer.train_sft import main as train_sft

COMPILE_LINE = "decoder layers compiled (--use_compile)"


@pytest.mark.parametrize("choice, device, expected", [
    ("auto", "cuda", 1), ("auto", "cuda:1", 1), ("auto", "cpu", 0),
    ("0", "cuda", 0), ("1", "cuda", 1), ("0", "cpu", 0), ("1", "cpu", 1)])
def test_auto_compiles_on_cuda_only_and_explicit_values_are_kept(choice, device, expected):
    assert resolve_use_compile(choice, device) == expected
    assert default_compile(torch.device(device).type) == (1 if device.startswith("cuda") else 0)


def recorded_use_compile(save_dir) -> int:
    """--use_compile as the run's resume file recorded it."""
    checkpoint = torch.load(os.path.join(str(save_dir), "run_resume.pt"), map_location="cpu", weights_only=False)
    return checkpoint["args"]["use_compile"]


def captured_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_a_cpu_run_with_the_default_flags_compiles_nothing(tiny_config_path, chat_jsonl, tmp_path, capsys,
                                                           one_thread):
    before = captured_graphs()
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, batch=2, max_steps=1))
    assert captured_graphs() == before
    assert COMPILE_LINE not in capsys.readouterr().out
    assert recorded_use_compile(tmp_path) == 0  # auto, resolved: what a resume compares


def test_use_compile_1_on_a_cpu_compiles_each_layer_with_torch_compiles_defaults(tiny_config_path, chat_jsonl,
                                                                                 tmp_path, capsys, compile_calls,
                                                                                 one_thread):
    """Each layer goes to torch.compile with no option: its default backend, inductor. Here the layers are then
    compiled with the eager backend instead (dynamo's tracing without inductor's code generation, ~1 min on this
    machine: the slow test below runs it)."""
    before = captured_graphs()
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, batch=2, max_steps=1, use_compile=1))
    assert compile_calls == [{}, {}]  # the tiny model's 2 layers
    assert captured_graphs() > before
    assert COMPILE_LINE in capsys.readouterr().out
    assert recorded_use_compile(tmp_path) == 1


@pytest.mark.slow
def test_use_compile_1_on_a_cpu_compiles_through_inductor(tiny_config_path, chat_jsonl, tmp_path, one_thread):
    # fxgraph_cache_*: inductor's cache of compiled graphs looked up once per graph it compiles (hit or miss)
    def inductor_graphs() -> int:
        return sum(n for key, n in counters["inductor"].items() if key.startswith("fxgraph_cache_"))
    before = inductor_graphs()
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, batch=2, max_steps=1, use_compile=1))
    assert inductor_graphs() > before
