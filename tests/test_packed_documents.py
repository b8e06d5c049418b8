# python -m pytest -q -n0 tests/test_packed_documents.py
"""Several documents packed into one row (model/qwen3.py's `documents`: a mask causal and block diagonal by document,
positions restarting at 0 at each document's start) against each document run alone in a row of its own: the same
logits, loss and gradients in fp32, eagerly, with gradient checkpointing and with compiled layers; `documents=None`
leaves the forward as it was; and dataset/packed_documents.py's `pack_documents`: order, EOS, labels, splits."""
import pytest
import torch
import torch.nn.functional as F

from support import TINY_CONFIG
from dataset.collators import IGNORE_INDEX
from dataset.packed_documents import PADDING, pack_documents
from model import KVCache, Qwen3Config, create_model
from model.qwen3 import Packing, build_attention_mask, positions_from_documents, positions_from_mask

EOS, PAD = 151645, 151643
TOL = dict(atol=1e-5, rtol=1e-5)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model():
    # weights at std 0.1, not 0.02: attention to another document then moves the logits far beyond the tolerance
    return create_model(Qwen3Config.from_dict({**TINY_CONFIG, "initializer_range": 0.1}), seed=0).train()


def random_documents(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


def one_row(lengths: list[int], padding: str) -> tuple[list[list[int]], dict]:
    """The documents of `lengths` packed into one row (their EOS included) and the forward's arguments: padding
    "none", "document" (4 pads at the end, a document of their own), "right mask" or "left mask" (4 pads that only
    attention_mask marks, their ids the neighbouring document's)."""
    documents = random_documents(lengths)
    length = sum(lengths) + len(lengths) + (0 if padding == "none" else 4)
    packed = pack_documents(documents, length, EOS, PAD)
    ids, docs, labels = packed.input_ids, packed.documents, packed.labels
    assert ids.shape == (1, length)
    mask = torch.ones_like(ids)
    if padding == "right mask":
        mask[:, -4:] = 0
        docs = docs.masked_fill(docs == PADDING, len(lengths) - 1)
    if padding == "left mask":
        ids, docs, labels = (t.roll(4, dims=1) for t in (ids, docs, labels))
        mask[:, :4] = 0
        docs = docs.masked_fill(docs == PADDING, 0)
    arguments = dict(input_ids=ids, documents=docs, labels=labels)
    if padding.endswith("mask"):
        arguments["attention_mask"] = mask
    return documents, arguments


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The next-token loss of unshifted labels (the collators' and pack_documents'): position t predicts labels[t+1]."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def packed_run(model, arguments: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The row's logits at its document tokens (the pads left out), its summed loss and the loss's gradients."""
    model.zero_grad()
    arguments = dict(arguments)
    labels = arguments.pop("labels")
    logits = model(**arguments).logits
    loss = summed_loss(logits, labels)
    loss.backward()
    real = arguments["documents"] != PADDING
    if "attention_mask" in arguments:
        real &= arguments["attention_mask"].bool()
    return logits[real].detach(), loss.detach(), grads(model)


def alone_run(model, documents: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Each document with its EOS alone in an unpadded row (the plain causal forward): the logits one after the
    other, the sum of their summed losses and its gradients."""
    model.zero_grad()
    all_logits, loss = [], 0.0
    for document in documents:
        ids = torch.tensor([document + [EOS]])
        logits = model(ids).logits
        loss = loss + summed_loss(logits, ids)
        all_logits.append(logits[0].detach())
    loss.backward()
    return torch.cat(all_logits), loss.detach(), grads(model)


def grads(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


CASES = [([17], "none"), ([9, 14], "none"), ([5, 11, 7], "none"), ([6, 10], "document"), ([6, 10], "right mask"),
         ([6, 10], "left mask")]


@pytest.mark.parametrize("lengths, padding", CASES)
def test_a_packed_row_is_its_documents_run_alone(lengths, padding):
    model = tiny_model()
    documents, arguments = one_row(lengths, padding)
    logits, loss, _ = packed_run(model, arguments)
    alone_logits, alone_loss, _ = alone_run(model, documents)
    torch.testing.assert_close(logits, alone_logits, **TOL)
    torch.testing.assert_close(loss, alone_loss, **TOL)
    if len(lengths) > 1:  # the test can fail: without the documents, the later documents see the earlier ones
        leaked = model(**{k: v for k, v in arguments.items() if k not in ("documents", "labels")}).logits
        assert not torch.allclose(leaked[arguments["input_ids"] != PAD][-1], alone_logits[-1], atol=1e-2)


@pytest.mark.parametrize("how", ["eager", "checkpointed", "compiled"])
def test_the_gradients_are_those_of_the_documents_one_by_one(how, compile_calls):
    model = tiny_model()
    documents, arguments = one_row([5, 11, 7], "document")
    _, _, alone_grads = alone_run(model, documents)
    model.gradient_checkpointing = how == "checkpointed"
    if how == "compiled":
        torch._dynamo.reset()
        model.compile_layers()  # compile_calls: dynamo's eager backend, the mask passed through each layer's graph
    _, _, packed_grads = packed_run(model, arguments)
    assert len(compile_calls) == (TINY_CONFIG["num_hidden_layers"] if how == "compiled" else 0)
    for name, grad in alone_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, **TOL, msg=name)


def test_without_documents_the_forward_is_unchanged(monkeypatch):
    """documents=None: the same SDPA calls as before (no mask and is_causal without attention_mask; the padding
    mask with it) and the same logits bit for bit. One document over the whole row: the same logits as no documents
    (the masked kernel's rounding apart)."""
    model = tiny_model().eval()
    ids = torch.tensor(random_documents([12, 12]))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, is_causal=False, **options):
        calls.append((attn_mask, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **options)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        plain, plain_none = model(ids).logits, model(ids, documents=None).logits
        assert len(calls) == 4 and all(mask_ is None and causal for mask_, causal in calls)  # 2 forwards x 2 layers
        calls.clear()
        masked, masked_none = model(ids, mask).logits, model(ids, mask, documents=None).logits
        assert len(calls) == 4
        assert all(torch.equal(mask_, build_attention_mask(mask, 12, 0)) and not causal for mask_, causal in calls)
        one_document = model(ids, documents=torch.zeros_like(ids)).logits
    assert torch.equal(plain, plain_none) and torch.equal(masked, masked_none)
    torch.testing.assert_close(one_document, plain, **TOL)


def test_positions_restart_at_each_document_and_skip_masked_pads():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5]])
    assert positions_from_documents(documents).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1]])
    positions = positions_from_documents(documents, mask)
    assert positions[0].tolist() == [0, 1, 2, 0, 1, 0, 0, 1]
    assert torch.equal(positions[1], positions_from_mask(mask)[1])  # one document: the left-padded rule


