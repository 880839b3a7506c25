"""Text in, text out: a tiny model with a real tokenizer; stop strings end generation unseen."""



def test_text_is_the_continuation_of_the_prompt_text(text_model):
    """The text is what decoding prompt + generation adds to the prompt's text (so a leading space
    of the first token is kept, which decoding the generated ids alone would drop)."""
    tok = text_model.tokenizer
    prompt = tok.encode("hello world")
    g = text_model.generate(prompt, max_tokens=20, ignore_eos=True)
    assert tok.decode(prompt) + g.text == tok.decode(prompt + g.token_ids)
    assert len(g.token_ids) == 20


def test_stop_string_is_not_emitted_and_ends_generation(text_model):
    free = text_model.generate("the quick", max_tokens=30, ignore_eos=True)
    stop = free.text[8:11]
    assert len(stop) == 3
    cut = free.text.index(stop)
    stopped = text_model.generate("the quick", max_tokens=30, stop=[stop], ignore_eos=True)
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:cut]
    assert stop not in stopped.text
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]


def test_streamed_text_equals_generated_text(text_model):
    chunks = list(text_model.stream("said the", max_tokens=25, ignore_eos=True, stop=["zzz"]))
    assert "".join(c.text for c in chunks) == text_model.generate("said the", max_tokens=25, ignore_eos=True).text


def test_eos_comes_from_tokenizer_config_and_chat_template_renders(text_model):
    eos = text_model.tokenizer.token_to_id("</s>")
    assert eos in text_model.eos_token_ids
    prompt = text_model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<s>user: hi</s><s>assistant:"
