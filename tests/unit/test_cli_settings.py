"""Settings from the command line, DILOCO_* variables and a TOML file, as `diloco` reads them.

Precedence, highest first: the flag, the environment, the file's [command] table, the file's top,
the default. A value that does not parse, is not one of the choices, or a file key no option takes
is an error naming where it came from; nothing wrong passes silently.
"""

from __future__ import annotations

import pytest

from diloco import __version__
from diloco.coordinator.config import CoordinatorConfig, RunSettings
from diloco.coordinator.policy import RoundConfig
from diloco.infra.cli import build_parser, every_setting, main
from diloco.infra.options import KNOWN_SETTINGS, build
from diloco.storage.errors import ConfigError


def parse(argv: list[str], monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None = None):  # noqa: ANN201
    for name in [k for k in __import__("os").environ if k.startswith("DILOCO_")]:
        monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    return build_parser(argv).parse_args(argv)


def test_a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default(tmp_path, monkeypatch):
    config = tmp_path / "run.toml"
    config.write_text('outer-lr = 0.5\nmin_quorum = 3\ncodec = "int4"\n\n[coordinator]\nouter_lr = 0.6\n')
    args = parse(["coordinator", "--run", "r", "--config", str(config)], monkeypatch)
    assert (args.outer_lr, args.min_quorum, args.codec, args.outer_momentum) == (0.6, 3, "int4", 0.9)
    args = parse(["coordinator", "--run", "r", "--config", str(config)], monkeypatch,
                 {"DILOCO_MIN_QUORUM": "2", "DILOCO_STANDBY": "yes"})
    assert (args.min_quorum, args.standby) == (2, True)
    args = parse(["coordinator", "--run", "r", "--min-quorum", "4"], monkeypatch,
                 {"DILOCO_MIN_QUORUM": "2", "DILOCO_CONFIG": str(config)})
    assert (args.min_quorum, args.outer_lr) == (4, 0.6)


def test_wrong_settings_are_refused_naming_where_they_came_from(tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match="DILOCO_MIN_QUORUM: 'two' is not a valid int"):
        parse(["coordinator", "--run", "r"], monkeypatch, {"DILOCO_MIN_QUORUM": "two"})
    with pytest.raises(ConfigError, match="DILOCO_CODEC: 'int7' is not one of fp32, bf16, int8, int4"):
        parse(["coordinator", "--run", "r"], monkeypatch, {"DILOCO_CODEC": "int7"})
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parse(["coordinator", "--run", "r", "--codec", "int7"], monkeypatch)
    assert "invalid choice: 'int7'" in capsys.readouterr().err
    typo = tmp_path / "typo.toml"
    typo.write_text("steps = 3  # a learner's setting: other commands leave it\n[coordinator]\nmin_qorum = 2\n")
    with pytest.raises(ConfigError, match="unknown setting.*min_qorum"):
        parse(["coordinator", "--run", "r", "--config", str(typo)], monkeypatch)
    broken = tmp_path / "broken.toml"
    broken.write_text("min_quorum = \n")
    with pytest.raises(ConfigError, match="cannot read the config file"):
        parse(["coordinator", "--run", "r", "--config", str(broken)], monkeypatch)
    assert main(["coordinator", "--run", "r", "--config", str(typo)]) == 2
    assert "min_qorum" in capsys.readouterr().err


def test_settings_are_checked_as_data_naming_where_they_came_from(tmp_path, monkeypatch, capsys, caplog):
    """NaN and negative seconds from DILOCO_* variables and TOML were taken as they came (round_s,
    min_round_s); every float must be finite and every setting in range, wherever it is set."""
    with pytest.raises(ConfigError, match="DILOCO_ROUND_S: 'nan' is not a valid float: expected a finite number"):
        parse(["coordinator", "--run", "r"], monkeypatch, {"DILOCO_ROUND_S": "nan"})
    config = tmp_path / "run.toml"
    config.write_text("[coordinator]\nmin_round_s = inf\n")
    with pytest.raises(ConfigError, match="min_round_s: inf is not a valid float: expected a finite number"):
        parse(["coordinator", "--run", "r", "--config", str(config)], monkeypatch)
    with pytest.raises(SystemExit):
        parse(["coordinator", "--run", "r", "--max-grace-s", "nan"], monkeypatch)
    assert "'nan' is not a finite number" in capsys.readouterr().err
    # In range too: negative seconds are refused when the settings are built, naming the variable.
    args = parse(["coordinator", "--run", "r"], monkeypatch, {"DILOCO_ROUND_S": "-1"})
    with pytest.raises(ConfigError, match="DILOCO_ROUND_S: round_s must be >= 0 seconds"):
        build(CoordinatorConfig, args, round=build(RoundConfig, args))
    monkeypatch.delenv("DILOCO_ROUND_S")
    assert main(["coordinator", "--run", "r", "--min-round-s", "-0.5"]) == 1  # before any connection
    assert "min_round_s must be > 0 seconds, got -0.5" in caplog.text
    for bad in ({"lease_s": float("inf")}, {"fetch_threads": 0}, {"claim_idle_s": -1.0}):
        with pytest.raises(ConfigError):
            CoordinatorConfig(**bad)
    with pytest.raises(ConfigError, match="max_grace_s must be a finite number"):
        RoundConfig(max_grace_s=float("inf"))