def test_the_forward_gives_rope_the_restarted_positions(monkeypatch):
    """Under the block-diagonal mask RoPE sees only position differences within a document, which an offset keeps:
    the logits cannot tell restarted positions from the row's own (measured: within 1e-5), so this looks at what the
    forward hands RoPE."""
    model = tiny_model()
    _, arguments = one_row([5, 11, 7], "none")
    seen = []
    rope = model.model.rotary_emb.forward

    def recording(positions, dtype):
        seen.append(positions)
        return rope(positions, dtype)
    monkeypatch.setattr(model.model.rotary_emb, "forward", recording)
    with torch.no_grad():
        model(arguments["input_ids"], documents=arguments["documents"])
    assert seen[0].tolist() == [list(range(6)) + list(range(12)) + list(range(8))]


def test_documents_refuse_a_cache_packing_and_another_shape():
    model = tiny_model()
    ids = torch.tensor(random_documents([6]))
    documents = torch.zeros_like(ids)
    cache = KVCache(model.config, 1, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="neither a kv_cache nor packing"):
        model(ids, documents=documents, kv_cache=cache)
    with pytest.raises(ValueError, match="neither a kv_cache nor packing"):
        model(ids, documents=documents, packing=Packing.of(torch.ones_like(ids)))
    with pytest.raises(ValueError, match="one document id per token"):
        model(ids, documents=documents[:, :-1])


def test_pack_documents_keeps_order_eos_labels_and_splits():
    documents = [[1, 2], [], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [15]]  # the third spans four rows
    packed = pack_documents(documents, 5, EOS, PAD)
    streams = [document + [EOS] for document in documents]
    total = sum(len(s) for s in streams)
    assert packed.input_ids.shape == packed.documents.shape == packed.labels.shape == (-(-total // 5), 5)
    ids, docs, labels = packed.input_ids.flatten(), packed.documents.flatten(), packed.labels.flatten()
    for index, stream in enumerate(streams):  # every document once, in order, its EOS after it
        assert ids[docs == index].tolist() == stream
        assert labels[docs == index].tolist() == [IGNORE_INDEX] + stream[1:]  # the last token predicts EOS
    assert torch.equal(ids[:total], torch.tensor(sum(streams, [])))  # the documents in their order
    assert ids[total:].eq(PAD).all() and docs[total:].eq(PADDING).all() and labels[total:].eq(IGNORE_INDEX).all()
    for k in range(1, len(ids)):  # no label crosses from one document to another
        if labels[k] != IGNORE_INDEX:
            assert docs[k - 1] == docs[k] and labels[k] == ids[k]
    # the split: document 2 starts at the end of row 0 (its first token), fills rows 1 and 2 and ends at the start of
    # row 3; a row's first token is a label its row cannot predict (the shift drops it), and the continuation is a
    # new segment at position 0
    assert packed.documents[:, 0].tolist() == [0, 2, 2, 2] and packed.documents[0, -1] == 2
    assert packed.labels[1, 0] == packed.input_ids[1, 0] == 5 and packed.labels[0, -1] == IGNORE_INDEX
    positions = positions_from_documents(packed.documents)
    assert positions[:, 0].tolist() == [0, 0, 0, 0] and positions[3].tolist() == [0, 0, 1, 0, 1]
