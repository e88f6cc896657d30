"""Tests for the BPE tokenizer in clip_model.py: identical ids to open_clip's tokenizer (which
ships the real merges file), round trips, truncation, small merges files, and how the merges
file is found.

    python -m pytest -q tests/test_tokenizer.py
"""

import gzip
import random

import pytest
import torch

import clip_model
from clip_model import SimpleTokenizer, basic_clean, whitespace_clean
from conftest import closed_port


def varied_strings(count: int = 300, seed: int = 0) -> list:
    """Hand-picked hard cases plus random strings drawn from pools of awkward characters."""
    fixed = [
        "", " ", "a photo of a cat.", "A Photo Of A CAT!!!", "don't you'll we've I'm she's they'd",
        "café naïve façade Ångström São Paulo Zürich", "日本語のテキスト", "中文文本测试", "한국어",
        "Привет, мир", "مرحبا بالعالم", "emoji 🙂🙃👍🏽 👨‍👩‍👧 🇫🇷", "&amp; &lt;b&gt; &quot;x&quot; &amp;amp;",
        "mojibake: Ã©tÃ© â€œquotedâ€\x9d", "tabs\tand\nnewlines\r\n  and   spaces",
        "!!!???...,,,;;;:::---___***", "((([[[{{{}}}]]])))", "3.14159 2,718 1e10 0x1F #42 $9.99 100%",
        "zigzagged texture.", "a centered satellite photo of Sea or Lake.", "2012 Audi TTS Coupe",
        "<|hello|> <tag> </w>", "x" * 300, "supercalifragilisticexpialidocious",
        "e\u0301 (combining accent) vs é", "ﬁ ligature ﬀ", "\u200bzero\u200bwidth", "ℕ ℤ ℚ ∑ ∫ √",
        "C++ C# F# .NET node.js", "http://example.com/path?q=1&r=2", "user@example.com",
    ]
    pools = [
        "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", "     \t\n",
        "!?.,;:'\"-_()[]{}<>/\\|@#$%^&*+=~`", "éèêëàâäôöûüçñßøåæœ", "🙂👍🏽🐍🚀❤️✨",
        "日本中文한국어", "&amp;&lt;&gt;&quot;&#39;",
    ]
    generator = random.Random(seed)
    strings = list(fixed)
    while len(strings) < count:
        length = generator.choice([1, 3, 8, 20, 60, 150])
        strings.append("".join(generator.choice(generator.choice(pools)) for _ in range(length)))
    long_text = " ".join(generator.choice(["red", "striped", "circle", "at", "the", "top", "left"])
                         for _ in range(200))
    return strings + [long_text, long_text.upper(), "word " * 80]


@pytest.fixture(scope="module")
def tokenizers(openclip_bpe_path):
    open_clip = pytest.importorskip("open_clip")
    from open_clip.tokenizer import SimpleTokenizer as ReferenceTokenizer

    return SimpleTokenizer(openclip_bpe_path), ReferenceTokenizer(openclip_bpe_path)


def test_ids_equal_open_clip_on_varied_text(tokenizers):
    ours, reference = tokenizers
    texts = varied_strings()
    assert len(texts) >= 300
    for text in texts:
        assert ours.encode(text) == reference.encode(text), f"encode differs on {text[:60]!r}"


def test_tokenize_with_truncation_equals_open_clip(tokenizers):
    ours, reference = tokenizers
    texts = varied_strings()
    expected = reference(texts)  # open_clip always truncates to 77, ending with end-of-text
    assert torch.equal(ours.tokenize(texts, truncate=True), expected)
    assert (ours.tokenize(texts, truncate=True).argmax(-1) > 0).all()


def test_vocabulary_matches_clip(tokenizers):
    ours, reference = tokenizers
    assert ours.vocab_size == 49408 == len(reference.encoder)
    assert (ours.sot_token, ours.eot_token) == (49406, 49407)


def test_decode_encode_round_trips_normalised_text(tokenizers):
    ours, _ = tokenizers
    for text in varied_strings():
        normalised = whitespace_clean(basic_clean(text)).lower()
        decoded = ours.decode(ours.encode(text))
        # BPE keeps every character; only the spacing around punctuation may change.
        assert "".join(decoded.split()) == "".join(normalised.split()), f"round trip of {text[:60]!r}"
    assert ours.decode(ours.encode("a photo of a cat.")) == "a photo of a cat . "


def test_special_tokens_are_spelled_as_openai_spells_them(tokenizers):
    # OpenAI's tokenizer (which ours follows) reads a literal "<|endoftext|>" in the input as
    # the special token; open_clip renamed its specials "<end_of_text>", so this one case is
    # the only place where the two tokenizers differ by design.
    ours, _ = tokenizers
    assert ours.encode("<|startoftext|>hello<|endoftext|>") == [49406, ours.encode("hello")[0], 49407]
    assert ours.decoder[49407] == "<|endoftext|>"


