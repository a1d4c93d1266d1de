"""Prompt formats: the zoo keeps the synthetic-QA format; chat and completion formats for real models put
the same tokens around the context in every mode; answers are extracted and scored as users expect."""

from __future__ import annotations

import pytest

from mot_cag.evaluation.metrics import contains_answer, exact_match
from mot_cag.pipeline.context import Piece, make_builder
from mot_cag.prompts import INSTRUCTION, PromptFormat, chat_format, prompt_format, qa_suffix

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def chat_qwen(tiny_models):
    """The tiny Qwen2 with a chat template set (as a real instruct model has)."""
    lm = tiny_models["qwen2"]
    lm.tokenizer.chat_template = TEMPLATE
    yield lm
    lm.tokenizer.chat_template = None


def test_zoo_models_keep_the_synthetic_qa_format(tiny_models):
    for lm in tiny_models.values():
        fmt = prompt_format(lm)
        assert fmt.kind == "qa" and fmt.separator == ""
        assert fmt.suffix_text("Where was Ana Brell born?", "Ana Brell was born in") == qa_suffix(
            "Where was Ana Brell born?", "Ana Brell was born in")
    opt = tiny_models["opt"]
    assert list(prompt_format(opt).head) == [opt.tokenizer.bos_token_id]  # OPT's BOS, the zoo's only head
    assert prompt_format(tiny_models["gpt2"]).head == ()


def test_chat_format_splits_the_rendered_template_around_the_documents(chat_qwen):
    fmt = prompt_format(chat_qwen)
    assert fmt.kind == "chat"
    tok = chat_qwen.tokenizer
    head = tok.decode(list(fmt.head))
    assert head == f"<|im_start|>user\n{INSTRUCTION}\n\n"
    suffix = fmt.suffix_text("Where was Ana Brell born?", cue="ignored for chat")
    assert suffix == "Question: Where was Ana Brell born?<|im_end|>\n<|im_start|>assistant\n"
    # head + documents + suffix is exactly the template rendered for the whole user turn
    docs = [fmt.piece_text("Ana Brell was born in Corvale."), fmt.piece_text("Tomas Reddick works as a baker.")]
    whole = tok.apply_chat_template(
        [{"role": "user", "content": f"{INSTRUCTION}\n\n{''.join(docs)}Question: Where was Ana Brell born?"}],
        tokenize=False, add_generation_prompt=True)
    assert head + "".join(docs) + suffix == whole


@pytest.mark.parametrize("mode", ["direct", "native-chunks", "none"])
def test_every_mode_starts_the_context_with_the_same_head(chat_qwen, mode):
    fmt = prompt_format(chat_qwen)
    pieces = [Piece("Ana Brell was born in Corvale."), Piece("Tomas Reddick works as a baker.")]
    ctx = make_builder(mode, chat_qwen).build(pieces)
    assert ctx.ids[: len(fmt.head)] == list(fmt.head)
    assert ctx.kv.length == ctx.tokens == len(ctx.ids)
    if mode != "none":
        direct = make_builder("direct", chat_qwen).build(pieces)
        assert ctx.ids == direct.ids  # identical tokens: modes differ only in how the cache was made


def test_template_that_drops_the_user_text_is_refused(tiny_models):
    tok = tiny_models["gpt2"].tokenizer
    tok.chat_template = "<|im_start|>assistant\n"
    try:
        with pytest.raises(ValueError, match="verbatim"):
            chat_format(tok)
    finally:
        tok.chat_template = None


@pytest.mark.parametrize("text, answer", [
    ("The answer is: Corvale.", "Corvale"),
    ("Answer: Corvale", "Corvale"),
    ("The answer to this question is: Cet Sor was born in Stinddaldale", "Cet Sor was born in Stinddaldale"),
    ("\n\nCorvale\nQuestion: next", "Corvale"),
    ("Ana Brell was born in Corvale. Tomas Reddick works", "Ana Brell was born in Corvale"),
    ("3.14 apples", "3.14 apples"),
])
def test_chat_answers_are_stripped_of_boilerplate(text, answer):
    assert PromptFormat("chat", ()).extract(text) == answer


def test_decoding_stops_after_one_sentence_or_line():
    fmt = PromptFormat("chat", ())
    assert not fmt.finished("Ana Brell was born in Corv")
    assert fmt.finished("Ana Brell was born in Corvale. Tomas")
    assert fmt.finished("Corvale\n")
    assert not fmt.finished("\n")


def test_contains_answer_beside_exact_match():
    assert exact_match("The Corvale", "corvale") == 1.0  # SQuAD normalisation: case, articles
    assert exact_match("Ana Brell was born in Corvale", "Corvale") == 0.0
    assert contains_answer("Ana Brell was born in Corvale", "Corvale") == 1.0
    assert contains_answer("Corvaleton", "Corvale") == 0.0  # whole words only
    assert contains_answer("code 48213!", "48213") == 1.0


def test_real_model_answers_never_start_with_a_line_break_or_end(tiny_models, chat_qwen):
    """A base model reading joined chunks sometimes wrote a line break first and looped on "Answer:" (an empty
    answer); real-model formats ban those first tokens, the zoo's format bans nothing."""
    import torch

    from mot_cag.models import cache as kv
    from mot_cag.prompts import completion_format, encode

    tok = chat_qwen.tokenizer
    for fmt in (prompt_format(chat_qwen), completion_format(tok)):
        assert set(encode(tok, "\n")) <= set(fmt.first_token_bans)
        assert tok.eos_token_id is None or tok.eos_token_id in fmt.first_token_bans
    assert prompt_format(tiny_models["gpt2"]).first_token_bans == ()
    model = chat_qwen.model
    ids = torch.tensor(encode(tok, "Question: Where was Ana Brell born?\nAnswer:"))
    free = list(kv.greedy_tokens(model, ids, None, 3))
    banned = list(kv.greedy_tokens(model, ids, None, 3, ban_first=[free[0]]))
    assert banned[0] != free[0]  # the ban holds on the first token only ...
    logits = model(input_ids=ids.view(1, -1)).logits[0, -1]
    logits[free[0]] = float("-inf")
    assert banned[0] == int(logits.argmax())  # ... and the next best token is taken instead
