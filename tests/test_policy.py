"""The reuse policy (``mmkv.policy``): its values declared once and taken by every surface that offers them (the
request model, the CLI, the demo, the edit strategies), one seam bound everywhere, its checks, the budget's
count, and no code outside it comparing ``reuse`` with a string."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pydantic
import pytest

import mmkv
from mmkv.policy import (
    MAX_SEAM,
    RANKINGS,
    REPAIRS,
    REUSE_POLICIES,
    Ranking,
    RepairKind,
    ReusePolicy,
    TurnPolicy,
)

ROOT = Path(__file__).resolve().parents[1]


def _literal_values(annotation) -> set[str]:
    """The string values a (possibly optional) Literal annotation admits."""
    values: set[str] = set()
    for arg in typing.get_args(annotation) or (annotation,):
        values |= set(typing.get_args(arg)) if typing.get_origin(arg) is typing.Literal else set()
    return values or set(typing.get_args(annotation))


# --------------------------------------------------------------------------------------- declared once
def test_the_tuples_are_the_literals():
    """Each tuple lists its Literal's values, in order; a repair is the seam or one of the rankings."""
    assert REUSE_POLICIES == typing.get_args(ReusePolicy) == ("kv", "encoder", "none")
    assert RANKINGS == typing.get_args(Ranking) == ("deviation", "attention")
    assert REPAIRS == typing.get_args(RepairKind) == ("seam", *RANKINGS)


def test_the_request_model_takes_the_policy_types():
    """The request's ``mmkv`` object admits exactly the policy's values and seam bound."""
    from mmkv.serve.protocol.request import MmkvOptions

    fields = MmkvOptions.model_fields
    assert _literal_values(fields["reuse"].annotation) == set(REUSE_POLICIES)
    assert _literal_values(fields["repair"].annotation) == set(REPAIRS)
    MmkvOptions(seam=MAX_SEAM, reuse="encoder", repair="attention")
    for bad in ({"seam": MAX_SEAM + 1}, {"seam": -1}, {"reuse": "all"}, {"repair": "random"}, {"budget": 2}):
        with pytest.raises(pydantic.ValidationError, match=next(iter(bad))):
            MmkvOptions(**bad)


def test_the_cli_offers_the_policy_values():
    """``mmkv serve``'s --reuse and --repair choices are the policy's tuples (its bounds: tests/test_cli.py)."""
    import argparse

    from mmkv.cli import _serve_parser

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers())
    serve = parser._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001
    choices = {a.dest: a.choices for a in serve._actions if a.choices}  # noqa: SLF001
    assert tuple(choices["reuse"]) == REUSE_POLICIES and tuple(choices["repair"]) == REPAIRS


def test_the_demo_offers_and_checks_the_policy_values():
    """The demo's settings accept exactly the policy's values (the radio buttons list the same tuple)."""
    from app.backend import TurnSettings
    from app.episode import EpisodeSettings

    for settings in (TurnSettings, EpisodeSettings):
        for reuse in REUSE_POLICIES:
            assert settings(reuse=reuse).reuse == reuse
        for bad in ("all", "KV", ""):
            with pytest.raises(ValueError, match="reuse must be one of"):
                settings(reuse=bad)
    assert "list(REUSE_POLICIES)" in (ROOT / "app" / "demo.py").read_text()


def test_edit_rankings_are_the_policy_rankings(tiny):
    """A selective edit takes the rankings the repair takes; another is refused naming them."""
    from mmkv.text import RANKINGS as text_rankings

    assert text_rankings is RANKINGS
    session = mmkv.Session(tiny)
    session.add_text("account_role: {role}.", fields={"role": "admin"})
    with pytest.raises(ValueError, match="unknown ranking 'seam'"):
        session.edit("role", "viewer", "selective", rank="seam")


