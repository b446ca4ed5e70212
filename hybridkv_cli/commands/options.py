"""The commands' shared options and help texts, each declared once."""

from __future__ import annotations

import inspect
import re
from typing import Optional

import typer

from hybridkv_cli.io.errors import UsageError

# Options shared by `ask` and `profile`, declared once.
ARGS = typer.Argument(..., metavar="MEDIA... QUESTION", help="A video, image files or a directory, then the question "
                      "(with --context: the question only).")
ASK_ARGS = typer.Argument(None, metavar="MEDIA... QUESTION", help="A video, image files or a directory, then the "
                          "question (with --context: the question only; with -Q/--questions: the media only, none "
                          "with --context).", show_default=False)
MODEL_HELP = ("Hub id or local directory (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision), 'demo' (offline tiny "
              "video-QA model), 'demo-random[:qwen2vl|qwen3vl|llava-ov]', 'smollm2' or a .gguf file (text models)")
MODEL = typer.Option("Qwen/Qwen2.5-VL-7B-Instruct", help=MODEL_HELP + ".")
CONTEXT = typer.Option(None, "--context", metavar="FILE", help="Ask about the text in FILE instead of media "
                       "(a text prompt: its tokens take the visual tokens' role); - reads stdin.")
BUDGET = typer.Option(None, help="Device-resident prompt KV as a share of the full cache, in (0, 1] [default: 0.1; "
                      "full: always 1].")
WINDOW = typer.Option(None, help="Methods that score with the last prompt queries (hybridkv, rcr, snapkv, "
                      "madakv, sparsemm): observation window, always kept [default: 32; hybridkv: 16].")
THETA = typer.Option(None, help="HybridKV θ: heads whose sparsity score is >= θ are static [default: 0.9].")
TOPK = typer.Option(None, help="HybridKV p: the sparsity score is the attention mass on the top p·N tokens "
                    "[default: 0.05].")
SHARE = typer.Option(None, help="HybridKV r: a dynamic head's budget as a share of the average head budget "
                     "[default: 0.75].")
CHUNK = typer.Option(None, help="HybridKV: tokens per retrieval chunk [default: 1 with --landmark keys; "
                     "else 16, or 8 where a dynamic head holds fewer than two chunks of 16].")
SINK_AWARE = typer.Option(None, "--sink-aware/--no-sink-aware", help="HybridKV: score heads without the first 4 "
                          "tokens (attention sinks) [default: the method's].")
LANDMARK = typer.Option(None, help="HybridKV: how dynamic heads rank chunks: keys (every token's key at 2 bits) | "
                        "host-keys (the same in host memory, read every step) | labels (a quarter of the channels "
                        "at 2 bits, then the candidates' 2-bit keys from the host: a quarter of the device bytes) | "
                        "minmax | mean | detector | auto (keys unless they would cost over half the budget, then "
                        "host-keys with every head dynamic) [default: auto].")
INDEX_FILE = typer.Option(None, metavar="FILE", help="hybridkv --landmark labels: the label file of this model "
                          "(hybridkv calibrate) [default: label channels chosen from the prompt].")
REFRESH = typer.Option(None, help="hybridkv (static heads) / rcr: refresh while decoding: rcr | periodic | none "
                       "[default: the method's].")
REFRESH_RATE = typer.Option(None, help="rcr refresh: target share of layer-steps that "
                            "re-select [default: 0.4].")
REFRESH_PERIOD = typer.Option(None, help="periodic refresh: every T-th decode step [default: 3].")
SWAPS = typer.Option(None, help="HybridKV with 2-bit keys: most tokens a dynamic head takes in per decode step "
                     "that it does not hold, so a step copies a bounded number of rows from host memory; 0: no "
                     "cap [default: 0].")
STICKINESS = typer.Option(None, help="HybridKV with 2-bit keys: logits a held token gains in the ranking, so a "
                          "newcomer is copied in only when it beats it by that much [default: 0].")
