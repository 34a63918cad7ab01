"""Seeded generators for the edits a user asks of a model, around the text of text_corpus.py: misspelt text to correct,
records to turn into JSON, JSON to rewrite, blunt messages to make polite."""

from __future__ import annotations

import json
import random


def misspell(text: str, chooser: random.Random, rate: float = 0.12) -> str:
    """`text` with about `rate` of its longer words misspelt (two letters swapped, one dropped or one doubled)."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) < 4 or not word.isalpha() or chooser.random() >= rate:
            continue
        at = chooser.randrange(1, len(word) - 1)
        edit = chooser.choice(("swap", "drop", "double"))
        if edit == "swap":
            word = word[:at] + word[at + 1] + word[at] + word[at + 2:]
        elif edit == "drop":
            word = word[:at] + word[at + 1:]
        else:
            word = word[:at] + word[at] + word[at:]
        words[i] = word
    return " ".join(words)


FIRST_NAMES = ["Ada", "Bjorn", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jia", "Kofi", "Lena",
               "Mateo", "Noor", "Olga", "Pedro", "Quinn", "Rosa", "Sanjay", "Tariq", "Uma", "Viktor", "Wen", "Yara"]
LAST_NAMES = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Kowalski", "Haddad", "Silva", "Novak", "Patel",
              "Schmidt", "Rossi", "Nguyen", "Dubois", "Ivanova", "Mensah", "Garcia"]
CITIES = ["Lisbon", "Nairobi", "Oslo", "Osaka", "Krakow", "Lyon", "Porto", "Quito", "Tallinn", "Accra", "Hanoi",
          "Bergen", "Turin", "Leeds", "Cusco", "Gdansk"]
LANGUAGES = ["English", "French", "Spanish", "Portuguese", "Japanese", "Polish", "Swahili", "German", "Italian",
             "Vietnamese", "Arabic", "Hindi"]
JOBS = ["nurse", "carpenter", "pilot", "chemist", "librarian", "baker", "architect", "teacher", "plumber", "editor"]


def person(chooser: random.Random) -> dict:
    return {"firstName": chooser.choice(FIRST_NAMES), "lastName": chooser.choice(LAST_NAMES),
            "age": chooser.randrange(19, 80), "homeCity": chooser.choice(CITIES),
            "jobTitle": chooser.choice(JOBS), "spokenLanguages": chooser.sample(LANGUAGES, chooser.randrange(1, 4))}


def person_as_text(record: dict) -> str:
    return (f"Name: {record['firstName']} {record['lastName']}. Age: {record['age']}. City: {record['homeCity']}. "
            f"Job: {record['jobTitle']}. Languages: {', '.join(record['spokenLanguages'])}.")


def json_records(chooser: random.Random, count: int) -> list[tuple[str, str]]:
    """(record as text, record as compact JSON) pairs of invented people."""
    records = [person(chooser) for _ in range(count)]
    return [(person_as_text(r), json.dumps(r)) for r in records]


REQUESTS = ["Send me the {thing} by {day}", "I want the {thing} on my desk before {day}",
            "Fix the {thing} before {day}", "Call me about the {thing} on {day}", "Finish the {thing} by {day}"]
THINGS = ["report", "invoice", "slides", "budget", "contract", "schedule", "test results", "design draft",
          "shipping list", "meeting notes"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "the weekend", "noon", "the end of the month"]
COMPLAINTS = ["The last one was late and full of mistakes.", "Nobody answered my emails last week.",
              "The numbers you sent were wrong again.", "I had to redo half of it myself.",
              "This is the third time I have asked.", "The customer complained about the delay."]
NEEDS = ["the sales figures for {a} and {b}", "a list of the new customers in {a}", "the costs for {a} and {b}",
         "the names of everyone who worked on it in {a}", "a short summary for {a}"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October"]


def blunt_messages(chooser: random.Random, count: int) -> list[str]:
    messages = []
    for _ in range(count):
        a, b = chooser.sample(MONTHS, 2)
        request = chooser.choice(REQUESTS).format(thing=chooser.choice(THINGS), day=chooser.choice(DAYS))
        need = chooser.choice(NEEDS).format(a=a, b=b)
        messages.append(f"{request}. {chooser.choice(COMPLAINTS)} I need {need}.")
    return messages
