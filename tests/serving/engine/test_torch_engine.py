"""The torch engine on CPU with the tiny shape: real tokens, both KV layouts, aborts, preemption."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

from torch.nn import functional as F  # noqa: E402

from serving.engine import EngineError, EngineRequest, make_engine  # noqa: E402
from serving.engine.streams import VOCAB_SIZE, detokenize  # noqa: E402
from serving.engine.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402
from serving.engine.torch_engine.model import SHAPES, build_model  # noqa: E402
from serving.engine.torch_engine.prompt import prompt_token_ids  # noqa: E402

TORCH_READY_GUARD_S = 300.0
TINY = {"model_shape": "tiny", "device": "cpu"}


def requests(count: int, max_tokens: int = 9) -> list[EngineRequest]:
    """Mixed prompt lengths (some longer than the token budget, so prefill is chunked)."""
    return [
        EngineRequest(f"r{i}", 5 + 17 * i, max_tokens + i % 3, seed=i, prompt="tok " * (3 + 9 * i))
        for i in range(count)
    ]


async def collect(engine, request: EngineRequest) -> tuple[list[int], str | None, str]:
    ids: list[int] = []
    text = ""
    reason = None
    async for chunk in engine.generate(request):
        ids.extend(chunk.token_ids)
        text += chunk.text
        reason = chunk.finish_reason
    return ids, reason, text


async def run_all(engine: TorchEngine, reqs: list[EngineRequest]) -> list[tuple]:
    try:
        return await asyncio.gather(*(collect(engine, r) for r in reqs))
    finally:
        await engine.close()


class FullRecompute:
    """Reference attention with no KV cache: plain causal attention over the whole sequence."""

    def __call__(self, layer: int, q, k, v):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)


def reference_tokens(request: EngineRequest, seed: int = 0) -> list[int]:
    """Greedy decoding by recomputing the whole sequence each token: what the engine must match."""
    shape = SHAPES["tiny"]
    model = build_model(shape, 512, torch.device("cpu"), torch.float32, seed)
    ids = prompt_token_ids(request, shape.vocab_size)
    out: list[int] = []
    for _ in range(request.max_tokens):
        logits = model(torch.tensor(ids), torch.arange(len(ids)), FullRecompute())
        token = int(logits[-1].argmax())
        ids.append(token)
        out.append(token)
    return out


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_engine_matches_full_recompute_with_chunked_prefill(layout: str) -> None:
    reqs = requests(6)
    engine = TorchEngine(
        TorchEngineConfig(**TINY, kv_layout=layout, max_num_seqs=3, max_num_batched_tokens=40)
    )
    results = asyncio.run(run_all(engine, reqs))
    for req, (ids, reason, text) in zip(reqs, results, strict=True):
        assert ids == reference_tokens(req)
        assert reason == "length"
        assert text == detokenize([i % VOCAB_SIZE for i in ids])
    assert engine.stats().steps > max(r.max_tokens for r in reqs)


def test_both_layouts_give_the_same_tokens() -> None:
    reqs = requests(10)
    outs = {}
    for layout in ("paged", "contiguous"):
        engine = TorchEngine(
            TorchEngineConfig(**TINY, kv_layout=layout, max_num_seqs=4, max_num_batched_tokens=64)
        )
        outs[layout] = [ids for ids, _, _ in asyncio.run(run_all(engine, reqs))]
    assert outs["paged"] == outs["contiguous"]
    assert len({tuple(ids) for ids in outs["paged"]}) > 1, "different prompts, different streams"


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_concurrent_requests_finish_with_exactly_max_tokens_under_preemption(layout: str) -> None:
    reqs = requests(12, max_tokens=14)
    engine = TorchEngine(
        TorchEngineConfig(
            **TINY, kv_layout=layout, max_num_seqs=8, max_num_batched_tokens=96, num_kv_blocks=24
        )
    )
    results = asyncio.run(run_all(engine, reqs))
    for req, (ids, reason, _) in zip(reqs, results, strict=True):
        assert (len(ids), reason) == (req.max_tokens, "length")
    stats = engine.stats()
    assert stats.preemptions > 0, "24 blocks for 12 growing sequences must preempt"
    assert stats.running == stats.waiting == stats.live_tokens == 0
    engine.kv.check()
    assert engine.kv.used_blocks == 0
    assert [ids for ids, _, _ in results[:2]] == [reference_tokens(r) for r in reqs[:2]]


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_abort_frees_blocks_and_tensors(layout: str) -> None:
    async def main() -> None:
        engine = TorchEngine(TorchEngineConfig(**TINY, kv_layout=layout, max_num_seqs=4))
        long = [EngineRequest(f"a{i}", 40, 400, seed=i) for i in range(3)]
        streams = [engine.generate(r) for r in long]
        for stream in streams:
            await anext(stream)
        before = engine.stats()
        assert before.kv_blocks_used > 0 and before.running == 3
        kv_bytes_before = engine.store.nbytes
        engine.abort("a1")
        last = None
        async for chunk in streams[1]:
            last = chunk
        assert last is not None and last.finish_reason == "abort"
        for _ in range(2):  # the first may be buffered; the second waits for a step to finish
            await anext(streams[0])
        after = engine.stats()
        assert after.running == 2
        assert engine.kv.tokens("a1") == 0 and "a1" not in engine.kv.holders()
        engine.kv.check()
        if layout == "contiguous":
            assert "a1" not in engine.store.tensors
            assert engine.store.nbytes < kv_bytes_before
        for stream in (streams[0], streams[2]):
            await stream.aclose()
        for _ in range(5000):  # bounded: a tiny step takes about a millisecond
            if not engine.in_step:
                break
            await asyncio.sleep(0.001)
        assert engine.stats().kv_blocks_used == 0
        assert engine.store.nbytes == (0 if layout == "contiguous" else kv_bytes_before)
        await engine.close()

    asyncio.run(main())


def test_model_runs_in_a_worker_thread_not_the_event_loop() -> None:
    async def main() -> set[str]:
        engine = TorchEngine(TorchEngineConfig(**TINY))
        threads: set[str] = set()
        execute = engine.runner.execute

        def recording(slices):
            threads.add(threading.current_thread().name)
            return execute(slices)

        engine.runner.execute = recording  # type: ignore[method-assign]
        await run_all(engine, requests(2))
        return threads

    threads = asyncio.run(main())
    assert threads and all(name.startswith("torch-engine") for name in threads)


def test_errors_close_and_make_engine() -> None:
    async def main() -> None:
        engine = make_engine("torch", **TINY, max_model_len=64)
        assert isinstance(engine, TorchEngine)
        with pytest.raises(EngineError) as too_long:
            await anext(engine.generate(EngineRequest("big", 60, 10)))
        assert too_long.value.code == "prompt_too_long"
        stream = engine.generate(EngineRequest("x", 8, 50))
        await anext(stream)
        with pytest.raises(EngineError) as dup:
            await anext(engine.generate(EngineRequest("x", 8, 5)))
        assert dup.value.code == "bad_request"
        await engine.close()
        with pytest.raises(EngineError) as down:
            async for _ in stream:
                pass
        assert down.value.code == "engine_down"
        assert engine.stats().kv_blocks_used == 0

    asyncio.run(main())
    with pytest.raises(ValueError, match="kv_layout"):
        TorchEngineConfig(kv_layout="ring")


def test_safetensors_weights_load_and_tie_the_lm_head(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    source = build_model(SHAPES["tiny"], 64, torch.device("cpu"), torch.float32, seed=7)
    state = {k: v.contiguous() for k, v in source.state_dict().items() if k != "lm_head.weight"}
    with torch.no_grad():
        source.lm_head.weight.copy_(source.model.embed_tokens.weight)
    save_file(state, str(tmp_path / "model.safetensors"))
    req = EngineRequest("w", 12, 6, prompt="the same prompt")
    loaded = TorchEngine(TorchEngineConfig(**TINY, seed=0, weights_path=str(tmp_path)))
    ((ids, _, _),) = asyncio.run(run_all(loaded, [req]))
    prompt = prompt_token_ids(req, SHAPES["tiny"].vocab_size)
    logits = source(torch.tensor(prompt), torch.arange(len(prompt)), FullRecompute())
    assert ids[0] == int(logits[-1].argmax())
    with pytest.raises(FileNotFoundError):
        TorchEngine(TorchEngineConfig(**TINY, weights_path=str(tmp_path / "missing")))


def test_importing_zerolayer_does_not_import_torch() -> None:
    code = "import sys, serving.engine, serving.engine.vllm_engine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_real_shapes_match_the_shared_profile() -> None:
    from serving.engine.stepmodel import load_profile

    models = load_profile()["models"]
    for name in ("llama-3.2-1b", "llama-3.1-8b"):
        shape = SHAPES[name]
        assert shape.params == models[name]["params"]
        assert shape.kv_bytes_per_token(2) == models[name]["kv_bytes_per_token"]


def test_replica_streams_the_torch_engines_tokens_over_h2c() -> None:
    """``zl-replica --engine torch`` (tiny, CPU) streams over h2c exactly what the engine yields."""
    from harness.stacks import ReplicaProcess
    from serving.wire.tokens import count_prompt_tokens, request_seed
    from zerolayer.client import ZeroLayerClient

    prompt = "tell me about paging"
    options = ["--engine-option", "model_shape=tiny", "--engine-option", "device=cpu",
               "--engine-option", "kv_layout=paged"]  # fmt: skip
    # A hang guard: torch's import and the tiny model's build took past the 60 s default beside
    # three busy test workers and two busy loops (nox -s tests-under-load).
    replica = ReplicaProcess("torch", extra_args=options, ready_timeout_s=TORCH_READY_GUARD_S)
    try:

        async def main() -> tuple[str, int, str | None, str]:
            async with (
                ZeroLayerClient([replica.url]) as client,
                client.stream(prompt=prompt, max_tokens=10, seed=5, session="s") as s,
            ):
                chunks = [c async for c in s]
            request = EngineRequest(
                "x", count_prompt_tokens(prompt), 10, request_seed(prompt, 5), prompt=prompt
            )
            ((_, _, expected),) = await run_all(TorchEngine(TorchEngineConfig(**TINY)), [request])
            text = "".join(c.text for c in chunks)
            return text, sum(c.tokens for c in chunks), s.timing.finish_reason, expected

        text, tokens, reason, expected = asyncio.run(asyncio.wait_for(main(), 120))
        assert (tokens, reason) == (10, "length")
        assert text == expected
    finally:
        replica.kill()
