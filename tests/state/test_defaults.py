"""One set of defaults: ``hhook.register`` names every option of :class:`hhook.THCState`
(and of its :class:`~hhook.state.options.Options`) with the same default, ``bits`` alone
differing on purpose; docs/usage.md's table of each entry point's defaults is the code's."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import re
from pathlib import Path

import hhook
import hhook.diloco
from hhook.state.options import NAMES, Options

DOC = Path(__file__).resolve().parents[2] / "docs" / "usage.md"
ENTRY_POINTS = {"hhook.register": hhook.register, "hhook.THCState": hhook.THCState,
                "hhook.diloco.DiLoCo": hhook.diloco.DiLoCo}


def _defaults(function) -> dict:
    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


def test_register_names_every_option_with_the_state_s_default_but_bits():
    register, state = _defaults(hhook.register), _defaults(hhook.THCState)
    options = {f.name: f.default for f in dataclasses.fields(Options)}
    assert set(NAMES) == set(options) and set(state) == {"process_group", *NAMES}
    assert all(state[name] == options[name] for name in NAMES)
    missing = set(state) - set(register)
    assert not missing, f"hhook.register hides options behind **: {sorted(missing)}"
    assert not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(hhook.register).parameters.values())
    differ = {name for name in state if register[name] != state[name]}
    assert differ == {"bits"} and register["bits"] == "auto" and state["bits"] == 4


def test_register_refuses_options_beside_a_state_and_unknown_options():
    import pytest
    import torch

    with pytest.raises(TypeError, match=r"pass options or a state, not both \(got \['seed'\]\)"):
        hhook.register(torch.nn.Linear(2, 2), hhook.THCState(), seed=3)
    with pytest.raises(TypeError, match="bitz"):
        hhook.register(torch.nn.Linear(2, 2), bitz=4)


def _doc_table() -> tuple[list[str], dict]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("### Defaults of each entry point", 1)[1].splitlines()
    first = next(i for i, line in enumerate(section) if line.startswith("|"))
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), section[first:]))  # this table only
    header = [cell.strip().strip("`") for cell in rows[0].strip("|").split("|")][1:]
    table = {}
    for line in rows[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        table[cells[0].strip("`")] = [cell.strip("`") for cell in cells[1:]]
    return header, table


def test_the_docs_defaults_table_is_the_code_s():
    header, table = _doc_table()
    assert header == list(ENTRY_POINTS), header
    for column, (name, function) in enumerate(ENTRY_POINTS.items()):
        defaults = _defaults(function)
        for option, cells in table.items():
            want = repr(defaults[option]) if option in defaults else "-"
            assert cells[column] == want, f"docs/usage.md: {name}'s {option} is {cells[column]}, the code's {want}"
    assert set(table) == {"process_group", *NAMES}
    assert re.search(r"bits.{0,40}differs", DOC.read_text(encoding="utf-8"))
