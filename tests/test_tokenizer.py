# Run: python -m pytest tests/test_tokenizer.py
"""Our tokenizer (tokenizers + the folder's Jinja chat template) against transformers' AutoTokenizer on the same
real Qwen3 files: chat template rendering byte for byte, encode/decode, special ids, length."""
import copy

import pytest
import transformers
from jinja2.exceptions import SecurityError

from model import default_tokenizer_dir, load_tokenizer
from support import give_another_tokenizer


@pytest.fixture(scope="module")
def tokenizers():
    return load_tokenizer(None), transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir())


CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is 2 + 2?"}],
    "system_and_turns": [
        {"role": "system", "content": "You are a careful mathematician."},
        {"role": "user", "content": "Compute 3 * 7."},
        {"role": "assistant", "content": "3 * 7 = 21."},
        {"role": "user", "content": "And 21 / 3?"},
    ],
    # earlier assistant turns with <think> blocks: the template strips reasoning from all but the last turns
    "think_blocks": [
        {"role": "user", "content": "Solve x + 1 = 3."},
        {"role": "assistant", "content": "<think>\nSubtract 1 from both sides.\n</think>\n\nx = 2."},
        {"role": "user", "content": "Now x + 2 = 5."},
        {"role": "assistant", "content": "<think>\nSubtract 2.\n</think>\n\nx = 3."},
    ],
    "reasoning_content": [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "7 has no divisors besides 1 and 7."},
        {"role": "user", "content": "Is 9 prime?"},
        {"role": "assistant", "content": "No, 9 = 3 * 3.", "reasoning_content": "9 is divisible by 3."},
    ],
    "non_ascii": [
        {"role": "system", "content": "Réponds en français, s'il te plaît. 请用中文回答。"},
        {"role": "user", "content": "Combien font ½ + ¼ ? 🙂 — ∑ᵢ xᵢ², naïve café, 数学"},
        {"role": "assistant", "content": "<think>\n½ = 0,5 ; ¼ = 0,25\n</think>\n\n¾ 🎉"},
        {"role": "user", "content": "Merci ! Ünïcödé \"quotes\" and \\backslash\\"},
    ],
}


def _hf_ids(result):
    # transformers 5 returns a BatchEncoding for tokenize=True, transformers 4 a plain list
    return list(result["input_ids"]) if hasattr(result, "keys") else list(result)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(tokenizers, name, enable_thinking, add_generation_prompt):
    ours, hf = tokenizers
    messages = CONVERSATIONS[name]
    kwargs = dict(add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
    text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = ours.apply_chat_template(messages, tokenize=True, **kwargs)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids == _hf_ids(hf.apply_chat_template(messages, tokenize=True, **kwargs))


def test_enable_thinking_false_puts_empty_think_in_prompt(tokenizers):
    ours, _ = tokenizers
    messages = CONVERSATIONS["single_user"]
    off = ours.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    on = ours.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing tabs\t\t\n\nnewlines",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>",
    "<|endoftext|>between<|endoftext|>",
    "The answer is $\\boxed{\\frac{1}{2}}$.",
    "数学 naïve café 🙂 ½ ∑ᵢ xᵢ²",
    "def f(x):\n    return x ** 2  # 12345678901234567890",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_transformers(tokenizers, text):
    ours, hf = tokenizers
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert ours.encode_batch([text, "x"]) == [ids, ours.encode("x")]


def test_special_ids_and_length(tokenizers):
    ours, hf = tokenizers
    assert ours.eos_token_id == hf.eos_token_id == 151645  # <|im_end|>
    assert ours.pad_token_id == hf.pad_token_id == 151643  # <|endoftext|>
    assert len(ours) == len(hf) == 151669  # real tokens; the model's embedding pads this to 151936 rows
    assert ours.get_vocab() == hf.get_vocab()
    assert ours.encode("<|im_end|>") == [151645]
    assert ours.token_to_id("<think>") == hf.convert_tokens_to_ids("<think>")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_batch_split_counts_the_tokens_of_the_prefix(tokenizers, text):
    # At every character position: the split count is the number of tokens that spell exactly text[:split], checked
    # against transformers' offsets: the first token that reaches past the split must start at it, else a token
    # crosses the position (inside a word; inside " \u2211", whose bytes are spread over two tokens) and it is None.
    ours, hf = tokenizers
    offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    splits = list(range(len(text) + 1))
    results = ours.encode_batch_split([text] * len(splits), splits)
    for split, (ids, count) in zip(splits, results):
        assert ids == ours.encode(text)
        first_past = next((index for index, (_, end) in enumerate(offsets) if end > split), len(offsets))
        clean = first_past == len(offsets) or offsets[first_past][0] >= split
        assert count == (first_past if clean else None), f"split {split} of {text!r}"
        if count is not None:
            assert ours.decode(ids[:count]) == text[:split]


@pytest.mark.parametrize("source", ["{{ messages.__class__.__name__ }}", "{{ messages.append(1) }}",
                                    "{{ messages[0].update({'role': 'x'}) }}"])
def test_chat_template_stays_sandboxed(tokenizers, source):
    # The sandbox's verdicts are memoised per (type, attribute): an unsafe access is refused the second time too,
    # and a safe one of the same name on another type is still allowed.
    ours, _ = tokenizers
    odd = copy.copy(ours)
    odd.chat_template = source
    for _ in range(2):
        with pytest.raises(SecurityError):
            odd.apply_chat_template([{"role": "user", "content": "hi"}])
    odd.chat_template = "{{ messages[0].content.upper() }}{{ 'a,b'.split(',') | length }}"
    assert odd.apply_chat_template([{"role": "user", "content": "hi"}]) == "HI2"


def test_a_tokenizer_json_is_parsed_once_per_content(tmp_path):
    """A run loads its tokenizer several times (data, each teacher's vocabulary check, every export): the same bytes
    give the same parse, in any folder, each load keeping its own folder; a file changed in place is parsed anew."""
    import shutil
    copy_dir = tmp_path / "copy"
    shutil.copytree(default_tokenizer_dir(), copy_dir)
    packaged, copied = load_tokenizer(None), load_tokenizer(str(copy_dir))
    assert copied._tok is packaged._tok and copied.folder == str(copy_dir) != packaged.folder
    assert copied.same_vocabulary(packaged)
    give_another_tokenizer(copy_dir)
    edited = load_tokenizer(str(copy_dir))
    assert edited._tok is not packaged._tok and "<|a_token_only_the_teacher_has|>" in edited.get_vocab()
    assert not edited.same_vocabulary(packaged)
