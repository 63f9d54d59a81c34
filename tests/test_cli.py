import json

from kvoffload.cli import main


def test_bench_transfer_on_cpu_writes_its_table(tmp_path, capsys):
    out = tmp_path / "t.json"
    argv = ["bench", "transfer", "--models", "qwen2.5-7b", "--layouts", "kv_split,page"]
    assert main([*argv, "--blocks", "3,8", "--reps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["backend"] == "host" and len(result["rows"]) == 4
    for row in result["rows"]:
        assert row["round_trip_exact"] and row["store_GBps"] > 0 and row["load_GBps"] > 0
        assert row["slot_bytes"] == 28 * 2 * 16 * 4 * 128 * 2
    assert "GB/s" in capsys.readouterr().out


def test_bench_store_reports_costs(tmp_path):
    out = tmp_path / "s.json"
    assert main(["bench", "store", "--resident", "3000", "--reps", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["policy"] for r in rows} == {"lru", "arc"}
    for r in rows:
        assert r["resident"] == 3000 and r["lookup_2048_us"] > 0 and r["bytes_per_block"] > 0


def test_bad_arguments_exit_with_a_message(capsys):
    import pytest

    with pytest.raises(SystemExit, match="--models: expected names"):
        main(["bench", "transfer", "--models", "gpt-5"])


def _options(parser, path=()):
    """(command path, action) for every option of every command."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_of_every_command_has_help():
    from kvoffload.cli import build_parser

    missing = [f"{' '.join(p)} {a.dest}" for p, a in _options(build_parser()) if not a.help]
    assert missing == []


def test_help_is_plain_text_with_defaults(capsys):
    import pytest

    from kvoffload.cli import COMMANDS

    for path in [(), ("bench",), *COMMANDS]:
        with pytest.raises(SystemExit) as done:
            main([*path, "--help"])
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert "``" not in text, f"raw RST backticks in kvoffload {' '.join(path)} --help"
        if path == ("bench", "e2e"):
            assert "--block-size BLOCK_SIZE" in text and "(default: 16)" in text
            assert "time to first token" in text  # the module docstring as the description
        if path == ("bench", "store"):
            assert "(default: arc,lru)" in text  # a list default, shown as the user types it


def test_bench_tables_fit_a_terminal_of_80_columns_without_cutting_cells(tmp_path, capsys):
    from kvoffload.console import console

    console.size = (80, 25)  # as on a terminal 80 columns wide
    try:
        out = tmp_path / "s.json"
        assert main(["bench", "store", "--resident", "3000", "--reps", "2", "--out", str(out)]) == 0
        argv = ["bench", "transfer", "--models", "qwen2.5-7b", "--layouts", "kv_split,page"]
        assert main([*argv, "--blocks", "3", "--reps", "1", "--out", str(tmp_path / "t.json")]) == 0
    finally:
        console._width = console._height = None
    text = capsys.readouterr().out
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_piped_output_never_wraps_a_path_or_a_case_name(tmp_path, capsys):
    """Not a terminal (a pipe, a log, CI): every line whole, however long."""
    from kvoffload.bench.transfer_cases import CASES, parse_cases

    deep = tmp_path / ("a-directory-with-a-long-name-" * 4) / "store.json"
    assert main(["bench", "store", "--resident", "3000", "--reps", "2", "--out", str(deep)]) == 0
    assert f"wrote {deep}" in capsys.readouterr().out.splitlines()
    assert main(["bench", "transfer", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for model, layout, block_size in parse_cases(CASES):
        name = f"{model}:{layout}:{block_size}"
        assert any(line.startswith(name + " ") for line in lines), name


def test_every_column_has_a_legend(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["bench", "store", "--resident", "3000", "--reps", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for column in (
        "resident",
        "lookup 2048",
        "store 512",
        "evicting",
        "(dict)",
        "B/block",
        "churned",
    ):
        assert f"{column}: " in text, column
    assert main(["bench", "transfer", "--dry-run"]) == 0
    text = capsys.readouterr().out
    for column in ("case", "slot", "pieces/block", "piece", "blocks per transfer", "~s"):
        assert f"{column}: " in text, column
    argv = ["bench", "transfer", "--models", "qwen2.5-7b", "--layouts", "page", "--blocks", "3"]
    assert main([*argv, "--reps", "1", "--out", str(tmp_path / "t.json")]) == 0
    text = capsys.readouterr().out
    for column in ("blocks", "piece", "store", "load", "(%)"):
        assert f"{column}: " in text, column


def test_every_error_is_one_line_in_one_form(capsys):
    """``kvoffload <command> [option]: expected X, got Y``, whether argparse or the command
    refuses the value."""
    import pytest

    cases = [
        (
            ["bench", "store", "--resident", "abc"],
            "kvoffload bench store --resident: expected comma-separated integers, got 'abc'",
        ),
        (
            ["bench", "store", "--policies", "fifo"],
            "kvoffload bench store --policies: expected names from ['arc', 'lru'], got 'fifo'",
        ),
        (
            ["bench", "e2e", "--turns", "x"],
            "kvoffload bench e2e --turns: expected an integer, got 'x'",
        ),
        (
            ["bench", "e2e", "--dtype", "f13"],
            "kvoffload bench e2e --dtype: expected one of 'auto', 'bfloat16', 'float32', got 'f13'",
        ),
        (
            ["bench", "nope"],
            "kvoffload bench: expected one of 'transfer', 'store', 'tiers', 'multi-gpu', 'e2e', "
            "got 'nope'",
        ),
        (
            ["bench", "store", "--bogus", "1"],
            "kvoffload bench store: expected its options (--help), got --bogus 1",
        ),
        (["bench", "store", "--reps"], "kvoffload bench store --reps: expected a value, got none"),
        (
            ["bench", "transfer", "--blocks", "0"],
            "kvoffload bench transfer --blocks, "
            "--block-size, --reps: expected values > 0, got 0, 16, 5",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as done:
            main(argv)
        err = capsys.readouterr().err.strip()
        shown = err or str(done.value.code)  # argparse prints; a command's SystemExit carries it
        assert shown == message, argv
        assert done.value.code != 0


def test_results_go_to_a_new_file_outside_the_repository(tmp_path, monkeypatch):
    from pathlib import Path

    from kvoffload.bench.common import RESULTS_DIR, default_out

    monkeypatch.chdir(tmp_path)
    first = default_out("e2e_tiny", "cpu AMD EPYC 7B13")
    assert first.parent == tmp_path / RESULTS_DIR
    assert first.name.startswith("e2e_tiny_cpu-amd-epyc-7b13_") and first.suffix == ".json"
    first.parent.mkdir()
    first.write_text("{}")
    second = default_out("e2e_tiny", "cpu AMD EPYC 7B13")
    assert second != first and not second.exists()  # a run never replaces an earlier one
    repo = Path(__file__).resolve().parents[1]
    assert repo / "benchmarks" / "results" not in first.parents


def test_the_progress_bar_shows_time_left():
    from rich.progress import TimeRemainingColumn

    from kvoffload.bench.common import progress

    assert any(isinstance(c, TimeRemainingColumn) for c in progress().columns)
