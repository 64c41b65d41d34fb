"""The prompt sets of `bench/speculative.py`: English passages, Python files and open questions,
written here so that the benchmark never downloads anything.

Each set is a tuple of user messages for `/v1/chat/completions`:
- `quoting`: a passage and which of its sentences to give back word for word
  (retrieval-style answers, where much of the output is already in the prompt);
- `summarization`: the same passages, each with an instruction to summarize it;
- `code_edit`: a 30-60 line Python file and an edit (a rename, docstrings) to return whole;
- `free_chat`: open questions whose answers are not in the prompt.
"""

from __future__ import annotations

PASSAGES = (
    """Before electric light, a lighthouse was only as good as the flame inside it and the \
glass around it. Early towers burned wood or coal in open braziers, and much of the light \
escaped upward into the sky where no sailor could use it. Oil lamps with polished metal \
reflectors were an improvement, but the reflectors tarnished quickly and had to be cleaned \
every day. In 1822 the French physicist Augustin Fresnel proposed a new kind of lens built \
from concentric rings of glass prisms. Each ring bent the light by a slightly different \
angle, so that the rays leaving the lamp were gathered into a single horizontal beam. A \
solid lens of the same power would have been far too thick and heavy to make, but the \
stepped design used much less glass and absorbed much less light. The largest Fresnel \
lenses, called first-order lenses, stood taller than a man and could be seen more than \
twenty miles out to sea. Lighthouse keepers wound clockwork mechanisms every few hours to \
rotate the lens, which gave each station its own pattern of flashes. Ships could then tell \
one lighthouse from another at night by counting the seconds between flashes.""",
    """Sourdough bread rises without any yeast bought from a shop. Instead, the baker keeps a \
starter, a mixture of flour and water in which wild yeasts and lactic acid bacteria live \
together. The yeasts feed on sugars released from the starch in the flour and produce \
carbon dioxide, which forms the bubbles that make the dough rise. The bacteria produce \
lactic and acetic acids, which give the bread its sour taste and help it keep longer \
without going stale or growing mould. A starter must be fed regularly with fresh flour and \
water; if it is left alone for too long, the microbes run out of food and the culture \
weakens. Many bakers discard part of the starter before each feeding so that the jar does \
not overflow. Because the wild yeasts work more slowly than commercial yeast, a sourdough \
loaf may need twelve hours or more between mixing and baking. The long fermentation also \
breaks down some of the gluten and other proteins in the flour, which is one reason that \
some people find sourdough easier to digest than ordinary bread. The temperature of the \
kitchen has a large effect: a warm room speeds the yeasts up, and a cool one makes the \
bread more sour.""",
    """An aquifer is a layer of rock, sand or gravel that holds water in the spaces between its \
grains and lets that water move through it. Rain that falls on the land either runs off \
into streams, evaporates, or soaks into the ground. The water that soaks in moves slowly \
downward until it reaches a zone where every pore is already full; the top of that zone is \
called the water table. Wells are drilled below the water table so that water flows into \
them from the surrounding rock. In some aquifers the water moves only a few centimetres a \
day, and water pumped out today may have fallen as rain thousands of years ago. When people \
pump water faster than rain can replace it, the water table drops, and wells must be made \
deeper. In coastal areas, heavy pumping can also draw salt water from the sea into the \
aquifer, which spoils the water for drinking and farming. Because it takes so long to \
refill, a deep aquifer is in practice closer to a mine than to a river: once it is drained, \
it may not recover within a human lifetime.""",
    """A honeybee that has found a good patch of flowers returns to the hive and tells her \
sisters where it is by dancing. On the vertical surface of the comb she runs a short \
straight line while waggling her abdomen from side to side, then circles back to the start \
and repeats the run, turning alternately to the left and to the right. The angle of the \
straight run compared with the vertical shows the direction of the food compared with the \
direction of the sun. A run straight up the comb means that the bees should fly toward the \
sun; a run straight down means that they should fly away from it. The length of the waggle \
run tells the distance: the longer the run lasts, the farther away the flowers are. Other \
bees follow the dancer closely, touching her with their antennae and picking up the scent \
of the flowers she has visited. The Austrian scientist Karl von Frisch worked out the \
meaning of the dance in the 1940s and shared the Nobel Prize in Physiology or Medicine in \
1973 for his studies of animal behaviour.""",
    """Around 1450, in the German city of Mainz, Johannes Gutenberg began printing with movable \
metal type. Printing from carved wooden blocks was already known, but each block could only \
print the one page it had been carved for. Gutenberg cast individual letters from an alloy \
of lead, tin and antimony that melted at a low temperature and hardened quickly in a mould. \
A printer could set the letters into lines, print as many copies of a page as he needed, \
and then take the type apart and use it again for the next page. Gutenberg also developed \
an oil-based ink that stuck to metal better than the water-based inks used for wood blocks, \
and he adapted the screw press that was used to make wine and olive oil. His best known \
work, a Latin Bible of about 1,300 pages, was finished around 1455. Within fifty years \
printing shops had opened in more than two hundred European towns, and millions of books \
had been printed. Books became cheaper, more people learned to read, and new ideas could \
spread far faster than when every copy had to be written out by hand.""",
    """The tides are caused mainly by the pull of the Moon's gravity on the Earth's oceans. \
The Moon pulls hardest on the water on the side of the Earth facing it, and least on the \
water on the far side. The result is two bulges of water, one toward the Moon and one away \
from it. As the Earth turns, a coastline passes through both bulges each day, which is why \
most places have two high tides and two low tides about every twenty-four hours and fifty \
minutes. The extra fifty minutes come from the Moon's own movement along its orbit. The Sun \
also raises tides, but they are less than half as strong as the Moon's because the Sun is \
so much farther away. When the Sun, the Moon and the Earth are in a line, at new moon and \
full moon, their pulls add together and produce especially high and low tides called \
spring tides. When the Sun and the Moon are at right angles, a week later, the tides are \
weaker and are called neap tides. The shape of a coast matters too: in a narrow bay the \
water can pile up, and the difference between high and low tide can exceed ten metres.""",
    """Octopuses are among the most intelligent animals without a backbone. An octopus has \
about five hundred million neurons, a number similar to that of a dog, but about two thirds \
of them are in its eight arms rather than in its brain. Each arm can taste and touch what it \
holds and can carry out simple movements on its own, even when it has been separated from \
the body. In laboratories octopuses have learned to open screw-top jars, to find their way \
through mazes, and to tell different people apart, sometimes squirting water at keepers \
they dislike. In the wild some octopuses carry coconut shells with them and assemble them \
into a shelter when they need to hide. Octopuses can also change the colour and texture of \
their skin in a fraction of a second, using thousands of small sacs of pigment that are \
controlled directly by the nervous system. Their intelligence is all the more surprising \
because most species live only one or two years, and the young never meet their parents, \
so almost everything an octopus knows it must learn by itself.""",
    """The first machine that looked like a bicycle was built in 1817 by Karl Drais, a German \
forester. It had two wheels in a line and a seat, but no pedals: the rider pushed against \
the ground with his feet, like a child on a balance bike. In the 1860s French makers \
attached pedals directly to the front wheel. Because one turn of the pedals gave one turn \
of the wheel, the only way to go faster was to make the front wheel larger, which led to \
the penny-farthing, whose front wheel could be taller than a man's shoulder. These machines \
were fast but dangerous; a rider who hit a stone could be thrown over the handlebars head \
first. The safety bicycle of the 1880s solved the problem with a chain that drove the rear \
wheel through gears, so that both wheels could be the same modest size. Soon afterwards \
John Boyd Dunlop's air-filled rubber tyres made the ride far more comfortable. By 1900 the \
bicycle had taken almost the shape it has today, and millions of people could travel for \
themselves further and faster than they could walk.""",
    """A vaccine teaches the immune system to recognise a germ before the body meets the real \
thing. Most vaccines contain either a weakened or killed form of a virus or bacterium, or \
only one of its parts, such as a protein from its surface. Some newer vaccines instead \
deliver instructions that make the body's own cells produce that protein for a short time. \
The immune system reacts to the harmless material much as it would to an infection. Cells \
called B cells produce antibodies that attach to the foreign protein, and T cells learn to \
find and destroy infected cells. After the response is over, some of these cells remain in \
the body as memory cells, sometimes for many years. If the real germ arrives later, the \
memory cells recognise it at once and the immune system responds faster and more strongly \
than it did the first time, often before the person feels ill. Some vaccines need more than \
one dose, or a booster years later, because the memory fades over time or because the germ \
itself changes.""",
    """Iceland sits on the Mid-Atlantic Ridge, where the North American and Eurasian plates are \
slowly pulling apart. Molten rock rises close to the surface there, and the country has \
more than thirty active volcanic systems. The same heat that causes eruptions is also a \
resource. Rainwater seeps down through cracks in the rock, is heated deep underground, and \
returns to the surface as hot springs and steam. Icelanders have drilled wells into these \
hot zones since the early twentieth century. Today about nine in ten homes in the country \
are heated with geothermal water, which is piped through insulated pipes from the \
wells to towns, sometimes over distances of more than twenty kilometres. Geothermal steam \
also drives turbines that produce about a quarter of the country's electricity, and most of \
the rest comes from hydropower. Greenhouses heated by the same water let farmers grow \
tomatoes, cucumbers and even bananas far below the Arctic Circle, and outdoor swimming \
pools stay warm through the dark winter months.""",
)

