"""An input-grounded workload, generated here (no downloads): questions that quote a report, edits of code.

Prompt lookup pays where the answer copies the prompt. Two kinds of chat
requests, built from a seed:
- a report of a few sections of plain sentences, and a request to quote one
  section word for word, or the sentences that mention a name;
- a small Python module, and a request to rewrite it with one identifier
  renamed, the whole module as the answer.
"""

from __future__ import annotations

import random

NAMES = ["Ada Park", "Bruno Diaz", "Chen Wei", "Dana Holt", "Emil Berg", "Farah Aziz", "Goran Ilic", "Hana Mori"]
PLACES = ["the north depot", "the river station", "the old mill", "the harbour office", "the hill farm"]
THINGS = ["the water pumps", "the spare batteries", "the delivery vans", "the cold store", "the solar panels"]
VERBS = ["inspected", "repaired", "replaced", "counted", "moved", "cleaned", "tested"]
TOPICS = ["Maintenance", "Deliveries", "Staffing", "Energy", "Storage", "Budget", "Safety"]
FUNCTION_BODIES = [
    ("total_weight", "items", "    total = 0\n    for item in {p}:\n        total += item.weight\n    return total\n"),
    ("average_age", "people", "    if not {p}:\n        return 0.0\n    return sum(p.age for p in {p}) / len({p})\n"),
    (
        "longest_name",
        "names",
        "    best = ''\n    for name in {p}:\n        if len(name) > len(best):\n"
        "            best = name\n    return best\n",
    ),
    (
        "count_late",
        "orders",
        "    late = 0\n    for order in {p}:\n        if order.days > 3:\n            late += 1\n    return late\n",
    ),
]


def _sentence(rng: random.Random) -> str:
    return (
        f"On day {rng.randrange(1, 29)}, {rng.choice(NAMES)} {rng.choice(VERBS)} {rng.choice(THINGS)} "
        f"at {rng.choice(PLACES)} and reported {rng.randrange(2, 90)} problems."
    )


def report(rng: random.Random, num_sections: int = 5) -> tuple[str, list[str]]:
    """(the report's text, its section titles)."""
    titles = rng.sample(TOPICS, num_sections)
    sections = [f"## {title}\n" + " ".join(_sentence(rng) for _ in range(4)) for title in titles]
    return "\n\n".join(sections), titles


def module() -> str:
    """A Python module of a few small functions."""
    return "\n\n".join(f"def {name}({param}):\n" + body.format(p=param) for name, param, body in FUNCTION_BODIES)


def grounded_requests(num_requests: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Chat messages of ``num_requests`` requests, alternating report questions and code edits."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        if i % 2 == 0:
            text, titles = report(rng)
            ask = (
                f"Quote the section titled {rng.choice(titles)} word for word."
                if i % 4 == 0
                else f"Quote every sentence that mentions {rng.choice(NAMES)}, word for word."
            )
            content = f"Here is a report.\n\n{text}\n\n{ask}"
        else:
            name, param, _ = rng.choice(FUNCTION_BODIES)
            content = (
                f"Here is a Python module.\n\n```python\n{module()}```\n\n"
                f"Rename the parameter `{param}` of `{name}` to `values` and output the whole module."
            )
        requests.append([{"role": "user", "content": content}])
    return requests
