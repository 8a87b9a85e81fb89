"""The command line: help, backends, env, and the conformance command catching a broken backend."""

import pytest

from gearshift.cli import build_parser, main


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in ("train", "backends", "env", "bench", "conformance"):
        assert name in out
    for name in ("train", "backends", "env", "conformance"):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        assert "usage: gearshift " + name in capsys.readouterr().out


def test_backends_lists_reference_backends_ready(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    lines = {tuple(line.split()[:2]): line for line in out.splitlines()[2:]}
    assert "ready" in lines[("rollout", "hf")]
    assert "ready" in lines[("train", "torch")]
    for name in ("vllm", "sglang", "fsdp", "deepspeed"):
        assert any(k[1] == name for k in lines), f"{name} missing from:\n{out}"


def test_env_reports_versions(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "transformers" in out and "python" in out


def test_unknown_backend_is_a_clear_error(capsys):
    assert main(["conformance", "--rollout", "no-such-engine"]) == 2
    assert "no rollout backend named 'no-such-engine'" in capsys.readouterr().err


def test_parser_builds():
    assert build_parser().prog == "gearshift"
