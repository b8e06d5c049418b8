# python -m pytest tests/test_attention_form.py
"""Every attention call reaches a fused kernel, in every loop, form and dtype.

  * Training forwards are plain causal attention by construction: right-padded rows, no mask tensor (CUDA's flash
    kernel takes no attn_mask at all), proven with a spy on F.scaled_dot_product_attention in the loops and by the
    numbers (the right-padded, unmasked forward gives the left-padded, masked forward's losses and gradients).
  * The table below says which CUDA kernel takes a call (torch 2.11's rules, aten/src/ATen/native/transformers/cuda/
    sdp_utils.cpp: FlashAttention fp16/bf16, no mask, grouped heads, causal only when the query and key lengths
    agree; the memory-efficient kernel fp32/fp16/bf16, masks, but as many key heads as query heads). Every loop --
    SFT, KD, OPD, RL, logit-free OPD -- runs here on the CPU with the CUDA forms (`attention_form` told "cuda"),
    in fp32, bf16 and fp16 autocast, and each of its calls -- training forwards, the prefill of left-padded prompts,
    the decode steps -- must be one a fused kernel takes: a call only the math kernel would take fails.
  * The CUDA forms compute the CPU forms' numbers (keys and values expanded: bit for bit; query heads folded:
    within rounding), and the CPU forms run on the CPU's fused kernel with the math kernel disabled."""
import pytest
import torch
import torch.nn.functional as F

import model.qwen3 as qwen3
import trainer.evaluation.heldout as heldout
import trainer.rollouts.source as rollouts_module
from dataset.collators import IGNORE_INDEX, SFTCollator
from loop_helpers import loop_args
from model import Qwen3Config, create_model, load_pretrained, load_tokenizer, save_pretrained
from support import write_chat_jsonl, write_text_corpus
from trainer.losses.chunked import chunked_sft_loss, completion_hidden
from trainer.train_distillation import main as train_distillation
from trainer.train_opd import main as train_opd
from trainer.train_sft import main as train_sft


@pytest.fixture
def attention_calls(monkeypatch):
    """Every SDPA call of the model: (mask given, is_causal, GQA, inside generation)."""
    calls, generating = [], [False]
    original = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kwargs):
        calls.append({"mask": attn_mask is not None, "causal": is_causal, "gqa": enable_gqa,
                      "generating": generating[0]})
        return original(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, **kwargs)

    def marking(generate):
        def wrapper(*args, **kwargs):
            generating[0] = True
            try:
                return generate(*args, **kwargs)
            finally:
                generating[0] = False
        return wrapper

    monkeypatch.setattr(qwen3.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(rollouts_module, "generate", marking(rollouts_module.generate))
    monkeypatch.setattr(heldout, "generate", marking(heldout.generate))
    return calls


def training_forms(calls: list[dict]) -> set[tuple]:
    return {(c["mask"], c["causal"], c["gqa"]) for c in calls if not c["generating"]}


def test_sft_kd_and_opd_train_with_unmasked_causal_attention(tiny_config_path, tmp_path, attention_calls,
                                                             one_thread):
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 8)
    train_sft(loop_args(tiny_config_path, data, tmp_path, name="sft", max_steps=1))
    assert training_forms(attention_calls) == {(False, True, True)}  # no mask, causal, GQA (4 heads, 2 KV heads)
    attention_calls.clear()
    teacher = str(tmp_path / "sft")
    train_distillation(loop_args(tiny_config_path, data, tmp_path, name="kd", max_steps=1, teacher_path=teacher))
    assert training_forms(attention_calls) == {(False, True, True)}  # the teacher's forward and the student's
    attention_calls.clear()
    train_opd(loop_args(tiny_config_path, data, tmp_path, name="opd", max_steps=2, teacher_path=teacher,
                        max_new_tokens=8, lmbda=0.5))
    assert training_forms(attention_calls) == {(False, True, True)}
    # generation (left-padded prompts, the KV-cache decode steps) keeps its mask
    assert {c["mask"] for c in attention_calls if c["generating"]} == {True}


def left_padded(batch: dict) -> dict:
    """The same rows as the collator used to give them: padding first, every row's tokens at the end."""
    lengths = batch["attention_mask"].sum(dim=1)
    shifts = batch["input_ids"].shape[1] - lengths
    return {key: torch.stack([row.roll(int(shift)) for row, shift in zip(value, shifts)])
            for key, value in batch.items()}