# What a retrieval answer asks of its context: the document, then which of its sentences to
# give back as they are. (Asked for a quote that answers a question, SmolLM2-135M mostly
# answers in its own words; asked for given sentences, it copies them: measured on this set.)
QUOTE_ASKS = (
    "Repeat the first two sentences of the document exactly.",
    "Quote the first three sentences of the document word for word.",
    "Copy the opening sentence of the document exactly, then the sentence after it.",
)
QUOTING = tuple(
    f"Here is a document:\n\n{passage}\n\n{QUOTE_ASKS[index % len(QUOTE_ASKS)]}"
    for index, passage in enumerate(PASSAGES)
)

SUMMARIZATION = tuple(
    f"{passage}\n\nSummarize the text above in three or four sentences." for passage in PASSAGES
)

CODE_FILES = (
    (
        "Rename the method `total_value` to `inventory_value` everywhere, add a docstring to "
        "it, and return the whole file.",
        """from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 0


@dataclass
class Inventory:
    items: dict[str, Item] = field(default_factory=dict)

    def add_item(self, name: str, price: float, quantity: int = 1) -> None:
        if name in self.items:
            self.items[name].quantity += quantity
        else:
            self.items[name] = Item(name, price, quantity)

    def remove_item(self, name: str, quantity: int = 1) -> None:
        item = self.items.get(name)
        if item is None:
            raise KeyError(f"no item named {name}")
        if quantity > item.quantity:
            raise ValueError(f"only {item.quantity} of {name} left")
        item.quantity -= quantity
        if item.quantity == 0:
            del self.items[name]

    def total_value(self) -> float:
        return sum(item.price * item.quantity for item in self.items.values())

    def cheapest(self) -> Item | None:
        if not self.items:
            return None
        return min(self.items.values(), key=lambda item: item.price)


def report(inventory: Inventory) -> str:
    lines = [f"{i.name}: {i.quantity} x {i.price:.2f}" for i in inventory.items.values()]
    lines.append(f"total: {inventory.total_value():.2f}")
    return "\\n".join(lines)
""",
    ),
    (
        "Rename the function `top_words` to `most_common_words` everywhere, add a docstring to "
        "it, and return the whole file.",
        """import re
import sys
from collections import Counter

WORD = re.compile(r"[a-z']+")
STOP_WORDS = {"the", "a", "an", "and", "or", "of", "to", "in", "is", "it", "that", "for"}


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def word_count(text: str) -> int:
    return len(words(text))


def top_words(text: str, limit: int = 10) -> list[tuple[str, int]]:
    counts = Counter(word for word in words(text) if word not in STOP_WORDS)
    return counts.most_common(limit)


def average_word_length(text: str) -> float:
    found = words(text)
    if not found:
        return 0.0
    return sum(len(word) for word in found) / len(found)


def sentences(text: str) -> list[str]:
    parts = re.split(r"[.!?]+", text)
    return [part.strip() for part in parts if part.strip()]


def main() -> None:
    text = sys.stdin.read()
    print(f"words: {word_count(text)}")
    print(f"sentences: {len(sentences(text))}")
    print(f"average word length: {average_word_length(text):.2f}")
    for word, count in top_words(text):
        print(f"{word:>15} {count}")


if __name__ == "__main__":
    main()
""",
    ),
    (
        "Rename the decorator `retry` to `with_retries` everywhere, add a docstring to it, and "
        "return the whole file.",
        """import functools
import logging
import random
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def retry(attempts: int = 3, delay: float = 0.5, backoff: float = 2.0) -> Callable[..., Any]:
    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            wait = delay
            for attempt in range(1, attempts + 1):
                try:
                    return func(*args, **kwargs)
                except OSError as error:
                    if attempt == attempts:
                        raise
                    logger.warning("attempt %d failed: %s", attempt, error)
                    time.sleep(wait + random.uniform(0, wait / 10))
                    wait *= backoff
            return None

        return wrapper

    return decorate


@retry(attempts=5)
def fetch_status(host: str) -> str:
    if random.random() < 0.5:
        raise OSError(f"{host} did not answer")
    return f"{host} is up"


@retry()
def read_config(path: str) -> str:
    with open(path, encoding="utf-8") as file:
        return file.read()


if __name__ == "__main__":
    print(fetch_status("example.org"))
""",
    ),
    (
        "Rename the function `group_rows` to `group_by_column` everywhere, add a docstring to "
        "it, and return the whole file.",
        """import csv
from collections import defaultdict
from pathlib import Path


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def group_rows(rows: list[dict[str, str]], column: str) -> dict[str, list[dict[str, str]]]:
    groups: dict[str, list[dict[str, str]]] = defaultdict(list)
    for row in rows:
        groups[row[column]].append(row)
    return dict(groups)


def totals(groups: dict[str, list[dict[str, str]]], column: str) -> dict[str, float]:
    return {key: sum(float(row[column]) for row in rows) for key, rows in groups.items()}


def write_report(path: Path, sums: dict[str, float]) -> None:
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["region", "total"])
        for key in sorted(sums):
            writer.writerow([key, f"{sums[key]:.2f}"])


def main() -> None:
    rows = read_rows(Path("sales.csv"))
    groups = group_rows(rows, "region")
    sums = totals(groups, "amount")
    write_report(Path("report.csv"), sums)
    best = max(sums, key=sums.__getitem__)
    print(f"{len(rows)} rows in {len(groups)} regions; best region: {best}")


if __name__ == "__main__":
    main()
""",
    ),
    (
        "Rename the class `LRUCache` to `RecentCache` everywhere, add a docstring to the class, "
        "and return the whole file.",
        """from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.entries: OrderedDict[K, V] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: K) -> V | None:
        if key not in self.entries:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return self.entries[key]

    def put(self, key: K, value: V) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)
        self.entries[key] = value
        if len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def __len__(self) -> int:
        return len(self.entries)


def demo() -> None:
    cache: LRUCache[str, int] = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.get("a")
    cache.put("c", 3)
    print(sorted(cache.entries), cache.hit_rate())


if __name__ == "__main__":
    demo()
""",
    ),
    (
        "Add a one-line docstring to every function, change nothing else, and return the whole "
        "file.",
        """ABSOLUTE_ZERO_C = -273.15


def celsius_to_fahrenheit(celsius: float) -> float:
    return celsius * 9 / 5 + 32


def fahrenheit_to_celsius(fahrenheit: float) -> float:
    return (fahrenheit - 32) * 5 / 9


def celsius_to_kelvin(celsius: float) -> float:
    if celsius < ABSOLUTE_ZERO_C:
        raise ValueError("below absolute zero")
    return celsius - ABSOLUTE_ZERO_C


def kelvin_to_celsius(kelvin: float) -> float:
    if kelvin < 0:
        raise ValueError("below absolute zero")
    return kelvin + ABSOLUTE_ZERO_C


def describe(celsius: float) -> str:
    if celsius < 0:
        return "freezing"
    if celsius < 15:
        return "cold"
    if celsius < 25:
        return "mild"
    return "hot"


def table(start: int, stop: int, step: int) -> list[str]:
    rows = []
    for celsius in range(start, stop, step):
        fahrenheit = celsius_to_fahrenheit(celsius)
        rows.append(f"{celsius:>5} C {fahrenheit:>7.1f} F  {describe(celsius)}")
    return rows


if __name__ == "__main__":
    print("\\n".join(table(-10, 40, 5)))
""",
    ),
    (
        "Rename the method `withdraw` to `take_out` everywhere, add a docstring to it, and "
        "return the whole file.",
        """from dataclasses import dataclass, field
from datetime import datetime


class InsufficientFunds(Exception):
    pass


@dataclass
class Transaction:
    amount: float
    kind: str
    at: datetime = field(default_factory=datetime.now)


@dataclass
class Account:
    owner: str
    balance: float = 0.0
    history: list[Transaction] = field(default_factory=list)

    def deposit(self, amount: float) -> None:
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        self.history.append(Transaction(amount, "deposit"))

    def withdraw(self, amount: float) -> None:
        if amount <= 0:
            raise ValueError("withdrawal must be positive")
        if amount > self.balance:
            raise InsufficientFunds(f"{self.owner} has only {self.balance:.2f}")
        self.balance -= amount
        self.history.append(Transaction(amount, "withdrawal"))

    def transfer(self, other: "Account", amount: float) -> None:
        self.withdraw(amount)
        other.deposit(amount)

    def statement(self) -> str:
        lines = [f"{t.at:%Y-%m-%d} {t.kind:<10} {t.amount:>10.2f}" for t in self.history]
        lines.append(f"balance {self.balance:.2f}")
        return "\\n".join(lines)


if __name__ == "__main__":
    alice, bob = Account("alice"), Account("bob")
    alice.deposit(100)
    alice.transfer(bob, 30)
    print(alice.statement())
""",
    ),
    (
        "Rename the function `bfs` to `breadth_first_path` everywhere, add a docstring to it, "
        "and return the whole file.",
        """from collections import deque

Graph = dict[str, list[str]]


def add_edge(graph: Graph, a: str, b: str) -> None:
    graph.setdefault(a, []).append(b)
    graph.setdefault(b, []).append(a)


def bfs(graph: Graph, start: str, goal: str) -> list[str] | None:
    if start == goal:
        return [start]
    previous: dict[str, str] = {}
    seen = {start}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for neighbour in graph.get(node, []):
            if neighbour in seen:
                continue
            seen.add(neighbour)
            previous[neighbour] = node
            if neighbour == goal:
                path = [goal]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return path[::-1]
            queue.append(neighbour)
    return None


def build_example() -> Graph:
    graph: Graph = {}
    for a, b in [("A", "B"), ("B", "C"), ("C", "D"), ("A", "E"), ("E", "D"), ("D", "F")]:
        add_edge(graph, a, b)
    return graph


if __name__ == "__main__":
    example = build_example()
    print(bfs(example, "A", "F"))
    print(bfs(example, "F", "B"))
""",
    ),
)

