"""Readers of option text: each turns one command-line value into a setting, or raises one line saying what was
expected (argparse's ``ArgumentTypeError``, which the parser prints as ``<prog>: error: argument --x: ...``).

They are the ``parse`` metadata of the config fields (:mod:`clusterlm.cli.options`), so a value from the command
line and the same value in a ``--config`` file's string are read by the same code.
"""

from __future__ import annotations

import argparse
import math

from clusterlm.config.defaults import CHAT_TEMPLATE_MODES, LAYER_PRESETS

__all__ = ["EmptyItemError", "chat_template_arg", "comma_items", "dim_arg", "feature_tokens_arg", "features_arg",
           "fraction_arg", "int_at_least_arg", "max_length_arg",
           "non_negative_int_arg", "on_off_arg", "optional_fraction_arg", "positive_int_arg", "ratios_arg", "seeds_arg",
           "size_arg", "string_list_arg"]


def size_arg(value: str) -> int | str | None:
    """Cluster-size bounds: an int, 'budget', '<f>x' or 'none'."""
    if value.lower() == "none":
        return None
    if value.isdigit():
        return int(value)
    if value == "budget":
        return value
    try:
        factor = float(value[:-1]) if value.endswith("x") else math.nan
    except ValueError:
        factor = math.nan
    if not (math.isfinite(factor) and factor > 0):
        raise argparse.ArgumentTypeError(
            f"expected an int >= 0, 'budget', a multiple of N / C such as '1.5x', or 'none', got {value!r}"
        )
    return value


def fraction_arg(value: str) -> float:
    """A fraction in (0, 1]."""
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not 0 < x <= 1:  # also NaN
        percent = f" (for {x:g} % write {x / 100:g})" if 1 < x <= 100 else ""
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] such as 0.31, got {value!r}{percent}")
    return x


def max_length_arg(value: str) -> int:
    """Tokens per example: an int >= 2 (a prompt token and an answer token)."""
    n = int(value) if value.strip().lstrip("-").isdigit() else 0
    if n < 2:
        raise argparse.ArgumentTypeError(f"expected an int >= 2 (a prompt and an answer token), got {value!r}")
    return n


class EmptyItemError(argparse.ArgumentTypeError, ValueError):
    """An empty item in a comma list: an option's error to argparse, a ValueError to Python callers."""


def comma_items(value: str, *, trailing_comma: bool = False) -> list[str]:
    """The stripped items of a comma list; ``trailing_comma``: one comma at the end is allowed (``--seeds 5,``).

    Raises:
        EmptyItemError: an empty item (two commas in a row, a comma at the start or end, only blanks):
            argparse names the option in front of the message.
    """
    parts = [v.strip() for v in str(value).split(",")]
    if trailing_comma and len(parts) > 1 and not parts[-1]:
        parts = parts[:-1]
    if not all(parts):
        raise EmptyItemError(f"{value!r} has an empty item (two commas in a row, or a comma at an end); "
                                         "separate the items with single commas, e.g. 0,1,2")
    return parts


def features_arg(value: str) -> str | list[str]:
    """``--features``: a preset (lm_head, paper, all-linear, lora) or comma-separated module names."""
    names = comma_items(value)
    if len(names) == 1 and names[0] in LAYER_PRESETS:
        return names[0]
    presets = [n for n in names if n in LAYER_PRESETS and n != "lm_head"]  # lm_head is also the head's module name
    if not names or presets:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(LAYER_PRESETS)} or comma-separated module names (e.g. "
            f"lm_head,model.layers.0.mlp.down_proj){'; a preset cannot be combined with others' if presets else ''}, "
            f"got {value!r}"
        )
    return names


def feature_tokens_arg(value: str) -> int | str:
    """Feature window: an int >= 2 or 'all' (whole examples)."""
    if value.lower() == "all":
        return "all"
    if value.isdigit() and int(value) >= 2:
        return int(value)
    raise argparse.ArgumentTypeError(f"expected an int >= 2 or 'all', got {value!r}")


def dim_arg(value: str) -> int | tuple[int, int]:
    """Projected feature size: an int >= 1, or ``k_o x k_i`` (e.g. 32x32)."""
    parts = value.lower().split("x")
    if len(parts) in (1, 2) and all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        dims = [int(p) for p in parts]
        return dims[0] if len(dims) == 1 else (dims[0], dims[1])
    raise argparse.ArgumentTypeError(f"expected an int >= 1 (1024) or K_OxK_I (32x32), got {value!r}")


def int_at_least_arg(value: str, low: int) -> int:
    n = int(value) if value.strip().lstrip("-+").isdigit() else low - 1
    if n < low:
        raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {value!r}")
    return n


def positive_int_arg(value: str) -> int:
    return int_at_least_arg(value, 1)


def non_negative_int_arg(value: str) -> int:
    return int_at_least_arg(value, 0)


def seeds_arg(value: str) -> list[int]:
    """A bare integer is a count (``3`` -> seeds 0, 1, 2); a comma makes a list (``0,5,7``; one seed: ``5,``)."""
    try:
        if "," in value:
            seeds = [int(v) for v in comma_items(value, trailing_comma=True)]
        else:
            seeds = list(range(int(value)))
    except EmptyItemError as e:  # said first, with the forms the option takes
        raise argparse.ArgumentTypeError(f"{e}; expected a count >= 1 (3 = seeds 0,1,2) or a comma list of distinct "
                                         "seeds >= 0 (0,5,7; one seed: 5,)") from None
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) < len(seeds):
        hint = "; for seed 0 alone write --seeds 0," if value.strip() == "0" else ""
        raise argparse.ArgumentTypeError(
            f"expected a count >= 1 (3 = seeds 0,1,2) or a comma list of distinct seeds >= 0 (0,5,7; one seed: "
            f"5,), got {value!r}{hint}")
    return seeds


def ratios_arg(value: str) -> list[float]:
    """``0.1,0.2,0.31,0.5``: distinct fractions in (0, 1]."""
    ratios = [float(v) if v.replace(".", "", 1).isdigit() else math.nan for v in comma_items(value)]
    if not ratios or any(not 0 < r <= 1 for r in ratios) or len(set(ratios)) < len(ratios):
        raise argparse.ArgumentTypeError(
            f"expected a comma list of distinct fractions in (0, 1], e.g. 0.1,0.2,0.31,0.5, got {value!r}")
    return ratios


def optional_fraction_arg(value: str) -> float | None:
    """A fraction in (0, 1], or ``none``."""
    return None if str(value).lower() == "none" else fraction_arg(value)


def string_list_arg(value: str) -> tuple[str, ...]:
    """``a,b,c`` -> ``("a", "b", "c")``; a list (from a config file or Python) item by item.

    Raises:
        argparse.ArgumentTypeError: an empty item.
    """
    if isinstance(value, (list, tuple)):
        return tuple(item for v in value for item in comma_items(str(v)))
    return tuple(comma_items(value))


def on_off_arg(value: str) -> bool:
    """``on`` / ``off`` (also true/false, yes/no, 1/0) -> True / False."""
    text = str(value).strip().lower()
    if text in ("on", "true", "yes", "1"):
        return True
    if text in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")


def chat_template_arg(value: str) -> bool | None:
    """``--chat-template auto|on|off`` -> None / True / False (what ``load_data(chat_template=)`` takes)."""
    text = str(value).strip().lower()
    if text not in CHAT_TEMPLATE_MODES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(CHAT_TEMPLATE_MODES)}, got {value!r}")
    return CHAT_TEMPLATE_MODES[text]
