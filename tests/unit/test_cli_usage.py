"""``raymesh``'s own face, Ray-free: what ``--help`` says and how a user's mistake on the command line is reported
(one line naming the option, its value and the fix, exit 2, no traceback)."""

from __future__ import annotations

import pytest

from orchestrator.cli import main
from orchestrator.cli.commands import build_parser


def _commands() -> dict[str, str]:
    """Each subcommand and the one-line help ``raymesh --help`` lists for it."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {action.dest: action.help for action in sub._choices_actions}


@pytest.mark.parametrize("command", sorted(_commands()))
def test_each_subcommand_help_says_what_it_does(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the description
    assert _commands()[command] in shown


def test_prepare_data_out_on_a_file_names_the_option_and_the_fix(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("def f(): pass\n")
    taken = tmp_path / "job.yaml"
    taken.write_text("name: kept\n")
    code = main(["prepare-data", "--source", str(tmp_path / "notes.txt"), "--out", str(taken)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"option `--out`: value '{taken}' is a file, not a directory; fix: point --out at a directory" in err
    assert "Traceback" not in err
    assert taken.read_text() == "name: kept\n"
