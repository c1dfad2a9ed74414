"""What the tests of the jobs share: a runner's `write` that shows nothing, and a reward
function whose value varies across random answers (so that GRPO's group advantages are not all
zero on an untrained model)."""


def quiet(line):
    """A `runner.run(..., write=)` that drops every line (the tests read metrics.jsonl)."""
    del line


def distinct_chars(prompts, completions, **_):
    """A GRPO reward function: each completion's distinct characters / 6."""
    return [len(set(c)) / 6 for c in completions]
