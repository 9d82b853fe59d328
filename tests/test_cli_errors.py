"""Every entry point prints a user error as one line naming the file or key, with no traceback:
each CLI on a missing input (in this process, as ``python -m`` runs it), and ``eagle3-run``. Anything
else is a bug and shows its traceback (:func:`eagle3.errors.run_cli`)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.errors import Eagle3Error

REPO = Path(__file__).resolve().parents[1]
NOWHERE = "/nonexistent-eagle3"

CASES = [
    ("data_gen.pools", ["--out", "{tmp}/p", "--user-file", f"{NOWHERE}/a.jsonl"], f"{NOWHERE}/a.jsonl"),
    ("data_gen.regenerate", ["--pool", f"{NOWHERE}/a.jsonl", "--out", "{tmp}/r"], f"{NOWHERE}/a.jsonl"),
    ("data_gen.harvest", ["--data", f"{NOWHERE}/a.jsonl", "--out", "{tmp}/h"], f"{NOWHERE}/a.jsonl"),
    ("data_gen.harvest", ["verify", f"{NOWHERE}/store"], f"{NOWHERE}/store"),
    ("eagle3.train", ["--store", f"{NOWHERE}/store", "--out", "{tmp}/t"], "train.data.store"),
    ("eagle3.export", ["--draft", f"{NOWHERE}/draft", "--out", "{tmp}/e"], f"{NOWHERE}/draft"),
    ("serve_eval.evaluate", ["--draft", f"{NOWHERE}/draft", "--out", "{tmp}/v"], f"{NOWHERE}/draft"),
    ("serve_eval.server", ["--draft", f"{NOWHERE}/draft"], f"{NOWHERE}/draft"),
    ("serve_eval.quant_report", ["--quantized", f"{NOWHERE}/q", "--out", "{tmp}/q"], f"{NOWHERE}/q"),
    ("hard_mining.rounds", ["--draft", f"{NOWHERE}/d", "--store", f"{NOWHERE}/s", "--records", f"{NOWHERE}/r.jsonl",
                            "--eval-store", f"{NOWHERE}/e", "--eval-records", f"{NOWHERE}/e.jsonl",
                            "--eval-sets", f"{NOWHERE}/sets", "--pool", f"{NOWHERE}/pool.jsonl", "--out", "{tmp}/m"],
     NOWHERE),
    ("hard_mining.live", ["--live", f"{NOWHERE}/live", "--draft", f"{NOWHERE}/d"], f"{NOWHERE}/live"),
    ("hard_mining.live", ["--live", "{tmp}", "--draft", f"{NOWHERE}/d", "--holdout", "1"], "live.holdout"),
    ("data_gen.nvfp4", ["--target", f"{NOWHERE}/model", "--calibration", f"{NOWHERE}/c.jsonl", "--out", "{tmp}/n"],
     NOWHERE),
]


def _run_module(module: str, argv: list[str]) -> int:
    saved = sys.argv
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code
        if isinstance(code, str):  # sys.exit("message"): printed to stderr, exit status 1
            print(code, file=sys.stderr)
            return 1
        return int(code or 0)
    finally:
        sys.argv = saved
    return 0


@pytest.mark.parametrize(("module", "argv", "named"), CASES, ids=[f"{m}-{a[0]}" for m, a, _ in CASES])
def test_a_bad_input_is_one_line_naming_it(module: str, argv: list[str], named: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    code = _run_module(module, [a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert code != 0 and "Traceback" not in err, err[-2000:]
    assert len(errors) == 1 and named in errors[0], err[-2000:]
    assert not any(tmp_path.iterdir()), "nothing is written for a bad input"


def test_eagle3_run_prints_a_stage_error_as_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "recipes.run", f"target.name_or_path={NOWHERE}/model",
                           "stages=[target]", f"out_dir={tmp_path}/run"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert errors == [e for e in errors if e.startswith("eagle3-run: error: ")] and len(errors) == 1
    assert f"{NOWHERE}/model" in errors[0]


# The training CLI with its stage body replaced by one raising ``error``: run as a program, so that
# what a user sees (the traceback or the one line, and the exit status) is what the test sees.
_FAILING_TRAIN = """
import sys
import eagle3.train.loop as cli
def fail(*args, **kwargs):
    raise {error}
