"""Model quality evaluations: `jserve eval perplexity`.

- perplexity.py: llama.cpp's `llama-perplexity` windows over a tokenized text, scored through the engine's prompt
  logprobs
- cli.py: the argparse wiring (imports nothing heavy until a command runs)
- data/heldout_en.txt: the text `--text` defaults to: 34 KB (6,249 words) of original English prose, seven short
  essays and stories (timekeeping, a lighthouse keeper, a river, bread, the post, honey bees, a market) written for
  jserve, so that no model was trained on it and it ships with no licence question: it is dedicated to the public
  domain (CC0). Plain ASCII, paragraphs one line each, separated by blank lines.
"""

from pathlib import Path

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "heldout_en.txt"
