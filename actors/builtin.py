"""The built-in offline prompt set (`data.source: builtin`): distinct, short English prompts
built on any machine from the Python standard library's docstrings, templated word problems,
unit conversions, writing tasks and explain/compare questions; deterministic for a seed."""

from __future__ import annotations

import json
import random
import subprocess
import sys

from actors.prompt_record import Conversation

_STDLIB = (
    "string textwrap itertools functools collections os.path json math statistics random re "
    "datetime heapq bisect shutil pathlib csv urllib.parse hashlib base64 difflib fractions "
    "decimal operator copy glob fnmatch zipfile gzip secrets uuid time calendar enum dataclasses "
    "os subprocess tempfile logging argparse pickle struct array queue threading socket html "
    "sqlite3 io contextlib inspect unicodedata shlex pprint cmath zlib binascii ipaddress "
    "email.utils platform weakref abc numbers colorsys keyword ast traceback warnings timeit "
    "asyncio concurrent.futures mimetypes configparser tarfile bz2 lzma hmac filecmp linecache "
    "codecs graphlib reprlib types shelve zoneinfo"
).split()
_STDLIB_QUESTIONS = (
    "What does `{q}` do in Python? Show a short example.",
    "Explain the Python {kind} `{q}` in a few sentences.",
    'The Python documentation says of `{q}`: "{doc}" What does this mean in plain words?',
    "When would I use `{q}` in a Python program, and what is a common mistake with it?",
    "Write a short Python snippet that demonstrates `{q}` and explain the output.",
    "Describe `{q}` from Python's {mod} module to a beginner.",
)
_NAMES = "Ana Ben Chloe Dev Emma Farid Grace Hugo Iris Jamal Kai Lena Marco Nora Omar Priya Quinn Rosa Sam Tariq Uma Victor Wen Yusuf Zoe".split()
_ITEMS = (
    "apples marbles stickers books pencils cookies stamps shells cards coins eggs balloons".split()
)
_WORD_PROBLEMS = (
    "{n1} has {a} {it}. {n2} gives {n1} {b} more, and then {n1} gives away {c}. How many {it} does {n1} have now?",
    "A box holds {a} {it}. How many {it} are in {b} boxes?",
    "{n1} shares {prod} {it} equally among {b} friends. How many does each friend get?",
    "A shop sells {it} at ${a} each. {n1} buys {b} and pays with ${big}. How much change does {n1} get?",
    "{n1} reads {a} pages a day. How many days does it take to read a book of {prod} pages?",
    "A train travels at {a} km/h for {b} hours. How far does it go?",
    "{n1} saves ${a} every week. How many weeks until {n1} has ${prod}?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "{n1} had {big} {it} and lost {c}% of them. How many are left?",
    "There are {a} students in a class and {b} classes in a school. If {c} students are absent, how many are present?",
)
_CONVERSIONS = (
    ("kilometers", "miles"), ("miles", "kilometers"), ("kilograms", "pounds"), ("pounds", "kilograms"),
    ("degrees Celsius", "degrees Fahrenheit"), ("degrees Fahrenheit", "degrees Celsius"),
    ("liters", "US gallons"), ("meters", "feet"), ("feet", "meters"), ("inches", "centimeters"),
    ("hours", "seconds"), ("days", "minutes"), ("megabytes", "kilobytes"), ("ounces", "grams"),
    ("square meters", "square feet"), ("kilometers per hour", "meters per second"),
    ("cups", "milliliters"), ("years", "days"), ("hectares", "acres"), ("knots", "kilometers per hour"),
)  # fmt: skip
_CONVERSION_FORMS = (
    "Convert {x} {a} to {b}.",
    "How many {b} are in {x} {a}? Show the calculation.",
    "I have {x} {a}. What is that in {b}?",
)
_TOPICS = (
    "the ocean", "autumn leaves", "a lost umbrella", "city traffic", "a first day at school", "coffee",
    "the night sky", "a garden in spring", "friendship", "a rainy Monday", "space travel", "an old library",
    "learning to ride a bike", "mountains", "a birthday party", "recycling", "a robot that learns to cook",
    "the smell of bread", "a long train ride", "winter mornings", "a busy kitchen", "volunteering",
    "a lighthouse", "homework", "a football match", "moving to a new city", "a thunderstorm", "honeybees",
    "an unexpected letter", "the internet", "a quiet lake", "grandparents", "a street market", "sleep",
    "a haunted house", "climate change", "a chess game", "a music festival", "the first snow", "a cat",
    "time management", "a bakery", "a desert", "electric cars", "a museum visit", "gratitude",
    "public libraries", "a marathon", "a camping trip", "video games", "the moon landing", "rivers",
    "a job interview", "a picnic", "kindness", "a broken phone", "a new puppy", "sunrise", "teamwork",
    "a small village", "healthy breakfasts", "a science fair",
)  # fmt: skip
_FORMS = (
    "Write a haiku about {t}.", "Write a short poem about {t}.", "Write a two-sentence story about {t}.",
    "Write a limerick about {t}.", "Write a short motivational message about {t}.",
    "Write a tweet about {t}.", "Write a short email to a friend about {t}.",
    "Write a product description inspired by {t}.", "Write the opening line of a novel about {t}.",
    "Write a short dialogue between two people about {t}.", "Give three fun facts related to {t}.",
    "Write a short diary entry about {t}.", "Describe {t} using all five senses.",
    "Write a short news headline and summary about {t}.", "Write a riddle whose answer is {t}.",
)  # fmt: skip
_CONCEPTS = (
    "photosynthesis", "inflation", "gravity", "machine learning", "the water cycle", "compound interest",
    "vaccines", "plate tectonics", "supply and demand", "DNA", "black holes", "democracy", "recursion",
    "encryption", "the greenhouse effect", "evolution", "electricity", "blockchain", "the immune system",
    "opportunity cost", "climate", "a hash table", "the stock market", "antibiotics", "the speed of light",
    "entropy", "a neural network", "the Pythagorean theorem", "probability", "a recession", "tides",
    "the Renaissance", "cloud computing", "nuclear fusion", "the scientific method", "sorting algorithms",
    "version control", "interest rates", "the food chain", "magnetism", "an operating system", "memory in computers",
    "time zones", "the Roman Empire", "renewable energy", "rainbows", "sound waves", "taxes", "a database index",
    "the placebo effect",
)  # fmt: skip
_AUDIENCES = (
    "a five-year-old",
    "a high school student",
    "a busy manager",
    "someone new to the topic",
    "an expert, briefly",
)
_EXPLAIN = (
    "Explain {c} to {a}.", "What is {c}? Answer for {a}.", "Why does {c} matter? Explain it to {a}.",
    "Give a simple analogy for {c} that would help {a}.",
)  # fmt: skip
_PAIRS = (
    ("a list", "a tuple in Python"), ("weather", "climate"), ("a virus", "a bacterium"), ("TCP", "UDP"),
    ("speed", "velocity"), ("stocks", "bonds"), ("RAM", "storage"), ("a simile", "a metaphor"),
    ("mitosis", "meiosis"), ("HTTP", "HTTPS"), ("an atom", "a molecule"), ("a compiler", "an interpreter"),
    ("debit cards", "credit cards"), ("renting", "buying a home"), ("tea", "coffee"), ("a lake", "a sea"),
    ("SQL", "NoSQL databases"), ("baking soda", "baking powder"), ("a crocodile", "an alligator"),
    ("weight", "mass"), ("AC", "DC current"), ("a democracy", "a republic"), ("git merge", "git rebase"),
    ("a process", "a thread"), ("empathy", "sympathy"), ("latitude", "longitude"), ("a hurricane", "a tornado"),
    ("affect", "effect"), ("machine learning", "traditional programming"), ("a star", "a planet"),
    ("classical", "operant conditioning"), ("an LED", "an incandescent bulb"), ("Python", "JavaScript"),
    ("saving", "investing"), ("a frog", "a toad"), ("breadth-first", "depth-first search"),
)  # fmt: skip
_COMPARE = (
    "What is the difference between {x} and {y}?",
    "Compare {x} and {y} in a short table.",
    "When should I choose {x} over {y}?",
)
_CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a sentence",
    "finds the largest number in a list", "removes duplicates from a list while keeping order",
    "converts Celsius to Fahrenheit", "checks whether a string is a palindrome", "computes the factorial of n",
    "merges two sorted lists", "returns the n-th Fibonacci number", "flattens a nested list",
    "counts vowels in a string", "finds the most common element in a list", "validates an email address",
    "computes the average of a list of numbers", "transposes a matrix", "groups words by their first letter",
    "returns the second largest number in a list", "checks if two strings are anagrams",
    "converts a Roman numeral to an integer", "computes the greatest common divisor of two numbers",
    "splits a list into chunks of size n", "capitalizes every word in a sentence", "sums the digits of a number",
    "reads a CSV file and prints each row", "generates a random password", "sorts a list of dicts by a key",
)  # fmt: skip
_CODE_FORMS = (
    "Write a Python function that {t}.",
    "Write a JavaScript function that {t}.",
    "How would you write a function that {t}? Explain the approach.",
)
_HOWTO = (
    "boil an egg", "write a good resume", "start running as a beginner", "learn a new language",
    "save money on groceries", "fall asleep faster", "prepare for a job interview", "plant tomatoes",
    "change a flat tire", "make a budget", "give a good presentation", "clean a laptop keyboard",
    "take better photos with a phone", "stay focused while studying", "make friends in a new city",
    "brew good coffee at home", "organize a small closet", "write a thank-you note", "plan a road trip",
    "reduce screen time", "care for a houseplant", "negotiate a salary", "learn to touch type",
    "keep a conversation going", "back up my files", "start a vegetable garden", "make pancakes",
    "deal with stress before exams", "pack a suitcase efficiently", "set goals for the new year",
)  # fmt: skip
_HOWTO_FORMS = ("How do I {t}?", "Give me five tips to {t}.", "What is the easiest way to {t}?")