cli.train = fail
sys.exit(cli.main(["--store", "store", "--out", sys.argv[1]]))
"""


def _train_failing_with(error: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _FAILING_TRAIN.format(error=error), str(tmp_path / "t")], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def test_an_internal_value_error_is_a_bug_with_its_traceback(tmp_path: Path) -> None:
    """A ValueError the project did not raise as a user error is a bug: its traceback, not a
    one-line 'user error' (the old net took every ValueError and OSError)."""
    done = _train_failing_with('ValueError("boom")', tmp_path)
    assert done.returncode != 0 and "Traceback (most recent call last)" in done.stderr, done.stderr[-2000:]
    assert "ValueError: boom" in done.stderr and "train: error:" not in done.stderr, done.stderr[-2000:]


def test_an_os_error_is_one_line_where_it_names_a_file_and_a_traceback_where_it_names_none(tmp_path: Path) -> None:
    named = _train_failing_with('PermissionError(13, "Permission denied", "/srv/data/secret.jsonl")', tmp_path)
    assert named.returncode == 2 and "Traceback" not in named.stderr, named.stderr[-2000:]
    assert named.stderr.strip().splitlines() == ["train: error: [Errno 13] Permission denied: "
                                                 "'/srv/data/secret.jsonl'"], named.stderr[-2000:]
    unnamed = _train_failing_with('OSError("a socket closed")', tmp_path)
    assert unnamed.returncode != 0 and "Traceback (most recent call last)" in unnamed.stderr, unnamed.stderr[-2000:]
    assert "OSError: a socket closed" in unnamed.stderr and "train: error:" not in unnamed.stderr


def test_run_cli_prints_a_project_error_as_one_line_and_lets_a_bug_through(capsys: pytest.CaptureFixture) -> None:
    from eagle3.errors import ConfigError, run_cli

    def body(error: Exception | None) -> int:
        if error is not None:
            raise error
        return 0

    assert run_cli("stage", body, None) == 0
    assert run_cli("stage", body, ConfigError("train.optim.lr=0: must be > 0")) == 2
    assert capsys.readouterr().err == "stage: error: train.optim.lr=0: must be > 0\n"
    for bug in (ValueError("boom"), KeyError("k"), OSError("no file named")):
        with pytest.raises(type(bug)):
            run_cli("stage", body, bug)
    assert capsys.readouterr().err == ""


def test_every_user_error_class_has_the_one_base() -> None:
    """Every exception class the packages define (imported module by module, found, not listed)
    derives from Eagle3Error; the server's BadRequest is an HTTP 4xx answer, not a user error."""
    import importlib
    import inspect
    import pkgutil

    found = []
    for package in ("eagle3", "data_gen", "serve_eval", "hard_mining", "recipes"):
        root = str(Path(__file__).parent.parent / package)
        for info in pkgutil.walk_packages([root], prefix=f"{package}."):
            if info.name.endswith("__main__"):  # running it is what importing it does
                continue
            module = importlib.import_module(info.name)
            found += [(module.__name__, c) for _, c in inspect.getmembers(module, inspect.isclass)
                      if issubclass(c, Exception) and c.__module__ == module.__name__]
    names = {f"{m}:{c.__name__}" for m, c in found}
    assert {"eagle3.draft.formats:DraftFormatError", "data_gen.harvest:HarvestError", "recipes.handoff:PipelineError",
            "hard_mining.rounds:MineError"} <= names  # the walk reaches them
    bad = sorted(f"{m}:{c.__name__}" for m, c in found
                 if not issubclass(c, Eagle3Error) and c.__name__ != "BadRequest")
    assert not bad, bad


