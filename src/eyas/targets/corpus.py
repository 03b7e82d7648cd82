"""A synthetic chat corpus written for eyas: conversations with real, learnable structure.

The demo trains a tiny target on it (random weights would make acceptance meaningless) and
the tiny tokenizer is trained on its text. Every answer follows from the question by a rule
(arithmetic, counting, spelling, lookups in small fact tables), so a small model can learn to
predict it and a draft can learn to predict the model.
"""

from __future__ import annotations

import random

ANIMALS = ("cat", "dog", "horse", "rabbit", "eagle", "hawk", "otter", "tiger", "zebra", "mouse",
           "camel", "panda", "whale", "shark", "goose", "raven", "sheep", "goat", "llama", "fox")
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "brown", "grey")
CITIES = {
    "Paris": ("France", "the Seine", "French"), "Rome": ("Italy", "the Tiber", "Italian"),
    "London": ("England", "the Thames", "English"), "Berlin": ("Germany", "the Spree", "German"),
    "Madrid": ("Spain", "the Manzanares", "Spanish"), "Vienna": ("Austria", "the Danube", "German"),
    "Cairo": ("Egypt", "the Nile", "Arabic"), "Lisbon": ("Portugal", "the Tagus", "Portuguese"),
    "Warsaw": ("Poland", "the Vistula", "Polish"), "Prague": ("Czechia", "the Vltava", "Czech"),
}
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve")
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a concise assistant. Answer clearly.")


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    q = rng.choice((f"What is {a} plus {b}?", f"Add {a} and {b}.", f"Compute {a} + {b}."))
    return q, f"To add {a} and {b}, we sum them: {a} + {b} = {a + b}. The answer is {a + b}."


def _count(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(1, 40)
    b = a + rng.randint(3, 9)
    seq = ", ".join(str(i) for i in range(a, b + 1))
    return f"Count from {a} to {b}.", f"Sure, here is the count from {a} to {b}: {seq}. Done."


def _spell(rng: random.Random) -> tuple[str, str]:
    w = rng.choice(ANIMALS + COLORS)
    letters = "-".join(w.upper())
    return f"How do you spell the word {w}?", f"The word {w} is spelled {letters}. It has {NUMBER_WORDS[len(w)]} letters."


def _city(rng: random.Random) -> tuple[str, str]:
    city = rng.choice(sorted(CITIES))
    country, river, lang = CITIES[city]
    q = rng.choice((f"Tell me about {city}.", f"What do you know about {city}?"))
    a = (f"{city} is the capital of {country}. The river {river[4:]} flows through {city}, "
         f"and most people there speak {lang}. {city} is a large and old city.")
    return q, a


def _list(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(2, 6)
    items = rng.sample(ANIMALS, n)
    body = "\n".join(f"{i + 1}. The {x}" for i, x in enumerate(items))
    return (f"Name {NUMBER_WORDS[n]} animals.",
            f"Here are {NUMBER_WORDS[n]} animals:\n{body}\nThese are all animals.")


def _colors(rng: random.Random) -> tuple[str, str]:
    animal, color = rng.choice(ANIMALS), rng.choice(COLORS)
    return (f"Write a sentence about a {color} {animal}.",
            f"The {color} {animal} walked slowly across the field. Everyone who saw the "
            f"{color} {animal} smiled, because a {color} {animal} is a rare sight.")


TASKS = (_add, _count, _spell, _city, _list, _colors)


def synthetic_chats(n: int, seed: int = 0) -> list[dict]:
    """`n` conversations in OpenAI `messages` form, each with an `id`; deterministic in `seed`."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(1 if rng.random() < 0.7 else 2):
            q, a = rng.choice(TASKS)(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        rows.append({"id": f"synth-{seed}-{i}", "messages": messages})
    return rows