def builtin_prompts(seed: int = 0) -> list[Conversation]:
    """The built-in offline prompt set: distinct, short English prompts in a seeded order."""
    rng = random.Random(seed)
    texts = _stdlib_questions(rng, limit=1000)
    texts += [_word_problem(rng) for _ in range(600)]
    for _ in range(300):
        a, b = rng.choice(_CONVERSIONS)
        x = rng.choice([rng.randint(2, 500), round(rng.uniform(0.5, 100), 1)])
        texts.append(_vary(rng, rng.choice(_CONVERSION_FORMS).format(x=x, a=a, b=b)))
    writing = [f.format(t=t) for f in _FORMS for t in _TOPICS]
    texts += [_vary(rng, t) for t in rng.sample(writing, 650)]
    texts += [
        _vary(rng, rng.choice(_EXPLAIN).format(c=c, a=a)) for c in _CONCEPTS for a in _AUDIENCES
    ]
    texts += [_vary(rng, f.format(x=x, y=y)) for f in _COMPARE for x, y in _PAIRS]
    texts += [_vary(rng, f.format(t=t)) for f in _CODE_FORMS for t in _CODE_TASKS]
    texts += [f.format(t=t) for f in _HOWTO_FORMS for t in _HOWTO]
    unique = sorted(set(texts))
    rng.shuffle(unique)
    return [[{"role": "user", "content": t}] for t in unique]