def masked_hidden(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous training forward: left-padded rows, a dense mask, positions from the mask."""
    hidden = model(batch["input_ids"], attention_mask=batch["attention_mask"], return_hidden=True).hidden_states
    hidden, targets = hidden[:, :-1], batch["labels"][:, 1:]
    keep = targets != IGNORE_INDEX
    return hidden[keep], targets[keep]


def loss_and_grads(model, hidden_and_targets) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    hidden, targets = hidden_and_targets
    loss, _ = chunked_sft_loss(hidden, model.lm_head.weight, targets, chunk_size=64, vocab_size=151669)
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_right_padded_unmasked_forward_equals_the_left_padded_masked_one(tiny_config_path, tmp_path, one_thread):
    tokenizer = load_tokenizer(None)
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: " + "word " * (3 + 9 * i)},
                          {"role": "assistant", "content": "answer " * (2 + 12 * i)}]} for i in range(3)]
    batch = SFTCollator(tokenizer, max_length=96, max_prompt_length=48)(rows)
    assert int((batch["attention_mask"] == 0).sum()) > 10  # rows of different lengths: real padding
    model = create_model(Qwen3Config.from_json(tiny_config_path), seed=3)
    loss, grads = loss_and_grads(model, completion_hidden(model, batch["input_ids"], batch["attention_mask"],
                                                          batch["labels"]))
    reference_loss, reference_grads = loss_and_grads(model, masked_hidden(model, left_padded(batch)))
    assert abs(loss - reference_loss) <= 1e-6 * abs(reference_loss)
    for name, grad in grads.items():
        assert (grad - reference_grads[name]).abs().max() <= 1e-6 * reference_grads[name].abs().max(), name


def test_completion_hidden_refuses_left_padded_rows(tiny_config_path):
    model = create_model(Qwen3Config.from_json(tiny_config_path), seed=0)
    ids = torch.tensor([[0, 5, 6, 7]])
    with pytest.raises(ValueError, match="right-padded"):
        completion_hidden(model, ids, torch.tensor([[0, 1, 1, 1]]), torch.tensor([[-100, -100, 6, 7]]))


@pytest.mark.slow  # long for the fast tier: the whole suite runs it
def test_rope_frequencies_stay_fp32_and_both_bf16_constructors_agree(tiny_config_path, tmp_path):
    config = Qwen3Config.from_json(tiny_config_path)
    save_pretrained(create_model(config, seed=5), str(tmp_path / "m"))
    built = create_model(config, seed=5, dtype=torch.bfloat16)
    loaded = load_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16)
    cast = create_model(config, seed=5).half().to(torch.bfloat16)  # any later cast keeps them fp32 too
    for model in (built, loaded, cast):
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32
        # the cos / sin table grows to each process's own lengths: not a buffer, which DDP would broadcast from
        # rank 0 at every forward (tables of different shapes on two ranks abort gloo)
        assert all("table" not in name for name, _ in model.named_buffers())
        assert model.model.rotary_emb.table.dtype == torch.float32
        assert model.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 151669, (1, 1024), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(built(ids).logits, loaded(ids).logits)


def cuda_kernels(call: dict) -> set[str]:
    """The fused CUDA kernels that take an SDPA call (torch 2.11; cuDNN left out: on some GPUs it takes fewer)."""
    kernels = set()
    if call["dtype"] in (torch.float16, torch.bfloat16) and not call["mask"] \
            and not (call["causal"] and call["query_len"] != call["key_len"]):
        kernels.add("flash")  # grouped heads too
    if not call["grouped"] and call["dtype"] in (torch.float32, torch.float16, torch.bfloat16):
        kernels.add("efficient")
    return kernels


@pytest.fixture
def cuda_forms(monkeypatch):
    """The model picks the attention forms it would on CUDA; every SDPA call is recorded as the kernel sees it
    (autocast's dtype where it is on)."""
    calls = []
    original, form = F.scaled_dot_product_attention, qwen3.attention_form

    def spy(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kwargs):
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
        calls.append({"dtype": dtype, "mask": attn_mask is not None, "causal": is_causal,
                      "grouped": q.shape[1] != k.shape[1], "query_len": q.shape[2], "key_len": k.shape[2]})
        return original(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, **kwargs)

    monkeypatch.setattr(qwen3.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(qwen3, "attention_form", lambda device_type, *rest: form("cuda", *rest))
    return calls


def refused(calls: list[dict]) -> list[dict]:
    return [call for call in calls if not cuda_kernels(call)]


DTYPES = [pytest.param("float32", marks=pytest.mark.slow), "bfloat16", pytest.param("float16", marks=pytest.mark.slow)]
LOOPS = ["sft", "kd", "opd", "rl", "logit_free", "pretrain"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loop", LOOPS)
def test_every_loops_attention_calls_are_ones_a_fused_cuda_kernel_takes(loop, dtype, tiny_config_path, tmp_path,
                                                                        cuda_forms, black_box_stub, one_thread):
    from trainer import train_logit_free, train_pretrain, train_rl
    data = (write_text_corpus(tmp_path / "corpus.jsonl", rows=4, row_length=96) if loop == "pretrain"
            else write_chat_jsonl(tmp_path / "chat.jsonl", 8))
    teacher = str(tmp_path / "teacher")
    save_pretrained(create_model(Qwen3Config.from_json(tiny_config_path), seed=9), teacher)
    on_policy = dict(max_new_tokens=8, eval_interval=1, eval_rows=2, eval_max_new_tokens=6)
    runs = {
        "sft": (train_sft, {}),
        "kd": (train_distillation, dict(teacher_path=teacher)),
        "opd": (train_opd, dict(teacher_path=teacher, lmbda=1.0, **on_policy)),
        "rl": (train_rl.main, dict(num_generations=2, **on_policy)),
        "logit_free": (train_logit_free.main, dict(teacher_url=black_box_stub.url, chunk_len=3, audit_chunks=2,
                                                   continuations=2, **on_policy)),
        # packed documents' dense block-diagonal mask, in training and in the held-out perplexity
        "pretrain": (train_pretrain.main, dict(eval_interval=1, eval_rows=2)),
    }
    main, flags = runs[loop]
    main(loop_args(tiny_config_path, data, tmp_path, name=loop, max_steps=1, dtype=dtype, **flags))
    assert cuda_forms and not refused(cuda_forms), refused(cuda_forms)[:3]
    if loop not in ("sft", "kd", "pretrain"):  # the rollouts' prefills (square) and decode steps (queries < keys) ran too
        assert {call["query_len"] == call["key_len"] for call in cuda_forms if call["mask"]} == {True, False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cuda_forms_compute_the_cpu_forms_numbers(tiny_config_path, dtype, monkeypatch, one_thread):
    """Training forward, prefill and decode: the CUDA forms' logits and tokens are the CPU forms' -- bit for bit
    where keys and values are expanded (training in fp32, the prefill), within rounding where query heads are
    folded (the decode steps); and the CPU forms run on the CPU's fused kernel alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from model import generate
    model = create_model(Qwen3Config.from_json(tiny_config_path), seed=4).eval()
    ids = torch.randint(0, 151669, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            train, prefill = model(ids).logits, model(ids, attention_mask=mask).logits
            tokens = generate(model, ids, mask, 12, do_sample=False).completion_ids
        return train, prefill, tokens

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # the CPU's fused kernel, no math fallback
        cpu = run()
    form = qwen3.attention_form
    monkeypatch.setattr(qwen3, "attention_form", lambda device_type, *rest: form("cuda", *rest))
    cuda = run()
    assert torch.equal(cuda[1], cpu[1]), "the expanded prefill"
    assert torch.equal(cuda[0], cpu[0]), "the training forward: expanded in fp32, flash's form (the CPU's) else"
    assert torch.equal(cuda[2], cpu[2])  # greedy over random weights: no near-tie for a fold's rounding to flip


def test_the_table_refuses_what_the_first_gpu_run_saw_refused():
    """The forms the first GPU run met: a masked grouped decode call (flash takes no mask, the memory-efficient
    kernel no grouped heads) and an fp32 grouped causal one (flash and cuDNN refuse fp32)."""
    decode = {"dtype": torch.bfloat16, "mask": True, "causal": False, "grouped": True, "query_len": 1,
              "key_len": 64}
    assert cuda_kernels(decode) == set()
    assert cuda_kernels({**decode, "grouped": False}) == {"efficient"}
    fp32_training = {"dtype": torch.float32, "mask": False, "causal": True, "grouped": True, "query_len": 64,
                     "key_len": 64}
    assert cuda_kernels(fp32_training) == set()
    assert cuda_kernels({**fp32_training, "dtype": torch.bfloat16}) == {"flash"}
