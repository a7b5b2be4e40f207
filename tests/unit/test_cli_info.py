"""``python -m sp_kpool info`` lists what a user can choose: every value of every per-call
option (and of ``ShardedSequence.split(layout=)``) with one line, and the experimental
switches, each a variable the settings read."""

from __future__ import annotations

from sp_kpool import cli
from sp_kpool.config import BALANCES, GATHERS, ORDERS, TAILS
from sp_kpool.layouts import LAYOUTS
from sp_kpool.settings import ENV, PRECISIONS


def test_every_choice_has_its_line():
    accepted = {"precision": PRECISIONS, "gather": GATHERS, "balance": BALANCES, "order": ORDERS, "tail": TAILS,
                "layout": LAYOUTS}  # fmt: skip
    assert {k: tuple(v) for k, v in cli.CHOICES.items()} == {k: tuple(v) for k, v in accepted.items()}
    assert all(line.strip() for values in cli.CHOICES.values() for line in values.values())


def test_the_experimental_switches_are_settings():
    for var, line in cli.EXPERIMENTAL:
        name, value = var.split("=")
        assert name in ENV.values() and value == "1" and line.strip(), var


def test_info_prints_the_choices(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "choices (" in out and "experimental switches" in out
    for values in cli.CHOICES.values():
        for value, line in values.items():
            assert any(value in ln and line in ln for ln in out.splitlines()), value
    for var, _ in cli.EXPERIMENTAL:
        assert var in out