REFRESH_SLOTS = typer.Option(None, help="refresh: most entries per head that a refresh re-selects (c); the "
                             "rest keep the prefill's best [default: 256].")
SINKS = typer.Option(None, help="streamingllm: attention-sink tokens kept at the start [default: 4].")
PAGE_SIZE = typer.Option(None, help="quest: tokens per page [default: 8].")
ROUTE = typer.Option(None, metavar="FILE", help="route: the method of each layer, a JSON route file (`hybridkv "
                     "route` builds one) or a pattern like hybridkv,snapkv repeated over the layers.")
HEAD_SCORES = typer.Option(None, metavar="FILE", help='sparsemm: JSON {"scores": [[per KV head] per layer]} '
                           "(offline head scores) instead of scores computed from the prompt.")
FRAMES = typer.Option(64, help="Frames sampled uniformly from a video.")
FPS = typer.Option(None, help="Sample frames at this rate instead of --frames.")
DEFER = typer.Option(False, "--defer-question", help="Compress the cache before the question is read; the "
                     "question then goes through the compressed cache (as a later question about an "
                     "already-compressed video would).")
STREAM = typer.Option("auto", "--stream", help="Prefill in chunks, each layer keeping a bounded working set "
                      "on the device while it reads, the question read after compression: auto (media of more "
                      "than 65536 tokens, or a video read with --max-frames) | on | off.")
STREAM_CHUNK = typer.Option(2048, "--stream-chunk", help="Streamed prefill: tokens read per chunk (cut between "
                            "frames, never inside an image or a 2-frame group).")
STREAM_WINDOW = typer.Option(16384, "--stream-window", help="Streamed prefill: earlier tokens each layer attends to "
                             "while reading (the rest wait in host memory for the compression).")
STREAM_KV_TOKENS = typer.Option(None, "--stream-kv-tokens", help="Streamed prefill: the compressed KV a head "
                                "keeps at most, in tokens, however long the video (the budget becomes "
                                "min(--budget, N / prompt tokens)): device KV flat in length.")
MAX_FRAMES = typer.Option(None, "--max-frames", help="Read one video as a stream, its frames decoded while the "
                          "prompt is prefilled in chunks: at most N frames (at --fps if given, else N spread over "
                          "it), or 'all' (every frame, or all at --fps). Each frame keeps a 64-frame clip's size.")
MAX_PIXELS = typer.Option(None, help="Max pixels per frame/image (resized by Qwen2.5-VL's rules).")
DEVICE = typer.Option("auto", help="auto | cuda | cpu")
DTYPE = typer.Option("auto", help="auto | bfloat16 | float16 | float32")
JSON = typer.Option(False, "--json", help="Print one JSON object on stdout (one input only).")
DEBUG = typer.Option(False, help="Show tracebacks.")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress bar or status spinners on stderr (errors and "
                     "warnings still show).")
# Options of runs over many inputs (see hybridkv_cli/runs/batch.py).
EACH = typer.Option(False, "--each", help="Each media argument is its own input (a directory: each video/image "
                    "file in it, natural order), all with the same question and one model load.")
JSONL = typer.Option(False, "--jsonl", help="Print one JSON line per input on stdout as soon as it is done; a failed "
                     'input gives {"input": PATH, "error": {"type": ..., "message": ...}}.')
OUTPUT = typer.Option(None, "--output", "-o", metavar="FILE", help="Append the JSON lines to FILE (whole lines, "
                      "fsynced one by one).")
ASK_MODEL = typer.Option(None, help=MODEL_HELP + " [default: Qwen/Qwen2.5-VL-7B-Instruct; .hkv inputs: the "
                         "file's model].")
SYSTEM = typer.Option(None, "--system", metavar="TEXT", help="A system prompt, rendered before the media in "
                      "the chat template (so compressed with it) [default: the template's own].")
