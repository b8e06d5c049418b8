# python -m pytest tests/test_fsdp.py
"""--fsdp 1 (FSDP2 + sharded DCP checkpoints) on CPU with gloo: 2 sharded ranks train as one process does, a killed
sharded run resumes bit-identically, a sharded checkpoint resumes at another world size, the HF export is the
whole model, two "nodes" (two torchrun launches on 127.0.0.1) train as one process, and OPD, RL, PPO (its critic
sharded too) and logit-free OPD with a sharded student sample on a real vLLM server."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from loop_helpers import (assert_one_line_error, checkpoint_step, env_one_thread, kill_after_first_checkpoint,
                          loop_args, max_weight_diff, metrics, run_command, script_exit, torchrun_command, weights)
from ppo_length_reward import main as train_ppo_varied
from model import Qwen3Config, create_model, load_pretrained, save_pretrained
from model.checkpoint_io import hf_weights
from support import ROOT, SERVED_CONFIG, TINY_CONFIG, write_chat_jsonl
from trainer.skeleton.sharding import load_shards
from trainer.train_distillation import main as train_distillation
from trainer.train_logit_free import main as train_logit_free
from trainer.train_opd import main as train_opd
from trainer.train_rl import main as train_rl
from trainer.train_sft import main as train_sft
from vllm_servers import free_port
from torch.distributed.checkpoint import FileSystemReader

LORA = {"lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-3}  # as tests/test_loop_invariants.py's LoRA loops

pytestmark = pytest.mark.usefixtures("one_thread")
SFT = os.path.join(ROOT, "trainer", "train_sft.py")
KD = os.path.join(ROOT, "trainer", "train_distillation.py")
OPD = os.path.join(ROOT, "trainer", "train_opd.py")
RL = os.path.join(ROOT, "trainer", "train_rl.py")
LOGIT_FREE = os.path.join(ROOT, "trainer", "train_logit_free.py")
PPO = os.path.join(ROOT, "tests", "ppo_length_reward.py")  # train_ppo.py with a reward a random model can earn


@pytest.fixture
def teacher_dir(tiny_config_path, tmp_path):
    save_pretrained(create_model(Qwen3Config.from_json(tiny_config_path), seed=123), str(tmp_path / "teacher"))
    return str(tmp_path / "teacher")


def sharded_args(config, data, save_dir, **flags) -> list[str]:
    return loop_args(config, data, save_dir, fsdp=1, **flags)


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.parametrize("loop", ["sft", "kd", "sft_lora"])
def test_two_sharded_ranks_train_as_one_process(loop, tiny_config_path, chat_jsonl, teacher_dir, tmp_path):
    """sft_lora: the adapters sharded with their base, and only they in the shard folder and the optimizer."""
    script, main = {"sft": (SFT, train_sft), "kd": (KD, train_distillation), "sft_lora": (SFT, train_sft)}[loop]
    extra = {"teacher_path": teacher_dir, "alpha": 0.3, "temperature": 2.0} if loop == "kd" else {}
    if loop == "sft_lora":
        extra.update(LORA)
    # with the held-out evaluation: every sharded rank evaluates in step, rank 0 logs the numbers of one process
    extra.update(eval_interval=3, eval_rows=4, eval_max_new_tokens=8)
    extra.update(export_steps="1,3")  # a snapshot's export gathers the shards as the run's own save does
    main(loop_args(tiny_config_path, chat_jsonl, tmp_path / "one", batch=2, accumulation=2, max_steps=3, **extra))
    run_command(torchrun_command(script, sharded_args(tiny_config_path, chat_jsonl, tmp_path / "two", batch=2,
                                                      max_steps=3, **extra)))
    assert max_weight_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) <= 1e-5
    for snapshot in ("run_step1", "run_step3"):
        assert max_weight_diff(weights(tmp_path / "one", snapshot), weights(tmp_path / "two", snapshot)) <= 1e-5
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    evals = [[m for m in run if "eval/accuracy" in m] for run in (one, two)]
    assert [m["step"] for m in evals[1]] == [0, 3]
    assert [m["eval/completion_len"] for m in evals[0]] == [m["eval/completion_len"] for m in evals[1]]
    if loop == "kd":
        assert [m["eval/reverse_kl"] for m in evals[0]] == pytest.approx([m["eval/reverse_kl"] for m in evals[1]],
                                                                          abs=1e-5)
    one, two = [m for m in one if "loss" in m], [m for m in two if "loss" in m]
    assert [m["loss"] for m in one] == pytest.approx([m["loss"] for m in two], abs=1e-5)
    assert [m["grad_norm"] for m in one] == pytest.approx([m["grad_norm"] for m in two], rel=1e-5)
    # the resume file names the shard folder; nothing else is left beside it (a LoRA run: each export's adapter)
    adapters = loop == "sft_lora"
    files = sorted(f for f in os.listdir(tmp_path / "two") if not f.endswith("_adapter") or not adapters)
    assert files[:3] == ["run", "run_metrics.jsonl", "run_resume.pt"]
    assert files[-2:] == ["run_step1", "run_step3"]
    assert adapters == all(os.path.isdir(tmp_path / "two" / f"{name}_adapter") for name in ("run", "run_step1",
                                                                                           "run_step3"))
    shards = [f for f in os.listdir(tmp_path / "two") if ".shards-" in f]
    assert len(shards) == 1
    if adapters:  # the model's part of the shard folder: the adapters alone, as their AdamW state
        saved = FileSystemReader(str(tmp_path / "two" / shards[0])).read_metadata().state_dict_metadata
        assert {key.split(".", 1)[0] for key in saved} == {"model", "optimizer"}
        assert all(".lora_" in key for key in saved if key.startswith(("model.", "optimizer.state.")))


@pytest.mark.serial
@pytest.mark.slow
def test_two_sharded_ranks_packed_train_as_one_padded_process(tiny_config_path, chat_jsonl, tmp_path):
    """--packing 1 on 2 FSDP ranks against one process with the padded batch: the same weights and numbers."""
    main_flags = dict(batch=2, max_steps=2)
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path / "one", accumulation=2, **main_flags))
    run_command(torchrun_command(SFT, sharded_args(tiny_config_path, chat_jsonl, tmp_path / "two", packing=1,
                                                   **main_flags)))
    assert max_weight_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) <= 1e-5
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["loss"] for m in one] == pytest.approx([m["loss"] for m in two], abs=1e-5)
    assert [m["grad_norm"] for m in one] == pytest.approx([m["grad_norm"] for m in two], rel=1e-5)


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory) -> dict:
    """24 rows, global batch 8 (batch 2 x accumulation 4 / ranks): 3 steps, a checkpoint each. The uninterrupted run
    in one process (what a resume at another world size must reach) and on 2 sharded ranks (what a resume at 2
    equals bit for bit), and the run SIGKILLed after its first checkpoint at 1 and at 2 ranks (each test resumes a
    copy of one) -> {name: its folder}, and the config and data the commands read."""
    folder = tmp_path_factory.mktemp("killed_runs")
    config = folder / "tiny.json"
    config.write_text(json.dumps(TINY_CONFIG))
    data = write_chat_jsonl(folder / "long.jsonl", 24, seed=1)
    runs = {"full_1": folder / "full_1", "full_2": folder / "full_2", "killed_1": folder / "killed_1",
            "killed_2": folder / "killed_2"}
    run_command(sharded_command(str(config), data, runs["full_1"], 1))
    run_command(sharded_command(str(config), data, runs["full_2"], 2))
    for ranks in (1, 2):
        killed = runs[f"killed_{ranks}"]
        kill_after_first_checkpoint(sharded_command(str(config), data, killed, ranks), str(killed / "run_resume.pt"))
        assert checkpoint_step(killed / "run_resume.pt") < 3, "the run finished before it could be killed"
    return {**runs, "config": str(config), "data": data}


def sharded_command(config: str, data: str, save_dir, ranks: int, **flags) -> list[str]:
    args = sharded_args(config, data, save_dir, batch=2, accumulation=4 // ranks, save_interval=1, **flags)
    return torchrun_command(SFT, args, nproc=ranks) if ranks > 1 else [sys.executable, SFT, *args]


def resumed(killed_runs: dict, killed: str, ranks: int, save_dir) -> dict[str, torch.Tensor]:
    """A copy of the killed run `killed`, resumed at `ranks` -> its final weights."""
    shutil.copytree(killed_runs[killed], save_dir)
    run_command(sharded_command(killed_runs["config"], killed_runs["data"], save_dir, ranks, from_resume=1))
    return weights(save_dir)


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.xdist_group("fsdp_killed_runs")  # under -n 2: the runs made once, on one worker
def test_a_killed_sharded_run_resumes_bit_identically(killed_runs, tmp_path):
    full, resumed_2 = weights(killed_runs["full_2"]), resumed(killed_runs, "killed_2", 2, tmp_path / "killed")
    assert all(torch.equal(full[k], resumed_2[k]) for k in full)


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.xdist_group("fsdp_killed_runs")
@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_a_sharded_checkpoint_resumes_at_another_world_size(first, then, killed_runs, tmp_path):
    """Killed after its first checkpoint at `first` ranks, resumed at `then`: the one-process run's weights."""
    assert max_weight_diff(weights(killed_runs["full_1"]),
                           resumed(killed_runs, f"killed_{first}", then, tmp_path / "ws")) <= 1e-5


