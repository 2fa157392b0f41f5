"""What a grammar costs per token on the embedded target's vocabulary (151,936 tokens), llguidance against
xgrammar: compile time, mask time per token along a real answer, rollback. Run from the repository root:

    .venv/bin/python scripts/grammar/masks.py           # xgrammar from PYTHONPATH if importable

Three constraints: a json_object, the json_schema of a BFCL call, and the tool-call grammar of `tool_choice`
"required" (the template's <tool_call> syntax, the call's schema). The answer walked is what the model writes.
"""

from __future__ import annotations

import json
import statistics
import time

from transformers import AutoTokenizer

from speculor.grammar.compile import Constraint, Grammars
from speculor.grammar.tools import call_schema, read_tools, tool_constraint
from speculor.runtime.assets import cache_dir

V = 151936
TOOL = {
    "type": "function",
    "function": {
        "name": "calculate_triangle_area",
        "parameters": {
            "type": "object",
            "properties": {"base": {"type": "integer"}, "height": {"type": "integer"}, "unit": {"type": "string"}},
            "required": ["base", "height"],
        },
    },
}
CALL = '{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5, "unit": "units"}}'
TEXTS = {"json_object": CALL, "json_schema": CALL, "tool call": f"<tool_call>\n{CALL}\n</tool_call>"}


def main() -> None:
    tok = AutoTokenizer.from_pretrained(cache_dir() / "models" / "qwen2.5-coder-1.5b-instruct")
    t0 = time.perf_counter()
    g = Grammars(tok, V)
    print(f"llguidance {__import__('llguidance').__version__}: tokenizer {1000 * (time.perf_counter() - t0):.0f} ms")
    tools = read_tools([TOOL])
    constraints = {
        "json_object": Constraint("json_object"),
        "json_schema": Constraint.json_schema(call_schema(tools)),
        "tool call": tool_constraint(tools, "required", True, g.special("<tool_call>")),
    }
    for name, c in constraints.items():
        t0 = time.perf_counter()
        m = g.matcher(c)
        compile_ms = 1000 * (time.perf_counter() - t0)
        ids = tok(TEXTS[name], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        times = []
        for i, t in enumerate(ids):
            t0 = time.perf_counter()
            m.compute_bitmask()
            times.append(1e6 * (time.perf_counter() - t0))
            if i == len(ids) - 1:  # before the end token: three back and forth again
                assert m.rollback(3) and m.consume_tokens(ids[i - 3 : i]), m.get_error()
            assert m.consume_token(t), (name, tok.decode([t]), m.get_error())
        print(
            f"  {name:12s} compile {compile_ms:7.2f} ms, mask {statistics.median(times):6.1f} us median, "
            f"{max(times):7.1f} max over {len(ids)} tokens; rollback ok"
        )
    xgrammar(tok, constraints, tools)


def xgrammar(tok, constraints, tools) -> None:
    try:
        import xgrammar as xgr
    except ImportError as exc:
        print(f"xgrammar: not importable ({exc})")
        return
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
    compiler = xgr.GrammarCompiler(info)
    print(
        f"xgrammar {__import__('importlib.metadata').metadata.version('xgrammar')}: "
        f"tokenizer {1000 * (time.perf_counter() - t0):.0f} ms"
    )
    import torch

    for name in constraints:
        t0 = time.perf_counter()
        if name == "json_object":
            compiled = compiler.compile_builtin_json_grammar()
        elif name == "json_schema":
            compiled = compiler.compile_json_schema(json.dumps(call_schema(tools)), any_whitespace=False)
        else:
            compiled = compiler.compile_structural_tag(
                [xgr.StructuralTagItem(begin="<tool_call>\n", schema=call_schema(tools), end="\n</tool_call>")],
                ["<tool_call>"],
            )
        compile_ms = 1000 * (time.perf_counter() - t0)
        m = xgr.GrammarMatcher(compiled)
        bitmask = torch.zeros((1, (V + 31) // 32), dtype=torch.int32)
        ids = tok(TEXTS[name], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        times = []
        for i, t in enumerate(ids):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            times.append(1e6 * (time.perf_counter() - t0))
            if i == len(ids) - 1:
                m.rollback(3)
                assert all(m.accept_token(x) for x in ids[i - 3 : i])
            if not m.accept_token(t):
                print(f"  {name}: xgrammar refused {tok.decode([t])!r}")
                break
        print(
            f"  {name:12s} compile {compile_ms:7.2f} ms, mask {statistics.median(times):6.1f} us median, "
            f"{max(times):7.1f} max over {len(times)} tokens; rollback ok"
        )


if __name__ == "__main__":
    main()
