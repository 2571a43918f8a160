"""bench/lend.py: its flags, and one real run (a lent prefix read, nothing left lent)."""

from __future__ import annotations

import pytest

from pdserve.bench.lend import main, parse_args


def test_pairs_parse_and_bad_ones_name_the_flag(capsys):
    assert parse_args(["--pairs", "1-1,2-1"]).pairs == [(1, 1), (2, 1)]
    for bad in ("1", "1-x", "0-1"):
        with pytest.raises(SystemExit):
            parse_args(["--pairs", bad])
        assert "--pairs" in capsys.readouterr().err


def test_a_run_reads_every_borrow_and_prints_the_table(llama_dir, capsys):
    assert main(["--model", llama_dir, "--prefix-len", "64", "--repeats", "2", "--pairs", "1-1"]) == 0
    out = capsys.readouterr().out
    assert "| 1 | 1 | {'read': 2} |" in out, out