TEMPERATURE = typer.Option(0.0, metavar="T", help="Sample each answer token at this temperature (0 to 2; with "
                           "--top-p and --seed, the same tokens alone or in a batch) [default: 0: greedy].")
TOP_P = typer.Option(1.0, "--top-p", metavar="P", help="With --temperature: draw from the smallest set of tokens "
                     "whose probability reaches P.")
SEED = typer.Option(None, metavar="N", help="With --temperature: the seed of the draws (the record's "
                    "sampling.seed draws an answer again) [default: a fresh one per run].")
PRESENCE_PENALTY = typer.Option(0.0, "--presence-penalty", metavar="X", help="Lower the logit of every token the "
                                "answer already holds by X (-2 to 2; OpenAI's presence_penalty).")
FREQUENCY_PENALTY = typer.Option(0.0, "--frequency-penalty", metavar="X", help="Lower the logit of every token the "
                                 "answer already holds by X per time it holds it (-2 to 2; OpenAI's "
                                 "frequency_penalty).")
QUESTION = typer.Option(None, "--question", "-Q", metavar="TEXT", help="A question (repeat for several): the "
                        "arguments are then all media; the media is compressed once and every question answered "
                        "from that compressed cache (as --defer-question does), one record each.")
QUESTIONS = typer.Option(None, "--questions", metavar="FILE", help="Questions, one per line, or JSON lines "
                         '{"question": ..., "answer"?: ...} (an answer adds "expected" and "correct" to the record); '
                         "asked like repeated --question.")
RESUME = typer.Option(False, "--resume", help="With --output: skip inputs already answered in FILE (failed ones "
                      "are retried).")

ASK_HELP = (
    "Answer QUESTION about MEDIA, with latency, KV memory and head-classification reports.\n\n"
    "MEDIA is a video, one or more image files (one image set), or a directory of images (one image set). "
    "With --each every media argument is its own input (a directory: every video and image in it); with - the "
    "paths are read from stdin, one per line (blank lines ignored), each its own input. The model is loaded once "
    "for all inputs.\n\n"
    "Several questions: -Q/--question (repeat) or --questions FILE; the arguments are then all media, each "
    "compressed once and every question answered from that compressed cache (one record per question). A .hkv "
    "file (`hybridkv compress`) is a saved compressed cache: `hybridkv ask clip.hkv QUESTION` answers without the "
    "media, with the file's model, dtype and method.\n\n"
    "Output on stdout: a human report per input; --json: one JSON object (one input only); --jsonl: one JSON "
    'line per input, a failed input as {"input": PATH, "error": {"type": ..., "message": ...}}. --output FILE '
    "appends the same lines to FILE (stdout then stays empty unless --jsonl); --resume skips the inputs FILE "
    "already answered (failed ones are retried). Progress, warnings and errors go to stderr.\n\n"
    "Exit status: 0 every input answered; 1 an input failed (the others still ran) or the model did not load; "
    "2 bad command line; "
    "130 interrupted by Ctrl-C, 143 by SIGTERM, 129 by SIGHUP (completed lines are kept)."
)


BENCH_HELP = (
    "Compare compression methods × budgets on MEDIA... QUESTION (one input) or on --tasks FILE.jsonl.\n\n"
    "Every input runs once with the full cache (the reference) and once per method and budget, greedy, the same "
    "--max-new-tokens for all. Per method and budget: accuracy (the expected answer occurs in the output), "
    "fidelity (ROUGE-L F1 vs the full-cache output), device KV ratio, ms/token and host->device traffic per step. "
    'Task rows: {"id"?, "question", "answer"?, "context"? | "media"?}: the answer a string or a list of them, '
    "the media a path or a list of paths (relative to the file). See docs/bench.md.\n\n"
    "Exit status: 0 every run completed; 1 a run failed (the others still ran); 2 bad command line or task file."
)