@pytest.mark.serial
@pytest.mark.slow
def test_the_export_of_a_sharded_run_is_the_whole_model(tiny_config_path, chat_jsonl, tmp_path):
    run_command(torchrun_command(SFT, sharded_args(tiny_config_path, chat_jsonl, tmp_path, batch=2, max_steps=2)))
    exported = load_file(tmp_path / "run" / "model.safetensors")
    # the shards the resume file names, read whole by one process: the export holds exactly those weights
    model = create_model(Qwen3Config.from_json(tiny_config_path))
    optimizer = torch.optim.AdamW(model.parameters())
    checkpoint = torch.load(tmp_path / "run_resume.pt", weights_only=False)
    load_shards(str(tmp_path / checkpoint["shards"]), model, optimizer)
    # under HF's names and in HF's shapes (q/k/v and gate/up apart), the tied head once
    whole = {name: block.tensor[block.rows.start:block.rows.stop] for name, block in hf_weights(model).items()}
    assert exported.keys() == whole.keys() and all(torch.equal(exported[k], whole[k]) for k in whole)
    # and transformers reads it with our logits
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "run"), torch_dtype=torch.float32)
    ids = torch.tensor([[151644, 872, 198, 9707, 11, 1879]])
    ours = load_pretrained(str(tmp_path / "run"))
    with torch.no_grad():
        assert torch.allclose(theirs(ids).logits, ours(ids).logits, atol=1e-5)


