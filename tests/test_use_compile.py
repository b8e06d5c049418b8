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


def train_forward(model, length: int) -> None:
    ids = torch.randint(0, 1000, (2, length), generator=torch.Generator().manual_seed(length))
    model(ids).logits.float().square().mean().backward()


@pytest.fixture
def compiled_model():
    """An 8-layer model (as many layers as dynamo's recompile limit) whose layers are compiled with a counting
    backend: the counter's frame_count is how many graphs the layers' training path has compiled."""
    from torch._dynamo.testing import CompileCounter
    from model import Qwen3Config, create_model
    torch._dynamo.reset()
    config = Qwen3Config(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model, counter = create_model(config, seed=0).train(), CompileCounter()
    model.compile_layers(backend=counter)
    yield model, counter
    torch._dynamo.reset()


def rollout(model, decoder) -> None:
    from model.generate import generate
    ids = torch.randint(0, 1000, (2, 5), generator=torch.Generator().manual_seed(0))
    generate(model.eval(), ids, None, max_new_tokens=8, do_sample=False, decoder=decoder)
    model.train()


def assert_training_still_compiles(model, counter) -> None:
    """Training forwards at two lengths no forward had before: the training path compiles them (one graph more, the
    new length marked dynamic) and stays under the recompile limit, past which dynamo runs every frame eager."""
    before = counter.frame_count
    train_forward(model, 13)
    train_forward(model, 17)
    assert before < counter.frame_count < torch._dynamo.config.recompile_limit


def test_compiled_layers_keep_compiling_the_training_path_after_a_rollout(compiled_model, one_thread):
    """The rollouts of OPD, RL and logit-free OPD (and every held-out evaluation) decode through the layers with a KV
    cache; compiled, each layer's cache index would be a graph of its own, the recompile limit reached within one
    rollout, and the training forwards after it eager. The cache path is not compiled: one rollout compiles nothing."""
    model, counter = compiled_model
    train_forward(model, 9)
    assert counter.frame_count == 1  # one graph serves every layer
    rollout(model, None)
    assert counter.frame_count == 1
    assert_training_still_compiles(model, counter)


def test_a_compiled_decode_step_beside_compiled_layers_leaves_their_training_path_compiling(
        compiled_model, monkeypatch, one_thread):
    """--decode compiled with --use_compile 1: the decode step's own graph (here dynamo's eager backend instead of
    inductor's reduce-overhead) traces the layers' cache path; the layers' training graphs are left as they were."""
    from model.generate import Decoder
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda function, **options: compile_(function, backend="eager",
                                                                            fullgraph=options.get("fullgraph", False)))
    decoder = Decoder(compiled=True)
    monkeypatch.setattr(torch, "compile", compile_)
    model, counter = compiled_model
    train_forward(model, 9)
    rollout(model, decoder)
    rollout(model, decoder)
    assert counter.frame_count == 1
    assert_training_still_compiles(model, counter)