CODE_EDIT = tuple(
    f"```python\n{source}```\n\n{instruction} Reply with the complete updated file in one "
    f"code block."
    for instruction, source in CODE_FILES
)

FREE_CHAT = (
    "Write a short poem about a lighthouse keeper on a stormy night.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are three good habits for staying focused while studying?",
    "Write a short story about a cat who learns to ride a bicycle.",
    "Explain the difference between weather and climate.",
    "Give me a simple recipe for vegetable soup.",
    "Why do leaves change colour in autumn?",
    "Write a friendly email inviting a neighbour to a garden party.",
    "What is a black hole? Explain it in simple words.",
    "Describe a perfect Sunday morning in a small seaside town.",
    "What should I pack for a three-day hiking trip in the mountains?",
    "Explain how a refrigerator keeps food cold.",
)

PROMPT_SETS: dict[str, tuple[str, ...]] = {
    "quoting": QUOTING,
    "summarization": SUMMARIZATION,
    "code_edit": CODE_EDIT,
    "free_chat": FREE_CHAT,
}

# Prompts of the warm-up, distinct from every set's.
WARMUP = (
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
    "Explain what a compiler does in two sentences.",
    "Return this code unchanged:\n\n```python\ndef add(a, b):\n    return a + b\n```",
    "Name three rivers in Europe.",
)