COMPRESS_HELP = (
    "Prefill and compress MEDIA once (no question) and save the compressed cache to a .hkv file, to be asked "
    "later with `hybridkv ask FILE.hkv QUESTION` (or many questions: -Q, --questions) without decoding or "
    "encoding the media again.\n\n"
    "MEDIA is a video, image files (one image set) or a directory of images; with --each every argument is its "
    "own input (a directory: every video and image in it) and -o names a folder that gets NAME.hkv per input. "
    "--resume skips inputs whose cache file already holds this cache (one made with another model, method or "
    "options is compressed again). The file (safetensors, written atomically) holds the "
    "method and its options and the model it was made with; `ask` refuses it with another model, dtype, method "
    "or hybridkv version.\n\n"
    "Exit status: 0 every input compressed; 1 an input failed (the others still ran); 2 bad command line."
)

# Runs over many processes, GPUs and machines (see hybridkv_cli/runs/distributed.py, docs/scale-out.md).
WORKERS = typer.Option(None, "--workers", min=1, max=1024, metavar="N", help="Answer the inputs with N Ray workers "
                       '(at most 1024), one model load each, on a local Ray runtime (or the --ray cluster); needs pip '
                       'install -e ".[ray]".')
RAY = typer.Option(None, "--ray", metavar="ADDRESS", help="Join the Ray cluster at ADDRESS (host:port, or auto) and "
                   "answer there [--workers default: one per --gpus-per-worker GPUs of the cluster]; a cluster that "
                   "does not answer within 30 s is an error.")
GPUS_PER_WORKER = typer.Option(0.0, "--gpus-per-worker", min=0.0, max=1024.0, help="GPUs each Ray worker holds (a "
                               "fraction packs several workers on one GPU) [default: 0, the CPU].")

# Many generations decoded together on one device (hybridkv_cli/engine/, docs/batching.md).
BATCH_SIZE = typer.Option(None, "--batch-size", min=1, metavar="N", help="Decode up to N answers together "
                          "(inputs, or the questions of -Q/--questions; continuous batching: one joins as another "
                          "finishes; with --workers, in each worker) [default: 1, or as many as --kv-memory admits].")
KV_MEMORY = typer.Option(None, "--kv-memory", metavar="SIZE", help="Admit inputs to the batch while their device KV "
                         "(measured) stays within SIZE, e.g. 4GiB or 512MB: a compressed cache admits more.")
CUDA_GRAPHS = typer.Option(False, "--cuda-graphs", help="Decode through the batch decoder and, on CUDA, replay each "
                           "decode step as a CUDA graph (methods without per-step host work; the others run eagerly). "
                           "Not yet validated on a GPU: off by default.")


# --- method options ---------------------------------------------------------------------------------
# Each method option's type and flag, declared once; a command takes the ones it names through
# @method_options and receives them as one MethodOptions. Their values are checked where every
# method is built (hybridkv_cli/compression/option_values.py), not by the parser.
_FLAGS = {
    "budget": (Optional[float], BUDGET), "window": (Optional[int], WINDOW), "theta": (Optional[float], THETA),
    "sparsity_topk": (Optional[float], TOPK), "share": (Optional[float], SHARE), "chunk_size": (Optional[int], CHUNK),
    "sink_aware": (Optional[bool], SINK_AWARE), "landmark": (Optional[str], LANDMARK),
    "refresh": (Optional[str], REFRESH), "refresh_rate": (Optional[float], REFRESH_RATE),
    "refresh_period": (Optional[int], REFRESH_PERIOD), "refresh_slots": (Optional[int], REFRESH_SLOTS),
    "sinks": (Optional[int], SINKS), "page_size": (Optional[int], PAGE_SIZE),
    "head_scores": (Optional[str], HEAD_SCORES), "route": (Optional[str], ROUTE),
    "index_file": (Optional[str], INDEX_FILE), "swaps": (Optional[int], SWAPS),
    "stickiness": (Optional[float], STICKINESS),
}
HYBRIDKV_OPTIONS = ("window", "theta", "sparsity_topk", "share", "chunk_size", "sink_aware", "landmark", "index_file",
                    "refresh",
                    "refresh_rate", "refresh_period", "refresh_slots", "swaps", "stickiness")
