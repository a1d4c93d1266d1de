"""Training pairs for translators: synthetic split, JSONL rows, text files."""

from __future__ import annotations

import itertools
import json

import pytest

from mot_cag.errors import MotCagError
from mot_cag.translate.data import file_pairs, pair_stream, split_training_text, synthetic_pairs


def test_synthetic_pairs_follow_the_spec_format():
    pairs = list(itertools.islice(synthetic_pairs(3, repeat_prob=0.5), 20))
    assert all(c.startswith("\nQuestion: ") or c.startswith("\nRepeat: ") for _, c in pairs)
    assert any(c.startswith("\nRepeat: ") for _, c in pairs) and any("\nAnswer: " in c for _, c in pairs)
    for doc, cont in pairs:
        assert "\nQuestion:" not in doc and "\nRepeat:" not in doc and len(doc) > 20
        if cont.startswith("\nRepeat: "):
            assert cont == f"\nRepeat: {doc}"
    again = list(itertools.islice(synthetic_pairs(3, repeat_prob=0.5), 20))
    assert again == pairs  # seeded


def test_split_without_marker_cuts_at_a_space():
    doc, cont = split_training_text("one two three four five six")
    assert doc + cont == "one two three four five six" and cont.startswith(" ")


def test_jsonl_and_text_files(tmp_path):
    rows = [{"id": "1", "context": "Ana Brell lives in Corvale.", "question": "Where does Ana Brell live?",
             "answer": "Corvale", "cue": "Ana Brell lives in"},
            {"id": "2", "context": "Tomas Reddick plays the oboe.", "task": "repeat", "question": "",
             "answer": "Tomas Reddick plays the oboe."}]
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pairs = file_pairs(f)
    assert pairs[0] == ("Ana Brell lives in Corvale.",
                        "\nQuestion: Where does Ana Brell live?\nAnswer: Ana Brell lives in Corvale.")
    assert pairs[1] == ("Tomas Reddick plays the oboe.", "\nRepeat: Tomas Reddick plays the oboe.")
    text = tmp_path / "t.txt"
    text.write_text("A first paragraph that is long enough to be split in two halves.\n\nshort\n\n"
                    "A second paragraph that is also long enough to be split in two.")
    assert len(file_pairs(text)) == 2
    stream = list(itertools.islice(pair_stream(str(f), seed=0), 4))
    assert sorted(stream[:2]) == sorted(pairs)
    with pytest.raises(MotCagError, match="not a file"):
        file_pairs(tmp_path / "missing.jsonl")



def test_real_training_text_is_seeded_and_keeps_its_split():
    """Training text for real models: package prose and corpus-like documents, the same for a seed; the
    held-out split never shares a package file with the training one."""
    import itertools

    from mot_cag.translate.data import _split_of_path, document_pairs, prose_files, prose_pairs, real_text_pairs

    a = list(itertools.islice(real_text_pairs(3), 6))
    assert a == list(itertools.islice(real_text_pairs(3), 6))
    assert all(len(ctx) > 100 and cont for ctx, cont in a)
    files = prose_files()
    assert files and {_split_of_path(f) for f in files} == {"train", "eval"}
    train = {f for f in files if _split_of_path(f) == "train"}
    held = [ctx for ctx, _ in itertools.islice(prose_pairs(0, "eval"), 10)]
    texts = {f: f.read_text(encoding="utf-8", errors="replace") for f in files}
    # Every held-out context comes from a held-out file (a line may also occur in a training file, e.g. a
    # licence shipped twice, but its file is not a training one).
    assert all(any(ctx.strip()[:80] in texts[f] for f in files if f not in train) for ctx in held)
    doc, cont = next(document_pairs(5, "eval"))
    assert doc != next(document_pairs(5, "train"))[0]
    assert cont.startswith("\nQuestion: ") and "\nAnswer: " in cont
