"""What the speculative-decoding tests share: prompts with repeats and a tokenizer that decodes ids as numbers."""

# prompts with repeats, where an n-gram lookup or a draft model has something to find (the speculation tests)
SPEC_PROMPTS = [[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 20, 21, 22, 20, 21, 22, 20], [1, 9, 9, 9, 9, 9],
                [1, 30, 31, 30, 31, 30, 31, 30, 31, 30, 31], [1, 2, 3, 4, 2, 3, 4], [1, 44, 13, 50]]


class IdsTokenizer:
    """Decodes ids as their numbers and has no EOS: tests that compare token ids only."""

    eos_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))