# --------------------------------------------------------------------------------------------- checks
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"reuse": "all"}, "reuse must be one of"),
        ({"seam": -1}, "seam must be an int in"),
        ({"seam": MAX_SEAM + 1}, "seam must be an int in"),
        ({"seam": 1.0}, "seam must be an int in"),
        ({"seam": True}, "seam must be an int in"),
        ({"repair": "magic"}, "repair must be one of"),
        ({"budget": 1.5}, "budget must be a fraction"),
        ({"budget": -0.1}, "budget must be a fraction"),
        ({"budget": float("nan")}, "budget must be a fraction"),
        ({"budget": True}, "budget must be a fraction"),
        ({"budget": "0.05"}, "budget must be a fraction"),
    ],
)
def test_a_bad_policy_is_refused_naming_it(settings, message):
    """An unknown reuse or repair, a seam out of [0, MAX_SEAM] or not an int, a budget outside [0, 1], NaN, a bool
    or a string raise ValueError naming the field, from the policy and from a session's config alike."""
    with pytest.raises(ValueError, match=message):
        TurnPolicy(**settings)
    with pytest.raises(ValueError, match=message):
        mmkv.SessionConfig.of(**settings)


def test_what_each_reuse_level_reads():
    """``kv`` splices and reads the stores; ``encoder`` reads them but splices nothing; ``none`` does neither."""
    table = {r: (TurnPolicy(reuse=r).splices_kv, TurnPolicy(reuse=r).reads_stores) for r in REUSE_POLICIES}
    assert table == {"kv": (True, True), "encoder": (False, True), "none": (False, False)}
    assert TurnPolicy(seam=0).seam == 0 and TurnPolicy(seam=MAX_SEAM).seam == MAX_SEAM


def test_the_budget_defaults_per_repair_and_rounds_up_exactly():
    """No budget: 0 for the seam (the default policy recomputes nothing more), 0.05 for a ranking; the count is
    the share rounded up, exact on integers (0.05 x 100 = 5, not 6) and capped by what is spliced."""
    assert TurnPolicy().repair == "seam" and TurnPolicy().repair_budget == 0.0
    assert all(TurnPolicy(repair=r).repair_budget == 0.05 for r in RANKINGS)
    policy = TurnPolicy(repair="deviation", budget=0.05)
    assert [policy.num_chosen(n) for n in (0, 1, 20, 65, 100, 101)] == [0, 1, 1, 4, 5, 6]
    assert TurnPolicy(budget=1).num_chosen(7) == 7 and TurnPolicy().num_chosen(1000) == 0
    assert mmkv.SessionConfig.of(repair="attention", budget=0.25).policy.budget == 0.25


# -------------------------------------------------------------------------------------------- one owner
def _string_comparisons_of(name: str, path: Path) -> list[int]:
    """Lines of ``path`` comparing ``name`` (a variable or attribute) with a string or a tuple of strings."""

    def is_name(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == name) or (
            isinstance(node, ast.Attribute) and node.attr == name
        )

    def is_text(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return bool(node.elts) and all(is_text(e) for e in node.elts)
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_name(s) for s in sides) and any(is_text(s) for s in sides):
                lines.append(node.lineno)
    return lines


def test_no_code_but_the_policy_compares_reuse_with_a_string():
    """The library and the demo ask the policy (``splices_kv``, ``reads_stores``), never ``reuse == "kv"``."""
    files = [*(ROOT / "mmkv").rglob("*.py"), *(ROOT / "app").rglob("*.py")]
    found = {
        str(p.relative_to(ROOT)): lines
        for p in files
        if p.name != "policy.py" and (lines := _string_comparisons_of("reuse", p))
    }
    assert not found, found


def test_the_comparison_finder_finds_one(tmp_path):
    """The scan above is not vacuous: each form of a string comparison is found."""
    path = tmp_path / "m.py"
    path.write_text(
        'if policy.reuse == "kv": pass\nif reuse != "none": pass\nif x.reuse in ("kv", "none"): pass\n'
    )
    assert _string_comparisons_of("reuse", path) == [1, 2, 3]
