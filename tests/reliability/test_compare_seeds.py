"""``clusterlm compare --seeds``: a count, a list, and one chosen seed (issue 25, item 8).

``--seeds 0`` (meant as "seed 0 only") was refused with "expected a count (3) or a list of seeds >= 0 (0,1,2)",
which by its own wording accepts it. A bare integer is a count (``3`` = seeds 0, 1, 2); a comma makes a list, so
one chosen seed is written with a trailing comma (``0,`` = seed 0 only). The refusal and the help say so.
"""

from __future__ import annotations

import pytest
from cli_helpers import nonblank_lines, run_cli

from clusterlm.cli import commands as cli
from clusterlm.cli.options import parse_config


def _seeds(value: str) -> list[int]:
    seeds = cli.compare_config(parse_config(cli.compare_parser(), ["--seeds", value])).seeds
    return list(seeds)


def _refused(value: str, capsys: pytest.CaptureFixture) -> str:
    """The one stderr line of ``clusterlm compare --seeds=VALUE`` (parsed only: a regression never runs compare)."""
    with pytest.raises(SystemExit) as info:
        parsed = parse_config(cli.compare_parser(), [f"--seeds={value}"])  # = : "-1," is no option
        pytest.fail(f"--seeds={value} was accepted: {parsed['seeds']}")
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = nonblank_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(("value", "seeds"), [("3", [0, 1, 2]), ("1", [0]), ("0,", [0]), ("5,", [5]),
                                              ("0,5,7", [0, 5, 7]), (" 2 , 4 ", [2, 4]), ("0,1,", [0, 1])])
def test_a_count_a_list_and_one_chosen_seed(value: str, seeds: list[int]) -> None:
    assert _seeds(value) == seeds


def test_seeds_zero_is_refused_naming_the_single_seed_form(capsys: pytest.CaptureFixture) -> None:
    line = _refused("0", capsys)
    assert line.startswith("clusterlm compare: error: argument --seeds:") and "'0'" in line
    assert "for seed 0 alone write --seeds 0," in line  # the one form that means "seed 0 only"
    assert "a count >= 1" in line  # why 0 is refused: as a bare integer it counts seeds


@pytest.mark.parametrize("value", ["-1,", "x", ",", "", "1,1", "2.5", "-3"])
def test_bad_seeds_are_one_line_naming_both_forms(value: str, capsys: pytest.CaptureFixture) -> None:
    line = _refused(value, capsys)
    assert "a count >= 1 (3 = seeds 0,1,2)" in line and "one seed: 5," in line and "for seed 0 alone" not in line


def test_the_help_names_the_single_seed_form(capsys: pytest.CaptureFixture) -> None:
    assert run_cli(["compare", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--seeds SEEDS a count (3 = seeds 0,1,2) or a comma list of seeds (0,5,7); one chosen seed: a trailing " \
           "comma (5, = seed 5 only)" in text