@pytest.mark.serial
@pytest.mark.slow
def test_two_nodes_train_as_one_process(tiny_config_path, chat_jsonl, tmp_path):
    """Two torchrun launches, --nnodes 2 with a c10d rendezvous on 127.0.0.1: what docs/fsdp.md shows for two
    machines (with the first machine's address), each "node" one rank."""
    main_args = loop_args(tiny_config_path, chat_jsonl, tmp_path / "one", batch=2, accumulation=2, max_steps=3)
    train_sft(main_args)
    args = sharded_args(tiny_config_path, chat_jsonl, tmp_path / "nodes", batch=2, max_steps=3)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--node_rank", str(rank), "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
                               "--rdzv_id", "fsdp-test", SFT, *args],
                              env=env_one_thread(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=400)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert max_weight_diff(weights(tmp_path / "one"), weights(tmp_path / "nodes")) <= 1e-5


def test_opd_with_a_sharded_student_needs_a_rollout_server(tiny_config_path, chat_jsonl, teacher_dir, tmp_path,
                                                           capsys):
    code, stderr = script_exit(train_opd, loop_args(tiny_config_path, chat_jsonl, tmp_path, fsdp=1,
                                                    teacher_path=teacher_dir), capsys)
    assert_one_line_error(code, stderr, 2, "--fsdp 1", "--rollout_url")


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.parametrize("loop", ["opd", "opd_self", "rl", "logit_free", "rl_lora", "rl_epochs"])
def test_a_sharded_student_samples_on_the_rollout_server(loop, vllm_servers, black_box_stub, tmp_path):
    """A sharded student cannot decode on its own (every rank holds a part of every layer): it samples on the
    rollout server, rank 0 pushing the weights gathered from the shards; the sharded frozen models (OPD's teacher,
    RL's reference and teacher, the logit-free anchor's reference) score on all ranks; the student's head is read
    where the forward has gathered it. 2 sharded ranks train as one process does. rl_lora: a LoRA student, its
    adapters sharded with its base, the merged weights pushed (each adapter gathered whole, small), its reference
    its own base. opd_self: self-distillation, the live student its own teacher (its sharded forward without
    gradients on the privileged prompts, then the student's own; the head both read is the one gathered).
    rl_epochs: RL's rollouts one step stale and corrected (TIS), trained in 2 epochs of 2 minibatches with CISPO:
    log pi_old by a sharded forward without gradients, an update per minibatch, the sampler gap's maximum over
    ranks."""
    config = tmp_path / "served_config.json"
    config.write_text(json.dumps(SERVED_CONFIG))
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16)
    script, main, own = {
        "opd": (OPD, train_opd, dict(teacher_path=vllm_servers.teacher_dir)),
        "opd_self": (OPD, train_opd, dict(self_teacher="live", max_prompt_length=64,
                                          privileged_template="{question} The answer: {ground_truth}.")),
        # the OPD term with PowerOPD's reward and IW-OPD's weights (their first pass reads the gathered head too)
        "rl": (RL, train_rl, dict(num_generations=2, kl_coef=0.1, opd_coef=1.0, opd_reward="power",
                                  position_weight="iw", teacher_path=vllm_servers.teacher_dir)),
        "rl_lora": (RL, train_rl, dict(num_generations=2, kl_coef=0.1, opd_coef=1.0,
                                       teacher_path=vllm_servers.teacher_dir, **LORA)),
        "rl_epochs": (RL, train_rl, dict(num_generations=2, opd_coef=1.0, teacher_path=vllm_servers.teacher_dir,
                                         update_epochs=2, num_minibatches=2, policy_loss="cispo", max_staleness=1,
                                         rollout_correction="tis")),
        # one step: this random-init student's entropy is 11.9166 at every position, its peaks 1e-5 above the
        # mean, so after a step the weights of 2 ranks and of 2 micro-batches (rounding apart) audit other peaks
        # and sample other tokens (measured: equal after step 1, step 2's pi_hat 0.0846 vs 0.0727)
        "logit_free": (LOGIT_FREE, train_logit_free, dict(teacher_url=black_box_stub.url, chunk_len=3, audit_chunks=2,
                                                          continuations=3, anchor_beta=0.5, max_steps=1)),
    }[loop]

    def args(save_dir, **flags):
        return loop_args(str(config), data, save_dir, max_length=80, max_new_tokens=16,
                         rollout_url=vllm_servers.rollout.url, **{"max_steps": 3, **own, **flags})
    main(args(tmp_path / "one", batch=2, accumulation=2))
    run_command(torchrun_command(script, args(tmp_path / "two", batch=2, fsdp=1)))
    assert max_weight_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) <= 1e-5
    synced = [m["sync_logprob_diff"] for m in metrics(tmp_path / "two") if "sync_logprob_diff" in m]
    assert synced and all(diff < 1e-4 for diff in synced)  # stale: the last step pushes nothing, none sample after it


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sharded_ppo_resumes_policy_and_critic_from_their_own_shard_folders(lora, vllm_servers, tmp_path):
    """PPO on 2 sharded ranks, sampling on the rollout server: the critic is sharded as the student is (its forward
    without gradients frees its gathered head), and each save writes its shards into a folder of their own beside
    the student's, both named by the resume file. Killed after its first checkpoint and resumed on 2 ranks, the run
    ends where one uninterrupted process does, policy and critic; only the committed folders are left. lora:
    adapters on both, sharded with their bases (the critic's own, sharded: no sharing across FSDP units), the
    critic's head trained whole."""
    config = tmp_path / "served_config.json"
    config.write_text(json.dumps(SERVED_CONFIG))
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16)

    def args(save_dir, **flags):
        return loop_args(str(config), data, save_dir, max_length=80, max_new_tokens=16, max_steps=3, batch=2,
                         rollout_url=vllm_servers.rollout.url, kl_coef=0.1, update_epochs=2, num_minibatches=2,
                         save_interval=1, **(LORA if lora else {}), **flags)
    train_ppo_varied(args(tmp_path / "one", accumulation=2))
    two = tmp_path / "two"
    kill_after_first_checkpoint(torchrun_command(PPO, args(two, fsdp=1)), str(two / "run_resume.pt"))
    assert checkpoint_step(two / "run_resume.pt") < 3, "the run finished before it could be killed"
    run_command(torchrun_command(PPO, args(two, fsdp=1, from_resume=1)))
    one, resumed = weights(tmp_path / "one"), weights(two)
    assert any(k.startswith("critic:") for k in one) and max_weight_diff(one, resumed) <= 1e-5
    saved = torch.load(two / "run_resume.pt", weights_only=False)
    critic_shards = saved["kept"]["critic"]["shards"]
    assert critic_shards.startswith("run_resume.shards-critic-00000003-") and "model" not in saved["kept"]["critic"]
    assert sorted(f for f in os.listdir(two) if ".shards-" in f) == sorted([saved["shards"], critic_shards])


