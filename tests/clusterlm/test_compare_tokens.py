"""``compare`` at equal cost (issue 38): a token budget for every method, ``--budget tokens``, verdicts that name the
token ratio, and the held-out loss at random's token count (``per_token``).

The statistics run on synthetic frontiers; one real token-matched comparison (random, longest, cluster on 60 short
demo examples, one rank, one step) checks that every method selects the same tokens within one example per rank.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import clusterlm
from clusterlm.comparison.output import budget_line, equal_tokens_lines
from clusterlm.comparison.statistics import TOKEN_MATCH, per_token, token_note, verdicts
from clusterlm.config.comparison import CompareConfig, budget_of, compare_train_defaults, parse_method, parse_methods


def test_every_method_but_full_takes_a_token_budget():
    for name in ("random", "longest", "ifd", "s2l", "less", "cluster", "cluster-whole"):
        spec = parse_method(f"{name}[token_ratio=0.31]")
        assert spec.token_budget == {"token_ratio": 0.31} and budget_of(spec, 0.5) == {"token_ratio": 0.31}
    assert budget_of(parse_method("longest[token_budget=5000]"), 0.5, "tokens") == {"token_budget": 5000}
    assert budget_of(parse_method("random"), 0.31, "tokens") == {"token_ratio": 0.31}
    assert budget_of(parse_method("random"), 0.31) == {"ratio": 0.31}
    assert budget_of(parse_method("cluster-tokens"), 0.31) == {"token_ratio": 0.31}
    assert budget_of(parse_method("full"), 0.31, "tokens") == {}


@pytest.mark.parametrize("spec, match", [
    ("full[token_ratio=0.3]", "full takes no settings"),
    ("random[feature_tokens=32]", "only a token budget"),
    ("random[token_ratio=1.5]", "token_ratio must be a fraction"),
    ("longest[token_budget=0]", "token_budget must be an int >= 1"),
    ("random[token_ratio=0.3,token_budget=9]", "not both"),
    ("random[ratio=0.3]", "compare sets for every method"),
])
def test_bad_token_budgets_are_refused_naming_the_method(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_methods(spec)


def test_verdicts_carry_the_token_ratio_and_say_when_tokens_differ():
    row = {"seeds": 2, "delta_vs_random": -0.01, "ci95_vs_random": [-0.02, 0.0], "paired_vs_random": True,
           "seeds_for_1pct_vs_random": 3, "seed_sd_vs_random": 0.01, "total_s": 2.0, "tokens": 1260.0,
           "selected_tokens": 1300.0}
    ref = {"seeds": 2, "total_s": 1.0, "tokens": 1000.0, "selected_tokens": 1000.0}
    line = verdicts({"random": ref, "longest": row})[1]
    assert "1.26x random's tokens" in line and "not token-matched: 26% more" in line and "--budget tokens" in line
    matched = {**row, "tokens": 1030.0}
    assert token_note(matched, "random", ref) == "; 1.03x random's tokens"  # within 5 %: no warning
    capped = {**row, "selected_tokens": 1010.0}  # equal selections, a step cap made the training differ
    assert "the step cap (--max-steps) counts examples" in token_note(capped, "random", ref)


def _point(method, ratio, tokens, loss, half=0.01):
    return {"method": method, "ratio": ratio, "tokens": tokens, "eval_loss": loss, "ci95": [loss - half, loss + half],
            "seeds": 3, "selection_s": 0.0, "train_s": 1.0, "total_s": 1.0}


def test_per_token_interpolates_along_the_frontier_at_randoms_tokens():
    points = [_point("random", 0.2, 1000, 2.0), _point("random", 0.31, 1500, 1.9),
              _point("longest", 0.2, 1300, 1.95), _point("longest", 0.31, 1900, 1.85),
              _point("cluster", 0.2, 1020, 1.80), _point("cluster", 0.31, 1510, 1.70),
              _point("s2l", 0.2, 2000, 1.6), _point("s2l", 0.31, 3000, 1.5)]
    block = per_token(points, ["random", "longest", "cluster", "s2l"], 0.31)
    assert block["tokens"] == 1500
    longest = block["methods"]["longest"]  # 1500 lies between 1300 (0.2) and 1900 (0.31): a third of the way
    assert longest["eval_loss"] == pytest.approx(1.95 - (1 / 3) * 0.1) and "interpolated" in longest["how"]
    assert longest["ci95"] == pytest.approx([longest["eval_loss"] - 0.01, longest["eval_loss"] + 0.01])
    cluster = block["methods"]["cluster"]  # within 5 % of 1500 at 0.31: its own point
    assert cluster["eval_loss"] == 1.70 and "1.01x random's tokens" in cluster["how"]
    assert block["methods"]["s2l"]["eval_loss"] is None and "do not reach" in block["methods"]["s2l"]["how"]
    assert block["best"] == "cluster"
    text = "\n".join(equal_tokens_lines(block))
    assert "best at equal tokens: cluster" in text and "random's 1,500 training tokens" in text
    assert per_token([_point("cluster", 0.31, 10, 1.0)], ["cluster"], 0.31) is None  # no random: no reference


def test_budget_line_states_how_close_the_methods_tokens_are():
    summary = {"random": {"selected_tokens": 1000.0, "requested_tokens": 1005.0},
               "longest": {"selected_tokens": 1010.0, "requested_tokens": 1005.0}}
    line = budget_line({"budget": "tokens"}, summary)
    assert "token-matched" in line and "1,000-1,010 (1.0% apart)" in line and "gap" in line and ": 5." in line
    assert "--budget tokens" in budget_line({}, summary)


def test_token_matched_comparison_selects_equal_tokens(small_sft, tmp_path):
    config = CompareConfig(data=str(small_sft.train), eval_data=(str(small_sft.heldout),), world_size=1, ratio=0.4,
                           methods=("random", "longest", "cluster[feature_tokens=16]"), seeds=(0,), budget="tokens",
                           out=str(tmp_path / "cmp"),
                           train=compare_train_defaults().replace(max_steps=1, micro_batch_size=2,
                                                                  max_length=small_sft.max_length))
    result = clusterlm.compare(config)
    from clusterlm.data import load_data
    from clusterlm.models import load_model

    data = load_data(small_sft.train, load_model("tiny-llama")[1], max_length=small_sft.max_length, progress=False)
    longest_example = int(np.max(data.lengths))
    requested = [r["requested_tokens"] for r in result.records]
    assert len(set(requested)) == 1  # the same request for every method
    for r in result.records:  # one rank and one cluster: within one example of the request
        assert abs(r["selected_tokens"] - requested[0]) <= longest_example, r["method"]
    md = (tmp_path / "cmp" / "compare.md").read_text(encoding="utf-8")
    assert "Budget: tokens. Every method is token-matched" in md
    assert all("random's tokens" in line for line in md.splitlines() if line.startswith("verdict: ") and " vs " in line)
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text(encoding="utf-8"))
    assert saved["settings"]["budget"] == "tokens" and "per_token" in saved
    assert TOKEN_MATCH == 0.05
