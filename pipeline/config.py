"""PipelineConfig: every limit of every stage, in one checked dataclass."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from stages.reasoning import PARSERS as REASONING_PARSERS

__all__ = ["PipelineConfig", "default_cache_dir"]


def default_cache_dir() -> Path:
    """Where the embedded default checkpoint is written (``$VLM_PIPELINE_CACHE`` or ``~/.cache``)."""
    root = os.environ.get("VLM_PIPELINE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vlm-pipeline"
    )
    return Path(root)


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """Configuration of the pipeline; ``model=None`` selects the embedded default model."""

    # -- model --
    model: str | None = None
    # the names a request's "model" may carry (the first is the one reported); empty: the
    # checkpoint folder's name. Any other name is a 404 model_not_found.
    served_model_names: tuple[str, ...] = ()
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    # the language model's implementation (sampling/families.py): "transformers", the checkpoint's own
    # class over our paged attention; "native", the hand-written decoder (Mistral/Llama with default
    # RoPE); "auto", native where it computes the same model, else transformers
    model_impl: str = "auto"
    # the language model's weights and KV cache: "float32", "bfloat16", "float16", or "auto" (bfloat16
    # on CUDA, float32 elsewhere). Logits and sampling stay fp32; the vision encoder keeps its own.
    # On a CPU with native bf16 (AVX512-BF16, AMX) bfloat16 halves the decode step's matrix products
    # (docs/benchmarks.md#served); its tokens are bf16's, not fp32's.
    dtype: str = "auto"
    # The decode step's model forward compiled with torch.compile (sampling/compiled.py): "on", "off",
    # or "auto" (on where it was measured to pay: nowhere yet; on this CPU it did not, docs/benchmarks.md).
    # Compiled kernels are kept under cache_dir/inductor ($TORCHINDUCTOR_CACHE_DIR wins) between starts.
    compile_model: str = "auto"
    # Decode steps read their inputs (token ids, positions, block tables) from tensors allocated once,
    # each batch padded to a bucket of rows and of key blocks (sampling/decode_buffers.py): what a
    # CUDA graph replays. The same tokens as without on the CPU (tests/sampling/test_decode_buffers.py);
    # off: on the CPU there is no graph to replay and the padding only costs (docs/benchmarks.md).
    decode_buffers: bool = False
    cache_dir: Path = field(default_factory=default_cache_dir)

    # -- admission --
    # Requests admitted and not yet out of the preparation stages, plus those prepared and waiting for
    # room in the engine's command queue; beyond it: Overloaded (429). This is the bound that decides:
    # the first stage's inbox is sized to hold that many, so a burst is never refused earlier by a full
    # inbox (the stages behind it still hold stage_queue_size each), nor later by a full engine queue.
    max_pending_requests: int = 256
    retry_after_s: float = 1.0
    stage_queue_size: int = 16  # inbox of every stage after the first
    # What one chat request may hold, counted before anything renders or compiles it (a 400 naming the
    # field beyond it; pipeline/protocol/request_limits.py). OpenAI's bounds: 2,048 messages, 128 tools.
    max_messages: int = 2048
    max_content_parts: int = 8192  # content parts and earlier tool calls of every message together
    max_tools: int = 128
    # A request whose conversation or prompt is larger than this (characters of text, each message and
    # content part counting 256: about 0.1 s of rendering and tokenizing) is prepared in the template
    # stage's large lane, a thread of its own, so that small requests never wait behind it; at most
    # max_large_requests of them are in preparation at once (beyond: Overloaded, 429). A 4.95 M-character
    # message (under the prompt's text bound, so it reaches the tokenizer) held a template thread 3.2-3.7 s.
    template_large_request_chars: int = 256 * 1024
    max_large_requests: int = 8

    # -- fetch --
    allow_private_networks: bool = False
    media_root: str | None = None  # local files (file:// and bare paths) only under this folder
    fetch_connect_timeout_s: float = 5.0
    fetch_total_timeout_s: float = 20.0
    max_image_bytes: int = 20 * 1024 * 1024
    max_redirects: int = 3
    fetch_concurrency: int = 32
    # Of those, what one request's images may hold at once (at most fetch_concurrency): its other images
    # wait for its own, so a few requests with slow URLs cannot take every slot from the rest.
    fetch_concurrency_per_request: int = 4
    # Of those, what the fetches to one host (and port) may hold at once: requests whose image URLs
    # all name one slow host take this many slots, and the other hosts' images go on meanwhile.
    fetch_concurrency_per_host: int = 16

    # Run preparation work inline on the event loop: the naive baseline of the health benchmark,
    # never a serving setting.
    inline_preparation: bool = False

    # -- decode --
    max_image_pixels: int = 40_000_000  # decompression-bomb guard, checked before pixels are decoded
    decode_threads: int = 2  # thread mode

    # -- where image preparation runs --
    # "process": decode, image processor and (when it runs on the CPU) the vision encoder in worker
    # processes at a low CPU priority (stages/process_pool.py), so the event loop and the decode loop
    # never wait behind it; "thread": in threads of the serving process (the benchmarks' baseline).
    preparation_mode: str = "process"
    prep_workers: int = 0  # worker processes; 0: half the cores, at least 2 and at most 8
    prep_worker_nice: int = 19  # added to the workers' niceness: 19 is the lowest CPU priority
    prep_worker_timeout_s: float = 60.0  # a worker stuck on one image longer is killed and replaced
    prep_worker_task: str = "vision.image_worker:ImageTask"  # "module:factory" of the workers' job (tests)

    # -- template + tokenize --
    max_images_per_request: int = 8
    max_prompt_tokens: int = 16_384
    template_threads: int = 1
    # How a message's content reaches the chat template: "string" (its text as one string, what most
    # templates are written for), "openai" (a list of typed parts), or "auto": read from the template's
    # Jinja, as vLLM's --chat-template-content-format does (stages/chat_format.py)
    chat_template_content_format: str = "auto"
    # A Jinja chat template (its text, or the path of a file holding it) used instead of the tokenizer's
    chat_template: str | None = None
    # Control-token text ("[INST]", "<|im_end|>", ...) in messages, tool results, tools and template
    # variables is encoded as text by default, so that only the chat template writes control tokens and
    # no message can forge a turn (stages/control_tokens.py). True encodes it as the tokens it spells,
    # as transformers and vLLM do by default.
    allow_control_tokens_in_content: bool = False
    # Whether a request may bring its own chat template ("chat_template"). Off by default, as in vLLM
    # (--trust-request-chat-template): the template runs in transformers' Jinja sandbox, but nothing
    # bounds its loops, and one that runs for ever holds a template thread for ever.
    trust_request_chat_template: bool = False
    # How a reasoning model's thinking is told from its answer (stages/reasoning.py): "auto" (the
    # parser its tokenizer and chat template call for, none for a model that does not reason), a
    # parser's name ("deepseek_r1", "qwen3"), or "none" (the whole text is the answer, as before)
    reasoning_parser: str = "auto"
    # The checkpoint's generation_config.json sampling defaults (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_new_tokens) apply to requests that leave them unset: "auto" (vLLM's
    # default), "none" (OpenAI's defaults), or a folder holding a generation_config.json
    generation_config: str = "auto"

    # -- vision encode --
    vision_max_batch: int = 8
    vision_batch_wait_ms: float = 2.0
    # Batches encoded at once. 1 leaves a core to a decode engine that runs on the CPU (measured on
    # 2 cores: decode TPOT during an image burst x1.17 with 1, x2.1-2.4 with 2); where the engine runs
    # on a GPU, 2 raises preparation throughput (prep bench: 53 -> 63 req/s for base64 images).
    vision_encode_threads: int = 1
    # Where the vision encoder runs. "preparation": in the preparation stages (in the preparation
    # workers on a CPU, on the device in this process on a GPU). "engine": in the engine process,
    # beside the decoder on its device, with the embeddings cache there too: preparation sends pixels,
    # and no CUDA context or encoder weights stay in the serving process (engine_mode "process" only).
    # "auto": "engine" where the engine process runs on a GPU, else "preparation" (on the CPU the
    # workers' low-priority encodes keep the engine's core free).
    vision_encoder_placement: str = "auto"

    # Vision embeddings kept by image content (stages/encoder_cache.py), least recently used out; 0: off.
    # With the encoder in the engine process the embeddings are kept there, within this bound, and
    # the serving process keeps the images' pixels within it too (a hit skips decode and processor).
    encoder_cache_bytes: int = 256 * 1024 * 1024

    # -- grammar --
    grammar_cache_bytes: int = 512 * 1024 * 1024  # compiled grammars (and cached errors), least recent out
    grammar_max_concurrent_compiles: int = 2  # per backend
    # "auto": each request's backend from its features (stages/grammar/dispatch.py); "xgrammar" or
    # "llguidance" forces one (llguidance where it can compile the kind), for benchmarks and operators
    grammar_backend: str = "auto"
    grammar_compile_timeout_s: float = 30.0
    # A shutdown leaves compile threads running instead of waiting for them (one C++ call each that
    # cannot be interrupted; xgrammar's worst took 72 s here). The server sets it, so that it exits
    # within --shutdown-timeout; a library user's `async with Pipeline` waits (nothing left running).
    grammar_abandon_on_shutdown: bool = False
    # What one constraint may hold before it reaches a native compiler (stages/grammar/limits.py);
    # beyond a bound: a 400 naming the field and the limit. Chosen by measuring both backends
    # (xgrammar 0.2.8, llguidance 1.9) at several sizes of each kind (GrammarLimits says why each);
    # past them a chain of 3,000 $refs overflowed llguidance's stack and compile time and memory
    # grow faster than the input.
    grammar_max_bytes: int = 256 * 1024  # the constraint's JSON: schema, grammar, regex or choices
    grammar_max_schema_nodes: int = 10_000  # objects and arrays in one schema
    grammar_max_schema_depth: int = 128  # nesting levels, each $ref followed counting one more
    grammar_max_enum_values: int = 10_000  # entries of one enum or choice
    grammar_max_literal_bytes: int = 16 * 1024  # one const, enum value, choice or property name
    grammar_max_rules: int = 1_000  # rules of one EBNF/Lark grammar
    grammar_max_regex_bytes: int = 16 * 1024  # one regex or pattern
    grammar_max_nesting: int = 200  # parentheses nested in a grammar or regex
    # JSON grammars forbid free whitespace by default: a weak model under a grammar that allows it
    # writes "{" followed by whitespace until max_tokens.
    json_any_whitespace: bool = False

    # Structured answers that fail the answer check (never passed off as valid): without streaming
    # the choice is sampled again this many times, with seeds derived from the request's.
    answer_resample_attempts: int = 2

    # -- decode engine --
    max_running_seqs: int = 32
    max_model_len: int = 8192
    kv_block_size: int = 16
    num_kv_blocks: int | None = None  # None: enough for max_running_seqs sequences of max_model_len / 4
    prefill_chunk_tokens: int = 2048
    # A prefill chunk's tokens while other sequences decode (their next token waits for the chunk);
    # prefill_chunk_tokens when nothing decodes. An image span that must not be split (Gemma 3) and
    # is longer goes whole in a chunk of its own. Measured with bench tpot-under-load --burst-tokens 1
    # --timeline (tiny model, 2 shared cores, ~740-token image prompts): the engine's decode interval
    # p99 during the burst 24.6-27.4 ms at 256, 32.1-32.2 ms at 2048 (idle 10-12 ms); a prefill step
    # costs about 4 ms however short, so smaller budgets add steps (128: p99 16.2 ms, but a prefill
    # between almost every two decodes, p50 1.5x).
    prefill_chunk_tokens_with_decodes: int = 256
    # While sequences decode, the decode steps between two prefill chunks (1: prefill and decode steps
    # alternate while both have work). k > 1 slows one decode token in k instead of every one during
    # a burst of prompts, and holds each chunk for up to k decode steps (TTFT); a prefill is never
    # held when nothing decodes (sampling/scheduler.py). bench cadence (README, 2 shared cores): with
    # 64 prompts queued at once, k = 4 brings the decodes' TPOT p50 from 2.24x to 1.01x idle for 60%
    # more median TTFT; a lone prompt beside decodes waits 89 ms instead of 33. Served bursts
    # (tpot-under-load) reach the engine slower than alternation allows, and show no gain: 1.
    decode_steps_per_prefill: int = 1
    # How many sequences' prefill chunks one step may run in one forward, within the chunk's token
    # budget (sampling/prefill_batching.py); 1: one sequence a prefill step. A real model's step is
    # mostly reading its weights, which a batch of prompts shares: SmolLM2-135M served 16 concurrent
    # requests at 0.93x transformers' batched generate with 1, 1.18x with 32 (bench served, 2 cores).
    # On the embedded model a prefill's cost is its own compute, so the decodes a batch delays gain
    # nothing: bench tpot-under-load, 2 runs each, 1 / 32: TPOT p50 ratio 1.03-1.09 / 0.99-1.28, p99
    # 1.24-2.20 / 1.47-1.74 (docs/benchmarks.md).
    prefill_seqs_per_step: int = 32
    # Running decodes join a prefill step whose chunks are at most this many tokens, in one forward
    # (a mixed step, as vLLM v1 schedules them), which then prefills at most this many tokens; a decode
    # row is padded to the longest chunk in attention. 0: never (see prefill_seqs_per_step).
    mixed_chunk_tokens: int = 0
    default_max_tokens: int = 256
    # commands sent to the engine and not yet read (it reads between steps): the bound of what is in
    # flight to it, not a refusal. A prepared request that finds it full waits for room (admission
    # counts it: max_pending_requests)
    engine_queue_size: int = 64
    # "process": the engine (scheduler, model, sampler, grammar matchers) in its own process
    # (pipeline/engine/client.py), so the event loop and the decode loop never share a GIL;
    # "thread": the engine's step loop on a thread of the serving process (sampling/async_engine.py).
    # Process by default: it wins the targets here (README, Benchmarks): running decodes' TPOT p99
    # during a burst 1.67x idle against 5.14x (distinct images) and 1.06x against 4.10x (repeated),
    # text-only req/s x1.08-1.12 and TTFT p50 x0.79-0.84 of the thread's, /health p99 alike at
    # 208-214 against 131-141 req/s (repeated). It costs a second process and a start ~6 s longer
    # (the model loads there). Thread mode keeps one process: the benchmarks' same-run baseline, and
    # for library users who want no second process.
    engine_mode: str = "process"
    # process mode: an engine that holds requests and sends nothing for this long is killed and
    # started again (its requests get a 503 engine_failed); it sends at least 4 times a second while it
    # works or compiles a grammar whose verdict is awaited, so this bounds one step (a long prefill on
    # a CPU included), not a compile
    engine_step_timeout_s: float = 60.0
    engine_start_timeout_s: float = 300.0  # process mode: loading the model in a new engine process
    # process mode: torch's intra-op threads in the engine process; 0: torch's default (one per core);
    # None: by the model's size (pipeline/engine/threads.py): 1 for a model under 50M parameters, whose
    # ops are too small to share (the embedded model, 2 shared cores: one decode's TPOT 3.5 ms with 1
    # thread, 48-97 ms with 2, whose OpenMP workers spin against each other and the serving process),
    # one per core above (SmolLM2-135M served, bench served: 0.54x transformers' generate with 1
    # thread, 0.89x with 2)
    engine_torch_threads: int | None = None
    # The engine process's niceness (engine_mode "process"; -20..19, 0: the serving process's). Below 0
    # the decode loop takes a core ahead of the serving process's per-request work and the
    # preparation workers when they contend (it needs CAP_SYS_NICE; without it the engine logs a
    # warning and runs at 0).
    engine_process_nice: int = 0
    # Launch each decode step's forward before the last step's tokens are committed (sampling/ahead.py);
    # False: the synchronous loop. Off: on the 2-core CPU it does not pay (bench ahead, 3 runs of 7
    # pairs: median TPOT ratio 0.94-1.16 at batch 8 and 32, 0.98-1.13 at batch 1); on a GPU, try it.
    engine_one_step_ahead: bool = False
    # Write what a request's grammar forces (keys, quotes, separators) without a decode step per token:
    # appended after the sampled token and run as one extend in the next step (sampling/guided/forced.py).
    # The synchronous loop only (one step ahead, the next step is launched before they are known).
    forced_tokens: bool = True
    # Reuse the KV blocks of earlier prompts with the same prefix (sampling/prefix_cache.py); images
    # are keyed by content. False: every prompt is prefilled in full (n > 1 still shares its prompt).
    prefix_caching: bool = True
    # Keep every engine step's timing (kind, tokens, start, duration) for the benchmarks' step
    # timelines (``step_timeline()`` of either engine mode). Off when serving: the list only grows.
    record_step_timeline: bool = False

    def __post_init__(self) -> None:
        positive = {
            "max_pending_requests": self.max_pending_requests,
            "stage_queue_size": self.stage_queue_size,
            "max_image_bytes": self.max_image_bytes,
            "fetch_concurrency": self.fetch_concurrency,
            "fetch_concurrency_per_request": self.fetch_concurrency_per_request,
            "fetch_concurrency_per_host": self.fetch_concurrency_per_host,
            "max_image_pixels": self.max_image_pixels,
            "decode_threads": self.decode_threads,
            "max_images_per_request": self.max_images_per_request,
            "max_prompt_tokens": self.max_prompt_tokens,
            "template_threads": self.template_threads,
            "max_messages": self.max_messages,
            "max_content_parts": self.max_content_parts,
            "max_tools": self.max_tools,
            "template_large_request_chars": self.template_large_request_chars,
            "max_large_requests": self.max_large_requests,
            "vision_max_batch": self.vision_max_batch,
            "vision_encode_threads": self.vision_encode_threads,
            "grammar_cache_bytes": self.grammar_cache_bytes,
            "grammar_max_concurrent_compiles": self.grammar_max_concurrent_compiles,
            "grammar_max_bytes": self.grammar_max_bytes,
            "grammar_max_schema_nodes": self.grammar_max_schema_nodes,
            "grammar_max_schema_depth": self.grammar_max_schema_depth,
            "grammar_max_enum_values": self.grammar_max_enum_values,
            "grammar_max_literal_bytes": self.grammar_max_literal_bytes,
            "grammar_max_rules": self.grammar_max_rules,
            "grammar_max_regex_bytes": self.grammar_max_regex_bytes,
            "grammar_max_nesting": self.grammar_max_nesting,
            "max_running_seqs": self.max_running_seqs,
            "max_model_len": self.max_model_len,
            "kv_block_size": self.kv_block_size,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "prefill_chunk_tokens_with_decodes": self.prefill_chunk_tokens_with_decodes,
            "decode_steps_per_prefill": self.decode_steps_per_prefill,
            "prefill_seqs_per_step": self.prefill_seqs_per_step,
            "default_max_tokens": self.default_max_tokens,
            "engine_queue_size": self.engine_queue_size,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"PipelineConfig.{name} must be positive, got {value}")
        if self.grammar_backend not in ("auto", "xgrammar", "llguidance"):
            raise ValueError(
                f"PipelineConfig.grammar_backend must be auto, xgrammar or llguidance, got {self.grammar_backend!r}"
            )
        if self.encoder_cache_bytes < 0:
            raise ValueError("PipelineConfig.encoder_cache_bytes must be >= 0")
        if self.preparation_mode not in ("process", "thread"):
            raise ValueError(
                f"PipelineConfig.preparation_mode must be process or thread, got {self.preparation_mode!r}"
            )
        if self.engine_torch_threads is not None and self.engine_torch_threads < 0:
            raise ValueError("PipelineConfig.engine_torch_threads must be None or >= 0")
        if self.mixed_chunk_tokens < 0:
            raise ValueError(f"PipelineConfig.mixed_chunk_tokens must be >= 0, got {self.mixed_chunk_tokens}")
        if not -20 <= self.engine_process_nice <= 19:
            raise ValueError(f"PipelineConfig.engine_process_nice must be in -20..19, got {self.engine_process_nice}")
        if self.engine_mode not in ("thread", "process"):
            raise ValueError(f"PipelineConfig.engine_mode must be thread or process, got {self.engine_mode!r}")
        if self.vision_encoder_placement not in ("auto", "preparation", "engine"):
            raise ValueError(
                "PipelineConfig.vision_encoder_placement must be auto, preparation or engine, "
                f"got {self.vision_encoder_placement!r}"
            )
        if self.vision_encoder_placement == "engine" and self.engine_mode != "process":
            raise ValueError('PipelineConfig.vision_encoder_placement "engine" needs engine_mode "process"')
        if self.prep_workers < 0 or not 0 <= self.prep_worker_nice <= 19:
            raise ValueError("PipelineConfig.prep_workers must be >= 0 and prep_worker_nice in 0..19")
        if self.answer_resample_attempts < 0:
            raise ValueError("PipelineConfig.answer_resample_attempts must be >= 0")
        if self.max_redirects < 0:
            raise ValueError("PipelineConfig.max_redirects must be >= 0")
        timeouts = (
            "fetch_connect_timeout_s",
            "fetch_total_timeout_s",
            "grammar_compile_timeout_s",
            "prep_worker_timeout_s",
            "engine_step_timeout_s",
            "engine_start_timeout_s",
        )
        for name in timeouts:
            if getattr(self, name) <= 0:
                raise ValueError(f"PipelineConfig.{name} must be positive")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"PipelineConfig.device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.model_impl not in ("auto", "transformers", "native"):
            raise ValueError(f"PipelineConfig.model_impl must be auto, transformers or native, got {self.model_impl!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"PipelineConfig.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.compile_model not in ("auto", "on", "off"):
            raise ValueError(f"PipelineConfig.compile_model must be auto, on or off, got {self.compile_model!r}")
        if self.chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(
                "PipelineConfig.chat_template_content_format must be auto, string or openai, "
                f"got {self.chat_template_content_format!r}"
            )
        if self.reasoning_parser not in ("auto", "none", *REASONING_PARSERS):
            raise ValueError(
                f"PipelineConfig.reasoning_parser must be auto, none or one of {sorted(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("PipelineConfig.num_kv_blocks must be positive")

    def num_prep_workers(self) -> int:
        """The preparation pool's size (``prep_workers``, or from the core count)."""
        return self.prep_workers or max(2, min(8, (os.cpu_count() or 2) // 2))

    def encoder_in_engine(self) -> bool:
        """Whether the vision encoder runs in the engine process (``vision_encoder_placement``)."""
        if self.vision_encoder_placement == "auto":
            return self.engine_mode == "process" and self.resolved_device().startswith("cuda")
        return self.vision_encoder_placement == "engine"

    def resolved_device(self) -> str:
        """The torch device string this config runs on."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
