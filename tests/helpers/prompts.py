"""Prompts the tests share."""

# token-id prompts for the tiny models: plain text, a repeating pattern (n-gram drafts), a run
PROMPTS = [[5, 40, 41, 42, 43, 7, 9], [70, 71, 72, 70, 71, 72, 70, 71], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]

# chat prompts for SmolLM2 and the MoE built from it
SMOLLM2_PROMPTS = [
    "Write a Python function that returns the squares of a list of numbers.",
    "Fix the grammar: 'She go to school every days and play with her friend.'",
    "Give me a JSON object describing a cat named Tom who is 3 years old.",
]
