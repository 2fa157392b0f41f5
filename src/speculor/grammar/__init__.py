"""Structured output: a request's constraint (a JSON schema, a grammar, tool calls) and its state while decoding.

    compile.py  Grammars: a tokenizer's compiled constraints, built once per constraint by llguidance and cached
    state.py    GrammarState: one request's matcher; its mask at every row of a draft tree (walked with rollback),
                its forced runs, its fast-forward draft
    tools.py    OpenAI tools and response_format as constraints, and the model's calls parsed back from its text

A constraint changes the target: at every position p is restricted to the tokens the grammar allows and
renormalized (greedy: the argmax over them). Speculation is exact under it because verification reads the masked p at
every row (engine/steps.py `settle`).
"""