@pytest.mark.slow
def test_the_benchmark_shows_each_sharded_rank_holding_at_most_055_of_ddps_bytes(tiny_config_path):
    """Over a window of 8 micro-batches: each rank's total and its window-peak gradient bytes. FSDP2's no-sync
    accumulation (what Run did before) is measured too, and shows the counter sees the unsharded gradients."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_fsdp.py"), "--config",
                             tiny_config_path], capture_output=True, text=True, timeout=400, env=env_one_thread())
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {(cells[1].strip(), cells[2].strip()): cells for cells in
            (line.split("|") for line in result.stdout.splitlines() if line.startswith(("| 0 ", "| 1 ")))}
    for rank in "01":
        fsdp, no_sync = rows[rank, "FSDP"], rows[rank, "FSDP no-sync"]
        assert float(fsdp[-3]) <= 0.55 and float(fsdp[-2]) <= 0.55, result.stdout
        assert float(no_sync[-2]) >= 0.95, result.stdout


@pytest.mark.slow
def test_sharded_mixed_precision_computes_as_ddp_under_bf16_autocast(tiny_config_path):
    """CPU bf16 autocast, one forward + backward: with sharding.shard's policies (norms, embedding and head in their
    fp32, layer inputs not cast) FSDP's loss is DDP's and its gradient is far closer to DDP's than bf16's own error
    (fp32 against DDP); every unit gathered in bf16, as before, is not."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_fsdp.py"), "--precision",
                             "--config", tiny_config_path], capture_output=True, text=True, timeout=400,
                            env=env_one_thread())
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {cells[1].strip(): [float(c) for c in cells[2:5]] for cells in
            (line.split("|") for line in result.stdout.splitlines() if line.startswith("| fp32") or
             line.startswith("| FSDP") or line.startswith("| DDP"))}
    bf16_error = rows["fp32"][1]  # DDP's gradient against fp32's
    assert rows["FSDP"][0] <= 1e-6 and rows["FSDP"][1] <= 0.3 * bf16_error, result.stdout
    assert rows["FSDP all-bf16"][1] > 0.5 * bf16_error, result.stdout


