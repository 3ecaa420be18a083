"""``raymesh``'s own face, Ray-free: what ``--help`` says and how a user's mistake on the command line is reported
(one line naming the option, its value and the fix, exit 2, no traceback)."""

from __future__ import annotations

import argparse

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


def _flags_without_help(parser: argparse.ArgumentParser, command: str = "raymesh") -> list[str]:
    """Every option or positional of ``parser`` and its subcommands (walked down) that ``--help`` lists bare."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += _flags_without_help(sub, f"{command} {name}")
        elif not action.help and action.help is not argparse.SUPPRESS:
            missing.append(f"{command} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_flag_of_every_subcommand_has_help():
    assert _flags_without_help(build_parser()) == []


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


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if a command goes on to prepare data, check the run or reach Ray."""
    from orchestrator.runtime.hosted import HostedJob

    def started(*args, **kwargs):
        raise AssertionError("the command went on past its arguments' check")

    monkeypatch.setattr("orchestrator.cli.default_corpus.prepare_default_corpus", started)
    monkeypatch.setattr(HostedJob, "find", started)


@pytest.mark.parametrize("command", ["run", "attach"])
@pytest.mark.parametrize("where, problem", [(".", "is a directory; fix: give a file path"),
                                            ("job.yaml/summary.json", "is not a writable directory")])
def test_summary_json_that_cannot_be_written_is_refused_before_the_run(command, where, problem, tmp_path,
                                                                       monkeypatch, capsys, nothing_starts):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text("data:\n  path: data/tiny\n")
    target = "job.yaml" if command == "run" else "some-job-id"
    code = main([command, target, "--summary-json", where])
    err = capsys.readouterr().err
    assert code == 2
    assert f"option `--summary-json`: value '{where}' " in err and problem in err


CLOSED = "127.0.0.1:1"  # nothing listens on port 1: an unreachable cluster, and no local Ray is ever started


@pytest.mark.parametrize("argv", [["status", "some-job", "--ray-address", CLOSED], ["logs", "some-job"],
                                  ["stop", "some-job", "--ray-address", CLOSED],
                                  ["scale", "some-job", "--dp", "2", "--ray-address", CLOSED], ["submit", "job.yaml"]])
def test_an_unreachable_cluster_is_one_line_naming_the_address_given(argv, tmp_path, monkeypatch, capsys):
    """--address wins over RAY_ADDRESS (Ray's job SDK let RAY_ADDRESS replace it: a traceback after a 35 s wait on
    that address's GCS, or another cluster's jobs)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text("data:\n  path: data/tiny\n")
    monkeypatch.setenv("RAY_ADDRESS", CLOSED)
    code = main([*argv, "--address", f"http://{CLOSED}"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"cannot reach the Ray dashboard at http://{CLOSED}" in err
    assert "Traceback" not in err


def test_run_against_an_unreachable_cluster_names_it_and_the_fix(tmp_path, monkeypatch, capsys):
    """``ray.init`` retries an unreachable head for over ten minutes before it says so."""
    from orchestrator.runtime.ray_runtime import RayRuntime

    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text("data:\n  path: data/tiny\n")
    monkeypatch.setattr(RayRuntime, "preflight", lambda self, spec: None)  # no data needed to reach the cluster
    code = main(["run", "job.yaml", "--address", CLOSED])
    err = capsys.readouterr().err
    assert code == 2
    assert f"cannot reach a Ray cluster at {CLOSED} (from --address" in err and "fix: start it" in err


def test_attach_to_an_unreachable_cluster_says_so_not_that_no_controller_runs(monkeypatch, capsys):
    """``HostedJob.find`` answers None for an unreachable cluster too; attach said "no running raymesh controller",
    sending the user to look for a job that may be training fine on the cluster they mistyped."""
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("ray.init was called: the address should have been refused before it")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = main(["attach", "some-job", "--ray-address", CLOSED])
    err = capsys.readouterr().err
    assert code == 2
    assert f"cannot reach a Ray cluster at {CLOSED} (from --ray-address" in err and "fix: start it" in err
    assert "no running raymesh controller" not in err and "Traceback" not in err


@pytest.mark.parametrize("how", ["bad --tokenizer", "no tokens in the sources", "interrupted"])
def test_a_failed_prepare_data_leaves_no_out_folder_behind(how, tmp_path, monkeypatch, capsys):
    """A first prepare that fails part-way removes the --out folders it made (an empty one passed for a dataset's
    place), and never a folder the user already had."""
    source = tmp_path / "src"
    source.mkdir()
    (source / ("notes.bin" if how == "no tokens in the sources" else "a.txt")).write_text("def f(): pass\n")
    argv = ["prepare-data", "--source", str(source)]
    if how == "bad --tokenizer":
        argv += ["--tokenizer", str(tmp_path / "missing.json")]
    if how == "interrupted":
        def interrupt(*args, **kwargs):
            raise KeyboardInterrupt
        monkeypatch.setattr("workers.data.prepare._write_shards", interrupt)
    fresh = tmp_path / "new" / "data"
    assert main([*argv, "--out", str(fresh)]) == (130 if how == "interrupted" else 2)
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    main([*argv, "--out", str(mine)])
    assert mine.is_dir() and list(mine.iterdir()) == []
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("resume, folder, said", [
    (True, None, "option `--resume`: value '{ckpt}' finds no checkpoint: the job never saved one"),
    (False, "step-00000004", "job file field `run_dir`: value '{run}' holds checkpoints of another run in {ckpt}: "
                             "1 unsealed (no manifest): step-00000004"),
], ids=["resume-that-finds-none", "fresh-run-beside-an-unsealed-folder"])
def test_run_refuses_a_resume_with_nothing_to_resume_or_a_fresh_run_beside_checkpoints_before_ray(
        resume, folder, said, tmp_path, monkeypatch, capsys):
    from orchestrator.runtime import cluster
    from orchestrator.runtime.ray_runtime import RayRuntime

    def started(*args, **kwargs):
        raise AssertionError("the command went on to check the data or reach Ray")

    monkeypatch.setattr(RayRuntime, "preflight", started)
    monkeypatch.setattr(cluster, "connect", started)
    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    if folder:
        (ckpt / folder).mkdir(parents=True)
    (tmp_path / "job.yaml").write_text(f"data:\n  path: {tmp_path / 'data'}\nrun_dir: {run}\n")
    code = main(["run", str(tmp_path / "job.yaml"), *(["--resume"] if resume else [])])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert said.format(run=run, ckpt=ckpt) in err and "fix: " in err