def test_verbose_anywhere_and_the_version(monkeypatch, capsys):
    assert parse(["-v", "coordinator", "--run", "r"], monkeypatch).verbose
    assert parse(["coordinator", "--run", "r", "-v"], monkeypatch).verbose
    assert not parse(["coordinator", "--run", "r"], monkeypatch).verbose
    with pytest.raises(SystemExit) as exited:
        parse(["--version"], monkeypatch)
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"diloco {__version__}"


def test_one_name_per_setting_and_unknown_names_are_errors_naming_the_closest(tmp_path, monkeypatch, caplog):
    """--fragments is DILOCO_FRAGMENTS (DILOCO_NUM_FRAGMENTS still works, with a line saying it is
    the old name); a DILOCO_* variable, a top-level key or a table no command has is an error naming
    the closest valid one (they were dropped without a word)."""
    assert parse(["coordinator", "--run", "r"], monkeypatch, {"DILOCO_FRAGMENTS": "2"}).num_fragments == 2
    with caplog.at_level("WARNING"):
        assert parse(["coordinator", "--run", "r"], monkeypatch, {"DILOCO_NUM_FRAGMENTS": "3"}).num_fragments == 3
    assert "DILOCO_NUM_FRAGMENTS is the old name of DILOCO_FRAGMENTS" in caplog.text
    config = tmp_path / "run.toml"
    config.write_text("[coordinator]\nfragments = 5\n")
    assert parse(["coordinator", "--run", "r", "--config", str(config)], monkeypatch).num_fragments == 5
    with pytest.raises(ConfigError, match="DILOCO_MIN_QORUM is not a setting of any diloco command "
                                          r"\(did you mean DILOCO_MIN_QUORUM\?\)"):
        parse(["coordinator", "--run", "r"], monkeypatch, {"DILOCO_MIN_QORUM": "2"})
    # Another command's setting is no mistake: one environment may serve several commands.
    assert parse(["coordinator", "--run", "r"], monkeypatch, {"DILOCO_STEPS": "10"}).run == "r"
    config.write_text("outer_lrr = 0.5\n")
    with pytest.raises(ConfigError, match=r"outer_lrr is not a setting of any diloco command \(did you mean outer_lr\?\)"):
        parse(["coordinator", "--run", "r", "--config", str(config)], monkeypatch)
    config.write_text("[coordinater]\nmin_quorum = 2\n")
    with pytest.raises(ConfigError, match=r"\[coordinater\] is not a diloco command \(did you mean coordinator\?\)"):
        parse(["coordinator", "--run", "r", "--config", str(config)], monkeypatch)


def test_the_known_settings_are_every_commands_settings():
    """`options.KNOWN_SETTINGS` (what an unknown DILOCO_* variable or config key is checked against
    without importing every command) is what the commands declare: add a setting, add it there."""
    assert every_setting() == KNOWN_SETTINGS


def test_diloco_help_names_every_benchmark():
    from diloco.infra.bench.cli import BENCHES
    from diloco.infra.cli import COMMANDS

    [said] = [text for name, _room, text in COMMANDS if name == "bench"]
    assert said.endswith(": " + ", ".join(BENCHES)), said


def test_a_choice_outside_its_choices_is_refused_wherever_it_is_set(tmp_path, monkeypatch):
    """A choice from the environment or a file is checked as the command line's is (the choices come
    from the field's Literal type); one made in Python is checked where the settings are made
    (`check_choices`). Each error names the choices."""
    with pytest.raises(ConfigError, match="DILOCO_CADENCE: 'hourly' is not one of clock, steps"):
        parse(["coordinator", "--run", "r"], monkeypatch, {"DILOCO_CADENCE": "hourly"})
    monkeypatch.delenv("DILOCO_CADENCE")
    config = tmp_path / "run.toml"
    config.write_text("[coordinator]\nmerge_rule = \"average\"\n")
    with pytest.raises(ConfigError, match="merge_rule: 'average' is not one of adopt, rebase, mix"):
        parse(["coordinator", "--run", "r", "--config", str(config)], monkeypatch)
    with pytest.raises(ConfigError, match="cadence must be one of 'clock', 'steps', got 'hourly'"):
        RunSettings(cadence="hourly")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="merge_rule must be one of 'adopt', 'rebase', 'mix', got 'average'"):
        RunSettings(merge_rule="average")  # type: ignore[arg-type]


def test_comma_lists_of_numbers_and_of_choices_refuse_what_they_cannot_take() -> None:
    from diloco.infra.options import chosen, whole_numbers
    from diloco.storage.errors import ConfigError

    assert whole_numbers("1,2,4", "--shards") == [1, 2, 4] and whole_numbers(" ", "--shards") == []
    assert chosen("int4, sign8", "--codecs", ("fp32", "int4", "sign8")) == ["int4", "sign8"]
    for text, call in (("1,,2", lambda t: whole_numbers(t, "--lags")), ("two", lambda t: whole_numbers(t, "--lags")),
                       ("int4,fp16", lambda t: chosen(t, "--codecs", ("fp32", "int4"))),
                       ("", lambda t: chosen(t, "--codecs", ("fp32", "int4")))):
        with pytest.raises(ConfigError, match="--(lags|codecs) takes"):
            call(text)
