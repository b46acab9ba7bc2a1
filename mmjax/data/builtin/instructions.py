"""Built-in chat instructions: varied user requests (explanations, lists, advice, stories, poems, emails, code,
arithmetic, rewriting) whose answers a chat model writes in its own words. They are the prompts a draft model
is distilled on (`mmjax.tools.distill_draft`): the draft learns what the target says after them, so the more
kinds of answer they draw out, the more of the target's behaviour the draft sees.

`instructions()` is the fixed, ordered list: hand-written requests plus request templates filled with topics.
"""

from __future__ import annotations

import itertools

STANDALONE = (
    "What are three tips for staying focused while studying?",
    "Give me a recipe for a simple vegetable soup.",
    "How do I change a flat tire on a bicycle?",
    "Write a short story about a robot who learns to paint.",
    "Write a haiku about autumn leaves.",
    "Write a limerick about a cat who loves cheese.",
    "Write a polite email asking my manager for a day off next Friday.",
    "Write a thank-you note to a friend who helped me move house.",
    "Draft a short message inviting my neighbours to a garden party.",
    "What is the difference between weather and climate?",
    "Why is the sky blue?",
    "Why do we have seasons on Earth?",
    "How does a refrigerator keep food cold?",
    "How do vaccines work?",
    "What causes the tides?",
    "How do airplanes stay in the air?",
    "What is the water cycle?",
    "Explain what a black hole is in simple terms.",
    "What is photosynthesis?",
    "How does the internet work, in a few sentences?",
    "Give me five ideas for a rainy day at home with kids.",
    "List ten common fruits and their colors.",
    "Suggest a weekly exercise plan for a beginner.",
    "What should I pack for a three-day hiking trip?",
    "How can I improve my sleep?",
    "How can I save money on groceries?",
    "What are some good habits for a healthy morning routine?",
    "Give me some tips for a job interview.",
    "How do I start learning to play the guitar?",
    "What are the benefits of reading every day?",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that reverses a string.",
    "Write a Python function that returns the factorial of n.",
    "Write a Python program that prints the numbers from 1 to 20, but prints Fizz for multiples of three and "
    "Buzz for multiples of five.",
    "Write a Python function that counts the words in a sentence.",
    "Explain what a for loop does in programming.",
    "What is the difference between a list and a tuple in Python?",
    "Write a SQL query that selects all customers from the city of Paris.",
    "Explain recursion with a simple example.",
    "What is an API?",
    "If I have 12 apples and give away 5, how many do I have left? Explain your answer.",
    "A train travels 60 kilometers in one hour. How far does it travel in three and a half hours?",
    "What is 15 percent of 80? Show your steps.",
    "A shirt costs 20 dollars and is on sale for 25 percent off. What is the sale price?",
    "Solve for x: 3x + 7 = 22.",
    "What is the area of a rectangle that is 8 meters long and 5 meters wide?",
    "Rewrite this sentence to sound more formal: hey, can u send me the report asap?",
    "Rewrite this sentence in the passive voice: The chef cooked a delicious meal.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Summarize the story of Cinderella for a five-year-old.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Give me three synonyms for the word happy.",
    "What is the capital of Australia, and what is it known for?",
    "Name the planets of the solar system in order from the sun.",
    "Who was Marie Curie?",
    "Tell me a fun fact about octopuses.",
    "What are the main causes of air pollution?",
    "Describe a sunset over the ocean.",
    "Describe your ideal weekend.",
    "Write a short dialogue between a teacher and a student about homework.",
    "Write a product description for a reusable water bottle.",
    "Write a short motivational speech for a sports team before a big game.",
    "Create a to-do list for planning a birthday party.",
    "What questions should I ask when buying a used car?",
    "Explain the rules of chess briefly.",
    "How do I make a cup of tea?",
    "What is the best way to learn a new language?",
    "Give me a short workout I can do at my desk.",
    "Write a four-line poem about the moon.",
    "Write a short poem about friendship.",
    "Tell me a joke about computers.",
    "What is the meaning of the phrase 'break the ice'?",
    "Compare cats and dogs as pets.",
    "What are the pros and cons of working from home?",
    "Explain how a bill becomes a law, simply.",
    "What is inflation and why does it matter?",
    "Write a short review of a restaurant you enjoyed.",
    "Plan a one-day sightseeing trip in a city of your choice.",
    "How do I write a good essay introduction?",
    "What is the Pythagorean theorem?",
)

TOPICS = (
    "volcanoes", "the moon", "honey bees", "electricity", "the Roman Empire", "rainforests", "the human heart",
    "recycling", "gravity", "the printing press", "earthquakes", "coral reefs", "solar power", "dinosaurs",
    "the stock market", "machine learning", "the immune system", "glaciers", "the Olympic Games", "chocolate",
    "the ocean", "clouds", "magnets", "the brain", "trees", "coffee", "bridges", "birds' migration", "music",
    "mountains", "the alphabet", "money", "bread", "rivers", "satellites", "deserts", "batteries", "vitamins",
    "whales", "the calendar",
)

TEMPLATES = (
    "Explain {} to a ten-year-old.",
    "Tell me three interesting facts about {}.",
    "Write a short paragraph about {}.",
    "What is most important to know about {}?",
    "Write a short poem about {}.",
    "What are some common misconceptions about {}?",
    "Give me a short quiz with three questions about {}, with answers.",
    "Describe {} in five sentences.",
)


def instructions() -> list[str]:
    """The built-in instructions in a fixed order (the standalone requests, then each template with each topic,
    interleaved so any prefix of the list mixes kinds)."""
    filled = [t.format(topic) for topic, t in itertools.product(TOPICS, TEMPLATES)]
    step = len(TEMPLATES) + 1  # a topic's templates land apart when taken with a stride coprime to the count
    filled = [filled[(i * step) % len(filled)] for i in range(len(filled))]
    return [*STANDALONE, *filled]