def test_the_training_and_mining_clis_reach_every_setting_with_its_docstring() -> None:
    """Both CLIs are generated from their dataclasses: one flag per field, the field's default and
    docstring (the mining CLI used to reach 17 of MineConfig's 25 fields)."""
    from dataclasses import fields

    from eagle3.cli import field_docs
    from eagle3.train.config import TrainConfig
    from eagle3.train.loop import build_parser as train_parser
    from hard_mining.config import MineConfig
    from hard_mining.rounds import build_parser as mining_parser

    def settings(cls: type, prefix: str = "") -> list[tuple[str, type, str]]:  # (flag dest, owner, field)
        out = []
        for f in fields(cls):
            kind = cls.__dataclass_fields__[f.name].default_factory
            if isinstance(kind, type) and hasattr(kind, "__dataclass_fields__"):  # a section: --section.field
                out += settings(kind, f"{prefix}{f.name}.")
            else:
                out.append((prefix + f.name, cls, f.name))
        return out

    for cls, parser in ((TrainConfig, train_parser()), (MineConfig, mining_parser())):
        actions = {a.dest: a for a in parser._actions}
        listed = settings(cls)
        assert len(listed) >= len(fields(cls))
        for dest, owner, name in listed:
            assert dest in actions, f"{cls.__name__}.{dest} has no flag"
            doc = field_docs(owner).get(name)
            if doc:
                assert doc.split(".")[0] in " ".join(actions[dest].help.split()), dest
    args = mining_parser().parse_args(["--draft", "d", "--store", "s", "--records", "r", "--eval-store", "e",
                                       "--eval-records", "er", "--eval-sets", "es", "--out", "o",
                                       "--max-new-tokens", "7", "--variations", "2", "--no-progress"])
    from eagle3.cli import dataclass_from_args

    mine = dataclass_from_args(MineConfig, args)
    assert (mine.out_dir, mine.max_new_tokens, mine.variations, mine.records) == ("o", 7, 2, ["r"])


