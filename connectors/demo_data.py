"""The built-in prompt set of the demo, and the word list the preset tokenizers are built over.

Prompts only use listed words (capitalised at sentence starts), digits and punctuation, so the
preset tokenizers encode them without unknown tokens and decode them back to the same text.
"""

from __future__ import annotations

import random

WORDS: tuple[str, ...] = tuple(
    """
    a about above across after again against all also always an and animal answer any are around as ask
    at away back bad be because bed been before began begin being below best better between big bird
    black blue boat body book both bread bring brother build but by call came can car care carry cat
    change child city clean close cloud cold come could country cover cross cut dark day deep describe
    did do dog
    door down draw dream drink drive dry during each early earth east eat end enough even evening every
    explain eye face fall family far farm fast father feel few field find fire first fish five floor fly
    follow food foot for forest four friend from front full game garden gave get girl give glass go gold
    good great green ground grow had hand happy hard has have he head hear heart help her here high hill
    him his hold home horse hot house how idea ideas if in into is island it its just keep kind king know lake
    land large last late laugh learn leave left letter life light like line list listen little live long
    look love low machine make man many map may me mean meet might mind moon more morning most mother
    mountain move much music must my name near need never new next night no north not nothing now number
    ocean of off often old on once one only open or other our out over own page paper part people picture
    place plan plant play point poem question quick quiet rain read ready red remember rest right river
    road rock room round run said same sand say school sea second see seem sentence set she ship short
    should show side simple sing sister sky sleep slow small snow so some song soon sound south speak
    spring star start stay step still stone story street strong summer sun sure table take talk teach tell
    ten than that the their them then there these they thing things think this those three through time to
    today together told too took top toward town train tree true try turn two under until up us use very
    voice walk wall want warm was watch water way we weather week well went were west what when where
    which while white who why wide wild will wind window winter with without woman wood word work world
    would write year yellow yes yet you young your
    """.split()
)

_TOPICS = (
    "river", "mountain", "city", "garden", "ocean", "machine", "forest", "island", "school", "king",
    "train", "moon", "farm", "ship", "song", "horse",
)
_ADJECTIVES = ("old", "quiet", "green", "cold", "wild", "small", "dark", "happy", "strong", "simple", "warm")
_INSTRUCTIONS = (
    "Write a short story about the {adj} {topic}.",
    "Explain why the {topic} is {adj}.",
    "Tell me about the {topic} in the {season}.",
    "Write a poem about a {adj} {topic}.",
    "What would you do if you could build a {topic}?",
    "Give {count} ideas for a game about the {topic}.",
    "Describe a day on the {topic} with your {person}.",
    "List {count} things you can see from the {adj} {topic}.",
)
_SEASONS = ("spring", "summer", "winter", "morning", "evening", "night")
_PEOPLE = ("friend", "father", "mother", "brother", "sister", "family")


def demo_prompts(n: int = 64, seed: int = 0) -> list[str]:
    """`n` prompts of varied length (one line to a few paragraphs), the same for the same seed."""
    if n < 0:
        raise ValueError(f"demo_prompts: n must be >= 0, got {n}")
    rng = random.Random(seed)
    return [_prompt(rng) for _ in range(n)]


def _prompt(rng: random.Random) -> str:
    instruction = rng.choice(_INSTRUCTIONS).format(
        adj=rng.choice(_ADJECTIVES), topic=rng.choice(_TOPICS), season=rng.choice(_SEASONS),
        person=rng.choice(_PEOPLE), count=rng.randint(2, 9),
    )
    context_sentences = rng.choice((0, 0, 1, 3, 8, 20))
    if not context_sentences:
        return instruction
    context = " ".join(_sentence(rng) for _ in range(context_sentences))
    return f"Read this: {context} {instruction}"


def _sentence(rng: random.Random) -> str:
    words = rng.choices(WORDS, k=rng.randint(4, 14))
    return " ".join([words[0].capitalize(), *words[1:]]) + rng.choice(".!?")
