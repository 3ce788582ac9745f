"""No traceback from any command: every ``zl-bench`` subcommand, ``zl-replica`` and
``zl-baseline`` driven through a table of hostile and unusual inputs.

Each case is one error line on stderr (``zl-bench: error: ...``, ``zl-replica: error: ...``) and
exit 2, and the line says what was wrong. Every case fails before anything starts (no engine,
Ray or load), so the table runs in-process (``bench.cli.main``, the replica's and the baseline's
``main``) in seconds. The model directories are written here by hand: one that is missing, one
empty, one without a tokenizer, and one whose context (32 positions) is under every profile's
needs. A case that needs the real vLLM to refuse lives with the vLLM tests
(``tests/bench/test_model_fit_vllm.py``).
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import cli
from tests.support.paths import TEST_DATA

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}
SHORT_CONTEXT = 32  # no more than any class's max_tokens, of every profile at every scale


def _model(folder: Path, *, context: int = 2048, tokenizer: bool = True) -> Path:
    """A model directory as far as the commands read it before starting an engine: its
    ``config.json`` and (by name) its tokenizer files."""
    folder.mkdir(parents=True)
    config = {**LLAMA_CONFIG, "max_position_embeddings": context}
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
        (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": context}))
    return folder


class NotHttp:
    """A loopback TCP server that answers every connection with a line that is not HTTP."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


@dataclass(frozen=True)
class Place:
    """The files and servers the cases point at."""

    root: Path
    not_http: str

    def __getitem__(self, name: str) -> str:
        return str(self.root / name)


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Place]:
    root = tmp_path_factory.mktemp("hostile")
    (root / "empty").mkdir()
    _model(root / "no-tokenizer", tokenizer=False)
    _model(root / "short", context=SHORT_CONTEXT)
    _model(root / "good")
    (root / "a-file").write_text("not a directory\n")
    (root / "a-dir").mkdir()
    _profiles(root)
    _results(root)
    (root / "keys-wrong-type.toml").write_text('[keys.abc]\ntenant = 7\npriority = "normal"\n')
    server = NotHttp()
    try:
        yield Place(root, server.url)
    finally:
        server.close()


