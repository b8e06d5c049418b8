"""Token ids in, token ids and log-probabilities out: an OpenAI-compatible `/v1/completions` server (vLLM) as the
rollout engine of on-policy distillation, the evaluator's generator, or the scorer that a remote teacher is.

    server = CompletionServer("http://127.0.0.1:8000/v1", "student", what="rollout server")
    server.check(max_length=1024)                         # refused in seconds when it is down or serves no such model
    out = server.generate(prompt_ids, prompt_mask, 256, seeds=[...], temperature=1.0, eos_token_id=..., ...)
    logprobs = server.prompt_logprobs([ids, ...])        # log p(token t | tokens < t), t >= 1, per sequence

Each row is one request with its own seed, so a row's sample depends on its seed and the weights alone (as with the
built-in engine's per-row generators). The requests go out through `common.http.ApiClient` (bounded concurrency,
timeouts, retries); a row that fails after its retries fails the whole batch (`RuntimeFailure`): a batch is
complete or it is not returned.

What is sent so that the server samples exactly what `model.generate` would (same weights, same seed rule):
every sampling setting explicitly (a server's defaults come from the model's generation_config.json, e.g.
Qwen3's top_k 20), `ignore_eos` with `stop_token_ids=[eos]` (stop at our EOS only, not at every id listed in
generation_config), and a -100 logit bias (the most vLLM allows: a factor e^-100, never drawn) on the embedding's
padding rows beyond the tokenizer's vocabulary.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import torch

from common.errors import RuntimeFailure, UserError
from common.http import ApiClient, RequestError, ServerUnreachable, one_line
from model.generate import GenerateOutput, completion_mask_through_eos


class CompletionServer:
    """One served model on an OpenAI-compatible server, spoken to in token ids."""

    def __init__(self, base_url: str, model: str, *, what: str, api_key_env: str | None = None,
                 concurrency: int = 64, timeout: float = 600.0, max_retries: int = 3):
        self.model, self.what = model, what
        try:
            self.client = ApiClient(base_url, api_key_env=api_key_env, concurrency=concurrency,
                                    read_timeout=timeout, max_retries=max_retries, backoff_base=0.5,
                                    backoff_max=8.0, what=what, request_name="row")
        except ValueError as e:
            raise UserError(str(e)) from None

    def close(self) -> None:
        self.client.close()

    # -- start-up ------------------------------------------------------------------------------------------------------

    def check(self, max_length: int) -> None:
        """Refuse at once a server that is down, that does not serve `model`, or whose context is shorter than
        `max_length` (prompt + completion) tokens."""
        try:
            self.client.check_reachable()
            listing = self.client.get_json("/models", timeout=10.0)
        except (ServerUnreachable, RequestError) as e:
            raise RuntimeFailure(f"{self.what}: {one_line(str(e))}") from None
        served = {m.get("id"): m for m in (listing or {}).get("data", []) if isinstance(m, dict)}
        if self.model not in served:
            raise UserError(f"the {self.what} at {self.client.base_url} serves {sorted(served) or 'no models'}, "
                            f"not {self.model!r}: pass the name given to its --served-model-name")
        context = served[self.model].get("max_model_len")
        if isinstance(context, int) and context < max_length:
            raise UserError(f"the {self.what} serves {self.model!r} with --max-model-len {context}, shorter than "
                            f"--max_length {max_length}: restart it with --max-model-len {max_length} or more")

    def check_tokenizer(self, tokenizer) -> None:
        """UserError unless the server's tokenizer is ours: the same ids for a probe text with special tokens,
        the same strings for ids across the vocabulary, and no token past our last one."""
        try:
            served = self.client.post_once("/tokenize", {"model": self.model, "prompt": PROBE_TEXT,
                                                         "add_special_tokens": False}).get("tokens")
            spread = list(range(0, len(tokenizer), max(1, len(tokenizer) // 64))) + [len(tokenizer) - 1]
            decoded = [self.client.post_once("/detokenize", {"model": self.model, "tokens": [i]}).get("prompt")
                       for i in spread]
            beyond = self._detokenize_or_none(len(tokenizer))
        except (RequestError, AttributeError) as e:
            raise RuntimeFailure(f"the {self.what} did not answer /tokenize and /detokenize as vLLM does "
                                 f"({one_line(str(e))}): cannot check that it has our tokenizer") from None
        ours = tokenizer.encode(PROBE_TEXT)
        mismatch = next((i for i, text in zip(spread, decoded) if text != tokenizer.decode([i])), None)
        if served != ours or mismatch is not None or beyond:
            what = ("tokenizes a probe text differently" if served != ours else
                    f"decodes token {mismatch} differently" if mismatch is not None else
                    f"has a token {len(tokenizer)} ({beyond!r}) past our last one")
            raise UserError(f"the {self.what} ({self.model!r} at {self.client.base_url}) {what}: token-level "
                            f"distillation needs the student's tokenizer ({len(tokenizer)} tokens)")

    def _detokenize_or_none(self, token: int) -> str | None:
        try:
            return self.client.post_once("/detokenize", {"model": self.model, "tokens": [token]}).get("prompt")
        except RequestError as e:
            if e.status is not None and 400 <= e.status < 500:
                return None  # refused: no such token
            raise

    # -- sampling ------------------------------------------------------------------------------------------------------

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int, *,
                 seeds: Sequence[int], eos_token_id: int | list[int], pad_token_id: int, **sampling) -> GenerateOutput:
        """`model.generate`'s contract for left-padded prompts: (B, R) completion ids with pad after each row's EOS
        and the mask through the first EOS; R is the longest completion. One request per row, seeded by `seeds`
        (`sampling`: `sample_rows`' settings)."""
        completions = self.sample_tokens(prompt_ids, prompt_mask, max_new_tokens, seeds=seeds,
                                         eos_token_id=eos_token_id, **sampling)
        return completions_output(prompt_ids, [ids for ids, _ in completions], eos_token_id, pad_token_id)

    def sample_tokens(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int, *,
                      seeds: Sequence[int], **sampling) -> list[tuple[list[int], list[float]]]:
        """`sample_rows` for left-padded prompts, each row with the whole `max_new_tokens`."""
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        return self.sample_rows(rows, [max_new_tokens] * len(rows), seeds=seeds, **sampling)

    def sample_rows(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *, seeds: Sequence[int],
                    do_sample: bool = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    eos_token_id: int | list[int], vocab_size: int,
                    model_vocab_size: int) -> list[tuple[list[int], list[float]]]:
        """The requests alone, one per row, its token ids the request's prompt (never text: a multi-turn rollout's
        conversation so far is continued token for token) and at most its `max_new_tokens[i]` sampled: each row's
        completion token ids as the server returned them (through its EOS or the budget), and the log-probability
        the server drew each with (at the temperature, after top-k / top-p and the logit bias: a server started with
        --logprobs-mode processed_logprobs, as serving/vllm_launch.py starts it). Plain lists, no tensor work: what
        a background thread can do (trainer/rollouts/queue.py)."""
        eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        padding_rows = {str(i): -100.0 for i in range(vocab_size, model_vocab_size)}
        payloads = [{
            "model": self.model, "prompt": list(map(int, row)), "max_tokens": int(budget), "n": 1, "seed": int(seed),
            "temperature": temperature if do_sample else 0.0, "top_p": top_p if do_sample else 1.0,
            "top_k": top_k if do_sample else 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "ignore_eos": True, "stop_token_ids": eos_ids,
            "logit_bias": padding_rows, "logprobs": 0,
            "return_token_ids": True, "skip_special_tokens": False,
        } for row, budget, seed in zip(prompts, max_new_tokens, seeds)]
        return self._post_all(payloads, _sampled_tokens)

    # -- scoring -------------------------------------------------------------------------------------------------------

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """For each token sequence, the served model's log p(token t | tokens < t) for t = 1 .. len-1 (fp32, from
        the raw logits: no temperature, no truncation)."""
        payloads = [{"model": self.model, "prompt": list(map(int, ids)), "max_tokens": 1, "temperature": 0.0,
                     "prompt_logprobs": 0, "return_token_ids": True, "skip_special_tokens": False}
                    for ids in sequences]
        return self._post_all(payloads, _prompt_logprobs)

    def completion_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            targets: torch.Tensor) -> torch.Tensor:
        """Rows of token ids (`attention_mask` on each row's tokens, any padding) and `targets`, (B, T) bool on the
        tokens to score -- a completion's, or a multi-turn conversation's sampled tokens, which tool results
        interleave (never a row's first token) -> the served model's log-probabilities of those tokens, row after
        row: ((number of targets,), fp32, on input_ids' device), in the order the loss takes its label positions."""
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
        served = self.prompt_logprobs(rows)
        picks = scored_positions(targets, attention_mask)
        return torch.cat([logprobs[pick] for logprobs, pick in zip(served, picks)]).to(input_ids.device)

    def prompt_topk_logprobs(self, sequences: Sequence[Sequence[int]], k: int
                             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each token sequence, at t = 1 .. len-1: the ids of the served model's top-k tokens after tokens < t
        and of token t itself, and its log-probabilities of them (vLLM's `prompt_logprobs: k`, prefill only, from the
        raw logits) -> per sequence (ids (len-1, k+1) int64, log-probs (len-1, k+1) fp32); each id once: where token
        t is in the top-k, one column is id -1 (log-prob 0)."""
        payloads = [{"model": self.model, "prompt": list(map(int, ids)), "max_tokens": 1, "temperature": 0.0,
                     "prompt_logprobs": int(k), "return_token_ids": True, "skip_special_tokens": False}
                    for ids in sequences]
        return self._post_all(payloads, lambda body: _prompt_topk_logprobs(body, k))

    def completion_topk_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor,
                                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`completion_logprobs` with the top-k: at each target position the ids of the teacher's top-k tokens plus
        the sampled one, and its log-probabilities of them, row after row: ((number of targets, k+1) int64, (number
        of targets, k+1) fp32), on input_ids' device."""
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
        served = self.prompt_topk_logprobs(rows, k)
        picks = scored_positions(targets, attention_mask)
        ids = torch.cat([i[pick] for (i, _), pick in zip(served, picks)])
        logprobs = torch.cat([v[pick] for (_, v), pick in zip(served, picks)])
        return ids.to(input_ids.device), logprobs.to(input_ids.device)

    def check_topk(self, k: int, probe_ids: Sequence[int]) -> None:
        """Refuse at once a server that will not return k prompt log-probabilities per position (vLLM's
        --max-logprobs, default 20; no endpoint reports it, so a probe is scored), or returns fewer."""
        payload = {"model": self.model, "prompt": list(map(int, probe_ids)), "max_tokens": 1, "temperature": 0.0,
                   "prompt_logprobs": int(k), "return_token_ids": True, "skip_special_tokens": False}
        try:
            _prompt_topk_logprobs(self.client.post_once("/completions", payload), k)
        except RequestError as e:
            if e.status is not None and 400 <= e.status < 500:
                allowed = re.search(r"max allowed: (\d+)", e.detail or "")
                limit = f"at most {allowed.group(1)}" if allowed else "fewer"
                raise UserError(f"the {self.what} ({self.model!r} at {self.client.base_url}) returns {limit} "
                                f"log-probabilities per position, fewer than --teacher_topk {k}: restart it with "
                                f"--max-logprobs {k} (serving/vllm_launch.py --max_logprobs {k})") from None
            raise RuntimeFailure(f"the {self.what} at {self.client.base_url} failed: {one_line(str(e))}") from None
        except ValueError as e:
            raise RuntimeFailure(f"the {self.what} did not answer prompt_logprobs {k} as vLLM does "
                                 f"({one_line(str(e))}): cannot take its top-{k}") from None

    def _post_all(self, payloads: list[dict[str, Any]], parse) -> list:
        """Every payload answered, in order, or RuntimeFailure: a batch is never returned in part."""
        tasks = [lambda p=p, i=i: self.client.post("/completions", p, parse, index=i) for i, p in enumerate(payloads)]
        results: list = [None] * len(payloads)
        try:
            for index, outcome in self.client.run_concurrently(tasks):
                if isinstance(outcome, RequestError):
                    raise outcome
                results[index] = outcome
        except RequestError as e:
            raise RuntimeFailure(f"the {self.what} at {self.client.base_url} failed: {one_line(str(e))}") from None
        return results


def open_checked_server(base_url: str, model: str, *, what: str, max_length: int, api_key_env: str | None = None,
                        tokenizer=None, topk: int = 0, **client: Any) -> CompletionServer:
    """A server checked at once, so that one that is down or wrong is refused in seconds, before any model loads:
    up, serving `model` with a context of at least `max_length`, and, given the student's tokenizer, the same
    tokenizer (a teacher asked for its top-`topk`: and that many log-probabilities per position). `client`:
    CompletionServer's concurrency, timeout and retries (its defaults otherwise). The loops' servers
    (trainer/rollouts/servers.py) and eval_math.py's --server_url both start here."""
    server = CompletionServer(base_url, model, what=what, api_key_env=api_key_env, **client)
    server.check(max_length)
    if tokenizer is not None:
        server.check_tokenizer(tokenizer)
        if topk:
            server.check_topk(topk, probe_token_ids(tokenizer))  # its --max-logprobs >= K
    return server


def scored_positions(targets: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Per row, which of its prompt log-probabilities (tokens 1 .. len-1 of its attended tokens, `prompt_logprobs`)
    are of a target token: (len-1,) bool."""
    return [row[mask.bool()][1:] for row, mask in zip(targets.cpu(), attention_mask.cpu())]


def completions_output(prompt_ids: torch.Tensor, completions: Sequence[Sequence[int]], eos_token_id: int | list[int],
                       pad_token_id: int) -> GenerateOutput:
    """Rows of completion token ids -> `model.generate`'s output: padded after each row to the longest, the mask
    through each row's first EOS, on the prompts' device."""
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    width = max(len(c) for c in completions)
    completion_ids = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    for i, tokens in enumerate(completions):
        completion_ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    completion_ids = completion_ids.to(prompt_ids.device)
    eos = torch.tensor(eos_ids, device=prompt_ids.device)
    return GenerateOutput(sequences=torch.cat([prompt_ids, completion_ids], dim=1), completion_ids=completion_ids,
                          completion_mask=completion_mask_through_eos(completion_ids, eos))


def _choice(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
        raise ValueError("no 'choices' list")
    choice = body["choices"][0]
    if not isinstance(choice, dict):
        raise ValueError("choices[0] is not an object")
    return choice


def _sampled_tokens(body: Any) -> tuple[list[int], list[float]]:
    """choices[0].token_ids and choices[0].logprobs.token_logprobs, one per sampled token."""
    choice = _choice(body)
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise ValueError("choices[0].token_ids missing (the server must accept return_token_ids, as vLLM does)")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(ids) or \
            not all(isinstance(x, (int, float)) for x in logprobs):
        raise ValueError("choices[0].logprobs.token_logprobs missing or not one per token (the server must accept "
                         "logprobs, as vLLM does)")
    return ids, [float(x) for x in logprobs]


def _prompt_logprobs(body: Any) -> torch.Tensor:
    """choices[0].prompt_logprobs is [None, {str(id): {"logprob": x, ...}, ...}, ...]: the entry for the prompt's own
    token at each position (the top-0 list holds it, sometimes beside the argmax)."""
    choice = _choice(body)
    entries, ids = choice.get("prompt_logprobs"), choice.get("prompt_token_ids") or body.get("prompt_token_ids")
    if not isinstance(entries, list) or not isinstance(ids, list) or len(entries) != len(ids):
        raise ValueError("choices[0].prompt_logprobs / prompt_token_ids missing (the server must accept "
                         "prompt_logprobs and return_token_ids, as vLLM does)")
    values = []
    for token, entry in zip(ids[1:], entries[1:]):
        item = entry.get(str(token)) if isinstance(entry, dict) else None
        if not isinstance(item, dict) or not isinstance(item.get("logprob"), (int, float)):
            raise ValueError(f"no log-probability for prompt token {token}")
        values.append(float(item["logprob"]))
    return torch.tensor(values, dtype=torch.float32)


def _prompt_topk_logprobs(body: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """choices[0].prompt_logprobs with `prompt_logprobs: k`: per position a dict of the top-k ids and the prompt's
    own token (k entries when it is among them, else k+1) -> (ids, log-probs), each (len-1, k+1), every id once
    and one column -1 where the token is in the top-k. vLLM sends -inf as -9999 (probability 0 all the same)."""
    choice = _choice(body)
    entries, ids = choice.get("prompt_logprobs"), choice.get("prompt_token_ids") or body.get("prompt_token_ids")
    if not isinstance(entries, list) or not isinstance(ids, list) or len(entries) != len(ids):
        raise ValueError("choices[0].prompt_logprobs / prompt_token_ids missing (the server must accept "
                         "prompt_logprobs and return_token_ids, as vLLM does)")
    width = k + 1
    out_ids = torch.full((max(len(ids) - 1, 0), width), -1, dtype=torch.long)
    out_logprobs = torch.zeros((max(len(ids) - 1, 0), width), dtype=torch.float32)
    for t, (token, entry) in enumerate(zip(ids[1:], entries[1:])):
        if not isinstance(entry, dict) or str(token) not in entry or not k <= len(entry) <= width:
            raise ValueError(f"position {t + 1}: {len(entry) if isinstance(entry, dict) else 'no'} log-probabilities"
                             f" for top-{k} plus prompt token {token}")
        others = [(int(i), item) for i, item in entry.items() if int(i) != token]
        if len(others) == k:  # the prompt's token is not in the top-k: its own column
            others.append((token, entry[str(token)]))
        for j, (i, item) in enumerate(others):
            if not isinstance(item, dict) or not isinstance(item.get("logprob"), (int, float)):
                raise ValueError(f"position {t + 1}: no log-probability for token {i}")
            out_ids[t, j], out_logprobs[t, j] = i, float(item["logprob"])
        if len(others) < width:  # it is in the top-k: put it in too (the loss drops a repeat)
            out_ids[t, len(others)] = token
            out_logprobs[t, len(others)] = float(entry[str(token)]["logprob"])
    return out_ids, out_logprobs


# A chat-formatted exchange: special tokens, text, digits and LaTeX, scored at every position.
PROBE_TEXT = ("<|im_start|>user\nWhat is 17 * 23? Put the answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
              "<think>\n17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 = 391.\n</think>\n\n"
              "The answer is \\boxed{391}.<|im_end|>")


def probe_token_ids(tokenizer) -> list[int]:
    return tokenizer.encode(PROBE_TEXT)
