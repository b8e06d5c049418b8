# Run: python -m pytest tests/test_decode_engine.py
"""The decode loop keeps the device busy: counted with a TorchDispatchMode on the CPU (every aten op the loop runs,
after autocast and decompositions into kernels).

  * device-to-host reads per rollout (`_local_scalar_dense`, a copy to the CPU, and the ops whose output shape
    depends on the data: nonzero, masked_select, boolean indexing): a read makes the host wait for the device, so
    the loop reads how many rows stopped once every STOP_CHECK steps and the completions' width once at the end --
    at most 8 reads in a 64-token rollout, sampled or greedy, with rows stopping and leaving;
  * the aten ops that launch work in one eager decode step, per decoder layer and outside the layers (views
    excluded, then included): on CUDA each is a kernel launch the eager step pays per token (the compiled step
    replays them as CUDA graphs); the counts may fall, never grow. Measured on qwen3-tiny (fp32 and CPU bf16
    autocast): the limits below are the counts after fusing q/k/v and gate/up, RoPE from a table and the norms
    (before: 58 per layer and 71 outside in fp32; 86 and 94 with views)."""
import collections
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import Qwen3Config, create_model, generate
from model.qwen3 import DecoderLayer
from support import TINY_CONFIG

generate_module = importlib.import_module("model.generate")  # `model.generate` is the function

pytestmark = pytest.mark.usefixtures("one_thread")

DATA_DEPENDENT = {torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
                  torch.ops.aten._local_scalar_dense.default}
INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default}


def reads_the_device(func, args) -> bool:
    """Whether an aten call makes the host wait for the device: a scalar read, an output sized by the data, a
    boolean index (a nonzero inside), or a copy from another device to the CPU."""
    if func in DATA_DEPENDENT:
        return True
    if func in INDEXING:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
    if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
        source = args[1] if func == torch.ops.aten.copy_.default else args[0]
        target = args[0].device if func == torch.ops.aten.copy_.default else None
        return source.device.type != "cpu" and (target is None or target.type == "cpu")
    return False


class DeviceReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if reads_the_device(func, args):
            self.reads[str(func)] += 1
        return func(*args, **(kwargs or {}))


class StepOps(TorchDispatchMode):
    """Counts the aten ops of the decode steps, inside a decoder layer or outside, views apart."""

    def __init__(self, model):
        super().__init__()
        self.inside, self.counts = False, collections.Counter()
        for layer in model.modules():
            if isinstance(layer, DecoderLayer):
                layer.register_forward_pre_hook(lambda *_: setattr(self, "inside", True))
                layer.register_forward_hook(lambda *_: setattr(self, "inside", False))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts["layer" if self.inside else "outside", "view" if func.is_view else "work"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def tiny():
    return create_model(Qwen3Config.from_dict(TINY_CONFIG), seed=0).eval()


def prompts():
    ids = torch.randint(0, 151669, (6, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[4, :9] = 0
    return ids, mask


@pytest.mark.parametrize("do_sample", [True, False], ids=["sampled", "greedy"])
def test_a_64_token_rollout_reads_the_device_at_most_8_times(tiny, do_sample):
    ids, mask = prompts()
    generators = [torch.Generator().manual_seed(s) for s in range(6)]
    free = generate(tiny, ids, mask, 64, do_sample=do_sample, generator=generators, top_k=20).completion_ids
    eos = [int(free[0, 3]), int(free[2, 12]), int(free[3, 30])]  # rows stop at different steps and leave
    widths = []
    keep = generate_module.DecodeState.keep
    for eos_ids in (None, eos):
        with DeviceReads() as mode:
            generators = [torch.Generator().manual_seed(s) for s in range(6)]
            generate_module.DecodeState.keep = lambda state, index: widths.append(len(index)) or keep(state, index)
            try:
                out = generate(tiny, ids, mask, 64, do_sample=do_sample, generator=generators, top_k=20,
                               eos_token_id=eos_ids)
            finally:
                generate_module.DecodeState.keep = keep
        assert sum(mode.reads.values()) <= 8, dict(mode.reads)
        assert set(mode.reads) == {"aten._local_scalar_dense.default"}, dict(mode.reads)
    assert widths, "no row left the decoding batch: pick other EOS tokens"
    assert (out.completion_mask.sum(dim=1) < 64).sum() >= 2  # rows did stop


def test_sharded_ranks_agree_on_stopping_every_stop_check_steps(tiny):
    """--fsdp 1's lockstep decoding asks every rank (an all-reduce and a read) only at the loop's checks."""
    ids, mask = prompts()
    asked = []
    generate(tiny, ids, mask, 64, do_sample=False, all_stopped=lambda mine: asked.append(mine) or False)
    assert len(asked) == 63 // generate_module.STOP_CHECK


LIMITS = {  # (per layer, outside the layers): ops that launch work, and with views
    "float32": {"work": (50, 67), "all": (70, 85)},
    "bfloat16": {"work": (58, 69), "all": (78, 87)},
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_eager_decode_step_launches_no_more_ops_than_measured(tiny, dtype, monkeypatch):
    ids, mask = prompts()
    mode = StepOps(tiny)
    steps = []
    step = generate_module.decode_step

    def counted(*args, **kwargs):
        steps.append(1)
        with mode:
            return step(*args, **kwargs)

    monkeypatch.setattr(generate_module, "decode_step", counted)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        generate(tiny, ids, mask, 9, generator=torch.Generator().manual_seed(0))
    layers, n = tiny.config.num_hidden_layers, len(steps)
    counts = mode.counts
    work = (counts["layer", "work"] / n / layers, counts["outside", "work"] / n)
    total = ((counts["layer", "work"] + counts["layer", "view"]) / n / layers,
             (counts["outside", "work"] + counts["outside", "view"]) / n)
    limits = LIMITS[dtype]
    assert work[0] <= limits["work"][0] and work[1] <= limits["work"][1], work
    assert total[0] <= limits["all"][0] and total[1] <= limits["all"][1], total