def _vary(rng: random.Random, text: str) -> str:
    """Rephrase a prompt now and then, so openings are not all "Write ..." or "What ..."."""
    low = text[0].lower() + text[1:]
    if text.split()[0] in ("Write", "Explain", "Give", "Describe", "Compare", "Convert"):
        return rng.choice([
            text, text, text, f"Please {low}", f"Could you {low.rstrip('.?')}?", f"I need help: {low}",
            f"Quick task: {low}", f"Hey! {text}",
        ])  # fmt: skip
    return rng.choice(
        [text, text, text, f"Quick question: {text}", f"Hey! {text}", f"I was wondering: {low}"]
    )


def _word_problem(rng: random.Random) -> str:
    n1, n2 = rng.sample(_NAMES, 2)
    a, b = rng.randint(3, 60), rng.randint(2, 12)
    return rng.choice(_WORD_PROBLEMS).format(
        n1=n1, n2=n2, it=rng.choice(_ITEMS), a=a, b=b, c=rng.randint(1, min(a, 50)),
        prod=a * b, big=rng.choice([v for v in (100, 200, 500, 1000, 2000) if v > a * b]),
    )  # fmt: skip


# Read in a fresh, isolated interpreter: module attributes depend on what else the calling
# process imported (torch, Ray ...), and the held-out split must not move with them.
_CATALOG_SCRIPT = r"""
import importlib, inspect, json, sys
out = []
for mod_name in sys.argv[1:]:
    try:
        mod = importlib.import_module(mod_name)
    except ImportError:  # platform-specific modules are simply skipped
        continue
    names = getattr(mod, "__all__", None)
    for name in sorted(names if names is not None else vars(mod)):
        obj = getattr(mod, name, None)
        if name.startswith("_") or not (inspect.isroutine(obj) or inspect.isclass(obj)):
            continue
        # without __all__, keep only what the module itself defines (not its imports)
        own = (mod.__name__, mod.__name__.lstrip("_"))
        if names is None and getattr(obj, "__module__", "").lstrip("_") not in own:
            continue
        doc = " ".join((inspect.getdoc(obj) or "").strip().split("\n\n")[0].split())
        if 20 <= len(doc) <= 200 and "`" not in doc:
            out.append([mod_name, name, "class" if inspect.isclass(obj) else "function", doc])
print(json.dumps(out))
"""


def _stdlib_questions(rng: random.Random, limit: int) -> list[str]:
    """Questions about public functions and classes of stdlib modules, from their docstrings."""
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _CATALOG_SCRIPT, *_STDLIB],
        capture_output=True,
        text=True,
        check=True,
    )
    out = [
        rng.choice(_STDLIB_QUESTIONS).format(q=f"{mod}.{name}", kind=kind, doc=doc, mod=mod)
        for mod, name, kind, doc in json.loads(proc.stdout)
    ]
    rng.shuffle(out)
    return out[:limit]
