"""The 8000-token prompt of the long-prompt measurement: HumanEval's problems, in order, cut at 8000 target tokens.
Usage: python prompt8k.py > prompt8k.txt"""

from transformers import AutoTokenizer

from speculor.bench import prompts
from speculor.runtime import embedded

tok = AutoTokenizer.from_pretrained(embedded.ensure(embedded.DEFAULT_TARGET))
text = ""
for p in prompts.load(["humaneval"], 164):
    text += p.text + "\n"
    if len(tok(text)["input_ids"]) > 8000:
        break
print(tok.decode(tok(text)["input_ids"][:8000]), end="")
