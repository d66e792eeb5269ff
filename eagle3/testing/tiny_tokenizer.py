"""The tiny tokenizer: a byte-level BPE trained deterministically on an embedded corpus (our own
prose and GSM8K-style problems), Kimi's special tokens and chat template, and its side files."""

from __future__ import annotations

import random
from importlib import resources
from pathlib import Path
from typing import Any

from eagle3.checkpoint import write_json, writing
from eagle3.testing.tiny_vocab import BOS_ID, BPE_VOCAB_SIZE, PAD_ID, VOCAB_SIZE, special_token_name

# Our own prose (no third-party text), plus generated GSM8K-style problems below.
_ENGLISH = """\
The morning was cold, so Anna put on her warm coat before she walked to the market.
She wanted to buy fresh bread, a few apples and some cheese for the picnic on Sunday.
At the market there were many people, and every seller was calling out the price of the day.
A farmer sold eggs in boxes of twelve, and a baker had just taken hot loaves out of the oven.
Anna asked how much the bread cost, and the baker said that one loaf was three dollars.
She paid with a ten dollar bill and got her change back in coins.
On the way home she met her friend Ben, who was carrying a heavy bag of books from the library.
They talked about the weather, about school, and about the new park near the river.
Ben said that the park would open next week, and that there would be music and games for children.
Learning is easier when you ask good questions and check every answer twice.
A good teacher explains each step, and a good student writes the steps down in order.
If a train leaves the station at nine and travels for two hours, it arrives at eleven.
The library has more than four hundred shelves, and each shelf holds about thirty books.
Water boils at one hundred degrees, and it freezes at zero degrees on the same scale.
The company hired five new workers this year, and each of them works eight hours a day.
When the students finished their homework, the teacher gave them time to read quietly.
Please think step by step, show your work, and then write the final answer on its own line.
The user asked the assistant a question, and the assistant answered politely and clearly.
You are a helpful assistant. Answer the question and explain your reasoning in simple words.
Numbers can be added, subtracted, multiplied and divided, and the result is called the answer.
In April the shop sold twice as many bikes as it did in March, and in May it sold half as many.
She spent a quarter of her money on lunch and saved the rest for the weekend trip with her family.
He reads twenty pages every night, so he finishes a long novel in less than a month.
The farmer has cows, chickens and sheep; every cow has four legs and every chicken has two legs.
A pizza is cut into eight slices, and the children ate all of the slices except three.
They drove sixty miles per hour for three hours and then stopped at a small town for dinner.
The price of a ticket went up by ten percent, so the family paid more than they did last year.
Altogether the class collected two hundred cans of food for the school during the winter.
If the recipe needs three cups of flour for one cake, how many cups are needed for four cakes?
Her brother is five years older than she is, and their father is three times as old as her brother.
Every week the gardener waters the plants on Monday, Wednesday and Friday in the early morning.
The store sells pencils for a quarter each and notebooks for two dollars and fifty cents.
After the game the team had fewer points than before, because the other team scored again.
We need to find how many minutes it takes to walk around the lake at a steady pace.
Because it rained in June and July, the river was higher than usual in the first week of August.
What is the remaining amount after you pay for the shoes, the shirt and the jacket?
The bakery makes cookies, muffins and cupcakes, and it puts them in boxes of a dozen.
Each student in the class brought two friends, so the room was full of people and noise.
The answer is the number of hours, so the final answer should not include the word hours.
"""

_NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "James",
          "Kemal", "Lena", "Marco", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
_ITEMS = ["apples", "books", "pencils", "cookies", "marbles", "stickers", "eggs", "flowers",
          "cards", "shirts", "tickets", "boxes", "candies", "toys", "coins", "cupcakes"]


def _gsm8k_like(rng: random.Random) -> str:
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 50), rng.randint(2, 30), rng.randint(2, 9)
    kind = rng.randrange(5)
    if kind == 0:
        q = f"{name} has {a} {item}. {name} buys {b} more {item}. How many {item} does {name} have now?"
        r = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item} now."
        ans = a + b
    elif kind == 1:
        a += b
        q = f"{name} had {a} {item} and gave {b} of them to {other}. How many {item} are left?"
        r = f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} left."
        ans = a - b
    elif kind == 2:
        q = f"Each box holds {c} {item}. {name} fills {a} boxes. How many {item} are there in total?"
        r = f"There are {a} * {c} = <<{a}*{c}={a * c}>>{a * c} {item} in total."
        ans = a * c
    elif kind == 3:
        q = (f"{name} earns ${a} per hour and works {c} hours a day for {b} days. "
             f"How much money does {name} earn?")
        r = (f"Per day {name} earns {a} * {c} = <<{a}*{c}={a * c}>>{a * c} dollars. "
             f"In {b} days that is {a * c} * {b} = <<{a * c}*{b}={a * c * b}>>{a * c * b} dollars.")
        ans = a * c * b
    else:
        total = a * c
        q = f"{name} shares {total} {item} equally among {c} friends. How many {item} does each friend get?"
        r = f"Each friend gets {total} / {c} = <<{total}/{c}={a}>>{a} {item}."
        ans = a
    return f"Question: {q}\nAnswer: {r}\n#### {ans}\n\n"


def corpus_text() -> str:
    """The embedded tokenizer-training corpus (deterministic, seed-independent)."""
    rng = random.Random(20240601)
    # The prose is repeated so that BPE merges favour common English words over rare numbers.
    return 4 * _ENGLISH + "".join(_gsm8k_like(rng) for _ in range(400))


# Kimi's pre-tokenizer splits like cl100k (words with a leading space, digits in groups of at most
# three, punctuation runs, newlines); this is that pattern without Kimi's Han branch.
_SPLIT_PATTERN = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer() -> Any:
    """A ``tokenizers.Tokenizer``: byte-level BPE with 768 ids trained on :func:`corpus_text`,
    then the 256 reserved special tokens at ids 768..1023.

    The tokenizers BPE trainer is deterministic for a fixed corpus (ties are broken by pair id),
    which the tests check byte for byte."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    text = corpus_text()
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"tiny BPE has {tok.get_vocab_size()} tokens, expected {BPE_VOCAB_SIZE}")
    tok.add_special_tokens([AddedToken(special_token_name(i), special=True, normalized=False)
                            for i in range(BPE_VOCAB_SIZE, VOCAB_SIZE)])
    if tok.get_vocab_size() != VOCAB_SIZE or tok.token_to_id("[PAD]") != PAD_ID:
        raise RuntimeError("tiny tokenizer: special tokens did not land at ids 768..1023")
    return tok


def chat_template() -> str:
    return resources.files("eagle3.testing").joinpath("kimi_chat_template.jinja").read_text(encoding="utf-8")


def _write_tokenizer(d: Path, tokenizer: Any, eos: str, gen_eos: list[int]) -> None:
    with writing(d / "tokenizer.json"):
        (d / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    with writing(d / "chat_template.jinja"):
        (d / "chat_template.jinja").write_text(chat_template(), encoding="utf-8")
    write_json(d / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "[BOS]",
        "eos_token": eos,
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 262144,
    })
    write_json(d / "generation_config.json", {
        "bos_token_id": BOS_ID,
        "eos_token_id": gen_eos,
        "pad_token_id": PAD_ID,
    })


# ---------------------------------------------------------------------------------------------
