"""The tool-call bench's pieces that need no server: BFCL's questions as OpenAI tools, bfcl-eval's own checker
(imported without its model handlers), schema validity, the summary table."""

from __future__ import annotations

import pytest

from speculor.bench import toolcalls
from speculor.commands.toolbench import summary

pytest.importorskip("bfcl_eval")


def test_bfcl_questions_become_openai_tools_with_json_schema():
    qs = toolcalls.load("bfcl-multiple", 5)
    assert len(qs) == 5 and all(len(q.functions) >= 2 for q in qs)
    for q in qs:
        for t in q.tools:
            params = t["function"]["parameters"]
            assert params["type"] == "object"
            assert "dict" not in str(params) and "'float'" not in str(params)


def test_every_bfcl_question_of_the_sets_converts():
    for name in ("bfcl-simple", "bfcl-multiple", "bfcl-parallel"):
        assert len(toolcalls.load(name, 1000)) >= 100
    assert toolcalls.schema({"type": "dict", "properties": {"type": {"type": "string"}, "n": {"type": "float"}}}) == {
        "type": "object", "properties": {"type": {"type": "string"}, "n": {"type": "number"}}}


def test_bfcls_own_checker_accepts_the_right_call_and_refuses_a_wrong_one():
    q = toolcalls.load("bfcl-simple", 1)[0]  # calculate_triangle_area(base=10, height=5)
    check = toolcalls.checker()
    assert check(q, [{"calculate_triangle_area": {"base": 10, "height": 5}}])
    assert not check(q, [{"calculate_triangle_area": {"base": 10, "height": 6}}])
    assert not check(q, [{"area": {"base": 10, "height": 5}}])
    assert toolcalls.valid(q, [{"calculate_triangle_area": {"base": 10, "height": 5}}])
    assert not toolcalls.valid(q, [{"calculate_triangle_area": {"base": 10}}])  # a required argument missing
    assert not toolcalls.valid(q, [])


def test_the_summary_scores_each_row_against_plain():
    q = toolcalls.load("bfcl-simple", 1)[0]
    right = [{"calculate_triangle_area": {"base": 10, "height": 5}}]
    rows = [toolcalls.Answer(q.set, q.id, row, "t", right, [], 20, 1.0, 1.0 + s, "tool_calls",
                             extra={"round": 0}) for row, s in (("plain", 1.0), ("default", 0.5))]
    toolcalls.score(rows, {(q.set, q.id): q})
    table = summary(rows, ["plain", "default"])
    assert "| bfcl-simple | default | 1 | 100% (1/1) |" in table and "2.00x" in table and "1/1 |" in table