def test_long_text_without_truncation_is_a_clear_error(tokenizers):
    ours, _ = tokenizers
    with pytest.raises(clip_model.CLIPError, match="longer than the context length 77; shorten it or pass truncate=True"):
        ours.tokenize("word " * 80)
    assert ours.tokenize("word " * 75).shape == (1, 77)  # 75 words + 2 specials fit exactly


def test_module_level_tokenize_uses_the_given_tokenizer(tokenizers):
    ours, reference = tokenizers
    assert torch.equal(clip_model.tokenize(["a cat", "a dog"], tokenizer=ours), reference(["a cat", "a dog"]))


# ------------------------------------------------------------------------------------------
# Small merges files (the toy world learns its own) and finding the file
# ------------------------------------------------------------------------------------------

TINY_MERGES = ["r e", "re d</w>", "c i", "ci r", "cir c", "circ l", "circl e</w>", "a t</w>"]


@pytest.fixture(params=["plain", "gzip"])
def tiny_bpe_path(tmp_path, request):
    text = "#version: 0.2\n" + "\n".join(TINY_MERGES) + "\n"
    if request.param == "gzip":
        path = tmp_path / "tiny_bpe.txt.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path = tmp_path / "tiny_bpe.txt"
        path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_small_merges_file_gives_a_small_vocabulary(tiny_bpe_path):
    tokenizer = SimpleTokenizer(tiny_bpe_path)
    assert tokenizer.vocab_size == 512 + len(TINY_MERGES) + 2
    assert tokenizer.eot_token == tokenizer.vocab_size - 1  # end-of-text is still the largest id
    ids = tokenizer.encode("A red circle at")
    assert [tokenizer.decoder[i] for i in ids] == ["a</w>", "red</w>", "circle</w>", "at</w>"]
    assert tokenizer.decode(ids) == "a red circle at "
    unmerged = tokenizer.encode("blue")  # no merges apply: one id per byte
    assert len(unmerged) == 4


def test_the_merges_file_is_found_through_the_environment_and_the_cache(tiny_bpe_path, tmp_path, monkeypatch):
    monkeypatch.setenv("DEAR_BPE_PATH", tiny_bpe_path)
    assert SimpleTokenizer().bpe_path == tiny_bpe_path
    monkeypatch.delenv("DEAR_BPE_PATH")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / clip_model.BPE_FILENAME).write_bytes(open(tiny_bpe_path, "rb").read())
    monkeypatch.setenv("DEAR_CACHE_DIR", str(cache))
    if tiny_bpe_path.endswith(".gz"):
        assert SimpleTokenizer().vocab_size == 512 + len(TINY_MERGES) + 2


def test_a_missing_merges_file_is_named(tmp_path):
    missing = str(tmp_path / "nowhere.txt.gz")
    with pytest.raises(clip_model.CLIPFileError, match="nowhere.txt.gz .from bpe_path.: no such BPE merges file"):
        SimpleTokenizer(missing)


def test_no_merges_file_and_no_network_says_what_to_pass(tmp_path, monkeypatch):
    port = closed_port()
    monkeypatch.delenv("DEAR_BPE_PATH", raising=False)
    monkeypatch.setenv("DEAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(clip_model, "BPE_URL", f"http://127.0.0.1:{port}/bpe_simple_vocab_16e6.txt.gz")
    with pytest.raises(clip_model.CLIPFileError) as error:
        SimpleTokenizer()
    message = str(error.value)
    assert "\n" not in message and "CLIP_BPE_PATH" in message and "bpe_path=" in message


def test_a_malformed_merges_file_names_the_line(tmp_path):
    path = tmp_path / "broken.txt"
    path.write_text("#version: 0.2\nr e\nthis line has three\n")
    with pytest.raises(clip_model.CLIPFileError, match=r"broken.txt: line 3 is not a 'left right' merge"):
        SimpleTokenizer(str(path))


def test_a_bpe_file_of_another_vocabulary_than_the_models_is_one_line_naming_the_file(openclip_bpe_path):
    """SimpleTokenizer.check_fits, the one check (train.py's --bpe and clip_model.py's command
    line): a vocabulary larger than the token table would index past it, a smaller one means
    other words under the same ids; the model's own is accepted."""
    tokenizer = SimpleTokenizer(openclip_bpe_path)  # CLIP's real 49,408 tokens

    def model_with(vocab_size):
        return clip_model.CLIP(embed_dim=8, image_resolution=16, vision_layers=1, vision_width=16,
                               vision_patch_size=8, vision_heads=2, context_length=8, vocab_size=vocab_size,
                               transformer_width=16, transformer_heads=2, transformer_layers=1)

    tokenizer.check_fits(model_with(49408), "mine.pt")
    for other in (49407, 49409):
        with pytest.raises(clip_model.CLIPFileError) as error:
            tokenizer.check_fits(model_with(other), "mine.pt")
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"{openclip_bpe_path}: gives a vocabulary of 49408 tokens")
        assert f"the model mine.pt has {other}" in message