def test_a_flat_train_key_of_an_earlier_version_is_refused_naming_its_place(capsys) -> None:
    """Settings live in sections now: ``train.draft_layers=2`` / ``--lr`` name ``train.draft.layers`` /
    ``--optim.lr`` in one line, in a recipe override, a recipe file, the trainer's flags and in code."""
    from eagle3.train.config import train_config
    from eagle3.train.loop import main
    from recipes.run import moved_train_keys

    assert moved_train_keys(["train.draft_layers=2", "train.lr=1e-3", "train.data=online", "train.optim.lr=1e-3",
                             "train.data.mode=online", "train.steps=3"]) == [
        "train.draft_layers is now train.draft.layers", "train.lr is now train.optim.lr",
        "train.data is now train.data.mode"]
    with pytest.raises(SystemExit):
        main(["--store", "s", "--out", "o", "--lr", "1e-3"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("error: --lr is now --optim.lr")
    with pytest.raises(SystemExit):
        main(["--store", "s", "--out", "o", "--no-progress"])
    assert "--progress is now --log.progress" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^train\.num_layers is now train\.draft\.layers$"):
        train_config(num_layers=2)
    with pytest.raises(ValueError, match=r"train\.loss is a section now; the setting is train\.loss\.kind"):
        train_config(loss="tv")


def test_eagle3_run_names_the_new_place_of_a_flat_key(tmp_path: Path) -> None:
    import subprocess
    import sys

    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults:\n  - pipeline\n  - _self_\ntrain:\n  lr: 1e-3\n  optim:\n    warmup_steps: 2\n")
    for args, line in ((["stages=[size]", "train.draft_layers=2"], "train.draft_layers is now train.draft.layers"),
                       (["--config-path", str(tmp_path), "--config-name", "mine", "stages=[size]"],
                        f"{recipe}: train.lr is now train.optim.lr")):
        done = subprocess.run([sys.executable, "-m", "recipes.run", *args], capture_output=True, text=True,
                              cwd=Path(__file__).parents[1])
        assert done.returncode != 0 and done.stderr.strip() == f"eagle3-run: error: {line}", done.stderr


def test_a_checkpoint_of_the_flat_keys_is_compared_under_their_place_now(tmp_path: Path) -> None:
    """A run saved before the settings had sections pinned ``train.lr``: resuming it with another
    ``train.optim.lr`` is refused, not let through because the key's name changed."""
    from eagle3.errors import TrainError
    from eagle3.train.checkpoint import check_pinned

    now = {"train.optim.lr": 0.002, "train.data.mode": "offline", "train.draft.layers": 1}
    check_pinned({"train.lr": 0.002, "train.data": "offline", "train.num_layers": 1}, now, tmp_path)
    with pytest.raises(TrainError, match=r"trained with train\.draft\.layers=2, this run has 1"):
        check_pinned({"train.lr": 0.002, "train.num_layers": 2}, now, tmp_path)


def test_a_family_section_has_its_own_keys_refused_elsewhere_in_one_line(capsys, tmp_path: Path) -> None:
    """``train.draft`` is its family's class: a DFlash draft's own ``block_size`` (checked against the
    TTT steps it must hold), refused naming the key and the family on another family's draft, in code,
    on the trainer's command line and in a recipe override; the pinned settings carry it."""
    import pickle
    import subprocess
    import sys

    from eagle3.draft.families.dflash import DFlashSpec
    from eagle3.draft.spec import DraftSpec
    from eagle3.train.config import PINNED, setting_keys, train_config, train_settings, updated
    from eagle3.train.loop import main

    dflash = train_config(**{"draft.family": "dflash", "draft.block_size": 8, "ttt_steps": 3})
    assert type(dflash.draft) is DFlashSpec and dflash.draft_overrides(5)["block_size"] == 8
    assert dflash.pinned()["train.draft.block_size"] == 8
    unset = train_config(**{"draft.family": "dflash", "ttt_steps": 3})
    assert unset.draft_overrides(5)["block_size"] == 4
    assert unset.pinned() == updated(unset, **{"draft.block_size": 4}).pinned()  # the same model, pinned alike
    assert set(PINNED) <= setting_keys()  # a misspelt pinned key would be dropped silently
    assert len(train_config().pinned()) == len(PINNED) - 1  # every key of an eagle3 run's but DFlash's own
    assert pickle.loads(pickle.dumps(train_settings()())).draft.family == "eagle3"  # the schema travels
    plain = updated(dflash, **{"draft.family": "eagle3", "draft.block_size": None})  # unset: dropped
    assert type(plain.draft) is DraftSpec and "train.draft.block_size" not in plain.pinned()
    with pytest.raises(ValueError, match=r"^train\.draft\.block_size=8: a setting of dflash drafts, not of "
                                         r"train\.draft\.family=eagle3$"):
        updated(dflash, **{"draft.family": "eagle3"})
    with pytest.raises(ValueError, match=r"^train\.draft\.block_size=3: proposes 2 tokens, fewer than "
                                         r"train\.ttt_steps=3"):
        train_config(**{"draft.family": "dflash", "draft.block_size": 3, "ttt_steps": 3})
    with pytest.raises(ValueError, match=r"^train\.draft\.block_size=1: must be >= 2"):
        train_config(**{"draft.family": "dflash", "draft.block_size": 1, "ttt_steps": 1})
    with pytest.raises(SystemExit):
        main(["--store", "s", "--out", "o", "--draft.block-size", "8"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: train.draft.block_size=8: a setting of dflash drafts, not of train.draft.family=eagle3")
    done = subprocess.run([sys.executable, "-m", "recipes.run", "stages=[size]", "train.draft.block_size=8",
                           f"out_dir={tmp_path}"], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert done.returncode != 0 and done.stderr.strip() == (
        "eagle3-run: error: train.draft.block_size=8: a setting of dflash drafts, not of train.draft.family=eagle3")