ALL_OPTIONS = tuple(_FLAGS)


def method_options(names: tuple[str, ...]):
    """Give a command the method options ``names`` as flags, and hand them to it as one
    :class:`~hybridkv_cli.compression.registry.MethodOptions` in its ``options`` parameter."""

    def wrap(command):
        signature = inspect.signature(command, eval_str=True)  # its annotations, evaluated where it lives
        own = [p for p in signature.parameters.values() if p.name != "options"]
        flags = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=_FLAGS[n][1], annotation=_FLAGS[n][0])
                 for n in names]

        def run(**given):
            from hybridkv_cli.compression.registry import MethodOptions

            return command(options=MethodOptions(**{n: given.pop(n) for n in names}), **given)

        run.__name__, run.__doc__ = command.__name__, command.__doc__
        run.__signature__ = signature.replace(parameters=own + flags)
        return run

    return wrap


def decode_limits(batch_size: int | None, kv_memory: str | None, cuda_graphs: bool):
    """The decode limits ``--batch-size``, ``--kv-memory`` and ``--cuda-graphs`` give (a
    UsageError for a bad size); on Ray workers, each worker's."""
    from hybridkv_cli.engine import Limits
    return Limits(batch_size, None if kv_memory is None else parse_size(kv_memory, "--kv-memory"), cuda_graphs)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str, flag: str) -> int:
    """Bytes of a size such as ``4GiB``, ``512MB`` or ``1e9`` (a UsageError naming ``flag`` if not one)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if unit not in _UNITS or float(m.group(1)) <= 0:
        raise UsageError(f"expected a size such as 4GiB or 512MB, got '{text}'", flag)
    size = float(m.group(1)) * _UNITS[unit]
    if not size < 2**63:  # 1e999GiB is infinite
        raise UsageError(f"'{text}' is too large (at most 8 EiB)", flag)
    if size < 1:
        raise UsageError(f"'{text}' is less than one byte", flag)
    return int(size)


def streaming(mode: str, chunk: int, window: int, kv_tokens: int | None = None):
    """The streaming options (a usage error names a bad one)."""
    from hybridkv_cli.engine.stream import Streaming

    return Streaming(mode, chunk, window, kv_tokens)


def sampling(temperature: float, top_p: float, seed: int | None, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0):
    """The sampling options (a usage error names a bad one; each is checked even where
    temperature 0 leaves it unused)."""
    from hybridkv_cli.engine.sampling import Sampling

    for flag, field, value in (("--temperature", "temperature", temperature), ("--top-p", "top_p", top_p),
                               ("--seed", "seed", seed or 0), ("--presence-penalty", "presence_penalty",
                                                               presence_penalty),
                               ("--frequency-penalty", "frequency_penalty", frequency_penalty)):
        try:
            Sampling(**{field: value})
        except ValueError as e:
            raise UsageError(str(e), flag) from None
    return Sampling.of(temperature, top_p, seed, presence_penalty, frequency_penalty)


def max_frames_arg(value: str | None, fps: float | None, max_pixels: int | None, stream) -> int | str | None:
    """``--max-frames`` checked with the flags it goes with: a whole number >= 2, ``"all"``, or
    None (not given: the video is sampled and decoded up front)."""
    from hybridkv_cli.media.frame_stream import check_max_frames, check_stream_args

    if value is None:
        return None
    if stream.mode == "off":
        raise UsageError("--max-frames reads the video while prefilling in chunks: not with --stream off",
                         "--max-frames")
    cap = check_max_frames(value)
    check_stream_args(frames=cap or 2, fps=fps, max_frames=cap, max_pixels=max_pixels)
    return "all" if cap is None else cap
