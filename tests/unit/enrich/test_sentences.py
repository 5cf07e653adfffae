"""split_sentences on the cases the enrichment meets: abbreviations, decimals, bullets, code blocks."""

import subprocess
import sys

from raytrain.enrich.sentences import split_sentences


def test_plain_sentences_and_terminators():
    assert split_sentences("It rained. Was it cold? Yes! \"Very,\" she said. (Then it stopped.) The end.") == [
        "It rained.", "Was it cold?", "Yes!", "\"Very,\" she said.", "(Then it stopped.)", "The end.",
    ]


def test_abbreviations_decimals_and_initials_do_not_split():
    text = ("Dr. Smith measured 3.14 m, e.g. The tall one, at approx. 5 p.m. today. J. R. R. Tolkien lived in the "
            "U.S. Army camp? No. See Fig. 3 for details. The answer is no. Then we left.")
    assert split_sentences(text) == [
        "Dr. Smith measured 3.14 m, e.g. The tall one, at approx. 5 p.m. today.",
        "J. R. R. Tolkien lived in the U.S. Army camp?",
        "No.",
        "See Fig. 3 for details.",
        "The answer is no.",
        "Then we left.",
    ]


def test_newlines_and_bullets_are_boundaries():
    text = "Shopping list:\n- eggs\n- milk. Fresh only.\n\n1. first step\n2) second step\nno period here\nnext line"
    assert split_sentences(text) == [
        "Shopping list:", "- eggs", "- milk.", "Fresh only.", "1. first step", "2) second step", "no period here",
        "next line",
    ]


def test_code_blocks_stay_whole():
    code = "```python\nx = 1. \nif x:\n    print('A. B. C.')\n```"
    text = f"Run this. {chr(10)}{code}\nIt prints. Done."
    assert split_sentences(text) == ["Run this.", code, "It prints.", "Done."]
    unclosed = "Intro.\n~~~\na = 1\nb = 2"
    assert split_sentences(unclosed) == ["Intro.", "~~~\na = 1\nb = 2"]


def test_cjk_and_empty():
    assert split_sentences("这是第一句。这是第二句！") == ["这是第一句。", "这是第二句！"]
    assert split_sentences("") == [] and split_sentences(" \n\n ") == []


def test_deterministic_across_processes():
    text = "A b c. D e f? G h i! 2.5 kg. Mr. X. Y z."
    code = ("import json, sys; sys.path.insert(0, '.'); from raytrain.enrich.sentences import split_sentences; "
            f"print(json.dumps(split_sentences({text!r})))")
    import json

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == split_sentences(text)
