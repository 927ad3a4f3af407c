"""Prompts of random common English words, and the two workloads built from them that
``peers/vs_llamacpp.py`` sends both servers (``serving/server_gap.py`` runs the same one
in-process)."""

from __future__ import annotations

import random

# Plain English words: each is one token (with its leading space) in most BPE
# vocabularies, so a prompt of N words is ~N tokens on both sides, and both servers
# tokenize the same text (the tokenizers come from the same GGUF).
WORDS = """the of and to in is was for on that with as by at from his her he she it they
were are be this have had not but what all when we there can an which their said if do
will each about how up out them then many some so these would other into has more two
time like no see way could people than first been water who its now find long down day
did get come made may part over new sound take only little work know place year live me
back give most very after thing our just name good sentence man think say great where
help through much before line right too mean old any same tell boy follow came want show
also around form three small set put end does another well large must big even such
because turn here why ask went men read need land different home us move try kind hand
picture again change off play spell air away animal house point page letter mother
answer found study still learn should world high every near add food between own below
country plant last school father keep tree never start city earth eye light thought head
under story saw left few while along might close something seem next hard open example
begin life always those both paper together got group often run important until children
side feet car mile night walk white sea began grow took river four carry state once book
hear stop without second later miss idea enough eat face watch far really almost let
above girl sometimes mountain cut young talk soon list song being leave family""".split()


def make_prompt(rng: random.Random, n_words: int) -> str:
    """Sentences of random common words: distinct prompts, so no server gets a
    prefix-cache hit that the other does not."""
    words, out = rng.choices(WORDS, k=n_words), []
    while words:
        k = min(len(words), rng.randint(6, 14))
        sentence, words = words[:k], words[k:]
        out.append(" ".join(sentence).capitalize() + ".")
    return " ".join(out)


def workloads(quick: bool, seed: int) -> dict[str, dict]:
    """name -> {"requests": [(prompt, max_tokens)], "concurrency": n}; identical for both
    servers (seeded)."""
    rng = random.Random(seed)
    # 60..188 words: ~1.1 tokens a word with the full stops, so prompts of ~70..210 tokens
    n1, n2, conc = (2, 8, 8) if quick else (6, 64, 32)
    max_out = 60 if quick else 300
    single = [(make_prompt(rng, rng.randint(60, 188)), 128 if not quick else 32)
              for _ in range(n1)]
    many = [(make_prompt(rng, rng.randint(60, 188)), rng.randint(20, max_out))
            for _ in range(n2)]
    return {"1 stream": {"requests": single, "concurrency": 1},
            f"{conc} streams": {"requests": many, "concurrency": conc}}
