"""``zl-bench``: one command line; a user's mistake is one ``zl-bench: error:`` line, exit 2."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

from bench import cli


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("zl-bench: error: "), captured.err
    assert captured.err.count("\n") == 1, captured.err
    return captured.err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "--profiles", "q"], "unknown profile 'q'"),
        (["run", "--stacks", "zerolayer,nginx"], "unknown stack(s) nginx"),
        (["run", "--replicas", "0"], "--replicas"),
        (["run", "--scale", "huge"], "invalid choice: 'huge'"),
        (["run", "--engine", "gpu"], "invalid choice: 'gpu'"),
        (["run", "--loader", "wrk"], "invalid choice: 'wrk'"),
        (["run", "--zerolayer-urls", "http://127.0.0.1:70000"], "port must lie in 1-65535"),
        (["run", "--zerolayer-urls", "http://127.0.0.1:0"], "port must lie in 1-65535"),
        (["run", "--zerolayer-urls", "ftp://127.0.0.1:21"], "scheme must be http or https"),
        (["run", "--baseline-url", "127.0.0.1:8000"], "scheme must be http or https"),
        (["run", "--engine-option", "num_kv_blocks"], "expected KEY=VALUE"),
        (["run", "--engine-option", "nonsense=1"], "valid options: model_shape"),
        (["run", "--engine-option", "num_kv_blocks=many"], "num_kv_blocks"),
        (["run", "--slo", "ttft"], "expected NAME:MS"),
        (["run", "--slo", "latency:500"], "SLO series must be one of ttft, tpot, e2el"),
        (["run", "--slo", "ttft:soon"], "the bound must be a number of ms"),
        (["run", "--slo", "ttft_p101:500"], "percentile must lie in (0, 100]"),
        (["sweep", "--rates", "4,-1"], "rates must be positive"),
        (["sweep", "--rates", "4,x"], "expected comma-separated rates"),
        (["sweep", "--repeats", "0"], "--repeats"),
        (["sweep", "--resolution", "1.5"], "fraction in (0, 1)"),
        (["sweep", "--profile", "d"], "d_fault injects faults"),
        (["sweep", "--profile", "g"], "g_elasticity scales the stacks under load"),
        (["sweep", "--profile", "q"], "unknown profile 'q'"),
        (["nonsense"], "invalid choice: 'nonsense'"),
        (["fidelity", "--requests", "0"], "must be >= 1"),
        (["fidelity", "--engine-option", "model_shape=gpt-5"], "unknown model shape 'gpt-5'"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = ["--out", str(tmp_path)] if argv[0] in ("run", "sweep") else []
    err = _error([*argv, *out], capsys)
    assert says in err
    assert not any(tmp_path.iterdir()), "nothing is written for a mistake"


def test_an_unreachable_external_stack_stops_the_run_before_load(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: refused
        argv = ["run", "--zerolayer-urls", url, "--stacks", "zerolayer", "--profiles", "a"]
        err = _error([*argv, "--scale", "smoke", "--out", str(tmp_path)], capsys)
    assert err.startswith(f"zl-bench: error: zerolayer stack: {url} is not reachable: ")
    assert err.count("zerolayer stack") == 1, err
    assert not any(tmp_path.iterdir()), "no results directory, no load"


def test_help_shows_defaults_and_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "{smoke,laptop,seed}" in text and "(default: laptop)" in text
    assert "{native,k6,locust}" in text and "(default: native)" in text
    assert "{sim,null,torch,vllm}" in text and "(default: 2)" in text
    assert "``" not in text and ":func:" not in text


def test_every_subcommand_is_wired(capsys: pytest.CaptureFixture[str]) -> None:
    for spec in cli.SUBCOMMANDS:
        with pytest.raises(SystemExit) as exc:
            cli.main([spec.name, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: zl-bench {spec.name}"), out
        assert "``" not in out and ":class:" not in out and ":func:" not in out
        parser = cli.build_parser(spec.name)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command = sub.choices[spec.name].get_default("command")
        assert command.__name__ == "run_command", f"{spec.module}: {command}"
