"""Prompts for training a draft and for measuring acceptance, available offline.

Training prompts are templates crossed with topics and coding tasks; the evaluation set is a fixed
list of chat and code prompts none of which is a training prompt (some touch a training topic),
so reported acceptance is measured on prompts the draft never saw.
"""

from __future__ import annotations

import random

TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "the immune system",
    "volcanoes", "climate change", "the Roman Empire", "the printing press", "democracy",
    "the Industrial Revolution", "vaccines", "electric cars", "solar panels", "wind power",
    "the human heart", "DNA", "evolution", "gravity", "magnetism", "electricity", "atoms",
    "the periodic table", "chemical reactions", "the moon", "Mars", "the solar system",
    "comets", "earthquakes", "hurricanes", "rainforests", "deserts", "coral reefs", "bees",
    "dolphins", "elephants", "penguins", "dinosaurs", "the ocean", "mountains", "rivers",
    "glaciers", "recycling", "composting", "gardening", "cooking pasta", "baking bread",
    "coffee", "tea", "chocolate", "healthy eating", "exercise", "sleep", "meditation",
    "stress", "friendship", "teamwork", "leadership", "public speaking", "time management",
    "learning a language", "reading books", "writing essays", "poetry", "music theory",
    "the piano", "the guitar", "painting", "photography", "chess", "soccer", "basketball",
    "the Olympics", "marathons", "cycling", "swimming", "hiking", "camping", "travel",
    "airplanes", "trains", "bridges", "skyscrapers", "the internet", "email", "smartphones",
    "computers", "databases", "encryption", "passwords", "cloud computing", "robots",
    "artificial intelligence", "machine learning", "neural networks", "open source software",
    "version control", "unit testing", "debugging", "recursion", "sorting algorithms",
    "hash tables", "linked lists", "binary search", "graphs", "compilers", "operating systems",
    "memory management", "multithreading", "APIs", "web browsers", "HTML", "CSS", "JSON",
    "spreadsheets", "budgeting", "saving money", "interest rates", "inflation", "banks",
    "taxes", "small businesses", "marketing", "customer service", "job interviews",
    "resumes", "remote work", "libraries", "museums", "ancient Egypt", "the Renaissance",
    "World War I", "the Cold War", "the Silk Road", "the Vikings", "Shakespeare",
    "mythology", "fairy tales", "the alphabet", "numbers", "fractions", "geometry",
    "probability", "statistics", "calculus", "prime numbers", "maps", "compasses", "clocks",
    "calendars", "holidays", "birthdays", "weddings", "pets", "cats", "dogs", "horses",
)

TEMPLATES = (
    "What is {t}?", "Explain {t} in simple terms.", "Give me three facts about {t}.",
    "Write a short paragraph about {t}.", "How does {t} work?", "Why is {t} important?",
    "Write a haiku about {t}.", "Write a short poem about {t}.",
    "What are the pros and cons of {t}?", "Summarize the history of {t}.",
    "Explain {t} to a ten-year-old.", "What are common misconceptions about {t}?",
    "Give me a fun fact about {t}.", "List five words related to {t}.",
    "Write a short story that involves {t}.", "What should a beginner know about {t}?",
    "Compare {t} with something similar.", "Write a tweet about {t}.",
    "Describe {t} in one sentence.", "What questions would you ask an expert on {t}?",
)

CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the vowels in a string",
    "merges two sorted lists", "removes duplicates from a list while keeping order",
    "finds the largest element in a list", "flattens a nested list",
    "checks whether a string is a palindrome", "sorts a list of dictionaries by a key",
    "reads a text file and counts its lines", "converts Celsius to Fahrenheit",
    "computes the mean and standard deviation of a list", "implements binary search",
    "parses a date string in ISO format", "validates an email address with a regex",
    "groups words by their first letter", "transposes a matrix",
    "computes the greatest common divisor of two numbers", "implements a stack class",
    "implements a queue with two stacks", "finds all anagrams of a word in a list",
    "counts word frequencies in a text", "generates all permutations of a list",
)
CODE_TEMPLATES = (
    "Write a Python function that {t}.", "Write a function in Python that {t}, with a docstring.",
    "Show me how to write a Python function that {t}.",
    "Write a Python function that {t} and explain how it works.",
)

# held out: none of these is a training prompt
EVAL_CHAT = (
    "What is the capital of France?",
    "Explain what a hash function is, briefly.",
    "Give me three tips for better sleep.",
    "Write a haiku about autumn leaves.",
    "What are the main causes of the French Revolution?",
    "How do noise-cancelling headphones work?",
    "Describe a good morning routine.",
    "What is the difference between weather and climate?",
)
EVAL_CODE = (
    "Write a Python function that checks whether a year is a leap year.",
    "Write a Python function that returns the second largest number in a list.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a Python function that capitalizes the first letter of every word in a sentence.",
)


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """n chat prompts (mostly general questions, a quarter coding tasks), deterministic."""
    rng = random.Random(seed)
    chat = [t.format(t=x) for t in TEMPLATES for x in TOPICS]
    code = [t.format(t=x) for t in CODE_TEMPLATES for x in CODE_TASKS]
    rng.shuffle(chat)
    rng.shuffle(code)
    k = min(len(code), n // 4)
    out = chat[:n - k] + code[:k]
    rng.shuffle(out)
    return out