def test_a_frozen_sharded_model_gives_back_its_gathered_root_only_when_told(tiny_config_path):
    """FSDP2 reshards a root only at the end of its backward. The student's root (embedding, head) is gathered from
    its forward to the end of its backward -- the loss reads lm_head.weight whole -- and then freed; the teacher's,
    whose forward runs without gradients, would stay gathered for good: reshard_root frees it. Two fake ranks in
    this process (the collectives do nothing; the parameters' kinds are what is checked)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainer.skeleton.sharding import reshard_root, sharded_random_model

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        config = Qwen3Config.from_json(tiny_config_path)
        teacher, student = (sharded_random_model(config, seed, "cpu") for seed in (1, 2))
        teacher.requires_grad_(False)
        ids = torch.randint(0, config.vocab_size, (1, 8))
        with torch.no_grad():
            teacher(ids, return_hidden=True)
        assert not isinstance(teacher.lm_head.weight, DTensor)  # gathered, for the loss to read whole
        hidden = student(ids, return_hidden=True).hidden_states
        assert not isinstance(student.lm_head.weight, DTensor)
        (hidden @ student.lm_head.weight.T).sum().backward()
        assert isinstance(student.lm_head.weight, DTensor)  # freed by its backward
        assert not isinstance(teacher.lm_head.weight, DTensor)  # still gathered: nothing ran its backward
        root = teacher._get_fsdp_state()._fsdp_param_group.fsdp_params[0]  # the embedding (= the tied head)
        assert root._unsharded_param.untyped_storage().size() > 0
        reshard_root(teacher)
        assert isinstance(teacher.lm_head.weight, DTensor)
        assert root._unsharded_param.untyped_storage().size() == 0  # the gathered weight's memory is given back
    finally:
        dist.destroy_process_group()
