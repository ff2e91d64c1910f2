"""The documents of the lm-eval tasks in this folder (their yaml's custom_dataset), inline: no download."""

import datasets


def choices(**_kwargs) -> datasets.DatasetDict:
    rows = [
        {"question": "The capital of France is", "choices": [" Paris", " Rome", " a fish"], "answer": 0},
        {"question": "Two plus two equals", "choices": [" four", " seven"], "answer": 0},
        {"question": "The sky on a clear day is", "choices": [" green", " blue", " loud"], "answer": 1},
        {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Fahrenheit"], "answer": 0},
    ]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def questions(**_kwargs) -> datasets.DatasetDict:
    rows = [
        {"question": "What color is grass?", "answer": "green"},
        {"question": "How many legs does a cat have?", "answer": "four"},
        {"question": "What is the opposite of hot?", "answer": "cold"},
    ]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
