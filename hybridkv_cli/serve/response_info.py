"""What a finished answer tells its client besides the text: OpenAI's ``usage`` and ``logprobs``,
and the response's ``hybridkv`` field (how it was compressed, decoded, batched and whether its
prefix was kept)."""

from __future__ import annotations


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's ``usage``; ``cached_tokens``: the prompt prefix served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def hybridkv_info(record: dict, cache_hit: bool, tier: str, prefill_s: float) -> dict:
    """The ``hybridkv`` field from the answer's record (as ``ask -Q`` makes it), where its prefix
    came from (``tier`` of a hit) and, when this request made the prefix, its ``prefill_s``."""
    info = {k: record[k] for k in ("method", "budget", "prefill_s", "decode", "kv")}
    info["input"] = {k: v for k, v in record["input"].items() if k != "files"}
    batch = record.get("batch")  # how it was decoded: joined at which step, beside how many others
    info["batch"] = {k: batch[k] for k in ("joined_step", "size_max", "size_mean", "kv_device_bytes_peak",
                                            "kv_memory")} if batch else None
    info["sampling"] = record.get("sampling")  # how it was drawn: its seed, penalties (None: greedy, none)
    info["prefix_cache_hit"] = cache_hit
    info["prefix_cache_tier"] = tier if cache_hit else None
    info["prefix_prefill_s"] = None if cache_hit else prefill_s
    return info


def covering(tokenizer, tokens: list[int], text: str, start: int = 0) -> int:
    """The fewest of ``tokens`` (at least ``start``) whose text, leading space stripped, covers
    ``text`` (an answer's text so far or in full, which an answer cut at a stop string or ended by
    the end-of-sequence token leaves tokens after): a binary search."""
    made, kept = start, len(tokens)
    while made < kept:
        middle = (made + kept) // 2
        covered = len(tokenizer.decode(tokens[:middle], skip_special_tokens=True).lstrip()) >= len(text)
        made, kept = (made, middle) if covered else (middle + 1, kept)
    return made


def logprobs(tokenizer, tokens: list[int], entries: list) -> dict:
    """OpenAI's ``logprobs`` of some answer tokens: each one's text (special tokens by name), bytes
    and log probability with its best alternatives (``entries`` from the engine, one per token)."""
    content = [{**_token(tokenizer, token, logprob),
                "top_logprobs": [_token(tokenizer, other, value) for other, value in best]}
               for token, (logprob, best) in zip(tokens, entries)]
    return {"content": content, "refusal": None}


def _token(tokenizer, token: int, logprob: float) -> dict:
    piece = tokenizer.decode([token])
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}