def _profiles(root: Path) -> None:
    """Profile TOMLs of the user's own with a value of the wrong type."""
    files = {
        "rate-text.toml": 'extends = "a_latency"\n[scales.smoke]\nrate = "fast"\n',
        "tenants-text.toml": 'extends = "a_latency"\n[defaults]\ntenants = "t0"\n',
        "weight-text.toml": (
            'extends = "a_latency"\n[[classes]]\nname = "x"\nweight = "heavy"\n'
            "prompt_bytes = 100\nmax_tokens = 8\n"
        ),
        "not-toml.toml": "rate = = 3\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)


def _results(root: Path) -> None:
    """Results directories written half-way: run.json alone, run.json cut off mid-file, and a
    summary.json cut off."""
    run_json = (TEST_DATA / "v2-smoke-run" / "run.json").read_text()
    only_meta = root / "results" / "only-run-json"
    only_meta.mkdir(parents=True)
    (only_meta / "run.json").write_text(run_json)
    cut = root / "results" / "cut-run-json"
    cut.mkdir()
    (cut / "run.json").write_text(run_json[: len(run_json) // 2])
    cut_summary = root / "results" / "cut-summary"
    cut_summary.mkdir()
    for source in (TEST_DATA / "v2-smoke-run").iterdir():
        text = source.read_text()
        if source.name == "summary.json":
            text = text[: len(text) // 3]
        (cut_summary / source.name).write_text(text)


# -- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One command line (``{name}`` fields are the fixture's paths) and what its one error line
    says; or, for a case that ``completes``, what its output says."""

    id: str
    prog: str
    argv: tuple[str, ...]
    says: str
    completes: bool = False

    def args(self, place: Place) -> list[str]:
        def path(match: re.Match[str]) -> str:
            name = match.group(1)
            return place.not_http if name == "not_http" else place[name]

        return [PLACEHOLDER.sub(path, a) for a in self.argv]


PLACEHOLDER = re.compile(r"\{([^{}]+)\}")


def _bench(id: str, argv: Sequence[str], says: str) -> Case:
    return Case(id, "zl-bench", tuple(argv), says)


VLLM = ("--engine", "vllm")
SMOKE = ("--scale", "smoke", "--replicas", "1", "--quiet")


def _url_case(command: str, stack: str, url: str, what: str, says: str) -> Case:
    """``command`` driving a ``stack`` said to run at ``url``."""
    option = "--zerolayer-urls" if stack == "zerolayer" else "--baseline-url"
    argv = [command, option, url, "--stacks", stack, *SMOKE, "--out", "{out-url}"]
    return _bench(f"{command}-{stack}-url-{what}", argv, says)


MODELS = {
    "missing": ("{root-none}", "does not exist"),
    "empty": ("{empty}", "no config.json"),
    "no-tokenizer": ("{no-tokenizer}", "no tokenizer"),
}


def _model_cases() -> list[Case]:
    """Every command that takes ``model=DIR``, given each broken model directory."""
    commands: dict[str, Callable[[str], tuple[str, tuple[str, ...]]]] = {
        "run": lambda m: ("zl-bench", ("run", *VLLM, "-eo", m, *SMOKE, "--out", "{out-run}")),
        "sweep": lambda m: ("zl-bench", ("sweep", *VLLM, "-eo", m, *SMOKE, "--out", "{out-s}")),
        "aa": lambda m: ("zl-bench", ("aa", *VLLM, "-eo", m, *SMOKE, "--out", "{out-aa}")),
        "fragmentation": lambda m: (
            "zl-bench",
            ("fragmentation", *VLLM, "-eo", m, "--scale", "smoke", "--out", "{out-f}"),
        ),
        "chaos": lambda m: ("zl-bench", ("chaos", *VLLM, "-eo", m, "--out", "{out-chaos}")),
        "overhead": lambda m: ("zl-bench", ("overhead", *VLLM, "-eo", m)),
        "fidelity": lambda m: (
            "zl-bench",
            ("fidelity", "--against", "vllm", "-eo", m, "--out", "{out-fid}"),
        ),
        "calibrate": lambda m: ("zl-bench", ("calibrate", *VLLM, "-eo", m, "--out", "{p.json}")),
        "zl-replica": lambda m: ("zl-replica", (*VLLM, "-eo", m, "--port", "0")),
        "zl-baseline": lambda m: ("zl-baseline", (*VLLM, "-eo", m, "--port", "0")),
    }
    cases = []
    for command, build in commands.items():
        for model, (path, says) in MODELS.items():
            prog, argv = build(f"model={path}")
            argv = tuple("--engine-option" if a == "-eo" else a for a in argv)
            cases.append(Case(f"{command}-model-{model}", prog, argv, says))
    return cases


def _profile_case(command: str, name: str, says: str) -> Case:
    """``command`` given the profile TOML ``name`` (written by ``_profiles``)."""
    argv = [command, "--profiles", f"{{{name}.toml}}", *SMOKE, "--out", "{out-p}"]
    return _bench(f"{command}-profile-{name}", argv, says)


SHORT = "model={short}"
CASES: list[Case] = [
    *_model_cases(),
    # a context under every profile's needs: each class of every profile refused, then the run
    _bench(
        "run-context-under-every-profile",
        ["run", *VLLM, "--engine-option", SHORT, *SMOKE, "--out", "{out-short}"],
        "no profile fits",
    ),
    _bench(
        "sweep-context-under-the-profile",
        ["sweep", *VLLM, "--engine-option", SHORT, *SMOKE, "--out", "{out-short}"],
        "no profile fits",
    ),
    _bench(
        "overhead-context-under-the-request",
        ["overhead", *VLLM, "--engine-option", SHORT, "--max-tokens", "32"],
        "leaves no room for a prompt in max_model_len 32",
    ),
    _bench(
        "run-max-model-len-past-the-models",
        [
            "run",
            *VLLM,
            "--engine-option",
            "model={good}",
            "--engine-option",
            "max_model_len=4096",
            *SMOKE,
            "--out",
            "{out-long}",
        ],
        "longer than the model's context",
    ),
    # unreachable and non-HTTP URLs
    _url_case("run", "zerolayer", "http://127.0.0.1:9", "unreachable", "not reachable"),
    _url_case("run", "zerolayer", "{not_http}", "not-http", "does not answer HTTP"),
    _url_case("run", "baseline", "{not_http}", "not-http", "does not answer HTTP"),
    _url_case("sweep", "zerolayer", "{not_http}", "not-http", "does not answer HTTP"),
    _url_case("aa", "baseline", "http://127.0.0.1:9", "unreachable", "not reachable"),
    # an --out that is a file, or under a file (not writable)
    _bench(
        "run-out-is-a-file", ["run", *SMOKE, "--stacks", "zerolayer", "--out", "{a-file}"], "--out"
    ),
    _bench("sweep-out-is-a-file", ["sweep", *SMOKE, "--out", "{a-file}"], "--out"),
    _bench("aa-out-is-a-file", ["aa", *SMOKE, "--out", "{a-file}"], "--out"),
    _bench(
        "fragmentation-out-is-a-file",
        ["fragmentation", "--scale", "smoke", "--out", "{a-file}"],
        "--out",
    ),
    _bench("chaos-out-is-a-file", ["chaos", "--scale", "smoke", "--out", "{a-file}"], "--out"),
    _bench(
        "overhead-out-is-a-file",
        [
            "overhead",
            "--duration",
            "0.2",
            "--levels",
            "1",
            "--rss-streams",
            "0",
            "--targets",
            "inproc",
            "--out",
            "{a-file}",
        ],
        "--out",
    ),
    _bench(
        "fidelity-out-is-a-file",
        ["fidelity", "--against", "vllm", "--engine-option", "model={good}", "--out", "{a-file}"],
        "--out",
    ),
    _bench(
        "calibrate-out-under-a-file",
        [
            "calibrate",
            "--engine",
            "torch",
            "--engine-option",
            "model_shape=tiny",
            "--batches",
            "1",
            "--contexts",
            "16",
            "--prefill",
            "8,16,32",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--out",
            "{a-file}/p.json",
        ],
        "--out",
    ),
    _bench(
        "attack-out-is-a-directory",
        ["attack", "--only", "rapid-reset", "--seconds", "0.2", "--out", "{a-dir}"],
        "--out",
    ),
    _bench(
        "capacity-out-under-a-file",
        [
            "capacity",
            "--loaders",
            "native",
            "--rates",
            "20",
            "--seconds",
            "0.2",
            "--repeats",
            "1",
            "--out",
            "{a-file}/rows.json",
        ],
        "--out",
    ),
    _bench("tiny-model-out-is-a-file", ["tiny-model", "--out", "{a-file}"], "--out"),
    _bench(
        "history-trend-out-under-a-file",
        ["history", "trend", "median_e2el_ms", "--results", "{results}", "--out", "{a-file}/t.png"],
        "--out",
    ),
    # results directories written half-way
    Case(
        "report-run-json-alone",
        "zl-bench",
        ("report", "{results/only-run-json}"),
        "wrote ",
        completes=True,
    ),
    _bench("report-run-json-cut", ["report", "{results/cut-run-json}"], "run.json"),
    _bench("report-summary-cut", ["report", "{results/cut-summary}"], "summary.json"),
    _bench(
        "compare-half-written",
        ["compare", "{results/cut-summary}", "{results/only-run-json}"],
        "summary.json",
    ),
    _bench("notebook-run-json-cut", ["notebook", "{results/cut-run-json}"], "run.json"),
    _bench(
        "tag-without-a-store",
        ["tag", "{results/cut-run-json}", "x", "--results", "{results}"],
        "no results store",
    ),
    _bench(
        "index-store-is-a-file",
        ["index", "{results}", "--store", "{a-file}"],
        "--store",
    ),
    # profile TOMLs of the user's own with a value of the wrong type
    _profile_case("run", "rate-text", "must be a positive number"),
    _profile_case("run", "tenants-text", "tenants"),
    _profile_case("aa", "weight-text", "weight"),
    _profile_case("run", "not-toml", "does not read as TOML"),
    # the replica's and the baseline's own files
    Case(
        "zl-replica-api-keys-wrong-type",
        "zl-replica",
        ("--api-keys", "{keys-wrong-type.toml}", "--port", "0"),
        "--api-keys",
    ),
    Case(
        "zl-baseline-api-keys-wrong-type",
        "zl-baseline",
        ("--api-keys", "{keys-wrong-type.toml}", "--port", "0"),
        "--api-keys",
    ),
]


def _main(prog: str) -> Callable[[list[str]], int]:
    if prog == "zl-replica":
        from zerolayer.server.cli import main as replica_main

        return replica_main
    if prog == "zl-baseline":
        from baselines.rayserve.cli import main as baseline_main

        return baseline_main
    return cli.main


def _exit_status(prog: str, argv: list[str]) -> int:
    try:
        return _main(prog)(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_the_table_covers_every_command() -> None:
    drives = {c.argv[0] for c in CASES if c.prog == "zl-bench"}
    missing = {s.name for s in cli.SUBCOMMANDS} - drives
    assert not missing, f"no hostile case for {sorted(missing)}"
    assert {"zl-replica", "zl-baseline"} <= {c.prog for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_hostile_input_is_one_error_line_and_exit_2(
    case: Case, place: Place, capsys: pytest.CaptureFixture[str]
) -> None:
    status = _exit_status(case.prog, case.args(place))
    out, err = capsys.readouterr()
    if case.completes:
        assert status == 0 and case.says in out, (out, err)
        return
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{case.prog}") and ": error: " in lines[0], err
    assert case.says in lines[0], err
